"""Assignment 8's schedule checks accept right implementations and reject wrong ones: the
simulated GPipe and 1F1B timelines (Part 2) and the split-backward schedule (Part 4)."""

from __future__ import annotations

import pytest

from course_lib.grading import CheckFailed, check_simulate_schedule, check_split_schedule
from course_lib.grading.pipeline import simulate_split
from tests.adapters import mutant, planted, solution
from tests.cheats.a08_pipeline import (
    SIMULATE_BY_FIXED_POINT,
    SIMULATE_GPIPE_REVERSED,
    SPLIT_BY_STAGE,
)

A08 = solution("pipeline")


def not_implemented(*args, **kwargs):
    raise NotImplementedError()


# --- simulated schedules ------------------------------------------------------------------


simulate_schedule = A08.simulate_schedule
# Named mutations: the bubble formula off by one; every operation one time unit late; 1F1B
# run as GPipe.
simulate_off_by_one = mutant(
    "pipeline",
    "simulate_schedule",
    ('"bubble_fraction": 1 - busy / (P * makespan)', '"bubble_fraction": (P - 1) / (m + P)'),
).simulate_schedule
simulate_with_a_gap = mutant(
    "pipeline",
    "simulate_schedule",
    ("end[dependency] if dependency", "end[dependency] + 1.0 if dependency"),
).simulate_schedule
simulate_1f1b_as_gpipe = mutant(
    "pipeline",
    "simulate_schedule",
    ('warmup = m if schedule == "gpipe" else min(P - s - 1, m)', "warmup = m"),
).simulate_schedule


def simulate_without_dependencies(P, m, schedule, t_forward=1.0, t_backward=1.0):
    result = simulate_schedule(P, m, schedule, t_forward, t_backward)
    for s, ops in enumerate(result["timeline"]):  # every stage starts at once
        shift = ops[0][2]
        result["timeline"][s] = [(k, i, a - shift, b - shift) for k, i, a, b in ops]
    return result


def simulate_late_forward(P, m, schedule, t_forward=1.0, t_backward=1.0):
    """Right but for one forward: from 3 stages on, 1F1B's first stage runs its first forward
    after the warm-up one t_forward late, which its idle time hides (the makespan and the
    bubble stay right)."""
    result = simulate_schedule(P, m, schedule, t_forward, t_backward)
    ops = result["timeline"][0]
    if schedule == "1f1b" and 3 <= P <= m:
        k, i, a, b = ops[P - 1]
        ops[P - 1] = (k, i, a + t_forward, b + t_forward)
    return result


def simulate_listed_backwards(P, m, schedule, t_forward=1.0, t_backward=1.0):
    """Right times, but each stage lists its operations forwards first, not as they run."""
    result = simulate_schedule(P, m, schedule, t_forward, t_backward)
    result["timeline"] = [sorted(ops, key=lambda op: op[0] == "B") for ops in result["timeline"]]
    return result


# The cheats' texts: GPipe's backwards simulated in reverse order (a mirror image, the same
# bubble); another right simulator, relaxed to a fixed point.
simulate_gpipe_reversed = planted(
    "pipeline", "simulate_schedule", SIMULATE_GPIPE_REVERSED
).simulate_schedule
simulate_by_fixed_point = planted(
    "pipeline", "simulate_schedule", SIMULATE_BY_FIXED_POINT
).simulate_schedule


@pytest.mark.parametrize("fn", [simulate_schedule, simulate_by_fixed_point])
def test_simulate_schedule_accepts_right_implementations(fn):
    check_simulate_schedule(fn, cases=((1, 3), (2, 2), (4, 16), (5, 3), (8, 1), (2, 7), (8, 16)))


def test_simulated_bubble_is_the_formula_for_the_issue_cases():
    for m in (1, 4, 16):
        for schedule in ("gpipe", "1f1b"):
            result = simulate_schedule(4, m, schedule, t_backward=2.0)
            assert result["bubble_fraction"] == pytest.approx(3 / (m + 3), abs=1e-12)
            assert result["makespan"] == pytest.approx((m + 3) * 3.0)


@pytest.mark.parametrize(
    "fn, message",
    [
        (simulate_off_by_one, "bubble_fraction is 0.333"),
        (simulate_with_a_gap, "but it could start at 1, when the stage is free and what it"),
        (simulate_late_forward, "stage 0 starts F3 at 4, but it could start at 3, when"),
        (simulate_listed_backwards, "list stage 1's operations in the order they run"),
        (
            simulate_gpipe_reversed,
            "stage 0 runs F0 F1 F2 F3 B3 B2 B1 B0; the gpipe schedule runs F0 F1 F2 F3 B0 B1 "
            "B2 B3 there",
        ),
        (
            simulate_1f1b_as_gpipe,
            "stage 1 has 4 micro-batches in flight at once; 1F1B keeps at most min(m, P - s) = 3",
        ),
        (simulate_without_dependencies, "but it needs F0 of stage 0, which ends at 1"),
        (not_implemented, "raised NotImplementedError"),
    ],
)
def test_simulate_schedule_rejects_wrong_implementations(fn, message):
    with pytest.raises(CheckFailed) as info:
        check_simulate_schedule(fn)
    assert str(info.value).startswith("check_simulate_schedule: ")
    assert message in str(info.value)


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
