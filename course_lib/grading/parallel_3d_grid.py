"""check_process_grid's pieces: calling the student's process_grid on a rank, and
judging each layout it returns (and each size it must refuse).
"""

from __future__ import annotations

from collections.abc import Callable

from course_lib.grading._harness import fail
from course_lib.grading.parallel_3d_layout import _partners
from course_lib.grading.provenance import Provenance

GRID_CASES = ((4, 2), (4, 1), (4, 4), (8, 2), (8, 4), (6, 3), (1, 1))


def _as_sets(groups) -> set[frozenset[int]]:
    return {frozenset(int(r) for r in g) for g in groups}


# Lecture 10 builds the same grid (ProcessGrid), its groups (new_groups) and a whole DP x TP x
# PP training step (measure/parallel_3d/real_step.py: build_stage, step_3d): an answer that runs
# them, or a copy, is not the student's own. The measurements are forbidden whole: every function
# of every file of the package.
PLANNER = (
    "course_lib.parallel_3d.ProcessGrid",
    "course_lib.parallel_3d.new_groups",
    "course_lib.measure.parallel_3d",
)


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
