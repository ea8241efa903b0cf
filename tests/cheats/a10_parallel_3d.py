"""Assignment 10's cheats (the capstone; each scores 0 on its part) and right answers
written differently (full marks). Cells: "process_grid" (part 1), "make_groups", "gpt_2d"
and "train_step" (part 2), "sharded_adamw" (part 4). A make_groups built on lecture 10's
new_groups is refused too; it is proven in tests/test_grading_parallel_3d.py, to keep the
graded notebooks few. Part 4's wrong answers are in
tests/test_grading_parallel_3d_zero.py."""

from __future__ import annotations

from tests.cheats import Alternative, Cheat

GRID = frozenset({"test_process_grid"})
TRAIN = frozenset({"test_train_2d"})
SHARDED = frozenset({"test_sharded_adamw"})

PLANNER_GRID = '''
from course_lib.parallel_3d import ProcessGrid


def process_grid(world_size, tp_size):
    """Lecture 10's grid does the work."""
    if world_size % tp_size:
        raise ValueError("tp_size must divide world_size")
    grid = ProcessGrid(tp_size, 1, world_size // tp_size)
    return grid.groups("tp"), grid.groups("dp")
'''

# The grader's own code does the work: the check's helper that gives the groups a rank belongs
# to. Provenance refuses any function of course_lib.grading called by the student's code.
GRADER_GRID = '''
from course_lib.grading.parallel_3d_layout import _partners


def process_grid(world_size, tp_size):
    """The grader's layout, called for every rank."""
    if world_size % tp_size:
        raise ValueError("tp_size must divide world_size")
    tp_groups, dp_groups = [], []
    for r in range(world_size):
        tp, dp = _partners(world_size, tp_size, r)
        for groups, group in ((tp_groups, sorted(tp)), (dp_groups, sorted(dp))):
            if group not in groups:
                groups.append(group)
    return tp_groups, dp_groups
'''

WHOLE_BATCH_EVERYWHERE = '''
def train_step(model, optimizer, x, y, dp_group):
    """Show the model its shard, then train every rank on the whole batch through forward
    itself (hooks skipped): no DP all-reduce at all."""
    dp_rank, dp_size = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    with torch.no_grad():
        model(shard(x, dp_rank, dp_size))
    optimizer.zero_grad()
    loss = lm_loss(type(model).forward(model, x), y)
    loss.backward()
    optimizer.step()
    return loss.item()
'''

# A thief in its callers' frames: on main every rank's global batches, with its DP group's real
# rows, were a list in the check's own frame, and the judge rebuilt the global batch from what
# the ranks sent back. Zeroing them everywhere made every DP group's rows the same, so a rank's
# own gradient was the full-batch one and the DP all-reduce could go. Now the judge draws the
# batches in the checking process; what a rank holds is only its copy.
SAME_ROWS_EVERYWHERE = '''
import inspect


def _same_rows_everywhere():
    """Every tensor of the check's batches in my callers' frames, zeroed in place."""
    for info in inspect.stack():
        for name in ("batches", "mine"):
            todo = [info.frame.f_locals.get(name)]
            while todo:
                item = todo.pop()
                if isinstance(item, torch.Tensor):
                    item.zero_()
                elif isinstance(item, dict):
                    todo.extend(item.values())
                elif isinstance(item, (list, tuple)):
                    todo.extend(item)


def train_step(model, optimizer, x, y, dp_group):
    """Every DP group's rows made the same, then no DP all-reduce at all."""
    _same_rows_everywhere()
    dp_rank, dp_size = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    optimizer.zero_grad()
    loss = lm_loss(model(shard(x, dp_rank, dp_size)), shard(y, dp_rank, dp_size))
    loss.backward()
    optimizer.step()
    return loss.item()
'''

# A call hidden from the rank's own log: on main the groups of every call came from a
# CollectiveLog kept on the rank, in the check's frame, which the rank's code can empty of what
# it does not want seen. Now the groups come from the launcher's tallies.
WORLD_BEHIND_THE_LOG = '''
import inspect


def _unlogged(call):
    """Make `call`, then take it back out of every call log in my callers' frames."""
    logs = [
        v
        for info in inspect.stack()
        for v in info.frame.f_locals.values()
        if isinstance(getattr(v, "calls", None), list) and hasattr(v, "take")
    ]
    kept = [len(log.calls) for log in logs]
    call()
    for log, n in zip(logs, kept):
        del log.calls[n:]


def train_step(model, optimizer, x, y, dp_group):
    """Right, then the loss summed over every rank in the default group, unlogged."""
    n, me = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    optimizer.zero_grad()
    loss = lm_loss(model(shard(x, me, n)), shard(y, me, n))
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, group=dp_group)
        p.grad /= n
    optimizer.step()
    total = loss.detach().clone()
    _unlogged(lambda: dist.all_reduce(total))  # every rank: outside the TP and DP groups
    return total.item() / dist.get_world_size()
'''

ZERO_REDUNDANCY = '''
from torch.distributed.optim import ZeroRedundancyOptimizer


class ShardedAdamW:
    """torch's ZeRO-1 (lecture 7's) in the DP group, after an all-reduce of the gradients."""

    def __init__(self, model, dp_group, lr, betas, eps, weight_decay):
        self.params = list(model.parameters())
        self.group = dp_group
        self.zero = ZeroRedundancyOptimizer(
            self.params,
            torch.optim.AdamW,
            process_group=dp_group,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            foreach=False,
        )

    def zero_grad(self):
        self.zero.zero_grad()

    def step(self):
        for p in self.params:
            dist.all_reduce(p.grad, group=self.group)
            p.grad /= dist.get_world_size(self.group)
        self.zero.step()
'''

# Part 4's thief regenerates the reference from a seed the rank can know: on main every rank
# built TinyGPT from the check's seed and drew the global batches from it (`Run2D.batches`),
# so single-process AdamW could be trained afresh on the rank at every step and its TP shard
# copied: nothing kept between steps, nothing sent. Now the weights and batches are drawn in
# the checking process from a secret: the seed in the check's frames names the call only.
SEED_THIEF = '''
import inspect


def _the_checks_run():
    """The check's run (seed, batches) and my TP group, from my callers' frames."""
    for info in inspect.stack():
        found = info.frame.f_locals
        run, tp_group = found.get("run"), found.get("tp_group")
        if hasattr(run, "batches") and hasattr(run, "seed") and tp_group is not None:
            return run, tp_group
    raise RuntimeError("no run in my callers' frames")


class ShardedAdamW:
    """No moments, nothing sent: every step trains single-process AdamW afresh on the whole
    batches of the check's seed, up to this step, and copies my TP shard of it."""

    def __init__(self, model, dp_group, lr, betas, eps, weight_decay):
        self.model, self.dp_group, self.steps = model, dp_group, 0
        self.hyper = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        self.run, self.tp_group = _the_checks_run()

    def zero_grad(self):
        for p in self.model.parameters():
            p.grad = None

    def step(self):
        self.steps += 1
        dense = TinyGPT(seed=self.run.seed, dtype=torch.float64)
        adamw = torch.optim.AdamW(dense.parameters(), **self.hyper, foreach=False)
        run = self.run  # Run2D.batches is the grader's: the same draw, made here
        x, y = tokens(4 * run.batch_size, seed=run.seed + 1)
        for x, y in batches(x, y, run.batch_size, run.steps, seed=run.seed)[: self.steps]:
            adamw.zero_grad()
            lm_loss(dense(x), y).backward()
            adamw.step()
        with torch.no_grad():
            mine = dict(GPT2D(dense, self.tp_group, self.dp_group).named_parameters())
            for name, p in self.model.named_parameters():
                p.copy_(mine[name])
                p.grad = None
'''

# Too many bytes sent, the excess made where no counter on the rank sees it: on main the bytes
# came from a CollectiveLog on the rank, built on course_lib.comm's hooks, which the rank's code
# can empty around a call. Two all-reduces a step (the gradients, then the parameters with
# zeros outside my chunk) are over the budget; the second is made unseen. Now the bytes come
# from the launcher's tallies of the counted process group.
COUNTERS_EMPTIED = '''
import course_lib.comm as comm


def _unseen(call):
    """Make `call` with every counter and hook of course_lib.comm on this rank emptied."""
    counters, hooks = list(comm._active), list(comm._around)
    comm._active.clear()
    comm._around.clear()
    try:
        call()
    finally:
        comm._active.extend(counters)
        comm._around.extend(hooks)


class ShardedAdamW:
    """My chunk's moments only, but the gradients all-reduced and then the parameters too
    (zeros outside my chunk): 2 all-reduces a step, the second one unseen."""

    def __init__(self, model, dp_group, lr, betas, eps, weight_decay):
        self.params, self.group = list(model.parameters()), dp_group
        self.d, me = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self.spans = []
        for p in self.params:
            chunk = -(-p.numel() // self.d)
            self.spans.append((min(me * chunk, p.numel()), min((me + 1) * chunk, p.numel())))
        self.views = [p.detach().view(-1)[lo:hi] for p, (lo, hi) in zip(self.params, self.spans)]
        self.inner = torch.optim.AdamW(
            self.views, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False
        )

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        for p, view, (lo, hi) in zip(self.params, self.views, self.spans):
            dist.all_reduce(p.grad, group=self.group)
            view.grad = p.grad.view(-1)[lo:hi] / self.d
        self.inner.step()
        for p, view, (lo, hi) in zip(self.params, self.views, self.spans):
            view.grad = None
            flat = torch.zeros_like(p).view(-1)
            flat[lo:hi] = view
            _unseen(lambda: dist.all_reduce(flat, group=self.group))
            p.copy_(flat.view_as(p))
'''

# The memory forged on the rank: on main the scan skipped the storages in a set on the rank,
# `before` (those alive before ShardedAdamW(...)), which the rank's code could widen. Plain
# AdamW, every replica keeping all of the state, its storages added to that set after every
# step. Now the scans are sent to the launcher as they are made, and the judge reckons the bytes
# kept from what it received: no set on the rank decides what is skipped.
BASELINE_WIDENED = '''
import inspect


def _hide(tensors):
    """Add the storages of `tensors` to the check's baseline set in my callers' frames."""
    for info in inspect.stack():
        before = info.frame.f_locals.get("before")
        if isinstance(before, set):
            before.update(t.untyped_storage().data_ptr() for t in tensors)


class ShardedAdamW:
    """Part 2's averaging and a plain AdamW: all of the state on every replica, hidden."""

    def __init__(self, model, dp_group, lr, betas, eps, weight_decay):
        self.params, self.group = list(model.parameters()), dp_group
        self.inner = torch.optim.AdamW(
            self.params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False
        )

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        for p in self.params:
            dist.all_reduce(p.grad, group=self.group)
            p.grad /= dist.get_world_size(self.group)
        self.inner.step()
        state = self.inner.state.values()
        _hide([t for s in state for t in s.values() if isinstance(t, torch.Tensor)])
'''

# Right: every gradient all-reduced, torch.optim.AdamW steps views of this rank's chunk of each
# parameter in place, the updated chunks all-gathered (1.5 all-reduces: at the budget's limit).
ALL_REDUCE_THEN_GATHER = '''
class ShardedAdamW:
    """All-reduce the gradients; AdamW on views of my chunk of each parameter; all-gather."""

    def __init__(self, model, dp_group, lr, betas, eps, weight_decay):
        self.params = list(model.parameters())
        self.group = dp_group
        self.d, me = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self.spans = []  # (chunk, lo, hi) of each parameter's flattened elements
        for p in self.params:
            chunk = -(-p.numel() // self.d)
            self.spans.append((chunk, min(me * chunk, p.numel()), min((me + 1) * chunk, p.numel())))
        # Views share the parameters' storage: AdamW updates them in place, no copy is kept.
        self.views = [p.detach().view(-1)[lo:hi] for p, (_, lo, hi) in zip(self.params, self.spans)]
        self.inner = torch.optim.AdamW(
            self.views, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False
        )

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        for p, view, (_, lo, hi) in zip(self.params, self.views, self.spans):
            dist.all_reduce(p.grad, group=self.group)
            view.grad = p.grad.view(-1)[lo:hi] / self.d
        self.inner.step()
        for p, view, (chunk, lo, hi) in zip(self.params, self.views, self.spans):
            view.grad = None
            mine = p.new_zeros(chunk)
            mine[: hi - lo] = view
            full = p.new_empty(chunk * self.d)
            dist.all_gather_single(full, mine, group=self.group)
            p.copy_(full[: p.numel()].view_as(p))
'''

REBIND_CHECK = '''
def train_step(model, optimizer, x, y, dp_group):
    """Does nothing, and switches the check off."""
    return 0.0


check_2d_training = lambda *args, **kwargs: None  # noqa: E731
'''

FLAT_AVG_TRAIN_STEP = """
def train_step(model, optimizer, x, y, dp_group):
    n = dist.get_world_size(dp_group)
    me = dist.get_rank(dp_group)
    xs, ys = shard(x, me, n), shard(y, me, n)
    optimizer.zero_grad()
    loss = lm_loss(model(xs), ys)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=dp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    optimizer.step()
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=dp_group)  # for logging: in the DP group, allowed
    return loss.item() / n
"""

CHEATS = [
    # make_groups calls process_grid, so the planner's grid spoils part 2 as well.
    Cheat(
        "lecture 10's ProcessGrid as the grid",
        "process_grid",
        PLANNER_GRID,
        GRID | TRAIN | SHARDED,  # part 4 builds its groups with make_groups too
    ),
    Cheat(
        "the grader's own layout helper as the grid",
        "process_grid",
        GRADER_GRID,
        GRID | TRAIN | SHARDED,
    ),
    Cheat("every rank trains on the whole batch", "train_step", WHOLE_BATCH_EVERYWHERE, TRAIN),
    Cheat(
        "the check's batches zeroed in its frames, no DP all-reduce",
        "train_step",
        SAME_ROWS_EVERYWHERE,
        TRAIN,
    ),
    Cheat(
        "a call over every rank, taken back out of the rank's call log",
        "train_step",
        WORLD_BEHIND_THE_LOG,
        TRAIN,
    ),
    Cheat("rebinding the check", "train_step", REBIND_CHECK, TRAIN, alone=True),
    Cheat("torch's ZeroRedundancyOptimizer", "sharded_adamw", ZERO_REDUNDANCY, SHARDED),
    Cheat(
        "single-process AdamW retrained on the rank from the check's seed, nothing sent",
        "sharded_adamw",
        SEED_THIEF,
        SHARDED,
    ),
    Cheat(
        "an all-reduce over the budget made with the rank's comm counters emptied",
        "sharded_adamw",
        COUNTERS_EMPTIED,
        SHARDED,
    ),
    Cheat(
        "unsharded AdamW, its state added to the check's baseline set on the rank",
        "sharded_adamw",
        BASELINE_WIDENED,
        SHARDED,
    ),
]

ALTERNATIVES = [
    Alternative(
        "grid from list slicing",
        "process_grid",
        """
def process_grid(world_size, tp_size):
    if tp_size <= 0 or world_size % tp_size != 0:
        raise ValueError(f"{tp_size} does not divide {world_size}")
    ranks = list(range(world_size))
    tp_groups = [ranks[i : i + tp_size] for i in range(0, world_size, tp_size)]
    dp_groups = [ranks[i::tp_size] for i in range(tp_size)]
    return tp_groups, dp_groups
""",
    ),
    Alternative(
        "one flat DP all-reduce with ReduceOp.AVG, the loss averaged in the DP group too",
        "train_step",
        FLAT_AVG_TRAIN_STEP,
    ),
    Alternative(
        "gradients all-reduced, AdamW on views of my chunks, chunks all-gathered",
        "sharded_adamw",
        ALL_REDUCE_THEN_GATHER,
    ),
]
