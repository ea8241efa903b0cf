"""Part of the capstone's checks (grading/parallel_3d.py): Part 4, AdamW's state shared by
the replicas, that is ZeRO-1 inside the DP group of the 2-D grid.

    check_sharded_adamw(make_groups, GPT2D, ShardedAdamW)

On each rank the check builds the student's groups and 2-D model (Parts 1-2) and trains it
for a few AdamW steps in float64 with `ShardedAdamW(model, dp_group, **ADAMW)`: zero_grad(),
backward of the mean loss on the DP replica's shard of each global batch, step(). After every
step it measures, on every rank:

- result: the parameters, against this rank's TP shard of torch.optim.AdamW on one process
  on the whole batch (RTOL, ATOL);
- memory, `kept_bytes`: the storages of every tensor the garbage collector can reach on the
  rank (and of their .grad) that were not there before ShardedAdamW(...) was called, less the
  bytes of the model's parameters and of their gradients; at most `state_budget`: AdamW's
  two moments of ceil(n/d) elements of each of the rank's parameters, plus the two moments of
  its largest parameter (d: the DP size);
- communication: the bytes sent (CommCounter's ring model, recorded by CollectiveLog) by
  every collective from zero_grad() to the end of step(), except the TP group's in forward
  and backward (Part 2's traffic); at most `comm_budget`: 1.5 ring all-reduces of the rank's
  parameters padded to d equal chunks, plus d - 1 times its largest parameter.

Everything is counted in bytes and values, never timed. Memory kept outside torch (a numpy
array) is not seen: the notebook forbids it in words, as Assignment 7 does.
"""

from __future__ import annotations

import gc
import math
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from course_lib import _worker, compare, data, models
from course_lib.grading._harness import Verdict, fail, run_on_ranks
from course_lib.grading.parallel_3d_grid import PLANNER
from course_lib.grading.parallel_3d_layout import CONFIG, tp_shard, tp_shards
from course_lib.grading.parallel_3d_rank import ATOL, DTYPE, RTOL, Run2D
from course_lib.grading.parallel_3d_recording import CollectiveLog, group_ranks, watch_model
from course_lib.grading.provenance import Provenance
from course_lib.grading.training import ADAMW, make_optimizer, snapshot
from course_lib.launch import launch

CHECK = "check_sharded_adamw"
MOMENTS = 2  # AdamW's exp_avg and exp_avg_sq, one value each per parameter element
RESCAN_AFTER = 0.05  # seconds between the two scans of `kept_bytes`

# Lecture 7's ZeRO runs torch's ZeroRedundancyOptimizer and FSDP (course_lib.zero), lecture 10
# the grid and a whole 3-D step (PLANNER): an answer that runs them, or a copy, is not its own.
FORBIDDEN = (
    *PLANNER,
    "course_lib.zero",
    "course_lib.measure.zero",
    "torch.distributed.optim.ZeroRedundancyOptimizer",
    "torch.distributed.fsdp.fully_shard",
    "torch.distributed.fsdp.FullyShardedDataParallel",
)


# --- the budgets (bytes) ------------------------------------------------------------------


def rank_sizes(tp_rank: int, tp_size: int) -> dict[str, int]:
    """Elements of each parameter a rank of TP rank `tp_rank` holds (its TP shard)."""
    dense = models.TinyGPT(CONFIG)
    return {n: tp_shard(n, p, tp_rank, tp_size).numel() for n, p in dense.named_parameters()}


def state_budget(sizes: Iterable[int], dp_size: int, element_size: int = 8) -> int:
    """The most bytes a rank may keep between steps: AdamW's two moments of ceil(n/d)
    elements of each of its parameters (n elements each), plus those of its largest one."""
    sizes = list(sizes)
    share = sum(math.ceil(n / dp_size) for n in sizes)
    return MOMENTS * element_size * (share + max(sizes))


def unsharded_state(sizes: Iterable[int], element_size: int = 8) -> int:
    """AdamW's two moments of every parameter of the rank: what each replica keeps unsharded."""
    return MOMENTS * element_size * sum(sizes)


def comm_budget(sizes: Iterable[int], dp_size: int, element_size: int = 8) -> int:
    """The most bytes a rank may send per step outside Part 2's TP traffic: 1.5 ring
    all-reduces of its parameters padded to d equal chunks, 1.5 x 2(d-1)/d x d ceil(n/d) e
    = 3(d-1) e sum ceil(n/d), plus (d-1) e times its largest parameter."""
    sizes = list(sizes)
    share = sum(math.ceil(n / dp_size) for n in sizes)
    return (dp_size - 1) * element_size * (3 * share + max(sizes))


# --- measuring memory on a rank -----------------------------------------------------------


def _reachable() -> list[torch.Tensor]:
    """Every tensor the garbage collector knows on this rank, and their .grad. Objects a call
    froze to hide them from this scan are unfrozen first (see `_worker._freeze`)."""
    if _worker.frozen_by_a_call():
        gc.unfreeze()
    gc.collect()
    # isinstance() on torch's deprecated aliases warns, and so does .grad of a non-leaf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
        grads = [t.grad for t in tensors if t.grad is not None]
    return tensors + grads


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(key, bytes) of the storage behind `t`; a tensor without one of its own (a wrapper
    subclass, say) counts as its elements, under its own id."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return id(t), t.numel() * t.element_size()


def _key(t: torch.Tensor) -> int:
    return _storage(t)[0]


def _alive_storages(skip: set[int]) -> dict[int, tuple[int, torch.Tensor]]:
    """key -> (bytes, a tensor on it) of the storages alive on this rank, but those in `skip`."""
    found = {}
    for t in _reachable():
        key, nbytes = _storage(t)
        if nbytes and key not in skip:
            found[key] = (nbytes, t)
    return found


def kept_bytes(
    model: torch.nn.Module, before: set[int], own: Iterable[torch.Tensor] = ()
) -> tuple[int, list[str]]:
    """Bytes of the storages alive on this rank that are not in `before` (storage pointers of
    tensors held alive since) nor the check's `own`, less the bytes of the model's parameters
    and gradients that live in them; and the largest such storages, described."""
    skip = before | {_key(t) for t in own}
    allowed: Counter = Counter()
    for p in model.parameters():
        for t in (p, p.grad):
            if t is not None:
                allowed[_key(t)] += t.numel() * t.element_size()
    # A buffer a collective is done with can stay alive a moment after wait() returns, most
    # likely until gloo's thread lets it go (seen: 256 bytes more on one step in about 150,
    # under load). What the code keeps is alive in both of two scans some time apart: the
    # smaller total is the kept bytes (not the storages common to both scans, which a thread
    # swapping buffers between the scans would empty).
    scans = []
    for scan in range(2):
        time.sleep(RESCAN_AFTER if scan else 0)
        found = _alive_storages(skip)
        extra = {k: n - allowed[k] for k, (n, _) in found.items() if n > allowed[k]}
        scans.append((sum(extra.values()), extra, found))
    kept, extra, found = min(scans, key=lambda s: s[0])
    largest = sorted(extra, key=extra.get, reverse=True)[:3]
    shown = [
        f"{extra[k]:,} bytes ({found[k][1].dtype}, {tuple(found[k][1].shape)})" for k in largest
    ]
    return kept, shown


# --- on each rank ---------------------------------------------------------------------------


def _train_sharded_on_rank(make_groups, model_2d, sharded_adamw, run: Run2D) -> dict:
    """Train with the student's groups, model and optimizer; after every step, the
    parameters, the bytes kept and the bytes sent."""
    me = dist.get_rank()
    with Provenance(FORBIDDEN) as origin:
        tp_group, dp_group = make_groups(run.tp_size)
        model = model_2d(models.TinyGPT(CONFIG, seed=run.seed, dtype=DTYPE), tp_group, dp_group)
        tp_ranks, dp_ranks = group_ranks(tp_group), group_ranks(dp_group)
        dp_rank, dp = (dp_ranks.index(me) if me in dp_ranks else 0), len(dp_ranks)
        batches = [tuple(data.shard(t, dp_rank, dp) for t in b) for b in run.batches()]
        records = [snapshot(model.named_parameters())]
        alive = _reachable()  # held until the end, so no new storage can take their place
        before = {_key(t) for t in alive}
        optimizer = sharded_adamw(model, dp_group, **ADAMW)
        steps, inputs = [], []
        with CollectiveLog() as log:
            watch_model(model, log, inputs)
            for x, y in batches:
                log.phase = "zero_grad"
                optimizer.zero_grad()
                models.lm_loss(model(x), y).backward()
                log.phase = "step"
                optimizer.step()
                log.phase = "check"
                inputs.clear()
                calls = log.take()
                sent = sum(
                    c.sent
                    for c in calls
                    if not (c.phase in ("forward", "backward") and c.ranks == tp_ranks)
                )
                kept, largest = kept_bytes(model, before, _tensors(records))
                records.append(snapshot(model.named_parameters()))
                steps.append(
                    {"params": records[-1], "kept": kept, "largest": largest, "sent": sent}
                )
    del alive
    return {
        "groups": {"tp": tp_ranks, "dp": dp_ranks},
        "initial": records[0],
        "steps": steps,
        "copied": origin.complaint(),
    }


def _tensors(records: list[dict]) -> list[torch.Tensor]:
    return [t for record in records for t in record.values() if t is not None]


# --- in the checking process ------------------------------------------------------------------


def reference_adamw(run: Run2D) -> list[dict[str, torch.Tensor]]:
    """torch.optim.AdamW on one process on the whole batches: the parameters after each step."""
    model = models.TinyGPT(CONFIG, seed=run.seed, dtype=DTYPE)
    optimizer = make_optimizer("adamw", model.parameters())
    after = []
    for x, y in run.batches():
        optimizer.zero_grad()
        models.lm_loss(model(x), y).backward()
        optimizer.step()
        after.append(snapshot(model.named_parameters()))
    return after


def _judge_result(run: Run2D, results: list[dict], where: str) -> None:
    __tracebackhide__ = True
    tp, initial = run.tp_size, models.TinyGPT(CONFIG, seed=run.seed, dtype=DTYPE)
    for r, result in enumerate(results):
        want = tp_shards(snapshot(initial.named_parameters()), r % tp, tp)
        problem = compare.find_mismatch(result["initial"], want, rtol=0.0, atol=0.0)
        if problem:
            fail(
                CHECK,
                f"rank {r} ({where}): right after GPT2D(...), {problem}. Part 2's GPT2D must "
                "hold the TP shards first",
            )
    for s, ref in enumerate(reference_adamw(run)):
        for r, result in enumerate(results):
            want = tp_shards(ref, r % tp, tp)
            problem = compare.find_mismatch(
                result["steps"][s]["params"], want, rtol=RTOL, atol=ATOL
            )
            if problem:
                fail(
                    CHECK,
                    f"rank {r}, after step {s} ({where}): {problem} (its TP shard of "
                    "torch.optim.AdamW on one process on the whole batch).\nHint: every rank "
                    "of a DP group must end the step with all of its parameters updated, "
                    "those whose state another rank keeps included, from the gradient "
                    "averaged over the DP group",
                )


def _judge_budget(run: Run2D, results: list[dict], where: str, prop: str) -> float:
    """Every rank's every step within its budget of `prop` ("memory": the bytes kept,
    "communication": the bytes sent); the largest share of its budget any rank used."""
    __tracebackhide__ = True
    key, budget = ("kept", state_budget) if prop == "memory" else ("sent", comm_budget)
    worst = 0.0
    for r, result in enumerate(results):
        sizes = list(rank_sizes(r % run.tp_size, run.tp_size).values())
        dp = len(result["groups"]["dp"])
        allowed = budget(sizes, dp)
        for s, step in enumerate(result["steps"]):
            worst = max(worst, step[key] / allowed) if allowed else worst
            if step[key] > allowed:
                where_ = f"rank {r}, after step {s} ({where})"
                fail(CHECK, _over_budget(prop, where_, step, allowed, sizes, dp), prop=prop)
    return worst


def _over_budget(prop: str, where: str, step: dict, allowed: int, sizes: list, dp: int) -> str:
    if prop == "memory":
        return (
            f"{where}: your code keeps {step['kept']:,} bytes of tensors besides the model's "
            f"parameters and gradients; at most {allowed:,} allowed (AdamW's two moments of "
            f"1/{dp} of each parameter, plus those of the largest; unsharded AdamW keeps "
            f"{unsharded_state(sizes):,}). Largest: {', '.join(step['largest'])}.\nHint: keep "
            "the moments of your chunk of each parameter only, and free gradient chunks, "
            "buffers and copies before step() returns"
        )
    return (
        f"{where}: sent {step['sent']:,} bytes outside the TP all-reduces of forward and "
        f"backward; at most {allowed:,} allowed (1.5 ring all-reduces of its parameters in a "
        f"DP group of {dp}, plus {dp - 1} x its largest parameter).\nHint: a rank needs the "
        "averaged gradient of its own chunk only, and sends each updated chunk once"
    )


def check_sharded_adamw(
    make_groups: Callable[[int], tuple],
    model_2d: Callable[..., torch.nn.Module],
    sharded_adamw: Callable[..., object],
    *,
    world_size: int = 4,
    tp_size: int = 2,
    seed: int = 0,
    steps: int = 3,
    batch_size: int = 8,
    timeout: float = 60.0,
) -> None:
    """Train TinyGPT (float64) on a DP x TP grid with the student's make_groups, GPT2D and
    `sharded_adamw(model, dp_group, **ADAMW)` (zero_grad(), step()): after every step, the
    parameters equal the TP shard of single-process AdamW; the bytes kept between steps are
    at most `state_budget`; the bytes sent outside Part 2's TP traffic, `comm_budget`."""
    __tracebackhide__ = True
    run = Run2D(tp_size=tp_size, seed=seed, steps=steps, batch_size=batch_size)
    run.validate(world_size)
    results = run_on_ranks(
        CHECK, _train_sharded_on_rank, make_groups, model_2d, sharded_adamw, run,
        world_size=world_size, timeout=timeout, what="your ShardedAdamW (with Part 2's code)",
    )  # fmt: skip
    for r, result in enumerate(results):
        if result["copied"]:
            fail(CHECK, f"make_groups, GPT2D or ShardedAdamW on rank {r}: {result['copied']}")
    where = f"DP x TP = {world_size // tp_size} x {tp_size}, seed {seed}, AdamW, float64"
    verdict = Verdict(CHECK)
    with verdict.case():
        _judge_result(run, results, where)
    worst = {}
    for prop in ("memory", "communication"):
        with verdict.case():
            worst[prop] = _judge_budget(run, results, where, prop)
    verdict.conclude(
        f"{where}, {steps} steps: every rank's parameters equal its TP shard of "
        f"torch.optim.AdamW on the whole batch (rtol {RTOL:g}, atol {ATOL:g}); the tensors "
        f"kept between steps used at most {worst.get('memory', 0):.0%} of the state budget, "
        f"the bytes sent at most {worst.get('communication', 0):.0%} of the traffic budget"
    )


def sharded_adamw_report(
    make_groups, model_2d, sharded_adamw, *, world_size: int = 4, tp_size: int = 2
) -> str:
    """For the notebook: train 3 steps as the check does (on `launch`'s ranks) and show, per
    rank after the last step, the largest parameter error, the bytes kept against unsharded
    AdamW and the budget, and the bytes sent against their budget."""
    run = Run2D(tp_size=tp_size)
    run.validate(world_size)
    results = launch(
        _train_sharded_on_rank, make_groups, model_2d, sharded_adamw, run,
        world_size=world_size, timeout=60,
    )  # fmt: skip
    ref = reference_adamw(run)[-1]
    head = f"{'rank':>4} {'max error':>10} {'kept':>8} {'unsharded':>10} {'allowed':>8}"
    rows = [f"DP x TP = {world_size // tp_size} x {tp_size}", head + f" {'sent':>8} {'allowed':>8}"]
    for r, result in enumerate(results):
        sizes = rank_sizes(r % tp_size, tp_size).values()
        dp, last = len(result["groups"]["dp"]), result["steps"][-1]
        want = tp_shards(ref, r % tp_size, tp_size)
        error = max(compare.errors(last["params"][n], w)[0] for n, w in want.items())
        rows.append(
            f"{r:>4} {error:>10.1e} {last['kept']:>8,} {unsharded_state(sizes):>10,} "
            f"{state_budget(sizes, dp):>8,} {last['sent']:>8,} {comm_budget(sizes, dp):>8,}"
        )
    return "\n".join(rows)
