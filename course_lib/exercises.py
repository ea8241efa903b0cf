"""In-lecture exercises: an instant, friendly check that never grades and never fails.

    from course_lib.exercises import check_choice, check_function, check_number, check_numbers

    crossover = ...  # your answer, in bytes
    check_number(crossover, expected, rtol=0.02, unit="bytes", hint="set the two times equal")
    check_numbers({"ddp": ..., "zero3": ...}, {"ddp": 112e9, "zero3": 1.75e9}, unit="bytes")
    check_function(my_shard, library_shard, {"rank 1 of 2": (weight, 1, 2)})

An exercise cell leaves the answer as `...` until the student writes one: the check then says
so and nothing raises, so a lecture still runs top to bottom (CI runs every lecture). A wrong
answer is told how far off it is and given the hint, never the expected value: the point is
to find it. Graded work is in the assignments, with their own checks (`course_lib.grading`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any


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
        within = f"{rtol:.0%}" if rtol else f"±{atol:g}"
        print(f"✓ Right: {value:.4g}{unit} (checked to within {within}).")
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


def check_numbers(
    answers: object,
    expected: Mapping[str, float],
    *,
    rtol: float = 0.02,
    atol: float = 0.0,
    unit: str = "",
    hint: str = "",
) -> bool | None:
    """`check_number` for each named answer of a dict, one line per name: True when all are
    right, None while all are still `...` (a name left out counts as `...`)."""
    if _unanswered(answers):
        return None
    if not isinstance(answers, Mapping):
        print(f"✗ Expected a dict with the names {', '.join(map(repr, expected))}.")
        return False
    unknown = [name for name in answers if name not in expected]
    if unknown:
        print(f"✗ Unknown names {unknown}: use {', '.join(map(repr, expected))}.")
        return False
    verdicts = []
    for name, value in expected.items():
        print(f"{name}: ", end="")
        answer = answers.get(name, ...)
        verdicts.append(check_number(answer, value, rtol=rtol, atol=atol, unit=unit, hint=hint))
    if all(v is None for v in verdicts):
        return None
    return all(verdicts)


def _differs(yours: Any, expected: Any, atol: float) -> str | None:
    """How `yours` differs from `expected` (a tensor, a number or anything comparable with
    ==), without saying what `expected` is; None when they agree."""
    import torch  # here, so that the checks of lectures without torch stay light

    if isinstance(expected, torch.Tensor):
        if not isinstance(yours, torch.Tensor):
            return f"a {type(yours).__name__}, not a tensor"
        if yours.shape != expected.shape:
            return f"shape {tuple(yours.shape)}, which is not the right shape"
        worst = (yours.double() - expected.double()).abs().max().item() if yours.numel() else 0.0
        return f"the right shape, but values off by up to {worst:.3g}" if worst > atol else None
    if isinstance(expected, (int, float)) and isinstance(yours, (int, float)):
        return None if math.isclose(yours, expected, abs_tol=atol) else f"{yours!r}, not it"
    return None if yours == expected else f"{yours!r}, not it"


def check_function(
    candidate: object,
    reference: Callable[..., Any],
    cases: Mapping[str, tuple],
    *,
    atol: float = 0.0,
    hint: str = "",
) -> bool | None:
    """Call `candidate` and `reference` with the arguments of each named case and say on
    which case they first differ, and how (shape, values), never what the reference returned.
    A function still `...`, raising NotImplementedError or returning None is unanswered."""
    if _unanswered(candidate):
        return None
    if not callable(candidate):
        print(f"✗ Expected a function, got {candidate!r}.")
        return False
    for name, args in cases.items():
        try:
            yours = candidate(*args)
        except NotImplementedError:
            yours = None
        except Exception as error:  # the student's bug, reported, never raised
            print(f"✗ Not yet: on {name}, your function raised {type(error).__name__}: {error}")
            return False
        if yours is None or yours is ...:
            print(
                "Not answered yet: your function returned nothing; write it and return the result."
            )
            return None
        how = _differs(yours, reference(*args), atol)
        if how is not None:
            print(f"✗ Not yet: on {name}, your function returned {how}. {hint}".rstrip())
            return False
    print(f"✓ Right on all {len(cases)} cases: {', '.join(cases)}.")
    return True
