"""Assignment 8's simulated schedules, judged: is a timeline from `simulate_schedule` one
that the schedule could run?

A case is (P, m, schedule, t_forward, t_backward). The timeline must list, per stage and in
the order they run, every forward and backward of each micro-batch once, each for its
duration, one at a time, in the schedule's order (micro-batch by micro-batch), after what it
depends on (F i on stage s after F i on stage s - 1; B i after B i on stage s + 1, or after
F i on the last stage) and as soon as that and its stage allow; its makespan and bubble
fraction must agree with it and, the stages being equal, with (P-1)/(m+P-1).
"""

from __future__ import annotations

import math

from course_lib.costs import bubble_formula
from course_lib.grading._harness import fail
from course_lib.grading.pipeline_plumbing import in_flight_bound, peak_in_flight, schedule_order

# (kind, micro-batch, stage) -> the time an operation starts, or ends
Times = dict[tuple[str, int, int], float]


def check_timeline(check: str, case: tuple, result: object) -> None:
    """The timeline runs every op once, for its duration, one at a time per stage, in the
    schedule's order, as soon as what it depends on allows; makespan and bubble agree with
    it."""
    __tracebackhide__ = True
    P, m, schedule, tf, tb = case
    at = f"simulate_schedule({P}, {m}, {schedule!r}, t_forward={tf:g}, t_backward={tb:g})"
    timeline = _timeline(check, at, result, P)
    end: Times = {}
    start: Times = {}
    for s, ops in enumerate(timeline):
        _judge_stage(check, at, case, s, ops, start, end)
    _judge_dependencies(check, at, P, start, end)
    _judge_earliest(check, at, P, start, end)
    _judge_makespan(check, at, case, result, end)


def _timeline(check: str, at: str, result: object, P: int) -> list:
    """The result's timeline, once the result is a dict with the three keys and the
    timeline has one list per stage."""
    __tracebackhide__ = True
    if not isinstance(result, dict) or not {"timeline", "makespan", "bubble_fraction"} <= set(
        result
    ):
        fail(
            check,
            f"{at} returned {result!r:.200}; expected a dict with keys 'timeline', "
            "'makespan' and 'bubble_fraction'",
        )
    timeline = result["timeline"]
    if not isinstance(timeline, list | tuple) or len(timeline) != P:
        fail(check, f"{at}: 'timeline' must be a list of {P} lists, one per stage")
    return timeline


def _judge_stage(
    check: str, at: str, case: tuple, s: int, ops: object, start: Times, end: Times
) -> None:
    """Stage s runs F and B of each micro-batch once, each for its duration, one at a time,
    in the schedule's order and with no more in flight than it allows. Records when each of
    its operations starts and ends in `start` and `end`."""
    __tracebackhide__ = True
    P, m, schedule, tf, tb = case
    try:
        listed = [(float(a), float(b), str(k), int(i)) for k, i, a, b in ops]
    except (TypeError, ValueError):
        fail(check, f"{at}: stage {s}'s entries must be (kind, micro_batch, start, end)")
    ops = sorted(listed)
    keys = sorted((k, i) for _, _, k, i in ops)
    expected = sorted((k, i) for k in "FB" for i in range(m))
    if keys != expected:
        fail(
            check,
            f"{at}: stage {s} runs {keys}; expected F and B of each micro-batch "
            f"0..{m - 1} exactly once",
        )
    if [a for a, _, _, _ in listed] != [a for a, _, _, _ in ops]:
        fail(check, f"{at}: list stage {s}'s operations in the order they run (by start time)")
    previous_end = 0.0
    for a, b, k, i in ops:
        duration = tf if k == "F" else tb
        if not math.isclose(b - a, duration, rel_tol=1e-9, abs_tol=1e-9):
            fail(check, f"{at}: stage {s}'s {k}{i} lasts {b - a:g}, expected {duration:g}")
        if a < previous_end - 1e-9:
            fail(
                check,
                f"{at}: stage {s} starts {k}{i} at {a:g}, before its previous "
                f"operation ends at {previous_end:g}: a stage runs one at a time",
            )
        previous_end = b
        start[k, i, s], end[k, i, s] = a, b
    order = [(k, i) for _, _, k, i in ops]
    peak, bound = peak_in_flight(k for k, _ in order), in_flight_bound(schedule, P, m, s)
    if peak > bound:
        fail(
            check,
            f"{at}: stage {s} has {peak} micro-batches in flight at once; "
            f"1F1B keeps at most min(m, P - s) = {bound}",
        )
    want = schedule_order(schedule, P, m, s)
    if order != want:
        fail(
            check,
            f"{at}: stage {s} runs {_said(order)}; the {schedule} schedule runs "
            f"{_said(want)} there (the orders of Part 1, each kind in micro-batch order)",
        )


def _said(order: list[tuple[str, int]]) -> str:
    return " ".join(f"{kind}{i}" for kind, i in order)


def _needs(kind: str, i: int, s: int, P: int) -> tuple[str, int, int] | None:
    """The operation (kind, micro-batch, stage) that must end before `kind` i on stage s."""
    if kind == "F":
        return ("F", i, s - 1) if s > 0 else None
    return ("B", i, s + 1) if s < P - 1 else ("F", i, s)


def _judge_dependencies(check: str, at: str, P: int, start: Times, end: Times) -> None:
    """Every operation starts after what it needs has ended: F i after F i of the stage
    before, B i after B i of the stage after (after F i of its own on the last stage)."""
    __tracebackhide__ = True
    for (k, i, s), a in start.items():
        dep = _needs(k, i, s, P)
        if dep is not None and a < end[dep] - 1e-9:
            fail(
                check,
                f"{at}: stage {s} starts {k}{i} at {a:g}, but it needs "
                f"{dep[0]}{i} of stage {dep[2]}, which ends at {end[dep]:g}",
            )


def _judge_earliest(check: str, at: str, P: int, start: Times, end: Times) -> None:
    """Every operation starts as soon as its stage is free and what it needs has ended."""
    __tracebackhide__ = True
    for s in range(P):
        free = 0.0
        for a, k, i in sorted((a, k, i) for (k, i, t), a in start.items() if t == s):
            need = _needs(k, i, s, P)
            earliest = max(free, end[need] if need else 0.0)
            if a > earliest + 1e-9:
                fail(
                    check,
                    f"{at}: stage {s} starts {k}{i} at {a:g}, but it could start at "
                    f"{earliest:g}, when the stage is free and what it needs has ended: every "
                    "operation starts as soon as these allow",
                )
            free = end[k, i, s]


def _judge_makespan(check: str, at: str, case: tuple, result: dict, end: Times) -> None:
    """The makespan and bubble fraction returned are the timeline's, and the bubble is
    (P-1)/(m+P-1), as it is with equal stages when nothing waits longer than it must."""
    __tracebackhide__ = True
    P, m, _, tf, tb = case
    makespan = max(end.values())
    busy = m * (tf + tb)
    bubble = 1 - busy / makespan
    for key, want in (("makespan", makespan), ("bubble_fraction", bubble)):
        got = result[key]
        if not isinstance(got, float | int) or not math.isclose(
            got, want, rel_tol=1e-9, abs_tol=1e-12
        ):
            fail(
                check,
                f"{at}: {key} is {got!r}, but the timeline gives {want:.10g}"
                + (" (the idle share of P x makespan)" if key == "bubble_fraction" else ""),
            )
    formula = bubble_formula(P, m)
    if not math.isclose(bubble, formula, rel_tol=1e-9, abs_tol=1e-12):
        fail(
            check,
            f"{at}: the bubble is {bubble:.6g}, but with equal stages it is "
            f"(P-1)/(m+P-1) = {formula:.6g}; does every operation start as soon as the "
            "stage is free and what it needs is done?",
        )
