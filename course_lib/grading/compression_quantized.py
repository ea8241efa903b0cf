"""Assignment 5's first part, the 8-bit all-reduce: the formulas the notebook states, the
byte count by dtype, and the judging, in the checking process, of what the ranks report.

    payload_budget, scale_budget        the bytes one rank may send (codes, scales)
    round_trip_bound, all_reduce_bound  how far a round trip and a sum may be off
    BytesByKind                         bytes sent, split into 8-bit tensors and others (a
                                        tool the notebook's try cell shows; no check reads it)
    QCase, payload_problem              one case; the form quantize's answer must have
    judge_quantized                     one case: every rank's answers, sum and bytes
    Other, kept                         what a rank sends back of a value that is no tensor

How many bytes a rank sent, and in which dtypes, comes from the launcher's tallies, kept
outside the ranks: a call counts as 8-bit when all its tensors are int8/uint8
(`split_by_kind`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from course_lib import comm, counted_group
from course_lib.costs import all_reduce_bytes
from course_lib.grading._harness import fail
from course_lib.grading.compression_cases import QCase, q_reference
from course_lib.grading.traffic import Sent

EIGHT_BIT = (torch.int8, torch.uint8)
LEVELS = 254  # int8 codes -127..127: a step of max|x| / 127, so rounding costs max|x| / 254
SLACK = 1.05  # the bound's margin for partial sums that already carry rounding errors
SCALE_CHUNK = 64  # at most one scale per 64 elements


# --- budgets and bounds: the formulas the notebook states ----------------------------------


def payload_budget(numel: int, world_size: int) -> int:
    """Bytes of 8-bit tensors one rank may send: a ring all-reduce of int8 codes,
    2(P-1) chunks of ceil(N/P) elements, a quarter of what float32 costs."""
    return all_reduce_bytes(world_size * math.ceil(numel / world_size), world_size)


def scale_budget(numel: int, world_size: int) -> int:
    """Bytes of other tensors (scales) one rank may send: 8 bytes per peer and step for
    every 64 elements, plus two; small next to the float32 data (32 times smaller)."""
    return 8 * (world_size - 1) * (2 + math.ceil(numel / SCALE_CHUNK))


def round_trip_bound(x: torch.Tensor) -> float:
    """How far dequantize(quantize(x)) may be from x, per element: max|x| / 254."""
    return x.abs().max().item() / LEVELS if x.numel() else 0.0


def all_reduce_bound(abs_max_sum: float, world_size: int) -> float:
    """How far quantized_all_reduce may be from the exact sum, per element: every value is
    quantized at most max(2, P) times (once per ring step), each costing A / 254, where
    A = sum over ranks of max|x_r| bounds every partial sum."""
    return SLACK * max(2, world_size) * abs_max_sum / LEVELS


# --- counting bytes by dtype ---------------------------------------------------------------


class BytesByKind:
    """While active: the bytes this rank sends, split into 8-bit tensors and others.

    Built on `course_lib.comm`'s hooks (so on grading ranks it sees every route to a
    collective, as a CommCounter does, and counts bytes the same way): each outermost call
    is classified by the dtypes of its tensors, and its bytes are booked to "8-bit" if all
    of them are int8/uint8, else to their dtype's name. For the student's own look at a
    call: kept on the rank, beside the code it watches, it decides nothing (the checks read
    the same split from the launcher's tallies: `split_by_kind`)."""

    def __init__(self) -> None:
        self.sent: Counter = Counter()
        self.calls: Counter = Counter()

    def __enter__(self) -> BytesByKind:
        comm.add_around_hook(self._hook)
        return self

    def __exit__(self, *exc_info: object) -> None:
        comm.remove_around_hook(self._hook)

    def _hook(self, op: str, args: dict, sent: int, received: int, call: Callable) -> Any:
        dtypes = {t.dtype for t in counted_group.tensors_in(args.values())}
        kind = "8-bit" if dtypes and dtypes <= set(EIGHT_BIT) else _names(dtypes - {*EIGHT_BIT})
        self.sent[kind] += sent
        self.calls[f"{op} ({kind})"] += 1
        return call()

    def other_bytes(self) -> int:
        return sum(n for kind, n in self.sent.items() if kind != "8-bit")


def _names(dtypes: set) -> str:
    return ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes)) or "no tensor"


# --- what a rank sends back -----------------------------------------------------------------


@dataclass(frozen=True)
class Other:
    """A value the student's code returned that is not a tensor, as messages describe it (the
    value itself may not even travel back from the rank)."""

    type_name: str
    text: str

    def __str__(self) -> str:
        return self.text


def kept(value: Any) -> Any:
    """A copy of a returned value to send back from the rank: tensors as they are, pairs
    element by element, anything else described."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return tuple(kept(v) for v in value)
    return Other(type(value).__name__, f"{value!s:.80}")


def type_name(value: Any) -> str:
    return value.type_name if isinstance(value, Other) else type(value).__name__


# --- quantized all-reduce: the form of quantize's answer ----------------------------------


def payload_problem(x: torch.Tensor, payload: Any) -> str | None:
    """What is wrong with the form of quantize(x)'s `payload`, or None. Pure: the rank asks it
    before calling dequantize, and the judge asks it again of what the rank sent back."""
    if not (isinstance(payload, (tuple, list)) and len(payload) == 2):
        return (
            f"quantize returned {type_name(payload)}; it must return a pair (q, scale) of tensors"
        )
    q, scale = payload
    if not isinstance(q, torch.Tensor) or q.dtype not in EIGHT_BIT:
        what = q.dtype if isinstance(q, torch.Tensor) else type_name(q)
        return f"q must be a torch.int8 or torch.uint8 tensor, got {what}"
    if q.numel() != x.numel():
        return f"q has {q.numel()} elements; it needs one 8-bit code per element of x ({x.numel()})"
    limit = 1 + math.ceil(x.numel() / SCALE_CHUNK)
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point():
        return f"scale must be a floating-point tensor, got {type_name(scale)}"
    if scale.numel() > limit:
        return f"scale has {scale.numel()} elements; at most {limit} (one per 64 elements) allowed"
    return None


def round_trip_problem(x: torch.Tensor, record: dict) -> str | None:
    """One rank's round trip, judged from what its quantize and dequantize returned there
    (`compression_ranks`) against its input `x`, drawn here: the first problem, or None."""
    if not torch.equal(record["x_after"], x):
        return "quantize changed its input x in place; leave x as it is"
    problem = payload_problem(x, record["payload"])
    if problem:
        return problem
    restored = record["restored"]
    if not isinstance(restored, torch.Tensor) or restored.shape != x.shape:
        shape = tuple(restored.shape) if isinstance(restored, torch.Tensor) else restored
        return f"dequantize returned {shape}; expected a tensor of x's shape {tuple(x.shape)}"
    if restored.dtype != x.dtype:
        return f"dequantize returned {restored.dtype}; expected x's dtype {x.dtype}"
    error = (restored.double() - x.double()).abs()
    bound = round_trip_bound(x)
    if not torch.isfinite(restored).all() or error.max().item() > bound * (1 + 1e-5) + 1e-30:
        worst = int(error.nan_to_num(float("inf")).argmax())
        return (
            f"dequantize(quantize(x)) is off by {error.max().item():.4g} at flat index {worst} "
            f"(x = {x.reshape(-1)[worst].item():.4g}, got "
            f"{restored.reshape(-1)[worst].item():.4g}); "
            f"8 bits with scale max|x| / 127 allow at most max|x| / 254 = {bound:.4g}. "
            + _round_trip_hint(x, record["payload"][0])
        )
    return None


def _round_trip_hint(x: torch.Tensor, q: torch.Tensor) -> str:
    if x.abs().max() == 0:
        return "x is all zeros: avoid dividing by a zero scale (0 / 0 is nan)."
    if q.dtype == torch.int8 and (q == -128).any():
        return (
            "A code is -128: a value above 127 wrapped around in .to(torch.int8). Clamp the "
            "codes to [-127, 127] first, with a scale of max|x| / 127."
        )
    return (
        "Is the scale max|x| / 127 (int8) and are the codes rounded (torch.round) and clamped "
        "to the 8-bit range before the conversion (which wraps around instead of clipping)?"
    )


# --- quantized all-reduce: judging in the calling process ----------------------------------


def judge_quantized(
    check: str,
    name: str,
    case: QCase,
    inputs: list[torch.Tensor],
    records: list[dict],
    calls: list[list[Sent]],
) -> None:
    """Fail on the first problem with one case: each rank's round trip and result against its
    input (`inputs`, drawn here), the sum's accuracy and agreement, the bytes each rank sent
    (`calls`, per rank, from the launcher's tallies)."""
    __tracebackhide__ = True
    _judge_returned(check, name, case, inputs, records)
    _judge_sum(check, case, inputs, records)
    _judge_payload(check, case, calls)


def _judge_returned(
    check: str, name: str, case: QCase, inputs: list[torch.Tensor], records: list[dict]
) -> None:
    """The round trip on every rank, then what quantized_all_reduce returned and left."""
    __tracebackhide__ = True
    for r, rec in enumerate(records):
        problem = round_trip_problem(inputs[r], rec)
        if problem:
            fail(check, f"{case}: on rank {r}, {problem}")
    for r, rec in enumerate(records):
        result = rec["result"]
        if not isinstance(result, torch.Tensor):
            fail(
                check,
                f"{case}: on rank {r}, your {name} returned {type_name(result)}; it must "
                "return the sum as a new tensor",
            )
        if result.shape != inputs[r].shape or result.dtype != torch.float32:
            fail(
                check,
                f"{case}: on rank {r}, your {name} returned shape {tuple(result.shape)} and "
                f"{result.dtype}; expected the input's shape {tuple(case.shape)} and float32",
            )
        if not torch.equal(rec["input_after"], inputs[r]):
            fail(check, f"{case}: your {name} changed its input on rank {r}; leave it unchanged")


def _judge_sum(check: str, case: QCase, inputs: list[torch.Tensor], records: list[dict]) -> None:
    """The sum within the bound of the exact one (computed here), and the same tensor on
    every rank."""
    __tracebackhide__ = True
    p = case.world_size
    exact, abs_max_sum = q_reference(inputs)
    bound = all_reduce_bound(abs_max_sum, p)
    for r, rec in enumerate(records):
        error = (rec["result"].double() - exact).abs()
        if error.numel() and not (error.max().item() <= bound):
            worst = int(error.nan_to_num(float("inf")).argmax())
            fail(
                check,
                f"{case}: on rank {r}, the result is off the exact sum by "
                f"{error.max().item():.4g} at flat index {worst} (exact "
                f"{exact.reshape(-1)[worst].item():.4g}, got "
                f"{rec['result'].reshape(-1)[worst].item():.4g}); allowed max(2, P) * A / 254 "
                f"= {bound:.4g} with A = sum of max|x| over the ranks = "
                f"{abs_max_sum:.4g}. Does every rank's contribution arrive "
                "exactly once, dequantized with its own scale?",
            )
    for r, rec in enumerate(records[1:], start=1):
        if not torch.equal(rec["result"], records[0]["result"]):
            diff = (rec["result"] - records[0]["result"]).abs().max().item()
            fail(
                check,
                f"{case}: rank {r}'s result differs from rank 0's by up to {diff:.3g}; every "
                "rank must end with the same tensor, bit for bit. Does a rank keep its own "
                "reduced chunk in float32 while the others get it through 8 bits? Dequantize "
                "the same codes everywhere.",
            )


def split_by_kind(calls: list[Sent]) -> tuple[int, int, list[str]]:
    """(8-bit bytes, other bytes, the other dtypes' names) of one rank's calls in one case, from
    the launcher's tallies: a call is 8-bit when every tensor it carries is int8/uint8."""
    eight_bit = {str(d).removeprefix("torch.") for d in EIGHT_BIT}
    eight, other, kinds = 0, 0, []
    for call in calls:
        if call.dtypes and set(call.dtypes) <= eight_bit:
            eight += call.sent
        else:
            other += call.sent
            name = ", ".join(d for d in call.dtypes if d not in eight_bit) or "no tensor"
            if call.sent and name not in kinds:
                kinds.append(name)
    return eight, other, kinds


def _judge_payload(check: str, case: QCase, calls: list[list[Sent]]) -> None:
    """Each rank's bytes: scales within `scale_budget`, codes within `payload_budget`, and
    some codes at all where the sum needs other ranks' data."""
    __tracebackhide__ = True
    p = case.world_size
    numel = math.prod(case.shape)
    allowed8, allowed_other = payload_budget(numel, p), scale_budget(numel, p)
    for r in range(p):
        eight, other, kinds = split_by_kind(calls[r])
        ops = Counter(call.op for call in calls[r])
        seen = ", ".join(f"{op} x{n}" for op, n in sorted(ops.items())) or "none"
        if other > allowed_other:
            fail(
                check,
                f"{case}: rank {r} sent {other} bytes in tensors that are not 8-bit "
                f"({', '.join(kinds)}); only scales may travel that way, at most "
                f"{allowed_other} bytes here (8 (P-1) (2 + ceil(N/64))). Calls seen: {seen}. "
                "Send the values as int8/uint8 codes.",
            )
        if eight > allowed8:
            fail(
                check,
                f"{case}: rank {r} sent {eight} bytes of 8-bit codes; a ring all-reduce of "
                f"N = {numel} one-byte codes sends 2(P-1) ceil(N/P) = {allowed8}. Calls seen: "
                f"{seen}. Gathering every rank's whole tensor costs (P-1) N: reduce-scatter "
                "chunks first (each rank sums one chunk), then all-gather the summed chunks.",
            )
        if p > 1 and numel >= p and eight == 0:
            fail(
                check,
                f"{case}: rank {r} sent no 8-bit tensor through torch.distributed, yet the sum "
                "needs the other ranks' data. Send int8/uint8 codes with dist.* calls.",
            )
