"""Lecture 8's exercise on the bubble, checked off the page."""

from __future__ import annotations

from course_lib.costs import bubble_formula
from course_lib.exercises import check_number, check_numbers, together

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
