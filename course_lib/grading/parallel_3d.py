"""Checks for the capstone, 2-D parallel training: data parallel x tensor parallel.

    check_process_grid(process_grid)                 which ranks form each TP and DP group
    check_2d_training(make_groups, GPT2D, train_step)   TinyGPT trained on a DP x TP grid
    check_sharded_adamw(make_groups, GPT2D, ShardedAdamW)   AdamW's state sharded in DP groups

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

The training check runs SGD for a few steps in float64 from weights and batches it draws in
the checking process (each rank is given only its TP shard and its DP group's rows,
parallel_3d_cases) and compares every rank's parameters with its shard of single-process
training on the whole batch, trained here; the group of every call comes from the launcher's
tallies (none may leave the rank's TP and DP groups); which calls came in forward (those must
be in the TP group) and the batch each rank's model saw (TP partners see the same shard, DP
groups different ones) are recorded by hooks on the rank. For the notebook, memory and
communication per rank of a configuration, measured and by formula.

This module holds the first two checks and everything the notebook imports; the parts:

    parallel_3d_layout.py          the grid's rule and TinyGPT's TP shards (tp_shard, gather_dense)
    parallel_3d_grid.py            check_process_grid: calling process_grid, judging layouts
    parallel_3d_recording.py       CollectiveLog: collectives with their groups, step phases
    parallel_3d_cases.py           check_2d_training's secret draw, each rank's share of it
    parallel_3d_rank.py            check_2d_training on each rank: Run2D, training
    parallel_3d_judge.py           check_2d_training judged: reference, groups, batches, ...
    parallel_3d_configurations.py  memory and traffic per configuration, for the notebook
    parallel_3d_zero.py            check_sharded_adamw (Part 4, open): ZeRO-1 in the DP group,
                                   judged by its result, the bytes kept and the bytes sent;
                                   its parts are parallel_3d_zero_budget, _memory, _rank and
                                   _judge (same draw as check_2d_training, bytes from the
                                   launcher)
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from course_lib.grading._harness import Verdict, calls_by_case, fail, run_on_ranks
from course_lib.grading.parallel_3d_cases import draw, given, global_batches, initial
from course_lib.grading.parallel_3d_configurations import (
    Measured,
    configuration_table,
    formula,
    measure_configuration,
    split_counts,
)
from course_lib.grading.parallel_3d_grid import (
    GRID_CASES,
    _grids_on_rank,
    _judge_bad_grid,
    _judge_grid,
)
from course_lib.grading.parallel_3d_judge import (
    _check_batches,
    _check_collectives,
    _check_groups,
    _check_training,
    _revive_calls,
)
from course_lib.grading.parallel_3d_layout import gather_dense, tp_shard
from course_lib.grading.parallel_3d_rank import ATOL, RTOL, Run2D, _train_on_rank
from course_lib.grading.parallel_3d_recording import CollectiveLog
from course_lib.grading.parallel_3d_zero import (
    check_sharded_adamw,
    comm_budget,
    sharded_adamw_report,
    state_budget,
)

# --- check_process_grid (on one rank) ------------------------------------------------------


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


# --- check_2d_training ----------------------------------------------------------------------


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
    run.validate(world_size)
    # Weights and batches are drawn here, and each rank is given only its own share of them
    # (parallel_3d_cases): `seed` names the call but no longer chooses the numbers.
    drawn = draw()
    results, traffic = run_on_ranks(
        check,
        _train_on_rank,
        make_groups,
        model_2d,
        train_step,
        run,
        given(run, drawn, world_size),
        world_size=world_size,
        timeout=timeout,
        what="your make_groups, GPT2D and train_step",
        traffic=True,
    )
    # Every call of every group as the launcher tallied it: the set-up, then each step.
    tallied = calls_by_case(check, traffic.tallies, steps + 1)
    _revive_calls(results)
    for r, result in enumerate(results):
        if result["copied"]:
            fail(check, f"make_groups, GPT2D or train_step on rank {r}: {result['copied']}")
    where, batches = run.describe(world_size, secret=True), global_batches(run, drawn)
    verdict = Verdict(check)
    with verdict.case():
        _check_groups(check, run, results, where)
    verdict.settle()  # what follows reads the groups
    with verdict.case():
        _check_batches(check, run, results, where, batches)
    with verdict.case():
        _check_collectives(check, run, results, where, tallied)
    with verdict.case():
        _check_training(check, run, results, where, batches, initial(drawn))
    verdict.conclude(
        f"{where}: the groups, the samples each rank's model saw (its DP group's share of "
        "every batch), the groups of every collective, and every rank's parameters after "
        f"every step, equal to its shard of single-process training (rtol {RTOL:g}, atol "
        f"{ATOL:g})"
    )


__all__ = [
    "CollectiveLog",
    "Measured",
    "check_2d_training",
    "check_process_grid",
    "check_sharded_adamw",
    "comm_budget",
    "configuration_table",
    "formula",
    "gather_dense",
    "measure_configuration",
    "sharded_adamw_report",
    "split_counts",
    "state_budget",
    "tp_shard",
]
