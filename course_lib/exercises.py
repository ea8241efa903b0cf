"""In-lecture exercises: an instant, friendly check that never grades and never fails.

    from course_lib.exercises import check_choice, check_number

    crossover = ...  # your answer, in bytes
    check_number(crossover, expected, rtol=0.02, unit="bytes", hint="set the two times equal")

An exercise cell leaves the answer as `...` until the student writes one: the check then says
so and nothing raises, so a lecture still runs top to bottom (CI runs every lecture). A wrong
answer is told how far off it is and given the hint, never the expected value: the point is
to find it. Graded work is in the assignments, with their own checks (`course_lib.grading`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def _unanswered(answer: object) -> bool:
    if answer is ...:
        print("Not answered yet: replace ... with your answer and run the cell again.")
        return True
    return False


def check_number(
    answer: object,
    expected: float,
    *,
    rtol: float = 0.02,
    atol: float = 0.0,
    unit: str = "",
    hint: str = "",
) -> bool | None:
    """Print whether `answer` is `expected` within rtol/atol; True, False, or None if the
    answer is still `...`."""
    if _unanswered(answer):
        return None
    try:
        value = float(answer)
    except (TypeError, ValueError):
        print(f"✗ Expected a number, got {answer!r}.")
        return False
    unit = f" {unit}" if unit else ""
    if math.isclose(value, expected, rel_tol=rtol, abs_tol=atol):
        print(f"✓ Right: {value:.4g}{unit} (checked to within {rtol:.0%}).")
        return True
    if expected != 0 and value != 0 and (value > 0) == (expected > 0):
        ratio = value / expected
        off = f"{ratio:.2g}x too large" if ratio > 1 else f"{1 / ratio:.2g}x too small"
    else:
        off = "the wrong sign" if value != 0 else "zero, and it should not be"
    print(f"✗ Not yet: {value:.4g}{unit} is {off}. {hint}".rstrip())
    return False


def check_choice(
    answer: object, expected: str, options: Sequence[str], *, why: str = ""
) -> bool | None:
    """Print whether `answer` (one of `options`) is `expected`, and `why` either way: for a
    prediction checked against what was just measured."""
    if _unanswered(answer):
        return None
    if answer not in options:
        print(f"✗ {answer!r} is not one of {', '.join(map(repr, options))}.")
        return False
    if answer == expected:
        print(f"✓ Right: {expected}. {why}".rstrip())
        return True
    print(f"✗ Not this time: {answer} was not it, {expected} was. {why}".rstrip())
    return False
