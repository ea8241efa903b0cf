"""In-lecture exercises: an instant, friendly check that never grades and never fails.

    from course_lib.exercises import check_choice, check_number

    crossover = ...  # your answer, in bytes
    check_number(crossover, expected, rtol=0.02, unit="bytes", hint="set the two times equal")
    check_function(my_formula, costs.all_reduce_bytes, [(4_000, 2), (4_000, 8)])
    check_matrix(my_mixing_matrix, Ring(4).mixing_matrix())

An exercise cell leaves the answer as `...` until the student writes one: the check then says
so and nothing raises, so a lecture still runs top to bottom (CI runs every lecture). A wrong
answer is told how far off it is and given the hint, never the expected value: the point is
to find it. Graded work is in the assignments, with their own checks (`course_lib.grading`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch


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
    print(f"✗ Not yet: {value:.4g}{unit} is {_how_far(value, expected)}. {hint}".rstrip())
    return False


def _how_far(value: float, expected: float) -> str:
    """How a wrong number is off, without saying the right one."""
    if expected != 0 and value != 0 and (value > 0) == (expected > 0):
        ratio = value / expected
        return f"{ratio:.2g}x too large" if ratio > 1 else f"{1 / ratio:.2g}x too small"
    return "the wrong sign" if value != 0 else "zero, and it should not be"


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


def nearest_option(value: float, options: dict[str, float]) -> str:
    """The option whose number is nearest `value` on a log scale, to check a prediction such
    as "about 10x, 100x or 1000x" against a measured ratio."""
    if value <= 0:
        raise ValueError(f"a measured ratio must be positive, got {value!r}")
    return min(options, key=lambda label: abs(math.log(value / options[label])))


def check_function(
    function: object,
    reference: Callable,
    cases: Sequence[tuple],
    *,
    rtol: float = 1e-6,
    hint: str = "",
) -> bool | None:
    """Call the student's `function` and `reference` on each tuple of arguments in `cases`;
    print right, or the first case where they differ and how far off the student's value is.
    A function left as `...`, or one that still returns `...`, is unanswered."""
    if _unanswered(function):
        return None
    if not callable(function):
        print(f"✗ Expected a function (def ...), got {function!r}.")
        return False
    for args in cases:
        shown = ", ".join(map(repr, args))
        try:
            value = function(*args)
        except Exception as error:  # noqa: BLE001 - told to the student, never raised
            print(f"✗ Your function raised {type(error).__name__} for ({shown}): {error}")
            return False
        if _unanswered(value):
            return None
        try:
            value = float(value)
        except (TypeError, ValueError):
            print(f"✗ For ({shown}) your function returned {value!r}, not a number.")
            return False
        expected = float(reference(*args))
        if not math.isclose(value, expected, rel_tol=rtol, abs_tol=1e-12):
            off = _how_far(value, expected)
            print(f"✗ Not yet: for ({shown}) your function gives {value:.6g}, {off}. {hint}")
            return False
    print(f"✓ Right on all {len(cases)} inputs tried.")
    return True


def check_matrix(
    answer: object, expected: torch.Tensor, *, atol: float = 1e-6, hint: str = ""
) -> bool | None:
    """Print whether the matrix `answer` (nested lists, numpy or torch) equals `expected`
    entry by entry; if not, say which rows hold wrong entries and which row and column sums
    are off, never the right entries."""
    if _unanswered(answer):
        return None
    try:
        matrix = torch.as_tensor(answer, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        print(f"✗ Expected a matrix (a list of rows of numbers), got {answer!r}.")
        return False
    expected = torch.as_tensor(expected, dtype=torch.float64)
    if matrix.shape != expected.shape:
        print(
            f"✗ Not yet: your matrix is {tuple(matrix.shape)}, it should be "
            f"{tuple(expected.shape)}. {hint}".rstrip()
        )
        return False
    wrong = (matrix - expected).abs() > atol
    if not wrong.any():
        print(f"✓ Right: all {matrix.numel()} entries.")
        return True
    rows = sorted({int(i) for i in wrong.nonzero()[:, 0]})
    sums = []
    for axis, name in ((1, "row"), (0, "column")):
        off = ((matrix.sum(axis) - expected.sum(axis)).abs() > atol).nonzero().flatten().tolist()
        if off:
            sums.append(f"{name} sums off at {off}")
    print(
        f"✗ Not yet: {int(wrong.sum())} entries wrong, in rows {rows}"
        f"{'; ' + '; '.join(sums) if sums else ''}. {hint}".rstrip()
    )
    return False
