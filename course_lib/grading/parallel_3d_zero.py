"""Part of the capstone's checks (grading/parallel_3d.py): Part 4, AdamW's state shared by
the replicas, that is ZeRO-1 inside the DP group of the 2-D grid.

    check_sharded_adamw(make_groups, GPT2D, ShardedAdamW)

Every call draws new secret initial weights and global batches in the checking process
(`parallel_3d_cases`, as check_2d_training does); each rank is given only its TP shard of the
weights (the rest zeroed) and, per step, a global batch whose only real rows are its DP
group's. On each rank the check builds the student's groups and 2-D model (Parts 1-2) from
that shard and trains it for a few AdamW steps in float64 with
`ShardedAdamW(model, dp_group, **ADAMW)`: zero_grad(), backward of the mean loss on the DP
replica's shard of the batch, step(). After every step it judges, for every rank:

- result: the parameters, against this rank's TP shard of torch.optim.AdamW on one process
  on the whole batch, trained in the checking process (RTOL, ATOL);
- memory, the bytes kept: the storages of every tensor the garbage collector can reach on the
  rank (and of their .grad) that were not there before ShardedAdamW(...) was called, less the
  bytes of the model's parameters and of their gradients; at most `state_budget`: AdamW's
  two moments of ceil(n/d) elements of each of the rank's parameters, plus the two moments of
  its largest parameter (d: the DP size). Only the rank can scan its memory, but each scan is
  sent to the launcher as it is made and the bytes are reckoned here
  (parallel_3d_zero_memory);
- communication: the bytes sent (`comm.volume`'s ring model, as CommCounter counts) by every
  call from zero_grad() to the end of step(), except the TP group's in forward and backward
  (Part 2's traffic); at most `comm_budget`: 1.5 ring all-reduces of the rank's parameters
  padded to d equal chunks, plus d - 1 times its largest parameter. The calls, their groups
  and bytes are the launcher's tallies, split into each step's phases by the rank's marks;
  the TP group is the grid's rule.

Everything is counted in bytes and values, never timed. The parts:

    parallel_3d_zero_budget.py   the budgets and the verdict's words over them
    parallel_3d_zero_memory.py   the scans on the rank, the bytes kept reckoned here
    parallel_3d_zero_rank.py     training on each rank, its phases marked
    parallel_3d_zero_judge.py    the reference, the tallies per step, the verdict's cases
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from course_lib import compare
from course_lib.grading._harness import Verdict, fail, measured, run_on_ranks
from course_lib.grading.parallel_3d_cases import draw, given, global_batches, initial
from course_lib.grading.parallel_3d_layout import tp_shards
from course_lib.grading.parallel_3d_rank import ATOL, RTOL, Run2D
from course_lib.grading.parallel_3d_zero_budget import (
    comm_budget,
    rank_sizes,
    state_budget,
    unsharded_state,
)
from course_lib.grading.parallel_3d_zero_judge import (
    judge_budget,
    judge_result,
    per_step,
    reference_adamw,
)
from course_lib.grading.parallel_3d_zero_rank import _train_sharded_on_rank
from course_lib.launch import launch

CHECK = "check_sharded_adamw"


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
    # Weights and batches are drawn here, and each rank is given only its own share of them
    # (parallel_3d_cases): `seed` names the call but no longer chooses the numbers.
    drawn = draw()
    results, traffic = run_on_ranks(
        CHECK, _train_sharded_on_rank, make_groups, model_2d, sharded_adamw, run,
        given(run, drawn, world_size),
        world_size=world_size, timeout=timeout, what="your ShardedAdamW (with Part 2's code)",
        traffic=True,
    )  # fmt: skip
    steps_seen = per_step(CHECK, traffic.tallies, world_size, tp_size, steps)
    for r, result in enumerate(results):
        if result["copied"]:
            fail(CHECK, f"make_groups, GPT2D or ShardedAdamW on rank {r}: {result['copied']}")
    where = f"DP x TP = {world_size // tp_size} x {tp_size}, secret weights, AdamW, float64"
    dense = initial(drawn)
    verdict = Verdict(CHECK)
    with verdict.case():
        reference = reference_adamw(dense, global_batches(run, drawn))
        judge_result(CHECK, tp_size, dense, reference, results, where)
    worst = {}
    for prop in ("memory", "communication"):
        with verdict.case():
            worst[prop] = judge_budget(CHECK, tp_size, steps_seen, where, prop)
    verdict.conclude(
        f"{where}, {steps} steps: every rank's parameters equal its TP shard of "
        f"torch.optim.AdamW on the whole batch (rtol {RTOL:g}, atol {ATOL:g}); the tensors "
        f"kept between steps used at most {worst.get('memory', 0):.0%} of the state budget, "
        f"the bytes sent at most {worst.get('communication', 0):.0%} of the traffic budget"
    )
    what = "bytes kept between steps, share of the state budget (worst rank and step)"
    measured(CHECK, what, 100 * worst["memory"], "%", combine="worst")


def sharded_adamw_report(
    make_groups, model_2d, sharded_adamw, *, world_size: int = 4, tp_size: int = 2
) -> str:
    """For the notebook: train 3 steps as the check does (on `launch`'s ranks, so the calls
    and observations are the ranks' own records, not a launcher's) and show, per rank after
    the last step, the largest parameter error, the bytes kept against unsharded AdamW and
    the budget, and the bytes sent against their budget."""
    run = Run2D(tp_size=tp_size)
    run.validate(world_size)
    drawn = draw()
    results = launch(
        _train_sharded_on_rank, make_groups, model_2d, sharded_adamw, run,
        given(run, drawn, world_size), True,
        world_size=world_size, timeout=60,
    )  # fmt: skip
    steps_seen = per_step(CHECK, [r["local"] for r in results], world_size, tp_size, run.steps)
    ref = reference_adamw(initial(drawn), global_batches(run, drawn))[-1]
    dp = world_size // tp_size
    head = f"{'rank':>4} {'max error':>10} {'kept':>8} {'unsharded':>10} {'allowed':>8}"
    rows = [f"DP x TP = {dp} x {tp_size}", head + f" {'sent':>8} {'allowed':>8}"]
    for r, result in enumerate(results):
        sizes = rank_sizes(r % tp_size, tp_size).values()
        last = steps_seen[r][-1]
        want = tp_shards(ref, r % tp_size, tp_size)
        error = max(compare.errors(result["steps"][-1][n], w)[0] for n, w in want.items())
        rows.append(
            f"{r:>4} {error:>10.1e} {last['kept']:>8,} {unsharded_state(sizes):>10,} "
            f"{state_budget(sizes, dp):>8,} {last['sent']:>8,} {comm_budget(sizes, dp):>8,}"
        )
    return "\n".join(rows)


__all__ = [
    "check_sharded_adamw",
    "comm_budget",
    "rank_sizes",
    "sharded_adamw_report",
    "state_budget",
    "unsharded_state",
]
