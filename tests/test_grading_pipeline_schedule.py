"""Assignment 8's split-backward schedule (Part 4, open): orders with a smaller bubble than
1F1B in its memory pass, the others (1F1B's own, deadlocks, too much memory) fail."""

from __future__ import annotations

import pytest

from course_lib.grading import CheckFailed, check_split_schedule
from course_lib.grading.pipeline import simulate_split
from tests.adapters import mutant, planted, solution
from tests.cheats.a08_pipeline import SPLIT_BY_STAGE

A08 = solution("pipeline")


# --- Part 4 (open): a split-backward schedule, a smaller bubble in 1F1B's memory -------------

split_schedule = A08.split_schedule
split_by_stage = planted("pipeline", "split_schedule", SPLIT_BY_STAGE).split_schedule  # also right
split_holds_one_more = mutant(
    "pipeline", "split_schedule", ("f[s] - w[s] < P", "f[s] - w[s] <= P")
).split_schedule


def split_1f1b(P, m):
    """1F1B with each backward split, its W right after its B."""
    orders = []
    for s in range(P):
        w = min(P - s - 1, m)
        order = [("F", i) for i in range(w)]
        for i in range(m - w):
            order += [("F", w + i), ("B", i), ("W", i)]
        orders.append(order + [op for i in range(m - w, m) for op in (("B", i), ("W", i))])
    return orders


def split_gpipe(P, m):
    return [[(k, i) for k in "FBW" for i in range(m)] for _ in range(P)]


def split_w_before_b(P, m):
    orders = split_schedule(P, m)
    orders[1] = [("W", 0), *[op for op in orders[1] if op != ("W", 0)]]
    return orders


def split_deadlocks(P, m):
    """Stage 0 runs one micro-batch at a time; stage 1 waits for its second forward first."""
    return [[(k, i) for i in range(m) for k in "FBW"], *split_1f1b(P, m)[1:]]


def split_from_the_lecture(P, m):
    from course_lib.measure.pipeline import zero_bubble_order

    return [[(op.kind, op.micro) for op in ops] for ops in zero_bubble_order(P, m)]


def test_split_schedule_accepts_the_solution_and_a_different_answer(capsys):
    for fn in (split_schedule, split_by_stage):
        check_split_schedule(fn, cases=((2, 4), (3, 6), (4, 4), (4, 8), (5, 5), (6, 12)))
        out = capsys.readouterr().out
        assert out.startswith("check_split_schedule: passed."), out
    assert split_by_stage(4, 8) != split_schedule(4, 8)  # another order, also right


def test_split_measurements_against_1f1b():
    """Measured by the check's simulator (unit ops): 1F1B split takes 3m + 2(P - 1), GPipe's
    order the same, the lecture's zero bubble (P - s in flight on stage s) too; the solution
    (P on every stage) 15 units at P = m = 4 (ZB-H1's 3m + P - 1) and 29 at P = 4, m = 8."""
    for P, m, want in ((4, 4, 15), (4, 8, 29), (6, 6, 23), (6, 12, 43)):
        assert simulate_split(P, split_schedule(P, m))["makespan"] == want
        assert max(simulate_split(P, split_schedule(P, m))["peaks"]) == P
        for fn in (split_1f1b, split_gpipe, split_from_the_lecture):
            assert simulate_split(P, fn(P, m))["makespan"] == 3 * m + 2 * (P - 1)
    assert simulate_split(4, split_1f1b(4, 8))["peaks"] == [4, 3, 2, 1]
    assert simulate_split(4, split_deadlocks(4, 8))["stuck"] == {
        0: ("B", 0),
        **{s: ("F", 1) for s in (1, 2, 3)},
    }


@pytest.mark.parametrize(
    "fn, message",
    [
        (split_1f1b, "split_schedule(4, 4): the step takes 18 units, bubble 0.333; at most 17"),
        (split_gpipe, "split_schedule(4, 8): stage 0 holds 8 micro-batches at once"),
        (split_holds_one_more, "split_schedule(4, 8): stage 0 holds 5 micro-batches at once"),
        (split_w_before_b, "stage 1 runs W0 before B0; W of a micro-batch needs its B"),
        (split_deadlocks, "deadlocks: no stage can go on (stage 0 at B0, which needs B0 of"),
        (split_from_the_lecture, "runs course_lib.measure.pipeline.zero_bubble_order"),
    ],
)
def test_split_schedule_rejects(fn, message):
    with pytest.raises(CheckFailed) as info:
        check_split_schedule(fn)
    assert message in str(info.value), str(info.value)
