"""Lecture 6's exercises, checked with their expected values off the page: the cell holds the
student's answers and one call, not the formula that computes them.

    check_sgd_budget(sgd_bytes_per_parameter, gpus_for_13B)   # model states of SGD, 13B
    check_smallest_peak(smallest_peak_units, best_k)           # checkpointing 64 layers
"""

from __future__ import annotations

import math

from course_lib.costs import BYTES_PER_PARAMETER
from course_lib.exercises import check_number, together
from course_lib.memory import checkpoint_units, divisors


def check_sgd_budget(sgd_bytes_per_parameter: object, gpus_for_13B: object) -> bool | None:
    """Lecture 6: mixed-precision SGD's bytes per parameter, and the 80 GB GPUs a 13B needs."""
    sgd = {kind: b for kind, b in BYTES_PER_PARAMETER.items() if kind != "optimizer: exp_avg_sq"}
    return together(
        check_number(
            sgd_bytes_per_parameter,
            sum(sgd.values()),
            unit="bytes",
            hint="Go through the five rows of the table: which one does SGD not need?",
        ),
        check_number(
            gpus_for_13B,
            math.ceil(13e9 * sum(sgd.values()) / 80e9),
            rtol=0,
            atol=0.5,
            hint="Bytes per parameter x 13e9, over 80e9 bytes, rounded up.",
        ),
    )


def check_smallest_peak(smallest_peak_units: object, best_k: object) -> bool | None:
    """Lecture 6: the least peak of 64 layers checkpointed in k equal segments, and that k."""
    peaks = {k: checkpoint_units(64, k) for k in divisors(64)}
    return together(
        check_number(
            smallest_peak_units,
            min(peaks.values()),
            rtol=0,
            atol=0.5,
            unit="units",
            hint="The peak is k segment inputs plus one segment of n/k layers.",
        ),
        check_number(
            best_k, min(peaks, key=peaks.get), rtol=0, atol=0.5, hint="Where is n/k + k least?"
        ),
    )
