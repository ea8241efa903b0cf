"""Lecture 8's exercises, checked off the page: the bubble worked out by hand
(`check_bubble_shares`) and written as a function (`check_my_bubble`), and four predictions
checked against the schedules simulated or run (`check_one_f_one_b_in_flight`,
`check_zero_bubble_idle`, `check_first_backward`, `check_zero_bubble_measured`), each
computing its expected value and saying why here, out of the notebook's sight."""

from __future__ import annotations

from collections.abc import Sequence

from course_lib.costs import bubble_formula
from course_lib.exercises import (
    check_choice,
    check_function,
    check_number,
    check_numbers,
    nearest_option,
    together,
)
from course_lib.measure.pipeline.zero_bubble import pending_w_peak
from course_lib.pipeline import StageLog, Timeline

# --- the lecture's exercise on the bubble ------------------------------------------------------


def check_bubble_shares(bubble: object, fewest_m_under_3_percent: object) -> bool | None:
    """The idle share of 8 stages with 8 and 64 micro-batches, and the fewest m under 3%."""
    return together(
        check_numbers(
            bubble,
            {f"P=8, m={m}": bubble_formula(8, m) for m in (8, 64)},
            hint="Idle stage-time over all stage-time, as derived above.",
        ),
        check_number(
            fewest_m_under_3_percent,
            next(m for m in range(1, 10_000) if bubble_formula(8, m) < 0.03),
            rtol=0,
            atol=0.5,
            hint="Solve (P-1)/(m+P-1) < 0.03 for m; m is a whole number.",
        ),
    )


BUBBLE_CASES = [(4, 1, 1), (4, 8, 1), (8, 32, 1), (4, 8, 2), (8, 16, 4)]  # (P, m, v)


def check_my_bubble(my_bubble: object) -> bool | None:
    """The student's `my_bubble(P, m, v)` against the course's formula on five cases. It must
    be the student's own code: a function that reads or runs anything of course_lib (the
    formula under any name, the simulator) is refused."""
    return check_function(
        my_bubble,
        bubble_formula,
        BUBBLE_CASES,
        hint="Per stage: busy m(tf+tb), fill and drain (P-1)(tf+tb)/v; idle over all stage-time.",
        own_code=True,
    )


# --- the predictions, checked against the schedules ---------------------------------------------

IN_FLIGHT = ("1", "2", "4", "8")


def check_one_f_one_b_in_flight(
    one_f_one_b_stage0: object, one_f_one_b_stage3: object, one_f: Timeline
) -> tuple[bool | None, bool | None]:
    """The most micro-batches stages 0 and 3 hold at once under 1F1B (`one_f`, simulated)."""
    return (
        check_choice(
            one_f_one_b_stage0,
            str(one_f.peak_in_flight(0)),
            IN_FLIGHT,
            why="Stage s holds at most P - s, whatever m: P - s - 1 warm-ups, then one more.",
        ),
        check_choice(
            one_f_one_b_stage3,
            str(one_f.peak_in_flight(3)),
            IN_FLIGHT,
            why="The last stage (P - s = 1) runs each backward right after its forward.",
        ),
    )


IDLE_SHARES = {"the same as": 1.0, "half of": 0.5, "a third of": 1 / 3}


def check_zero_bubble_idle(
    zero_bubble_idle: object, one_f_split: Timeline, deferred: Timeline
) -> bool | None:
    """A stage's idle time with W deferred (`deferred`) as a share of 1F1B's (`one_f_split`),
    against the option nearest the simulation."""
    ratio = (deferred.makespan * deferred.bubble) / (one_f_split.makespan * one_f_split.bubble)
    return check_choice(
        zero_bubble_idle,
        nearest_option(ratio, IDLE_SHARES),
        list(IDLE_SHARES),
        why=f"Measured: {ratio:.2f} of 1F1B's idle time per stage, (F+B-W)/(F+B+W) = 1/3.",
    )


def check_first_backward(first_backward: object, logs: Sequence[StageLog]) -> bool | None:
    """Which rank started the first backward (of micro-batch 0) in a step run on ranks (`logs`,
    one per rank)."""
    starts = {
        log.stage: next(t.start for t in log.tasks if (t.kind, t.micro) == ("B", 0)) for log in logs
    }
    return check_choice(
        first_backward,
        f"rank {min(starts, key=starts.get)}",
        [f"rank {r}" for r in range(len(logs))],
        why="Backward starts from the loss, on the last rank; rank r waits for rank r + 1's "
        "gradient.",
    )


def check_zero_bubble_measured(
    predicted_bubble: object, most_ws_owed: object, runs: dict[str, Timeline], deferred: str
) -> tuple[bool | None, bool | None]:
    """The bubbles measured on ranks for 1F1B and for zero bubble with W's deferred (`runs`,
    by schedule; `deferred` names the second), within 5 points (the run adds idle time of its
    own: messages, wake-ups, compute beyond the sleeps), and the most W's a stage of
    the deferred run owed at once."""
    owed = [pending_w_peak(runs[deferred], s) for s in range(runs[deferred].n_stages)]
    return (
        check_numbers(
            predicted_bubble,
            {name: runs[name].bubble for name in ("1f1b", deferred)},
            rtol=0,
            atol=0.05,
            hint="1F1B: (P-1)/(m+P-1); W's deferred: idle (P-1)(F+B-W) per stage beside m(F+B+W).",
        ),
        check_number(
            most_ws_owed,
            max(owed),
            rtol=0,
            atol=0.5,
            hint="Which stage runs each B soonest after its F, and when are its W's paid?",
        ),
    )
