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

Every case runs the student's code on inputs drawn here, in the checking process, from a
secret new for each call of a check; each rank receives only its own (`compression_cases`,
`compression_ranks`). The references are computed here too, in float64, independently of the
student's code: the exact sums, and `powersgd_reference`, which follows the algorithm of
Vogels et al. 2019 with torch's error-feedback rule (error = local matrix - applied update,
as `powerSGD_hook` does); tests/test_grading_compression.py compares it with `powerSGD_hook`
itself. What each rank sent, call by call and case by case, is what its process group told
the launcher as the calls were made (`_harness.run_on_ranks(..., traffic=True)`): no count
kept on a rank decides a verdict; Part 1's split of the bytes into 8-bit and other reads each
call's dtypes from the same tallies (`compression_quantized.split_by_kind`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from course_lib import PerRank
from course_lib.grading._harness import (
    Verdict,
    calls_by_case,
    fail,
    judge_unreported,
    new_secret,
    run_on_ranks,
)
from course_lib.grading.compression_cases import (
    PCase,
    QCase,
    p_gradients,
    q_inputs,
)
from course_lib.grading.compression_powersgd import (
    P_TOLERANCE,
    float32_holds,
    initial_q,
    judge_powersgd,
    powersgd_reference,
)
from course_lib.grading.compression_quantized import (
    BytesByKind,
    all_reduce_bound,
    judge_quantized,
    payload_budget,
    round_trip_bound,
    scale_budget,
)
from course_lib.grading.compression_ranks import powersgd_on_rank, quantized_on_rank
from course_lib.grading.traffic import Sent

DEFAULT_SHAPES = ((1,), (7,), (1000,), (30, 33))
DEFAULT_WORLD_SIZES = (1, 2, 3, 4)


def _run(
    check: str,
    p: int,
    on_rank: Callable,
    answer: Any,
    cases: list,
    given: list,
    what: str,
    segments: int,
    timeout: float,
) -> tuple[list, list[list[list[Sent]]]]:
    """Run `on_rank(answer, cases, mine)` on p ranks, rank r given only `given[r]`: each
    rank's records, and per rank the calls of each of the `segments` it marked, from the
    launcher's tallies."""
    __tracebackhide__ = True
    found, traffic = run_on_ranks(
        check,
        on_rank,
        answer,
        cases,
        PerRank(given),
        world_size=p,
        timeout=timeout,
        what=what,
        traffic=True,
    )
    if found[0]["copied"]:
        fail(check, found[0]["copied"])
    calls = calls_by_case(check, traffic.tallies, segments)
    judge_unreported(check, traffic)
    return [rank_found["records"] for rank_found in found], calls


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
    rank, bytes within `payload_budget` and `scale_budget`. Seed 1 gives rank 0 zeros; the
    values are drawn from a secret."""
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
        inputs = q_inputs(cases, new_secret())  # [case][rank]
        given = [[x[r] for x in inputs] for r in range(p)]
        what = f"your quantize, dequantize or {name} (world size {p}, {len(cases)} cases)"
        # Two segments per case: the round trip (its calls count for nothing), the sum.
        args = (quantized_on_rank, fns, cases, given, what, 2 * len(cases), timeout)
        records, calls = _run(check, p, *args)
        for i, case in enumerate(cases):
            with verdict.case():
                found = [records[r][i] for r in range(p)]
                sent = [calls[r][2 * i + 1] for r in range(p)]
                judge_quantized(check, name, case, inputs[i], found, sent)
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
        grads = p_gradients(cases, new_secret())  # [case][rank][step]
        for i, case in enumerate(cases):  # too ill-conditioned for float32: draw again
            while not float32_holds(case, grads[i]):
                grads[i] = p_gradients([case], new_secret())[0]
        given = [[g[r] for g in grads] for r in range(p)]
        what = f"your {name} (world size {p}, {len(cases)} cases)"
        # Per case a segment for the construction (its calls count for no step), then one
        # per step.
        args = (powersgd_on_rank, powersgd_class, cases, given, what, len(cases) * (1 + steps))
        records, calls = _run(check, p, *args, timeout)
        for i, case in enumerate(cases):
            first = i * (1 + steps) + 1
            with verdict.case():
                found = [records[r][i] for r in range(p)]
                sent = [calls[r][first : first + steps] for r in range(p)]
                judge_powersgd(check, case, grads[i], found, sent)
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
