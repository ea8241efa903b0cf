"""Assignment 8's simulated schedules (Part 2): right timelines of GPipe and 1F1B pass, wrong
ones (dependencies, gaps, the order, the bubble's formula) fail."""

from __future__ import annotations

import pytest

from course_lib.grading import CheckFailed, check_simulate_schedule
from tests.adapters import mutant, planted, solution
from tests.cheats.a08_pipeline import SIMULATE_BY_FIXED_POINT, SIMULATE_GPIPE_REVERSED

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
