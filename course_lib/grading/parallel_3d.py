"""Checks for the capstone, 2-D parallel training: data parallel x tensor parallel.

    check_process_grid(process_grid)                 which ranks form each TP and DP group
    check_2d_training(make_groups, GPT2D, train_step)   TinyGPT trained on a DP x TP grid

The student's interface (the contract between the notebook, these checks and the tests):

- `process_grid(world_size, tp_size) -> (tp_groups, dp_groups)`: lists of rank lists. As in
  Megatron and picotron, TP is the innermost dimension: TP groups are blocks of consecutive
  ranks (the GPUs of one node), DP groups take one rank from each block. A `tp_size` that does
  not divide `world_size` raises ValueError.
- `make_groups(tp_size) -> (tp_group, dp_group)`: called on every rank; creates the groups
  with `dist.new_group` and returns this rank's two.
- `GPT2D(model, tp_group, dp_group)`: `model` is a dense `TinyGPT`; the 2-D model computes the
  same logits, with each block's attention and MLP tensor-parallel in `tp_group`. Its
  parameters keep TinyGPT's names and each rank holds its TP shard as Assignment 9 defines it
  (`tp_shard`): no parameter of the check's own is needed to gather it back to dense form.
- `train_step(model, optimizer, x, y, dp_group)`: `x, y` are the *global* batch; the step
  trains on this DP rank's shard (`course_lib.data.shard` by the rank in `dp_group`),
  averages the gradients over `dp_group`, and calls `optimizer.step()`.

The training check runs SGD for a few steps in float64 and compares every rank's parameters
with its shard of single-process training on the whole batch; it also records every
collective call with the ranks of its group (forward's must be in the TP group, none may leave
the rank's TP and DP groups) and the batch each rank's model saw (TP partners see the same
shard, DP groups different ones). Below the checks: memory and communication per rank of a
configuration, measured and by formula, for the notebook.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm, compare, data, models
from course_lib.comm import CommCounter
from course_lib.costs import all_reduce_bytes, tp_layer_bytes
from course_lib.grading._harness import Verdict, fail, run_on_ranks
from course_lib.grading.provenance import Provenance
from course_lib.grading.training import SGD_LR, make_optimizer, snapshot
from course_lib.launch import launch
from course_lib.memory import storage_bytes
from course_lib.runtime import world_size

DTYPE = torch.float64
RTOL, ATOL = 1e-10, 1e-10  # float64: split sums differ from whole ones by ~1e-15, measured
CONFIG = models.GPTConfig()  # the small TinyGPT: 2 blocks, d_model 32, 4 heads

# How Assignment 9 splits a dense parameter over the TP ranks, by its name in TinyGPT:
# column-parallel (rows of the weight and the bias; qkv as three stacked blocks), row-parallel
# (columns of the weight; the bias is whole). Every other parameter is replicated.
COLUMN = re.compile(r"^blocks\.\d+\.(attn\.qkv|mlp\.fc)\.(weight|bias)$")
ROW = re.compile(r"^blocks\.\d+\.(attn|mlp)\.proj\.weight$")


def tp_shard(name: str, dense: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """TP rank `tp_rank`'s piece of TinyGPT's parameter `name` (or its gradient)."""
    if COLUMN.match(name):
        parts = 3 if ".qkv." in name else 1  # q, k and v each split by heads
        blocks = dense.chunk(parts, dim=0)
        width = blocks[0].shape[0] // tp_size
        return torch.cat([b[tp_rank * width : (tp_rank + 1) * width] for b in blocks], dim=0)
    if ROW.match(name):
        width = dense.shape[1] // tp_size
        return dense[:, tp_rank * width : (tp_rank + 1) * width]
    return dense


def tp_shards(state: Mapping[str, torch.Tensor], tp_rank: int, tp_size: int) -> dict:
    return {name: tp_shard(name, t, tp_rank, tp_size) for name, t in state.items()}


def gather_dense(shards: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The dense TinyGPT state from the shards of one TP group, in TP-rank order: the inverse
    of `tp_shard`."""
    out = {}
    for name, first in shards[0].items():
        pieces = [s[name] for s in shards]
        if COLUMN.match(name):
            parts = 3 if ".qkv." in name else 1
            blocks = [p.chunk(parts, dim=0) for p in pieces]
            out[name] = torch.cat([b[i] for i in range(parts) for b in blocks], dim=0)
        elif ROW.match(name):
            out[name] = torch.cat(pieces, dim=1)
        else:
            out[name] = first
    return out


def _partners(world: int, tp_size: int, r: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Rank r's TP partners (the ranks of its block of tp_size consecutive ranks) and DP
    partners (the ranks at its position in every block), as the grid's rule defines them."""
    tp = tuple(s for s in range(world) if s // tp_size == r // tp_size)
    dp = tuple(s for s in range(world) if s % tp_size == r % tp_size)
    return tp, dp


# --- check_process_grid (on one rank) ------------------------------------------------------

GRID_CASES = ((4, 2), (4, 1), (4, 4), (8, 2), (8, 4), (6, 3), (1, 1))


def _as_sets(groups) -> set[frozenset[int]]:
    return {frozenset(int(r) for r in g) for g in groups}


# Lecture 10's planner builds the same grid (ProcessGrid) and its groups (new_groups): an
# answer that runs them, or a copy, is not the student's own.
PLANNER = ("course_lib.parallel_3d.ProcessGrid", "course_lib.parallel_3d.new_groups")


def _grids_on_rank(process_grid: Callable, cases: list[tuple[int, int]]) -> dict:
    """Call the student's process_grid on each case; what happened, as plain data."""
    with Provenance(PLANNER) as seen:
        outcomes = [_grid_outcome(process_grid, world, tp) for world, tp in cases]
    return {"outcomes": outcomes, "copied": seen.complaint()}


def _grid_outcome(process_grid: Callable, world: int, tp: int) -> dict:
    try:
        result = process_grid(world, tp)
    except Exception as error:  # noqa: BLE001 (reported to the student)
        return {"raised": type(error).__name__, "message": str(error)}
    try:
        tp_groups, dp_groups = result
        return {"groups": [[[int(r) for r in g] for g in gs] for gs in (tp_groups, dp_groups)]}
    except (TypeError, ValueError):
        return {"returned": repr(result)[:200]}


def check_process_grid(
    process_grid: Callable[[int, int], tuple], cases: tuple = GRID_CASES
) -> None:
    """`process_grid(world_size, tp_size)` returns (tp_groups, dp_groups) as lists of rank
    lists: TP groups are blocks of consecutive ranks, DP groups take one rank of each block.
    A tp_size that does not divide world_size raises ValueError. (The student's function
    runs on a grading rank, like every answer.)"""
    __tracebackhide__ = True
    check = "check_process_grid"
    bad = ((4, 3), (6, 4))
    (found,) = run_on_ranks(
        check,
        _grids_on_rank,
        process_grid,
        [*cases, *bad],
        world_size=1,
        timeout=30,
        what="your process_grid",
    )
    if found["copied"]:
        fail(check, found["copied"])
    outcomes = found["outcomes"]
    verdict = Verdict(check)
    for (world, tp), outcome in zip(cases, outcomes, strict=False):
        with verdict.case():
            _judge_grid(check, world, tp, outcome)
    for (world, tp), outcome in zip(bad, outcomes[len(cases) :], strict=True):
        with verdict.case():
            _judge_bad_grid(check, world, tp, outcome)
    verdict.conclude(
        f"{len(cases)} layouts ({', '.join(f'{w} ranks, TP {t}' for w, t in cases)}): TP "
        "groups are blocks of tp_size consecutive ranks and DP groups take one rank of each; "
        f"{len(bad)} sizes that do not divide raise ValueError"
    )


def _judge_grid(check: str, world: int, tp: int, outcome: dict) -> None:
    __tracebackhide__ = True
    call = f"process_grid({world}, {tp})"
    if "raised" in outcome:
        fail(check, f"{call} raised {outcome['raised']}: {outcome['message']}")
    if "returned" in outcome:
        fail(check, f"{call} returned {outcome['returned']}; expected (tp_groups, dp_groups)")
    tp_groups, dp_groups = outcome["groups"]
    got_tp, got_dp = _as_sets(tp_groups), _as_sets(dp_groups)
    want = [_partners(world, tp, r) for r in range(world)]
    want_tp, want_dp = _as_sets(w[0] for w in want), _as_sets(w[1] for w in want)
    if got_tp == want_dp and got_dp == want_tp and got_tp != want_tp:
        fail(
            check,
            f"{call}: the TP and DP groups are swapped: got TP groups "
            f"{_show(tp_groups)}, DP groups {_show(dp_groups)}. TP is the innermost "
            "dimension: its groups are blocks of tp_size consecutive ranks (one node)",
        )
    if got_tp != want_tp:
        fail(
            check,
            f"{call}: TP groups {_show(tp_groups)}, expected {_show(want_tp)} (blocks "
            "of tp_size consecutive ranks)",
        )
    if got_dp != want_dp:
        fail(
            check,
            f"{call}: DP groups {_show(dp_groups)}, expected {_show(want_dp)} (the "
            "ranks with the same position in each TP group)",
        )


def _judge_bad_grid(check: str, world: int, tp: int, outcome: dict) -> None:
    __tracebackhide__ = True
    if outcome.get("raised") == "ValueError":
        return
    if "raised" in outcome:
        fail(
            check,
            f"process_grid({world}, {tp}) raised {outcome['raised']}: "
            f"{outcome['message']}; raise ValueError when tp_size does not divide world_size",
        )
    returned = outcome.get("returned") or outcome["groups"]
    fail(
        check,
        f"process_grid({world}, {tp}) returned {returned}, but {tp} does not divide "
        f"{world}: raise ValueError saying so",
    )


def _show(groups) -> str:
    return str(sorted(sorted(int(r) for r in g) for g in groups))


# --- recording collectives with their groups -----------------------------------------------


def group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """Global ranks of `group` (None: the default group, every rank)."""
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(sorted(dist.get_process_group_ranks(group)))


@dataclass
class Collective:
    """One collective call: the op, its group's global ranks, bytes sent, and when."""

    op: str
    ranks: tuple[int, ...]
    sent: int
    phase: str


@dataclass
class CollectiveLog:
    """Records every torch.distributed call made while the block runs, with its group.

    Built on `course_lib.comm`'s hooks, so it sees what `CommCounter` sees and counts bytes
    the same way. `phase` is whatever the caller set last ("forward", "backward", ...)."""

    calls: list[Collective] = field(default_factory=list)
    phase: str = "other"

    def _hook(self, op, args, sent, received, call):
        self.calls.append(Collective(op, group_ranks(args.get("group")), sent, self.phase))
        return call()

    def __enter__(self) -> CollectiveLog:
        comm.add_around_hook(self._hook)
        return self

    def __exit__(self, *exc_info: object) -> None:
        comm.remove_around_hook(self._hook)

    def take(self) -> list[Collective]:
        """The calls recorded since the last take()."""
        calls, self.calls = self.calls, []
        return calls


def watch_model(model: nn.Module, log: CollectiveLog, inputs: list) -> None:
    """Record each forward's first input in `inputs`, and mark the log's phase: "forward"
    from the model's call until its output's gradient arrives, "backward" after."""

    def before(module, args, kwargs):
        given = [*args, *kwargs.values()]
        inputs.append(given[0].detach().clone() if given else None)
        log.phase = "forward"

    def after(module, args, output):
        log.phase = "loss"
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: setattr(log, "phase", "backward"))

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after)


# --- check_2d_training ----------------------------------------------------------------------


@dataclass(frozen=True)
class Run2D:
    """One 2-D training run: the grid, the model and the data."""

    tp_size: int = 2
    seed: int = 0
    steps: int = 3
    batch_size: int = 8

    def describe(self, world: int) -> str:
        dp = world // self.tp_size
        return (
            f"DP x TP = {dp} x {self.tp_size}, TinyGPT seed {self.seed}, float64, SGD, "
            f"batch of {self.batch_size}"
        )

    def batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The same global batches on every rank and in the reference."""
        c = CONFIG
        x, y = data.tokens(4 * self.batch_size, c.seq_len, c.vocab_size, seed=self.seed + 1)
        return data.batches(x, y, self.batch_size, self.steps, seed=self.seed)


def _secret_batches(run: Run2D) -> list[dict]:
    """This rank's global batches: its DP replica's shard is real, drawn from a secret that
    only its TP partners share; the other replicas' rows are noise drawn by this rank alone.
    Right code trains on its shard only and never notices; code that trains every rank on
    the whole batch, to skip the DP all-reduce, trains on noise."""
    world, me, tp = dist.get_world_size(), dist.get_rank(), run.tp_size
    dp, first = world // tp, me - me % tp
    mine = None
    for start in range(0, world, tp):  # the check's own TP groups; every rank makes each one
        group = dist.new_group(list(range(start, start + tp)))
        mine = group if start == first else mine
    seed = torch.tensor([secrets.randbits(62)])
    dist.broadcast(seed, src=first, group=mine)
    n, c = run.batch_size // dp, CONFIG
    rows = slice((me // tp) * n, (me // tp + 1) * n)
    out = []
    for s in range(run.steps):
        xs, ys = data.tokens(n, c.seq_len, c.vocab_size, seed=int(seed) + s)
        x, y = data.tokens(run.batch_size, c.seq_len, c.vocab_size, seed=secrets.randbits(62))
        x[rows], y[rows] = xs, ys
        out.append({"x": x, "y": y, "shard": (xs, ys)})
    return out


def _train_on_rank(make_groups, model_2d, train_step, run: Run2D) -> dict:
    """Train with the student's code on this rank; record groups, inputs, calls, params."""
    batches = _secret_batches(run)
    with Provenance(PLANNER) as origin:
        tp_group, dp_group = make_groups(run.tp_size)
    groups = {"tp": group_ranks(tp_group), "dp": group_ranks(dp_group)}
    model = model_2d(models.TinyGPT(CONFIG, seed=run.seed, dtype=DTYPE), tp_group, dp_group)
    initial = snapshot(model.named_parameters())
    optimizer = make_optimizer("sgd", model.parameters())
    steps, inputs = [], []
    with CollectiveLog() as log:
        watch_model(model, log, inputs)
        for batch in batches:
            log.phase = "step"
            train_step(model, optimizer, batch["x"], batch["y"], dp_group)
            seen, inputs[:] = list(inputs), []
            calls = [vars(call) for call in log.take()]  # plain data for the trip back
            steps.append(
                {"params": snapshot(model.named_parameters()), "seen": seen, "calls": calls}
            )
    return {
        "groups": groups,
        "initial": initial,
        "steps": steps,
        "shards": [batch["shard"] for batch in batches],
        "copied": origin.complaint(),
    }


def _global_batches(run: Run2D, results: list[dict]) -> list[tuple[torch.Tensor, ...]]:
    """The real global batches: every DP replica's shard, in DP order (from the first rank
    of each TP group)."""
    tp = run.tp_size
    replicas = [results[first]["shards"] for first in range(0, len(results), tp)]
    return [
        tuple(torch.cat([shards[s][i] for shards in replicas]) for i in (0, 1))
        for s in range(run.steps)
    ]


def _reference(run: Run2D, batches: list) -> dict:
    """Single-process training on whole batches: parameters before and after each step."""
    model = models.TinyGPT(CONFIG, seed=run.seed, dtype=DTYPE)
    optimizer = make_optimizer("sgd", model.parameters())
    steps = []
    for x, y in batches:
        before = snapshot(model.named_parameters())
        optimizer.zero_grad()
        models.lm_loss(model(x), y).backward()
        optimizer.step()
        steps.append(
            {"before": before, "after": snapshot(model.named_parameters()), "batch": (x, y)}
        )
    return {
        "initial": snapshot(models.TinyGPT(CONFIG, seed=run.seed, dtype=DTYPE).named_parameters()),
        "steps": steps,
    }


def _check_groups(check: str, run: Run2D, results: list[dict], where: str) -> None:
    __tracebackhide__ = True
    world = len(results)
    for r, result in enumerate(results):
        want_tp, want_dp = _partners(world, run.tp_size, r)
        got = {kind: tuple(ranks) for kind, ranks in result["groups"].items()}
        if (got["tp"], got["dp"]) == (want_dp, want_tp) and want_tp != want_dp:
            fail(
                check,
                f"rank {r} ({where}): make_groups returned TP group {list(got['tp'])} and DP "
                f"group {list(got['dp'])}: they are swapped. TP groups are blocks of tp_size "
                "consecutive ranks (one node, where the links are fast)",
            )
        for kind, want in (("TP", want_tp), ("DP", want_dp)):
            if got[kind.lower()] != want:
                fail(
                    check,
                    f"rank {r} ({where}): make_groups returned a {kind} group of ranks "
                    f"{list(got[kind.lower()])}, expected {list(want)} (as process_grid)",
                )


def _check_batches(check: str, run: Run2D, results: list[dict], where: str, batches) -> None:
    """TP partners see the same batch shard; DP rank d sees shard d of the global batch."""
    __tracebackhide__ = True
    world, tp = len(results), run.tp_size
    dp = world // tp
    for s, (x, _) in enumerate(batches):
        seen = []
        for r, result in enumerate(results):
            inputs = result["steps"][s]["seen"]
            if not inputs or any(i is None for i in inputs):
                fail(
                    check,
                    f"rank {r}, step {s} ({where}): train_step never called the model with "
                    "the token ids: call it as model(x_shard)",
                )
            seen.append(torch.cat(inputs))
        if dp > 1 and all(len(seen[r]) == len(x) for r in range(world)):
            fail(
                check,
                f"step {s} ({where}): every rank's model saw the whole batch "
                f"({tuple(seen[0].shape)} token ids). Each DP group must train on its own "
                "shard: data.shard(x, dist.get_rank(dp_group), dist.get_world_size(dp_group))",
            )
        for r in range(world):
            partner = r - r % tp  # the first rank of r's TP group
            if not torch.equal(seen[r], seen[partner]):
                fail(
                    check,
                    f"step {s} ({where}): ranks {partner} and {r} form a TP group but their "
                    "models saw different batches. The ranks of a TP group compute one model "
                    "together on the same data: shard the batch by the rank in the DP group "
                    "(dist.get_rank(dp_group)), not by the global rank",
                )
        for r in range(world):
            want = data.shard(x, r // tp, dp)
            if not torch.equal(seen[r], want):
                fail(
                    check,
                    f"rank {r}, step {s} ({where}): the model saw token ids of shape "
                    f"{tuple(seen[r].shape)}, not shard {r // tp} of {dp} of the global batch "
                    f"{tuple(x.shape)} (data.shard(x, dp_rank, dp_size))",
                )


def _check_collectives(check: str, run: Run2D, results: list[dict], where: str) -> None:
    """Forward talks only in the TP group; nothing talks outside the TP and DP groups."""
    __tracebackhide__ = True
    world = len(results)
    for r, result in enumerate(results):
        want_tp, want_dp = _partners(world, run.tp_size, r)
        for s, step in enumerate(result["steps"]):
            at = f"rank {r}, step {s} ({where})"
            for call in step["calls"]:
                everyone = len(call.ranks) == world and world > max(len(want_tp), len(want_dp))
                if call.phase == "forward" and call.ranks != want_tp:
                    fail(
                        check,
                        f"{at}: {call.op} in forward went over ranks {list(call.ranks)}; "
                        f"forward only talks inside the TP group {list(want_tp)} (the "
                        "row-parallel outputs): build the TP layers with group=tp_group",
                    )
                if call.ranks not in (want_tp, want_dp):
                    extra = (
                        " (the default group, every rank): the gradients of TP shards "
                        "must be averaged only over the DP group, pass group=dp_group"
                        if everyone
                        else ""
                    )
                    fail(
                        check,
                        f"{at}: {call.op} ({call.phase}) went over ranks "
                        f"{list(call.ranks)}{extra}; rank {r}'s TP group is {list(want_tp)} "
                        f"and its DP group {list(want_dp)}",
                    )


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Loosely equal: for telling which mistake was made, not for grading."""
    scale = max(1e-12, want.abs().max().item())
    return compare.find_mismatch({"t": got}, {"t": want}, rtol=1e-6, atol=1e-9 * scale) is None


def _local_delta(run: Run2D, step: dict, name: str, dp_rank: int, dp: int) -> torch.Tensor:
    """The SGD update of dense parameter `name` from DP shard `dp_rank`'s gradient alone."""
    model = models.TinyGPT(CONFIG, seed=run.seed, dtype=DTYPE)
    model.load_state_dict(step["before"])
    x, y = (data.shard(t, dp_rank, dp) for t in step["batch"])
    models.lm_loss(model(x), y).backward()
    return -SGD_LR * dict(model.named_parameters())[name].grad


def _training_hint(run: Run2D, ref_step: dict, name: str, r: int, world: int, got, step) -> str:
    tp = run.tp_size
    dp = world // tp
    t = r % tp
    before = tp_shard(name, ref_step["before"][name], t, tp)
    want = tp_shard(name, ref_step["after"][name], t, tp) - before
    moved = got - before
    forward_tp = sum(c.phase == "forward" for c in step["calls"])
    if tp > 1 and forward_tp < 2 * CONFIG.n_layers:
        return (
            f"forward made {forward_tp} collective calls in the TP group; each block needs "
            "at least 2, the all-reduces that sum the row-parallel outputs of attention and "
            "of the MLP (Megatron's g)"
        )
    if dp > 1 and _close(moved, dp * want):
        return (
            f"the update is {dp} (the DP size) times the full-batch one: after the all-reduce "
            "in the DP group, divide the gradients by the DP group's size"
        )
    local = tp_shard(name, _local_delta(run, ref_step, name, r // tp, dp), t, tp)
    if dp > 1 and _close(moved, local):
        return (
            "the update uses this DP rank's own gradient: average every gradient over the DP "
            "group (dist.all_reduce(p.grad, group=dp_group), then divide by its size)"
        )
    return "the 2-D model must compute the dense TinyGPT's loss and gradients exactly"


def _check_training(check: str, run: Run2D, results: list[dict], where: str, batches) -> None:
    __tracebackhide__ = True
    world, tp = len(results), run.tp_size
    ref = _reference(run, batches)
    for r, result in enumerate(results):
        want = tp_shards(ref["initial"], r % tp, tp)
        problem = compare.find_mismatch(result["initial"], want, rtol=0.0, atol=0.0)
        if problem:
            fail(
                check,
                f"rank {r} ({where}): right after GPT2D(...), {problem}.\nHint: keep "
                "TinyGPT's parameter names; rank r of the TP group holds block r of the "
                "column-parallel rows (q, k and v each split by heads) and of the "
                "row-parallel columns; everything else whole",
            )
    for s, ref_step in enumerate(ref["steps"]):
        for r, result in enumerate(results):
            step = result["steps"][s]
            want = tp_shards(ref_step["after"], r % tp, tp)
            problem = compare.find_mismatch(step["params"], want, rtol=RTOL, atol=ATOL)
            if problem:
                name = next(
                    n
                    for n in want
                    if compare.find_mismatch(
                        {n: step["params"][n]}, {n: want[n]}, rtol=RTOL, atol=ATOL
                    )
                )
                hint = _training_hint(run, ref_step, name, r, world, step["params"][name], step)
                fail(
                    check,
                    f"rank {r}, step {s} ({where}): after train_step, {problem} (its shard "
                    f"of single-process training on the whole batch).\nHint: {hint}",
                )


def check_2d_training(
    make_groups: Callable[[int], tuple],
    model_2d: Callable[..., nn.Module],
    train_step: Callable[..., object],
    *,
    world_size: int = 4,
    tp_size: int = 2,
    seed: int = 0,
    steps: int = 3,
    batch_size: int = 8,
    timeout: float = 60.0,
) -> None:
    """Train TinyGPT (float64, SGD) for `steps` steps on a DP x TP grid with the student's
    `make_groups`, `model_2d` (GPT2D) and `train_step`; every rank's parameters must match
    its shard of single-process training after every step, and the groups, the batches
    each rank saw and the groups of every collective must be right."""
    __tracebackhide__ = True
    check = "check_2d_training"
    run = Run2D(tp_size=tp_size, seed=seed, steps=steps, batch_size=batch_size)
    if world_size < 1 or tp_size < 1 or world_size % tp_size:
        raise ValueError(f"tp_size={tp_size} must divide world_size={world_size}")
    if CONFIG.n_heads % tp_size:
        raise ValueError(f"tp_size={tp_size} must divide TinyGPT's {CONFIG.n_heads} heads")
    if batch_size % (world_size // tp_size):
        raise ValueError(f"batch_size={batch_size} must divide evenly over the DP groups")
    results = run_on_ranks(
        check,
        _train_on_rank,
        make_groups,
        model_2d,
        train_step,
        run,
        world_size=world_size,
        timeout=timeout,
        what="your make_groups, GPT2D and train_step",
    )
    for result in results:
        for step in result["steps"]:
            step["calls"] = [Collective(**{**c, "ranks": tuple(c["ranks"])}) for c in step["calls"]]
    for r, result in enumerate(results):
        if result["copied"]:
            fail(check, f"make_groups on rank {r}: {result['copied']}")
    where, batches = run.describe(world_size), _global_batches(run, results)
    verdict = Verdict(check)
    with verdict.case():
        _check_groups(check, run, results, where)
    verdict.settle()  # what follows reads the groups
    with verdict.case():
        _check_batches(check, run, results, where, batches)
    with verdict.case():
        _check_collectives(check, run, results, where)
    with verdict.case():
        _check_training(check, run, results, where, batches)
    verdict.conclude(
        f"{where}: the groups, the samples each rank's model saw (its DP group's share of "
        "every batch), the groups of every collective, and every rank's parameters after "
        f"every step, equal to its shard of single-process training (rtol {RTOL:g}, atol "
        f"{ATOL:g})"
    )


# --- memory and communication per configuration (for the notebook) -------------------------


@dataclass(frozen=True)
class Measured:
    """What rank 0 held and sent in one AdamW step (float32) of a DP x TP configuration."""

    dp: int
    tp: int
    params: int
    grads: int
    optimizer_state: int
    tp_sent: int  # bytes sent in TP-group collectives (CommCounter's ring model)
    dp_sent: int  # bytes sent in DP-group collectives
    total_sent: int  # everything CommCounter saw


def _measure_on_rank(make_groups, model_2d, train_step, tp_size: int, batch_size: int):
    tp_group, dp_group = make_groups(tp_size)
    model = model_2d(models.TinyGPT(CONFIG, seed=0), tp_group, dp_group)
    optimizer = make_optimizer("adamw", model.parameters())
    x, y = Run2D(batch_size=batch_size).batches()[0]
    tp_ranks, dp_ranks = group_ranks(tp_group), group_ranks(dp_group)
    with CommCounter() as counter, CollectiveLog() as log:
        train_step(model, optimizer, x, y, dp_group)
    # AdamW's two moments; its 0-d step counters (one per tensor, not per parameter) are left out
    state = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    return Measured(
        dp=world_size() // tp_size,
        tp=tp_size,
        params=storage_bytes(model.parameters()),
        grads=storage_bytes(p.grad for p in model.parameters() if p.grad is not None),
        optimizer_state=storage_bytes(state),
        tp_sent=sum(c.sent for c in log.calls if c.ranks == tp_ranks and len(tp_ranks) > 1),
        dp_sent=sum(c.sent for c in log.calls if c.ranks == dp_ranks and len(dp_ranks) > 1),
        total_sent=counter.bytes_sent,
    )


def measure_configuration(
    make_groups, model_2d, train_step, tp_size: int, world: int = 4, batch_size: int = 8
) -> Measured:
    """Run one AdamW step of TinyGPT on `world` ranks with TP size `tp_size`; rank 0's
    bytes held and sent."""
    return launch(
        _measure_on_rank,
        make_groups,
        model_2d,
        train_step,
        tp_size,
        batch_size,
        world_size=world,
        timeout=60,
    )[0]


def split_counts(config: models.GPTConfig = CONFIG) -> tuple[int, int]:
    """(parameters split across TP ranks, parameters every rank holds whole) of TinyGPT."""
    dense = models.TinyGPT(config)
    split = sum(p.numel() for n, p in dense.named_parameters() if COLUMN.match(n) or ROW.match(n))
    return split, models.count_parameters(dense) - split


def formula(
    dp: int, tp: int, batch_size: int = 8, element_size: int = 4, config: models.GPTConfig = CONFIG
) -> dict[str, float]:
    """Bytes per rank by formula: parameters N_rep + N_split/t (gradients the same, AdamW's
    state twice that); TP sends 4 all-reduces per block of a (B/d) x s x h activation, DP one
    all-reduce of the rank's gradients, each 2(P-1)/P of its size in a ring of P."""
    split, replicated = split_counts(config)
    held = element_size * (replicated + split / tp)
    activation = batch_size / dp * config.seq_len * config.d_model * element_size
    tp_sent = config.n_layers * tp_layer_bytes(activation, tp)
    dp_sent = all_reduce_bytes(held, dp)
    return {
        "params": held,
        "grads": held,
        "optimizer_state": 2 * held,
        "tp_sent": tp_sent,
        "dp_sent": dp_sent,
        "total_sent": tp_sent + dp_sent,
    }


ROWS = {  # field of Measured: its label in the table
    "params": "parameters",
    "grads": "gradients",
    "optimizer_state": "AdamW state",
    "tp_sent": "sent in TP group",
    "dp_sent": "sent in DP group",
    "total_sent": "sent in total",
}


def configuration_table(runs: list[Measured], batch_size: int = 8) -> str:
    """Bytes rank 0 held and sent per step, "measured / formula", one column per layout."""
    width = 22
    rows = [
        f"{'bytes, rank 0':<18}" + "".join(f"{f'DP x TP = {m.dp} x {m.tp}':>{width}}" for m in runs)
    ]
    rows.append(f"{'':<18}" + f"{'measured / formula':>{width}}" * len(runs))
    formulas = [formula(m.dp, m.tp, batch_size) for m in runs]
    for kind, label in ROWS.items():
        cells = [
            f"{getattr(m, kind):,} / {f[kind]:,.0f}" for m, f in zip(runs, formulas, strict=True)
        ]
        rows.append(f"{label:<18}" + "".join(f"{c:>{width}}" for c in cells))
    return "\n".join(rows)


__all__ = [
    "CollectiveLog",
    "Measured",
    "check_2d_training",
    "check_process_grid",
    "configuration_table",
    "formula",
    "gather_dense",
    "measure_configuration",
    "split_counts",
    "tp_shard",
]
