"""Lecture 5's exercises, checked off the page: section 3's PowerSGD ratio, and the predictions
checked against the runs (momentum with error feedback, the fastest method at 100 Mbit/s), each
computing its expected value and saying why here, out of the notebook's sight."""

from __future__ import annotations

from collections.abc import Sequence

from course_lib.compression import (
    powersgd_ratio,
)
from course_lib.exercises import check_choice, check_number
from course_lib.measure.compression.training import CompressionLog

# --- section 3's exercise -----------------------------------------------------------------------


def check_powersgd_ratio(fewer_numbers_1024: object) -> bool | None:
    """Lecture 5: how many times fewer numbers PowerSGD sends for 1024 x 1024 at rank r = 4."""
    return check_number(
        fewer_numbers_1024,
        powersgd_ratio(1024, 1024, 4),
        rtol=0.01,
        hint="P is n x r and Q is m x r: compare (n + m) r numbers with n m.",
    )


# --- the predictions, checked against the runs ----------------------------------------------------


def check_momentum_ends(momentum_ends: object, last10: dict[str, float]) -> bool | None:
    """Lecture 5: whether top-1% with error feedback ended below, near or above its plain-SGD
    loss with momentum added (`last10[method]`: the mean loss of the last 10 steps)."""
    ratio = last10["topk+ef, momentum"] / last10["topk+ef"]
    return check_choice(
        momentum_ends,
        "below" if ratio < 0.8 else "above" if ratio > 1.25 else "near",
        ["below", "near", "above"],
        why=f"Measured: {ratio:.2f} times the plain-SGD loss; compare fp32 with and without "
        "momentum.",
    )


def check_fastest_at_100Mbit(
    fastest_at_100Mbit: object, slow_runs: Sequence[dict[str, CompressionLog]]
) -> bool | None:
    """Lecture 5: which method's steps took the least time in all at 100 Mbit/s (`slow_runs`:
    each rank's runs by method; rank 0's are timed)."""
    methods = list(slow_runs[0])
    return check_choice(
        fastest_at_100Mbit,
        min(methods, key=lambda m: sum(slow_runs[0][m].step_s)),
        methods,
        why="At 100 Mbit/s the bytes dominate: compare the net wait column with the compute.",
    )
