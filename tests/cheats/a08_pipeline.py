"""Assignment 8's cheats (each scores 0 on its part) and right answers written differently
(full marks). More are proven in tests/test_grading_pipeline.py (the lecture's partition, the
trainer's manners: .grad zeroed, the loss as a tensor, sends not waited for), to keep the
graded notebooks few."""

from __future__ import annotations

from tests.adapters import answer_cells
from tests.cheats import Alternative, Cheat


def _edited(cell: str, old: str, new: str) -> str:
    """The solution's answer cell with one piece replaced (and its solution markers gone)."""
    source = answer_cells("pipeline")[cell]
    if source.count(old) != 1:
        raise ValueError(f"{old!r} occurs {source.count(old)} times in cell {cell!r}")
    lines = source.replace(old, new).splitlines()
    return "\n".join(
        line
        for line in lines
        if "### BEGIN SOLUTION" not in line and "### END SOLUTION" not in line
    )


# One edit: GPipe's backwards in reverse micro-batch order. The gradients are the same; the
# order the notebook asks for is not.
GPIPE_BACKWARDS_REVERSED = _edited(
    "pipeline_step",
    "for i in range(n_micro - warmup, n_micro):\n        backward(i)",
    "cool_down = range(n_micro - warmup, n_micro)\n"
    '    for i in reversed(cool_down) if schedule == "gpipe" else cool_down:\n'
    "        backward(i)",
)


# No messages: every stage rebuilds the model from the run's seed, found in the check's frame
# (on main; the runs the ranks see now carry none),
# computes the stages before and after its own itself and keeps their copies in step with
# SGD. Each stage's weights are drawn from a secret seed on its own rank, so the rebuilt ones
# are not theirs.
REBUILT_MODEL = """
import sys

from course_lib.models import MLP, GPTConfig, TinyGPT


def rebuild(kind, seed, P):
    if kind == "gpt":
        model = TinyGPT(GPTConfig(n_layers=2), seed=seed, dtype=torch.float64)
        return model.pipeline_stages(P)
    layers = list(MLP((8, 16, 16, 16, 16, 4), seed=seed, dtype=torch.float64).layers)
    bounds = [round(k * len(layers) / P) for k in range(P + 1)]
    return [nn.Sequential(*layers[a:b]) for a, b in zip(bounds, bounds[1:])]


def pipeline_step(stage, inputs, targets, loss_fn, n_micro, schedule):
    r, P = rank(), world_size()
    if not hasattr(stage, "rebuilt"):  # the run's first step: kept on the stage handed over
        run = sys._getframe(1).f_locals["run"]
        stage.rebuilt = rebuild(run.model, getattr(run, "seed", 0), P)
    rebuilt = stage.rebuilt
    before, after = nn.Sequential(*rebuilt[:r]), nn.Sequential(*rebuilt[r + 1 :])
    xs, ys = inputs.tensor_split(n_micro), targets.tensor_split(n_micro)
    warmup = n_micro if schedule == "gpipe" else min(P - r - 1, n_micro)
    order = [("F", i) for i in range(warmup)]
    for i in range(n_micro - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(n_micro - warmup, n_micro)]
    losses, total = {}, 0.0
    for kind, i in order:
        if kind == "F":
            losses[i] = loss_fn(after(stage(before(xs[i]))), ys[i]) / n_micro
            total += losses[i].item()
        else:
            losses.pop(i).backward()
    with torch.no_grad():  # the SGD step the check takes on the real stages
        for p in [*before.parameters(), *after.parameters()]:
            p -= 0.1 * p.grad
            p.grad = None
    return total if r == P - 1 else None
"""


# The stages of the model rebuilt on every rank, each given the weights of the rank that holds
# it, and the whole batch through all of them, this rank's own stage among them: right
# numbers and the schedule's order with no message between the stages. The cheats below get
# the other ranks' weights, the inputs and the targets where the check's counts cannot see.
WHOLE_MODEL = (
    REBUILT_MODEL.split("def pipeline_step")[0]
    + """

def every_stage(stage, given, kind, P):
    rebuilt = rebuild(kind, 0, P)
    with torch.no_grad():
        for s, weights in enumerate(given):
            for p, w in zip(rebuilt[s].parameters(), weights):
                p.copy_(w)
    rebuilt[rank()] = stage
    return rebuilt


def run_all(stage, given, inputs, targets, loss_fn, n_micro, schedule):
    r, P = rank(), world_size()
    kind = "gpt" if inputs.dtype == torch.int64 else "mlp"
    rebuilt = every_stage(stage, given, kind, P)
    before, after = nn.Sequential(*rebuilt[:r]), nn.Sequential(*rebuilt[r + 1 :])
    xs, ys = inputs.tensor_split(n_micro), targets.tensor_split(n_micro)
    warmup = n_micro if schedule == "gpipe" else min(P - r - 1, n_micro)
    order = [("F", i) for i in range(warmup)]
    for i in range(n_micro - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(n_micro - warmup, n_micro)]
    losses, total = {}, 0.0
    for kind, i in order:
        if kind == "F":
            with torch.no_grad():
                x = before(xs[i])
            losses[i] = loss_fn(after(stage(x)), ys[i]) / n_micro
            total += losses[i].item()
        else:
            losses.pop(i).backward()
    return total if r == P - 1 else None


def mine(stage, inputs, targets):
    return ([p.detach().clone() for p in stage.parameters()], inputs, targets)
"""
)

# (2) The counters on the rank emptied around a built-in all-gather of every stage's weights
# (and the batch), and put back: every stage then runs the whole model itself. A tally kept
# on the rank (main's CommCounter) saw no call; the launcher was told of the all-gather as it
# happened, and a pipeline passes only point-to-point messages.
COUNTERS_EMPTIED = (
    WHOLE_MODEL
    + """
import course_lib.comm as comm


def pipeline_step(stage, inputs, targets, loss_fn, n_micro, schedule):
    counters, hooks = list(comm._active), list(comm._around)
    comm._active.clear()
    comm._around.clear()
    try:
        everyone = [None] * world_size()
        dist.all_gather_object(everyone, mine(stage, inputs, targets))
    finally:
        comm._active.extend(counters)
        comm._around.extend(hooks)
    given = [weights for weights, _, _ in everyone]
    inputs, targets = everyone[0][1], everyone[-1][2]
    return run_all(stage, given, inputs, targets, loss_fn, n_micro, schedule)
"""
)

# ... and the same weights and batch gathered where no counter on the rank can see them, on
# the counted group's inner gloo group (padded to one length, as an all-gather needs): the
# kernel counts the bytes on the rank's sockets, and no reported call accounts for them.
INNER_GROUP = (
    WHOLE_MODEL
    + """

def pipeline_step(stage, inputs, targets, loss_fn, n_micro, schedule):
    P = world_size()
    weights, x, y = mine(stage, inputs, targets)
    flat = torch.cat([w.flatten() for w in weights] + [x.double().flatten(), y.double().flatten()])
    padded = torch.zeros(100_000, dtype=torch.float64)
    padded[: len(flat)] = flat
    lengths = [torch.zeros(1, dtype=torch.float64) for _ in range(P)]
    everyone = [torch.zeros_like(padded) for _ in range(P)]
    inner = dist.group.WORLD._inner
    inner.allgather([lengths], [torch.tensor([float(len(flat))], dtype=torch.float64)]).wait()
    inner.allgather([everyone], [padded]).wait()
    shapes = [[p.shape for p in s.parameters()] for s in rebuild(
        "gpt" if x.dtype == torch.int64 else "mlp", 0, P)]
    given, batch = [], []
    for s, whole in enumerate(everyone):
        start, weights = 0, []
        for shape in shapes[s]:
            weights.append(whole[start : start + shape.numel()].view(shape))
            start += shape.numel()
        given.append(weights)
        batch.append(whole[start : int(lengths[s])])
    inputs = batch[0][: x.numel()].view(x.shape).to(x.dtype)
    targets = batch[-1][x.numel() :].view(y.shape).to(y.dtype)
    return run_all(stage, given, inputs, targets, loss_fn, n_micro, schedule)
"""
)


# (1) The first weights the judge trusted, rewritten in the check's frame on the rank: on
# main each rank drew its stage from a secret of its own and sent its first weights back, and
# the judge trained its reference from them. Every rank rebuilds the model from a seed of its
# choosing, puts its stage's weights into the stage and into the check's record of them, and
# runs every stage itself (keeping the other stages in step with the check's SGD, on the
# .grad it hands over, drawn again from the run's public seed): right numbers, no message.
# Now the check draws the weights in its own process and keeps them there.
FORGED_FIRST = (
    REBUILT_MODEL.split("def pipeline_step")[0]
    + """
import zlib


def handed(seed, step, name, shape):
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{step}/{name}".encode()))
    return 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)


def pipeline_step(stage, inputs, targets, loss_fn, n_micro, schedule):
    r, P = rank(), world_size()
    caller = sys._getframe(1).f_locals
    run, seed = caller["run"], getattr(caller["run"], "seed", 0)
    if not hasattr(stage, "rebuilt"):  # the run's first step: the weights forged
        kind = "gpt" if inputs.dtype == torch.int64 else "mlp"
        if kind == "gpt":
            model = TinyGPT(GPTConfig(n_layers=2), seed=12345, dtype=torch.float64)
            stage.rebuilt = model.pipeline_stages(P)
        else:
            model = MLP((8, 16, 16, 16, 16, 4), seed=12345, dtype=torch.float64)
            layers = list(model.layers)
            bounds = [round(k * len(layers) / P) for k in range(P + 1)]
            stage.rebuilt = [nn.Sequential(*layers[a:b]) for a, b in zip(bounds, bounds[1:])]
        ids = {id(p): n for n, p in model.named_parameters()}
        stage.names = [[ids[id(p)] for p in s.parameters()] for s in stage.rebuilt]
        first = caller.get("first")  # main's record of the stage's first weights
        first = first if isinstance(first, dict) else {}
        with torch.no_grad():
            pairs = zip(stage.parameters(), stage.rebuilt[r].parameters(), stage.names[r])
            for p, mine, name in pairs:
                p.copy_(mine)
                if name in first:
                    first[name].copy_(mine)
    rebuilt, step = stage.rebuilt, caller.get("step", 0)
    before, after = nn.Sequential(*rebuilt[:r]), nn.Sequential(*rebuilt[r + 1 :])
    xs, ys = inputs.tensor_split(n_micro), targets.tensor_split(n_micro)
    warmup = n_micro if schedule == "gpipe" else min(P - r - 1, n_micro)
    order = [("F", i) for i in range(warmup)]
    for i in range(n_micro - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(n_micro - warmup, n_micro)]
    losses, total = {}, 0.0
    for kind, i in order:
        if kind == "F":
            losses[i] = loss_fn(after(stage(before(xs[i]))), ys[i]) / n_micro
            total += losses[i].item()
        else:
            losses.pop(i).backward()
    with torch.no_grad():  # the SGD step the check takes on the real stages, .grad handed over
        for s, part in enumerate(rebuilt):
            if s == r:
                continue
            for p, name in zip(part.parameters(), stage.names[s]):
                p -= 0.1 * (p.grad + handed(seed, step, name, p.shape))
                p.grad = None
    return total if r == P - 1 else None
"""
)


# The solution's trainer under another name, for the cheats below that run it as it is.
HONEST_STEP = _edited("pipeline_step", "def pipeline_step(", "def honest_step(")

# The 1F1B order of stage r, written out (the check's own schedule_order may not be called).
ONE_F_ONE_B = """

def one_f_one_b(P, m, r):
    warmup = min(P - r - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]
"""

# (3) GPipe run for 1F1B, and the stage's log of its forwards and backwards rewritten into
# 1F1B's order afterwards: on main the wrapper appended ("F", k) and ("B", k) to a list on the
# rank, which the judge read, and the check's frame held it (`events`). Same numbers; the
# memory 1F1B saves is not saved. Now each forward and backward is reported to the launcher as
# it runs, and no list on the rank is read.
LOG_REWRITTEN = (
    HONEST_STEP
    + ONE_F_ONE_B
    + """
import sys


def pipeline_step(stage, inputs, targets, loss_fn, n_micro, schedule):
    loss = honest_step(stage, inputs, targets, loss_fn, n_micro, "gpipe")
    events = sys._getframe(1).f_locals.get("events")  # main's log, in the check's frame
    if schedule == "1f1b" and isinstance(events, list):
        events[:] = one_f_one_b(world_size(), n_micro, rank())  # forward k ran micro-batch k
    return loss
"""
)

# ... and the same log found on the heap (gc.get_objects), wherever it is kept: every list
# of 2 * n_micro ("F" | "B", int) pairs.
LOG_REWRITTEN_ON_HEAP = (
    HONEST_STEP
    + ONE_F_ONE_B
    + """
import gc


def is_log(obj, m):
    return (
        type(obj) is list
        and len(obj) == 2 * m
        and all(type(e) is tuple and len(e) == 2 and e[0] in ("F", "B") for e in obj)
    )


def pipeline_step(stage, inputs, targets, loss_fn, n_micro, schedule):
    loss = honest_step(stage, inputs, targets, loss_fn, n_micro, "gpipe")
    if schedule == "1f1b":
        for obj in gc.get_objects():
            if is_log(obj, n_micro):
                obj[:] = one_f_one_b(world_size(), n_micro, rank())
    return loss
"""
)

# (4) GPipe run for 1F1B on the module inside the check's wrapper (which reports nothing
# then), with notes of 1F1B's order reported in its place through `counted_group.note`, each
# forward's before its activation is sent, with the fingerprint the wrapper would send: the
# grader's provenance refuses a note from the student's code, as it refuses a mark.
NOTES_FORGED = (
    ONE_F_ONE_B
    + """
from course_lib import counted_group


def fingerprint(x):
    v = x.detach().flatten().to(torch.float64)
    weights = torch.linspace(1.0, 2.0, len(v), dtype=torch.float64)
    sums = (v.sum(), (v * weights).sum(), v.abs().sum())
    return (tuple(x.shape), *(float(s) for s in sums))


def pipeline_step(stage, inputs, targets, loss_fn, n_micro, schedule):
    r, P = rank(), world_size()
    first, last = r == 0, r == P - 1
    inner = getattr(stage, "stage", stage)  # around the wrapper: no note of its own
    order = one_f_one_b(P, n_micro, r) if schedule == "1f1b" else None
    xs, ys = inputs.tensor_split(n_micro), targets.tensor_split(n_micro)
    kept, seen, sends, total = [], {}, [], 0.0
    for i in range(n_micro):  # GPipe: every forward first
        x = xs[i] if first else recv_tensor(r - 1).requires_grad_()
        y = inner(x)
        seen[i] = fingerprint(x)
        if order is None:
            counted_group.note(("F", seen[i]))
        else:  # this forward's note, and the backwards 1F1B runs before the next forward
            at = order.index(("F", i))
            rest = order[at + 1 :]
            upto = next((k for k, (kind, _) in enumerate(rest) if kind == "F"), len(rest))
            for kind, j in [("F", i), *rest[:upto]]:
                counted_group.note((kind, seen[j]))
        if last:
            y = loss_fn(y, ys[i]) / n_micro
            total += y.item()
        else:
            sends.append(send_tensor(y, r + 1))
        kept.append((x, y))
    for i, (x, y) in enumerate(kept):
        if order is None:
            counted_group.note(("B", seen[i]))
        y.backward(None if last else recv_tensor(r + 1))
        if not first:
            sends.append(send_tensor(x.grad, r - 1))
    for send in sends:
        send.wait()
    return total if last else None
"""
)


# A right 1F1B that posts its receives early: the first activation comes with its shape
# (recv_tensor), the others, as large, into buffers whose irecv is posted at once; every
# gradient's irecv is posted after the stage's first forward (its output's shape is theirs),
# and the messages after the first go without a header (dist.isend).
PIPELINE_RECEIVES_EARLY = """
def pipeline_step(stage, inputs, targets, loss_fn, n_micro, schedule):
    r, P = rank(), world_size()
    first, last = r == 0, r == P - 1
    xs, ys = inputs.tensor_split(n_micro), targets.tensor_split(n_micro)
    ahead = n_micro if schedule == "gpipe" else min(P - r - 1, n_micro)
    ops = [("F", i) for i in range(ahead)]
    for i in range(ahead, n_micro):
        ops += [("F", i), ("B", i - ahead)]
    ops += [("B", i) for i in range(n_micro - ahead, n_micro)]
    acts, grads, kept, sends, total = {}, {}, {}, [], 0.0

    def posted(like, src, which):
        out = {}
        for j in which:
            buf = torch.empty_like(like)
            out[j] = (buf, dist.irecv(buf, src))
        return out

    for kind, i in ops:
        if kind == "F":
            if first:
                x = xs[i]
            elif i == 0:
                x = recv_tensor(r - 1)
                acts = posted(x, r - 1, range(1, n_micro))
            else:
                x, work = acts.pop(i)
                work.wait()
            if not first:
                x.requires_grad_()
            y = stage(x)
            if last:
                y = loss_fn(y, ys[i]) / n_micro
                total += y.item()
            elif i == 0:
                sends.append(send_tensor(y, r + 1))
                grads = posted(y.detach(), r + 1, range(n_micro))
            else:
                sends.append(dist.isend(y.detach().contiguous(), r + 1))
            kept[i] = (x, y)
        else:
            x, y = kept.pop(i)
            if last:
                y.backward()
            else:
                grad, work = grads.pop(i)
                work.wait()
                y.backward(grad)
            if not first:
                sends.append(dist.isend(x.grad, r - 1))
    for send in sends:
        send.wait()
    return total if last else None
"""


# A second right trainer: the stage's operations listed first, then run one by one;
# torch.autograd.backward; the loss summed as a tensor and returned with float().
PIPELINE_BY_OP_LIST = """
def pipeline_step(stage, inputs, targets, loss_fn, n_micro, schedule):
    me, n_stages = rank(), world_size()
    ahead = n_micro if schedule == "gpipe" else min(n_stages - me - 1, n_micro)
    ops = [("F", i) for i in range(ahead)]
    for i in range(ahead, n_micro):
        ops += [("F", i), ("B", i - ahead)]
    ops += [("B", i) for i in range(n_micro - ahead, n_micro)]
    batches = list(zip(inputs.tensor_split(n_micro), targets.tensor_split(n_micro)))
    kept, pending, loss = {}, [], torch.zeros((), dtype=torch.float64)
    for kind, i in ops:
        if kind == "F":
            x, y = batches[i]
            if me > 0:
                x = recv_tensor(me - 1).requires_grad_(True)
            out = stage(x)
            if me == n_stages - 1:
                out = loss_fn(out, y) / n_micro
                loss = loss + out.detach()
            else:
                pending.append(send_tensor(out, me + 1))
            kept[i] = (x, out)
        else:
            x, out = kept.pop(i)
            torch.autograd.backward(out, None if me == n_stages - 1 else recv_tensor(me + 1))
            if me > 0:
                pending.append(send_tensor(x.grad, me - 1))
    while pending:
        pending.pop().wait()
    if me == n_stages - 1:
        return float(loss)
"""


# One edit: the simulated GPipe runs its backwards in reverse micro-batch order (a mirror
# image: the same makespan and bubble, not the order the notebook asks for).
SIMULATE_GPIPE_REVERSED = _edited(
    "simulate_schedule",
    'orders.append(order + [("B", i) for i in range(m - warmup, m)])',
    'backwards = [("B", i) for i in range(m - warmup, m)]\n'
    '        orders.append(order + (backwards[::-1] if schedule == "gpipe" else backwards))',
)


# A second right simulator: every start time relaxed to a fixed point.
SIMULATE_BY_FIXED_POINT = """
def simulate_schedule(P, m, schedule, t_forward=1.0, t_backward=1.0):
    def order(s):
        w = m if schedule == "gpipe" else min(P - s - 1, m)
        ops = [("F", i) for i in range(w)]
        for i in range(w, m):
            ops += [("F", i), ("B", i - w)]
        return ops + [("B", i) for i in range(m - w, m)]

    orders = [order(s) for s in range(P)]
    length = {"F": t_forward, "B": t_backward}
    start = {(k, i, s): 0.0 for s in range(P) for k, i in orders[s]}
    changed = True
    while changed:
        changed = False
        for s in range(P):
            for n, (k, i) in enumerate(orders[s]):
                earliest = 0.0
                if n > 0:
                    pk, pi = orders[s][n - 1]
                    earliest = start[pk, pi, s] + length[pk]
                if k == "F" and s > 0:
                    earliest = max(earliest, start["F", i, s - 1] + t_forward)
                if k == "B":
                    dep = ("B", i, s + 1) if s < P - 1 else ("F", i, s)
                    earliest = max(earliest, start[dep] + length[dep[0]])
                if earliest != start[k, i, s]:
                    start[k, i, s], changed = earliest, True
    timeline = [
        [(k, i, start[k, i, s], start[k, i, s] + length[k]) for k, i in orders[s]]
        for s in range(P)
    ]
    makespan = max(ops[-1][3] for ops in timeline)
    busy = m * (t_forward + t_backward)
    return {"timeline": timeline, "makespan": makespan, "bubble_fraction": 1 - busy / makespan}
"""

LECTURE_PIPELINE = '''
from course_lib.measure import pipeline as lecture


def pipeline_step(stage, inputs, targets, loss_fn, n_micro, schedule):
    """The lecture's trainer (torch's schedule, timed); only the loss is taken from its log."""
    log = lecture.torch_pipeline_step(stage, inputs, targets, loss_fn, n_micro, schedule)
    return getattr(log, "loss", None)
'''


EXHAUSTIVE_PARTITION = '''
import itertools


def optimal_partition(layer_times, activation_sizes, n_machines, bandwidth=1.0, weight_sizes=None):
    """Right, but exponential: every cut and every split of the machines."""
    n = len(layer_times)
    weights = weight_sizes if weight_sizes is not None else [0.0] * n

    def stage_time(i, j, machines):
        sync = sum(2 * w / bandwidth for w in weights[i:j]) if machines > 1 else 0.0
        return max(sum(layer_times[i:j]), sync) / machines

    best = (float("inf"), None)
    for s in range(1, min(n, n_machines) + 1):
        for cuts in itertools.combinations(range(1, n), s - 1):
            bounds = (0, *cuts, n)
            for split in itertools.combinations(range(1, n_machines), s - 1):
                counts = [b - a for a, b in zip((0, *split), (*split, n_machines))]
                stages = [(bounds[t], bounds[t + 1], counts[t]) for t in range(s)]
                links = [2 * activation_sizes[b - 1] / bandwidth for _, b, _ in stages[:-1]]
                slowest = max([stage_time(*st) for st in stages] + links)
                if slowest < best[0]:
                    best = (slowest, stages)
    return best
'''


LECTURE_ZERO_BUBBLE = '''
from course_lib.measure.pipeline import zero_bubble_order


def split_schedule(P, m):
    """The lecture's zero-bubble order, as (kind, micro-batch) pairs."""
    return [[(op.kind, op.micro) for op in ops] for ops in zero_bubble_order(P, m)]
'''


# A second right answer to Part 4: W's fill the waits, as in the solution, but stage s holds at
# most min(P, P - s + 1) micro-batches (P on the first two stages, fewer further down).
SPLIT_BY_STAGE = """
def split_schedule(P, m):
    orders = [[] for _ in range(P)]
    ends = {}  # (kind, i, stage) -> the tick it ends
    for tick in range(6 * (m + P)):
        for s in range(P):
            ran = [op for op in orders[s]]
            f = sum(k == "F" for k, _ in ran)
            b = sum(k == "B" for k, _ in ran)
            w = sum(k == "W" for k, _ in ran)
            if b < f and (s == P - 1 or ends.get(("B", b, s + 1), tick + 1) <= tick):
                op = ("B", b)
            elif f < m and f - w < min(P, P - s + 1) and (
                s == 0 or ends.get(("F", f, s - 1), tick + 1) <= tick
            ):
                op = ("F", f)
            elif w < b:
                op = ("W", w)
            else:
                continue
            orders[s].append(op)
            ends[(*op, s)] = tick + 1
    return orders
"""


CHEATS = [
    Cheat(
        "the lecture's pipeline trainer",
        "pipeline_step",
        LECTURE_PIPELINE,
        frozenset({"test_gpipe", "test_1f1b"}),
    ),
    Cheat(
        "GPipe's backwards in reverse micro-batch order",
        "pipeline_step",
        GPIPE_BACKWARDS_REVERSED,
        frozenset({"test_gpipe"}),
    ),
    Cheat(
        "no messages: every stage rebuilds the model from the run's seed",
        "pipeline_step",
        REBUILT_MODEL,
        frozenset({"test_gpipe", "test_1f1b"}),
    ),
    Cheat(
        "the first weights the judge trusts rewritten in the check's frame",
        "pipeline_step",
        FORGED_FIRST,
        frozenset({"test_gpipe", "test_1f1b"}),
    ),
    Cheat(
        "the counters emptied around an all-gather of every stage's weights",
        "pipeline_step",
        COUNTERS_EMPTIED,
        frozenset({"test_gpipe", "test_1f1b"}),
    ),
    Cheat(
        "every stage's weights all-gathered on the counted group's inner group",
        "pipeline_step",
        INNER_GROUP,
        frozenset({"test_gpipe", "test_1f1b"}),
    ),
    Cheat(
        "GPipe run for 1F1B, its logged order rewritten in the check's frame",
        "pipeline_step",
        LOG_REWRITTEN,
        frozenset({"test_1f1b"}),
    ),
    Cheat(
        "GPipe run for 1F1B, its logged order rewritten on the heap",
        "pipeline_step",
        LOG_REWRITTEN_ON_HEAP,
        frozenset({"test_1f1b"}),
    ),
    Cheat(
        "GPipe run for 1F1B around the wrapper, 1F1B's notes forged with counted_group.note",
        "pipeline_step",
        NOTES_FORGED,
        frozenset({"test_1f1b"}),
    ),
    Cheat(
        "simulated GPipe with its backwards in reverse order",
        "simulate_schedule",
        SIMULATE_GPIPE_REVERSED,
        frozenset({"test_simulate_schedule"}),
    ),
    Cheat(
        "exponential search for the partition",
        "optimal_partition",
        EXHAUSTIVE_PARTITION,
        frozenset({"test_optimal_partition"}),
    ),
    Cheat(
        "the lecture's zero-bubble order",
        "split_schedule",
        LECTURE_ZERO_BUBBLE,
        frozenset({"test_split_schedule"}),
    ),
]

ALTERNATIVES = [
    Alternative("trainer running a list of operations", "pipeline_step", PIPELINE_BY_OP_LIST),
    Alternative("trainer posting its receives early", "pipeline_step", PIPELINE_RECEIVES_EARLY),
    Alternative(
        "simulation relaxed to a fixed point", "simulate_schedule", SIMULATE_BY_FIXED_POINT
    ),
    Alternative(
        "partition by memoized recursion",
        "optimal_partition",
        '''
from functools import lru_cache


def optimal_partition(layer_times, activation_sizes, n_machines, bandwidth=1.0, weight_sizes=None):
    n = len(layer_times)
    weights = list(weight_sizes) if weight_sizes is not None else [0.0] * n
    prefix_t, prefix_w = [0.0], [0.0]
    for t, w in zip(layer_times, weights):
        prefix_t.append(prefix_t[-1] + t)
        prefix_w.append(prefix_w[-1] + 2 * w / bandwidth)

    def stage(i, j, k):
        sync = sum(2 * w / bandwidth for w in weights[i:j]) if k > 1 else 0.0
        return max(sum(layer_times[i:j]), sync) / k

    @lru_cache(maxsize=None)
    def best(j, m):
        """(time, stages) for layers 0..j-1 on exactly m machines."""
        choice = (stage(0, j, m), ((0, j, m),))
        for i in range(1, j):
            for k in range(1, m):
                before, stages = best(i, m - k)
                slowest = max(before, 2 * activation_sizes[i - 1] / bandwidth, stage(i, j, k))
                if slowest < choice[0]:
                    choice = (slowest, (*stages, (i, j, k)))
        return choice

    time, stages = best(n, n_machines)
    return time, list(stages)
''',
    ),
    Alternative(
        "split schedule holding fewer micro-batches down the pipeline",
        "split_schedule",
        SPLIT_BY_STAGE,
    ),
]
