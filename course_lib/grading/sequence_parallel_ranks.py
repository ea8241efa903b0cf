"""What runs on each rank for Assignment 11's checks: the student's backward pass on this
rank's own rows, case after case, and what it returned (and, where a part measures them, the
work and memory of its torch operations, by `course_lib.meters.Meter`).

A rank holds nothing else. The other ranks' rows and the gradients torch's autograd gives
are drawn and computed in the checking process (`sequence_parallel_cases`), and the calls
each rank makes are reported to the launcher as they happen (`course_lib.counted_group`),
between the marks that say which case they belong to.

    run_cases(fn, cases, inputs, measure)   the student's function on this rank's rows
    run_layout(layout, tokens)              the student's layout, as plain lists
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch.utils import _python_dispatch

from course_lib import counted_group
from course_lib.grading.provenance import Provenance
from course_lib.grading.sequence_parallel_cases import Case
from course_lib.meters import Meter
from course_lib.runtime import world_size

# Lecture 11's module holds ring attention and Ulysses (forward), the online softmax's merge
# and the zigzag layout: an answer that runs any of it, or a copy, is not the student's own.
LECTURE_SP = ("course_lib.sequence_parallel",)
# Functions that take the meter off torch's dispatch stack: running them hides work.
METER_OFF = tuple(
    f"torch.utils._python_dispatch.{name}"
    for name in ("_disable_current_modes", "_pop_mode_temporarily")
    if hasattr(_python_dispatch, name)
)
# Tensor methods that hand a floating-point tensor's numbers to Python or numpy.
LEAVE_TORCH = ("numpy", "tolist", "item", "__array__", "__float__")


class Watch(Provenance):
    """Provenance (the lecture's code, copies of it, the grader's own code), and, where a
    part measures, the functions that switch the meter off and the calls that take
    floating-point numbers out of torch, where the meter cannot see them."""

    def __init__(self, measure: bool) -> None:
        super().__init__((*LECTURE_SP, *METER_OFF) if measure else LECTURE_SP)
        self.measure = measure
        self.left: list[str] = []

    def _profile(self, frame, event, arg):
        if event == "c_call" and self.measure:
            self._c_call(arg)
        return super()._profile(frame, event, arg)

    def _c_call(self, fn) -> None:
        owner, name = getattr(fn, "__self__", None), getattr(fn, "__name__", "?")
        module = owner.__name__ if isinstance(owner, types.ModuleType) else None
        module = module or getattr(fn, "__module__", None) or ""
        if isinstance(owner, torch.Tensor) and name in LEAVE_TORCH:
            if owner.is_floating_point() and f"Tensor.{name}()" not in self.left:
                self.left.append(f"Tensor.{name}()")
        elif module.split(".")[0] == "numpy" and f"numpy.{name}" not in self.left:
            self.left.append(f"numpy.{name}")

    def problem(self) -> str | None:
        """What to tell the student, or None."""
        off = [hit for hit in self.hits if hit in METER_OFF]
        if off:
            return (
                f"your code ran {off[0]}, which takes the meter off torch's dispatch stack; "
                "the measurement must see the whole call"
            )
        if self.left:
            return (
                f"your code called {', '.join(self.left[:3])}: it took floating-point numbers "
                "out of torch, where the meter cannot see them; compute with torch "
                "operations on tensors"
            )
        return self.complaint()


def _returned(value) -> tuple[list | None, str]:
    """Three tensors, detached (or None), and the type of what was returned."""
    kind = type(value).__name__
    if not isinstance(value, tuple | list) or len(value) != 3:
        return None, kind
    if not all(isinstance(t, torch.Tensor) for t in value):
        return None, f"{kind} of {', '.join(type(t).__name__ for t in value)}"
    return [t.detach().clone() for t in value], kind


def _run_case(fn: Callable, case: Case, args: tuple, measure: bool) -> dict:
    kwargs = {"causal": case.causal} if case.positions is None else {}
    meter = Meter(exempt=args) if measure else None
    raised = value = None
    try:
        if meter is None:
            value = fn(*args, **kwargs)
        else:
            with meter:
                value = fn(*args, **kwargs)
    except ValueError as error:  # the checks judge whether it was asked for
        raised = str(error) or "ValueError()"
    grads, kind = _returned(value)
    record = {"grads": grads, "returned": kind, "raised": raised}
    if meter is not None:
        record.update(peak=meter.peak_bytes, work=meter.work, missing=meter.missing[:3])
    return record


def run_cases(fn: Callable, cases: list[Case], inputs: list[tuple], measure: bool) -> dict:
    """On each rank: every case in turn, in the same order on every rank, on this rank's own
    `inputs` (one tuple of arguments per case). Before each case a mark goes to the launcher,
    so that the calls reported after it count for that case."""
    with Watch(measure) as watch:
        results = []
        for i, (case, args) in enumerate(zip(cases, inputs, strict=True)):
            counted_group.mark(i)
            results.append(_run_case(fn, case, args, measure))
        counted_group.mark(len(cases))  # what comes after the last case belongs to none
    return {"cases": results, "copied": watch.problem()}


def run_layout(layout: Callable, tokens: list[int]) -> dict:
    """On each rank: the student's layout for each length, as plain lists (or what it was)."""
    with Watch(measure=True) as watch:
        answers = [layout(n, world_size()) for n in tokens]
    found = []
    for shards in answers:  # converted after the watch: the student's code is done
        try:
            found.append([torch.as_tensor(s).tolist() for s in shards])
        except (TypeError, ValueError, RuntimeError):
            found.append(repr(shards)[:80])
    return {"layouts": found, "copied": watch.problem()}


__all__ = ["LECTURE_SP", "Watch", "run_cases", "run_layout"]
