"""Checks for Assignment 5, compressed communication: 8-bit all-reduce and PowerSGD.

    check_quantized_all_reduce(quantize, dequantize, quantized_all_reduce)
        quantize(x) -> (q, scale): q int8/uint8 with x's numel, scale a few floats;
        dequantize((q, scale)) -> x's shape and dtype, each element within max|x| / 254;
        quantized_all_reduce(x) -> the sum over the ranks, the same on every rank, within
        max(2, P) * A / 254 of the exact sum (A = sum over ranks of max|x_r|), sending only
        8-bit tensors (at most 2(P-1) * ceil(N/P) bytes) plus small scales.
    check_powersgd(PowerSGD)
        PowerSGD(rank, seed=0).compress_all_reduce(grad) -> the same rank-r approximation of
        the ranks' mean (gradient + error) on every rank, equal to `powersgd_reference`;
        error feedback (self.error), warm start, (n + m) * r elements all-reduced.

Part 3 (open), `check_compressed_training`, lives in compression_budget.py.

The exact sums and the PowerSGD reference are computed in float64, independently of the
student's code: `dist.all_reduce` of float64 copies, and `powersgd_reference`, which follows
the algorithm of Vogels et al. 2019 with torch's error-feedback rule (error = local matrix -
applied update, as `powerSGD_hook` does); tests/test_grading_compression.py compares it with
`powerSGD_hook` itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from course_lib.grading._harness import Verdict, fail, run_on_ranks
from course_lib.grading.compression_powersgd import (
    P_TOLERANCE,
    PCase,
    initial_q,
    judge_powersgd,
    powersgd_records,
    powersgd_reference,
)
from course_lib.grading.compression_quantized import (
    BytesByKind,
    QCase,
    all_reduce_bound,
    judge_quantized,
    payload_budget,
    quantized_records,
    round_trip_bound,
    scale_budget,
)
from course_lib.grading.provenance import Provenance

DEFAULT_SHAPES = ((1,), (7,), (1000,), (30, 33))
DEFAULT_WORLD_SIZES = (1, 2, 3, 4)

# Lecture 5's module holds a working 8-bit quantizer, its all-reduce and PowerSGD's pieces:
# an answer that runs them, or a copy, is not the student's own.
LECTURE = ("course_lib.compression",)


def _records(check: str, found: list[dict]) -> list:
    """Each rank's records, once no rank ran the lecture's code."""
    __tracebackhide__ = True
    if found[0]["copied"]:
        fail(check, found[0]["copied"])
    return [rank_found["records"] for rank_found in found]


def _run_watched(records_of: Callable, answer: Any, cases: list) -> dict:
    """On each rank: records_of(answer, cases), watched for the lecture's code."""
    with Provenance(LECTURE) as seen:
        records = records_of(answer, cases)
    return {"records": records, "copied": seen.complaint()}


def _run_and_judge(
    check: str,
    verdict: Verdict,
    p: int,
    cases: list,
    records_of: Callable,
    answer: Any,
    who: str,
    judge: Callable,
    timeout: float,
) -> None:
    """Run `cases` on p ranks (`who` says what is run, for a timeout), then judge(case,
    records of every rank) for each case apart."""
    __tracebackhide__ = True
    results = run_on_ranks(
        check,
        _run_watched,
        records_of,
        answer,
        cases,
        world_size=p,
        timeout=timeout,
        what=f"{who} (world size {p}, {len(cases)} cases)",
    )
    results = _records(check, results)
    for i, case in enumerate(cases):
        with verdict.case():
            judge(case, [results[r][i] for r in range(p)])


def check_quantized_all_reduce(
    quantize: Callable,
    dequantize: Callable,
    quantized_all_reduce: Callable,
    *,
    world_sizes: Iterable[int] = DEFAULT_WORLD_SIZES,
    shapes: Iterable[tuple[int, ...]] = DEFAULT_SHAPES,
    seeds: Iterable[int] = (0, 1),
    timeout: float = 30.0,
) -> None:
    """8-bit quantization and an all-reduce that sends only 8-bit codes (plus scales): the
    round trip within max|x| / 254, the sum within max(2, P) * A / 254 and identical on every
    rank, bytes within `payload_budget` and `scale_budget`. Seed 1 gives rank 0 zeros."""
    __tracebackhide__ = True
    check = "check_quantized_all_reduce"
    fns = (quantize, dequantize, quantized_all_reduce)
    for fn in fns:
        if not callable(fn):
            fail(check, f"expected your functions, got {type(fn).__name__} {fn!r:.60}")
    name = getattr(quantized_all_reduce, "__name__", "quantized_all_reduce")
    shapes = [tuple(s) for s in shapes]
    verdict, count = Verdict(check), 0
    for p in sorted(set(world_sizes)):
        cases = [QCase(p, shape, seed) for seed in seeds for shape in shapes]
        who = f"your quantize, dequantize or {name}"
        judge = functools.partial(judge_quantized, check, name)
        _run_and_judge(check, verdict, p, cases, quantized_records, fns, who, judge, timeout)
        count += len(cases)
    sizes = ", ".join(str(p) for p in sorted(set(world_sizes)))
    verdict.conclude(
        f"{count} case(s) on {sizes} rank(s), shapes {shapes}: the round trip within "
        "max|x| / 254, the sum within max(2, P) * A / 254 and the same on every rank, and "
        "every rank's bytes within the payload and scale budgets"
    )


def check_powersgd(
    powersgd_class: Callable,
    *,
    world_sizes: Iterable[int] = DEFAULT_WORLD_SIZES,
    shapes: Iterable[tuple[int, int]] = ((8, 6),),
    ranks: Iterable[int] = (1, 2, 8),
    seeds: Iterable[int] = (0,),
    steps: int = 3,
    dtype: torch.dtype = torch.float32,
    timeout: float = 30.0,
) -> None:
    """`PowerSGD(rank, seed=seed)` on every rank, `steps` calls of
    `compress_all_reduce(grad)` each: the same approximation on every rank, equal to
    `powersgd_reference` (exact mean when rank >= min(n, m)), the error-feedback invariant
    after every step, and at most a ring all-reduce of (n + m) * rank elements sent."""
    __tracebackhide__ = True
    check = "check_powersgd"
    if not callable(powersgd_class):
        fail(check, f"expected your class, got {type(powersgd_class).__name__}")
    if dtype not in P_TOLERANCE:
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    name = getattr(powersgd_class, "__name__", "PowerSGD")
    verdict, count = Verdict(check), 0
    for p in sorted(set(world_sizes)):
        cases = [
            PCase(p, (int(shape[0]), int(shape[1])), r, seed, steps, dtype)
            for seed in seeds
            for shape in shapes
            for r in ranks
        ]
        judge = functools.partial(judge_powersgd, check)
        args = (powersgd_records, powersgd_class, f"your {name}", judge, timeout)
        _run_and_judge(check, verdict, p, cases, *args)
        count += len(cases)
    sizes = ", ".join(str(p) for p in sorted(set(world_sizes)))
    verdict.conclude(
        f"{count} case(s) on {sizes} rank(s) (shapes {list(shapes)}, ranks {list(ranks)}, "
        f"{steps} steps each): every step's approximation equals PowerSGD's and is the same "
        "on every rank, the error memory keeps what was left out, and each rank sends at "
        "most a ring all-reduce of (n + m) * rank elements"
    )


__all__ = [
    "BytesByKind",
    "all_reduce_bound",
    "check_powersgd",
    "check_quantized_all_reduce",
    "initial_q",
    "payload_budget",
    "powersgd_reference",
    "round_trip_bound",
    "scale_budget",
]
