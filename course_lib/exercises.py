"""In-lecture exercises: an instant, friendly check that never grades and never fails.

    from course_lib.exercises import check_choice, check_function, check_number, check_numbers

    crossover = ...  # your answer, in bytes
    check_number(crossover, expected, rtol=0.02, unit="bytes", hint="set the two times equal")
    check_numbers({"ddp": ..., "zero3": ...}, {"ddp": 112e9, "zero3": 1.75e9}, unit="bytes")
    check_function(my_formula, costs.all_reduce_bytes, [(4_000, 2), (4_000, 8)])
    check_function(my_shard, library_shard, {"rank 1 of 2": (weight, 1, 2)})
    check_function(value_and_gradient(MyOp.apply), value_and_gradient(torch.sin), [(x,)])
    check_matrix(my_mixing_matrix, Ring(4).mixing_matrix())

An exercise cell leaves the answer as `...` until the student writes one: the check then says
so and nothing raises, so a lecture still runs top to bottom (CI runs every lecture). A wrong
answer is told how far off it is and given the hint, never the expected value: the point is
to find it. Graded work is in the assignments, with their own checks (`course_lib.grading`).

An expected value a cell could show as an expression (a formula, a library call that computes
exactly what is asked) is computed off the page, by a check named after the exercise in the
lecture's `course_lib.measure.<topic>`: the cell holds the answer and one call, and copying
from the page earns nothing. Lecture 0, which has no module of its own, has its checks here
(`check_bytes_on_8_ranks`, `check_warm_speedup`).
"""

from __future__ import annotations

import dis
import gc
import math
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from course_lib.costs import all_reduce_bytes


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
        within = f"{100 * rtol:g}%" if rtol else f"±{atol:g}"
        print(f"✓ Right: {value:.4g}{unit} (checked to within {within}).")
        return True
    print(f"✗ Not yet: {value:.4g}{unit} is {_how_far(value, expected)}. {hint}".rstrip())
    return False


def _how_far(value: float, expected: float) -> str:
    """How a wrong number is off, without saying the right one."""
    if expected != 0 and value != 0 and (value > 0) == (expected > 0):
        ratio = value / expected
        if 0.9 < ratio < 1.1:  # close: "1x too large" would say nothing
            return f"{abs(ratio - 1):.1%} too {'large' if ratio > 1 else 'small'}"
        return f"{ratio:.2g}x too large" if ratio > 1 else f"{1 / ratio:.2g}x too small"
    return "the wrong sign" if value != 0 else "zero, and it should not be"


def check_choice(
    answer: object, expected: str | Sequence[str], options: Sequence[str], *, why: str = ""
) -> bool | None:
    """Print whether `answer` (one of `options`) is `expected`, and `why` either way: for a
    prediction checked against what was just measured. `expected` may name several options,
    each right (a measurement too close to call: `faster`)."""
    if _unanswered(answer):
        return None
    if answer not in options:
        print(f"✗ {answer!r} is not one of {', '.join(map(repr, options))}.")
        return False
    right = (expected,) if isinstance(expected, str) else tuple(expected)
    if answer in right:
        said = (
            f"here {' and '.join(right)} were too close to call, so each is"
            if right[1:]
            else answer
        )
        print(f"✓ Right: {said}. {why}".rstrip())
        return True
    print(f"✗ Not this time: {answer} was not it, {' or '.join(right)} was. {why}".rstrip())
    return False


def faster(seconds: Mapping[str, float], margin: float = 0.2) -> str | tuple[str, ...]:
    """The option that took the least time, or every option within `margin` (relative) of the
    fastest when the gap is that small: a prediction is then checked against what noise on a
    shared machine cannot flip."""
    best = min(seconds.values())
    close = tuple(k for k, s in seconds.items() if s <= best * (1 + margin))
    return close[0] if len(close) == 1 else close


def nearest_option(value: float, options: dict[str, float]) -> str:
    """The option whose number is nearest `value` on a log scale, to check a prediction such
    as "about 10x, 100x or 1000x" against a measured ratio."""
    if value <= 0:
        raise ValueError(f"a measured ratio must be positive, got {value!r}")
    return min(options, key=lambda label: abs(math.log(value / options[label])))


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
    return together(*verdicts)


def together(*verdicts: bool | None) -> bool | None:
    """One verdict for an exercise of several checks: True when every one is right, None while
    every one is still unanswered (`...`), False otherwise."""
    if all(v is None for v in verdicts):
        return None
    return all(verdicts)


def _differs(yours: Any, expected: Any, rtol: float, atol: float) -> str | None:
    """How `yours` differs from `expected` (a tensor, a number or anything comparable with
    ==), without saying what `expected` is; None when they agree."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(yours, torch.Tensor):
            return f"a {type(yours).__name__}, not a tensor"
        if yours.shape != expected.shape:
            return f"shape {tuple(yours.shape)}, which is not the right shape"
        if torch.allclose(yours.double(), expected.double(), rtol=rtol, atol=atol):
            return None
        worst = (yours.double() - expected.double()).abs().max().item()
        return f"the right shape, but values off by up to {worst:.3g}"
    if isinstance(expected, (int, float)) and isinstance(yours, (int, float)):
        if math.isclose(yours, expected, rel_tol=rtol, abs_tol=atol):
            return None
        return f"{yours:.6g}, {_how_far(float(yours), float(expected))}"
    if isinstance(yours, (list, tuple)) and isinstance(expected, (list, tuple)):
        yours, expected = list(yours), list(expected)  # a list for a tuple is still right
    return None if yours == expected else f"{yours!r}, which is not the answer"


def check_function(
    candidate: object,
    reference: Callable[..., Any],
    cases: Mapping[str, tuple] | Sequence[tuple],
    *,
    rtol: float = 1e-9,
    atol: float = 0.0,
    hint: str = "",
    own_code: bool = False,
) -> bool | None:
    """Call `candidate` and `reference` with the arguments of each case (named, or a list of
    argument tuples) and say on which case they first differ, and how (shape, values, how many
    times too large), never what the reference returned. A function still `...`, raising
    NotImplementedError or returning None or `...` is unanswered; one that is the reference,
    or calls it by its name, is refused: agreeing with itself shows nothing.

    own_code=True, for a formula the student writes: a function that reads anything of
    `course_lib` (under any name, from its globals or its closure) or runs course_lib code
    while it is called is refused too, so no alias or other library route to the answer
    passes (`my_bubble = lambda *a: costs.bubble_formula(*a)`, `simulate(...).bubble`)."""
    if _unanswered(candidate):
        return None
    if not callable(candidate):
        print(f"✗ Expected a function, got {candidate!r}.")
        return False
    if _calls(candidate, reference):
        print(
            f"✗ Not yet: your function uses {reference.__name__}, the course's own answer it is "
            "checked against. Write it yourself, from the formula."
        )
        return False
    if own_code and (used := _library_read(candidate)):
        _refuse_library(used)
        return False
    if not isinstance(cases, Mapping):
        cases = {f"({', '.join(map(repr, args))})": args for args in cases}
    for name, args in cases.items():
        ran: list[str] = []
        try:
            yours = _watched(candidate, args, ran) if own_code else candidate(*args)
        except NotImplementedError:
            yours = None
        except Exception as error:  # the student's bug, reported, never raised
            print(f"✗ Not yet: on {name}, your function raised {type(error).__name__}: {error}")
            return False
        if ran:
            _refuse_library(ran[0])
            return False
        if yours is None or yours is ...:
            print(
                "Not answered yet: your function returned nothing; write it and return the result."
            )
            return None
        how = _differs(yours, reference(*args), rtol, atol)
        if how is not None:
            print(f"✗ Not yet: on {name}, your function returned {how}. {hint}".rstrip())
            return False
    print(f"✓ Right on all {len(cases)} cases: {', '.join(cases)}.")
    return True


def _calls(candidate: object, reference: Callable[..., Any]) -> bool:
    """Whether `candidate` is `reference` or names it in its code (nested functions too)."""
    if candidate is reference:
        return True
    code, name = getattr(candidate, "__code__", None), getattr(reference, "__name__", "")
    if code is None or not name.isidentifier() or code is getattr(reference, "__code__", None):
        return False  # a lambda, or two wrappers made by one factory (`value_and_gradient`)
    return name in _names(code)


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names) | set(code.co_freevars)  # globals, and names of enclosing scopes
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


LIBRARY = "course_lib"


def _from_library(value: object) -> bool:
    """Whether `value` is course_lib's: one of its modules, or a function, class or object
    defined in one."""
    if isinstance(value, types.ModuleType):
        name = value.__name__
    else:
        try:
            name = getattr(value, "__module__", None) or type(value).__module__
        except Exception:  # an object whose attributes misbehave is not the library's
            return False
    return isinstance(name, str) and (name == LIBRARY or name.startswith(LIBRARY + "."))


def _library_read(candidate: object) -> str | None:
    """The first name through which `candidate`'s code reads something of course_lib (a
    global it loads, a variable of an enclosing scope), or None."""
    code = getattr(candidate, "__code__", None)
    if code is None:
        return None
    scope = getattr(candidate, "__globals__", {})
    builtins = scope.get("__builtins__", {})
    builtins = vars(builtins) if isinstance(builtins, types.ModuleType) else builtins
    for name in _globals_loaded(code):
        if name in scope or name in builtins:
            if _from_library(scope[name] if name in scope else builtins[name]):
                return name
    for name, cell in zip(
        code.co_freevars, getattr(candidate, "__closure__", None) or (), strict=True
    ):
        try:
            if _from_library(cell.cell_contents):
                return name
        except ValueError:  # an empty cell: a variable not bound yet
            continue
    return None


def _globals_loaded(code: types.CodeType) -> list[str]:
    """Names `code` (and the functions defined in it) load as globals."""
    names = [
        i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")
    ]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _globals_loaded(const)
    return names


def _watched(candidate: Callable[..., Any], args: tuple, ran: list[str]) -> Any:
    """Call `candidate(*args)`, appending to `ran` the name of every course_lib function it
    ran (a profiler sees each Python call, whatever name or object led to it)."""

    def profile(frame: types.FrameType, event: str, arg: object) -> None:
        module = frame.f_globals.get("__name__", "")
        if event == "call" and (module == LIBRARY or module.startswith(LIBRARY + ".")):
            ran.append(f"{module}.{frame.f_code.co_name}")

    # No garbage collection while watching: a collection could run a finaliser of the
    # library's (a counter's release) inside the candidate's call, and blame the candidate.
    collecting, previous = gc.isenabled(), sys.getprofile()
    gc.disable()
    sys.setprofile(profile)
    try:
        return candidate(*args)
    finally:
        sys.setprofile(previous)
        if collecting:
            gc.enable()


def _refuse_library(name: str) -> None:
    print(
        f"✗ Not yet: your function uses {name}, from course_lib. The check refuses any "
        "function that calls or reads the course's library: write it yourself, from the formula."
    )


def value_and_gradient(fn: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    """Wrap a function of one tensor so that check_function compares its forward and its
    backward at once: the wrapper returns fn(x) followed by the gradient of sum(w * fn(x))
    with respect to x, for weights w = 1, 2, 3, ... (so a backward that ignores the incoming
    gradient shows). An unwritten forward (returning None or ...) is passed on as None."""

    def both(x: torch.Tensor) -> torch.Tensor | None:
        x = x.detach().clone().requires_grad_(True)
        y = fn(x)
        if y is None or y is ...:
            return None
        weights = torch.arange(1, y.numel() + 1, dtype=y.dtype).reshape(y.shape)
        (y * weights).sum().backward()
        if x.grad is None:
            raise ValueError("backward gave x no gradient: return it from backward")
        return torch.cat([y.detach().flatten(), x.grad.flatten()])

    return both


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


# --- lecture 0's exercises (lecture 0 has no module of its own) ------------------------------


def check_bytes_on_8_ranks(bytes_per_rank_on_8: object) -> bool | None:
    """Lecture 0: the bytes one rank sends to all-reduce 1,000,000 float32 values on 8 ranks."""
    return check_number(
        bytes_per_rank_on_8,
        all_reduce_bytes(4 * 1_000_000, 8),
        rtol=0.01,
        unit="bytes",
        hint="A float32 is 4 bytes, so N = 4,000,000; then 2(P-1)/P * N with P = 8.",
    )


WARM_SPEEDUPS = {"10x": 10, "100x": 100, "1000x": 1000}


def check_warm_speedup(warm_speedup: object, cold: float, warm_ms: float) -> bool | None:
    """Lecture 0: how many times faster than starting fresh workers (`cold` seconds) a warm
    call (`warm_ms` milliseconds) was, against the option nearest the run on a log scale."""
    return check_choice(
        warm_speedup,
        nearest_option(cold / (warm_ms / 1000), WARM_SPEEDUPS),
        list(WARM_SPEEDUPS),
        why="Fresh workers are forked and join a process group; a warm call is one message each.",
    )
