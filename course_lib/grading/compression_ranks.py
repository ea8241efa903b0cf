"""What runs on each rank in Assignment 5's checks: the student's code on this rank's own
inputs, and what it returned. Nothing else.

Every rank's inputs are drawn, and the right answers computed, in the checking process
(`compression_cases`, the judges); a rank receives only its own share (`PerRank`). The calls
a rank makes are reported to the launcher as they happen (`course_lib.counted_group`), between
the marks that say which segment of the run (a case, a step) they belong to: the rank keeps no
tally the check judges by (the tallies carry each call's dtypes too:
`compression_quantized.split_by_kind`).

    quantized_on_rank(fns, cases, inputs)     Part 1: per case, a round trip, then the sum
    powersgd_on_rank(cls, cases, grads)       Part 2: per case, a PowerSGD and its steps
    train_on_rank(cls, start, shards)         Part 3: SGD with the student's compressor
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from course_lib.grading.compression_cases import LR, PCase, QCase, loss_of
from course_lib.grading.compression_quantized import kept, payload_problem
from course_lib.grading.provenance import Provenance
from course_lib.grading.traffic import CaseMarks

# Lecture 5's module holds a working 8-bit quantizer, its all-reduce and PowerSGD's pieces:
# an answer that runs them, or a copy, is not the student's own.
LECTURE = ("course_lib.compression",)
# Part 3 refuses PyTorch's DDP communication hooks too (PowerSGD, fp16/bf16, quantization).
FORBIDDEN = (
    *LECTURE,
    "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
    "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook",
    "torch.distributed.algorithms.ddp_comm_hooks.quantization_hooks",
)


@contextlib.contextmanager
def _noting(where: str) -> Iterator[None]:
    """An exception of the student's code names the case it was raised in."""
    try:
        yield
    except BaseException as exc:
        if hasattr(exc, "add_note"):  # Python 3.11+: the traceback then names the case
            exc.add_note(f"(while checking: {where})")
        raise


# --- Part 1 --------------------------------------------------------------------------------


def _quantized_case(fns: tuple, case: QCase, x: torch.Tensor, marks: CaseMarks) -> dict:
    """One case on this rank: quantize and dequantize its input (segment 2i: calls made
    there count for no budget, as the round trip needs none), then quantized_all_reduce
    (segment 2i + 1), each on a copy, so that the judge sees whether they changed it."""
    quantize, dequantize, quantized_all_reduce = fns
    marks.next()
    given = x.clone()
    with _noting(str(case)):
        payload = quantize(given)
    record: dict[str, Any] = {"x_after": given.clone(), "payload": kept(payload), "restored": None}
    # The judge asks the same of what comes back; here it only says whether dequantize can
    # be handed the payload, as the notebook states its form.
    if torch.equal(given, x) and payload_problem(x, payload) is None:
        with _noting(str(case)):
            record["restored"] = kept(dequantize((payload[0], payload[1])))
    mine = x.clone()
    marks.next()
    with _noting(str(case)):
        result = quantized_all_reduce(mine)
    record.update(result=kept(result), input_after=mine.clone())
    return record


def quantized_on_rank(fns: tuple, cases: list[QCase], inputs: list[torch.Tensor]) -> dict:
    """Every case in turn, in the same order on every rank, on this rank's own `inputs` (one
    tensor per case), watched for the lecture's code; a last mark after the last case."""
    marks = CaseMarks()
    with Provenance(LECTURE) as seen:
        records = [
            _quantized_case(fns, case, x, marks) for case, x in zip(cases, inputs, strict=True)
        ]
        marks.next()  # what comes after the last case belongs to none
    return {"records": records, "copied": seen.complaint()}


# --- Part 2 --------------------------------------------------------------------------------


def powersgd_on_rank(
    powersgd_class: Callable, cases: list[PCase], grads: list[list[torch.Tensor]]
) -> dict:
    """Per case, `PowerSGD(rank, seed=seed)` (segment of its own: its calls count for no
    step), then one call of compress_all_reduce per step on this rank's own gradient
    (`grads[case][step]`, a copy: the judge holds the original), each a segment; per step
    what it returned and its `self.error`."""
    marks, out = CaseMarks(), []
    with Provenance(LECTURE) as seen:
        for case, mine in zip(cases, grads, strict=True):
            marks.next()
            with _noting(str(case)):
                compressor = powersgd_class(case.rank, seed=case.seed)
            steps = []
            for t, grad in enumerate(mine):
                marks.next()
                with _noting(f"{case}, step {t}"):
                    approximation = compressor.compress_all_reduce(grad.clone())
                error = getattr(compressor, "error", None)
                steps.append({"approximation": kept(approximation), "error": kept(error)})
            out.append(steps)
        marks.next()
    return {"records": out, "copied": seen.complaint()}


# --- Part 3 --------------------------------------------------------------------------------


def _shape_problem(got: Any, params: list[torch.Tensor]) -> str | None:
    if not isinstance(got, (list, tuple)) or len(got) != len(params):
        return f"{type(got).__name__} {got!r:.60}; expected a list of {len(params)} tensors"
    for j, (g, p) in enumerate(zip(got, params, strict=True)):
        if not isinstance(g, torch.Tensor) or g.shape != p.shape or g.dtype != p.dtype:
            what = (g.dtype, tuple(g.shape)) if isinstance(g, torch.Tensor) else type(g)
            return f"{what} at position {j}; expected a float32 tensor of shape {tuple(p.shape)}"
        if not torch.isfinite(g).all():
            return f"a tensor with inf or nan at position {j}"
    return None


def train_on_rank(
    compressor_class: Callable,
    start: list[torch.Tensor],
    shards: list[tuple[torch.Tensor, torch.Tensor]],
    where: str,
) -> dict:
    """This rank's training with the student's compressor, from the initial parameters
    `start` (every rank's) on its own shard of each step: its final parameters and what went
    wrong first, if anything. What it sent is the launcher's count of the whole run (the
    check sends nothing here: every byte is the compressor's, whenever it sends it)."""
    params = [p.clone().requires_grad_() for p in start]
    problem = None
    with Provenance(FORBIDDEN) as seen:
        compressor = compressor_class()
        for step, (x, y) in enumerate(shards):
            grads = torch.autograd.grad(loss_of(params, x, y), params)
            with _noting(f"{where}, step {step}"):
                got = compressor.average([g.detach().clone() for g in grads])
            problem = _shape_problem(got, params)
            if problem:
                problem = f"step {step}: average returned {problem}"
                break
            with torch.no_grad():
                for p, g in zip(params, got, strict=True):
                    p -= LR * g
    return {
        "params": [p.detach().clone() for p in params],
        "problem": problem,
        "copied": seen.complaint(),
    }
