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

The exact sums and the PowerSGD reference are computed in float64, independently of the
student's code: `dist.all_reduce` of float64 copies, and `powersgd_reference`, which follows
the algorithm of Vogels et al. 2019 with torch's error-feedback rule (error = local matrix -
applied update, as `powerSGD_hook` does); tests/test_grading_compression.py compares it with
`powerSGD_hook` itself.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from course_lib import comm
from course_lib.comm import CommCounter
from course_lib.costs import all_reduce_bytes
from course_lib.grading._harness import Verdict, fail, run_on_ranks
from course_lib.grading.provenance import Provenance
from course_lib.runtime import rank

EIGHT_BIT = (torch.int8, torch.uint8)
LEVELS = 254  # int8 codes -127..127: a step of max|x| / 127, so rounding costs max|x| / 254
SLACK = 1.05  # the bound's margin for partial sums that already carry rounding errors
SCALE_CHUNK = 64  # at most one scale per 64 elements
DEFAULT_SHAPES = ((1,), (7,), (1000,), (30, 33))
DEFAULT_WORLD_SIZES = (1, 2, 3, 4)


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
    of them are int8/uint8, else to their dtype's name."""

    def __init__(self) -> None:
        self.sent: Counter = Counter()
        self.calls: Counter = Counter()

    def __enter__(self) -> BytesByKind:
        comm.add_around_hook(self._hook)
        return self

    def __exit__(self, *exc_info: object) -> None:
        comm.remove_around_hook(self._hook)

    def _hook(self, op: str, args: dict, sent: int, received: int, call: Callable) -> Any:
        dtypes = {t.dtype for t in _tensors(args.values())}
        kind = "8-bit" if dtypes and dtypes <= set(EIGHT_BIT) else _names(dtypes - {*EIGHT_BIT})
        self.sent[kind] += sent
        self.calls[f"{op} ({kind})"] += 1
        return call()

    def other_bytes(self) -> int:
        return sum(n for kind, n in self.sent.items() if kind != "8-bit")


def _tensors(values: Iterable) -> list[torch.Tensor]:
    out = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out += _tensors(value)
    return out


def _names(dtypes: set) -> str:
    return ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes)) or "no tensor"


# --- quantized all-reduce: what runs on each rank ------------------------------------------


@dataclass(frozen=True)
class QCase:
    """One run of quantized_all_reduce: world size, shape, seed."""

    world_size: int
    shape: tuple[int, ...]
    seed: int

    def __str__(self) -> str:
        return f"world size {self.world_size}, shape {self.shape}, seed {self.seed}"


def _q_input(case: QCase, r: int) -> torch.Tensor:
    """Rank r's float32 input: normal values whose size differs per rank, with one outlier
    (so a scale taken from the wrong statistic clips it); seed 1 gives rank 0 all zeros."""
    g = torch.Generator().manual_seed(7919 * case.seed + 131 * r + len(case.shape))
    x = torch.randn(case.shape, generator=g) * (1 + r)
    if x.numel() > 1:
        x.view(-1)[int(torch.randint(x.numel(), (1,), generator=g))] = -6.0 * (1 + r)
    if case.seed == 1 and r == 0:
        x.zero_()
    return x


def _round_trip(quantize: Callable, dequantize: Callable, x: torch.Tensor) -> str | None:
    """Quantize and dequantize x on this rank; describe the first problem, or None."""
    original = x.clone()
    payload = quantize(x)
    if not torch.equal(x, original):
        return "quantize changed its input x in place; leave x as it is"
    if not (isinstance(payload, (tuple, list)) and len(payload) == 2):
        return (
            f"quantize returned {type(payload).__name__}; it must return a pair (q, scale) "
            "of tensors"
        )
    q, scale = payload
    if not isinstance(q, torch.Tensor) or q.dtype not in EIGHT_BIT:
        what = q.dtype if isinstance(q, torch.Tensor) else type(q).__name__
        return f"q must be a torch.int8 or torch.uint8 tensor, got {what}"
    if q.numel() != x.numel():
        return f"q has {q.numel()} elements; it needs one 8-bit code per element of x ({x.numel()})"
    limit = 1 + math.ceil(x.numel() / SCALE_CHUNK)
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point():
        return f"scale must be a floating-point tensor, got {type(scale).__name__}"
    if scale.numel() > limit:
        return f"scale has {scale.numel()} elements; at most {limit} (one per 64 elements) allowed"
    restored = dequantize((q, scale))
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
            + _round_trip_hint(x, q)
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


# Lecture 5's module holds a working 8-bit quantizer, its all-reduce and PowerSGD's pieces:
# an answer that runs them, or a copy, is not the student's own.
LECTURE = ("course_lib.compression",)


def _records(check: str, found: list[dict]) -> list:
    """Each rank's records, once no rank ran the lecture's code."""
    __tracebackhide__ = True
    if found[0]["copied"]:
        fail(check, found[0]["copied"])
    return [rank_found["records"] for rank_found in found]


def _run_quantized(fns: tuple[Callable, Callable, Callable], cases: list[QCase]) -> dict:
    with Provenance(LECTURE) as seen:
        records = _quantized_records(fns, cases)
    return {"records": records, "copied": seen.complaint()}


def _quantized_records(fns: tuple[Callable, Callable, Callable], cases: list[QCase]) -> list:
    quantize, dequantize, quantized_all_reduce = fns
    records = []
    with CommCounter():  # keeps torch.distributed wrapped for the whole run
        for case in cases:
            x = _q_input(case, rank())
            problem = _round_trip(quantize, dequantize, x)
            exact = x.double()
            dist.all_reduce(exact)
            abs_max = torch.tensor(
                [x.abs().max().item() if x.numel() else 0.0], dtype=torch.float64
            )
            dist.all_reduce(abs_max)
            mine = x.clone()
            with BytesByKind() as kinds:
                try:
                    result = quantized_all_reduce(mine)
                except BaseException as exc:
                    if hasattr(exc, "add_note"):
                        exc.add_note(f"(while checking: {case})")
                    raise
            records.append(
                {
                    "round_trip": problem,
                    "result": result.detach().clone()
                    if isinstance(result, torch.Tensor)
                    else result,
                    "exact": exact,
                    "abs_max_sum": abs_max.item(),
                    "changed": not torch.equal(mine, x),
                    "bytes": dict(kinds.sent),
                    "calls": dict(kinds.calls),
                }
            )
    return records


# --- quantized all-reduce: judging in the calling process ----------------------------------


def _judge_quantized(check: str, name: str, case: QCase, records: list[dict]) -> None:
    __tracebackhide__ = True
    for r, rec in enumerate(records):
        if rec["round_trip"]:
            fail(check, f"{case}: on rank {r}, {rec['round_trip']}")
    for r, rec in enumerate(records):
        result = rec["result"]
        if not isinstance(result, torch.Tensor):
            fail(
                check,
                f"{case}: on rank {r}, your {name} returned {type(result).__name__}; it must "
                "return the sum as a new tensor",
            )
        if result.shape != rec["exact"].shape or result.dtype != torch.float32:
            fail(
                check,
                f"{case}: on rank {r}, your {name} returned shape {tuple(result.shape)} and "
                f"{result.dtype}; expected the input's shape {tuple(case.shape)} and float32",
            )
        if rec["changed"]:
            fail(check, f"{case}: your {name} changed its input on rank {r}; leave it unchanged")
    p = case.world_size
    bound = all_reduce_bound(records[0]["abs_max_sum"], p)
    for r, rec in enumerate(records):
        error = (rec["result"].double() - rec["exact"]).abs()
        if error.numel() and not (error.max().item() <= bound):
            worst = int(error.nan_to_num(float("inf")).argmax())
            fail(
                check,
                f"{case}: on rank {r}, the result is off the exact sum by "
                f"{error.max().item():.4g} at flat index {worst} (exact "
                f"{rec['exact'].reshape(-1)[worst].item():.4g}, got "
                f"{rec['result'].reshape(-1)[worst].item():.4g}); allowed max(2, P) * A / 254 "
                f"= {bound:.4g} with A = sum of max|x| over the ranks = "
                f"{records[0]['abs_max_sum']:.4g}. Does every rank's contribution arrive "
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
    numel = math.prod(case.shape)
    allowed8, allowed_other = payload_budget(numel, p), scale_budget(numel, p)
    for r, rec in enumerate(records):
        eight, other = (
            rec["bytes"].get("8-bit", 0),
            sum(n for kind, n in rec["bytes"].items() if kind != "8-bit"),
        )
        calls = ", ".join(f"{op} x{n}" for op, n in sorted(rec["calls"].items())) or "none"
        if other > allowed_other:
            fail(
                check,
                f"{case}: rank {r} sent {other} bytes in tensors that are not 8-bit "
                f"({', '.join(k for k in rec['bytes'] if k != '8-bit')}); only scales may "
                f"travel that way, at most {allowed_other} bytes here (8 (P-1) (2 + ceil(N/64))). "
                f"Calls seen: {calls}. Send the values as int8/uint8 codes.",
            )
        if eight > allowed8:
            fail(
                check,
                f"{case}: rank {r} sent {eight} bytes of 8-bit codes; a ring all-reduce of "
                f"N = {numel} one-byte codes sends 2(P-1) ceil(N/P) = {allowed8}. Calls seen: "
                f"{calls}. Gathering every rank's whole tensor costs (P-1) N: reduce-scatter "
                "chunks first (each rank sums one chunk), then all-gather the summed chunks.",
            )
        if p > 1 and numel >= p and eight == 0:
            fail(
                check,
                f"{case}: rank {r} sent no 8-bit tensor through torch.distributed, yet the sum "
                "needs the other ranks' data. Send int8/uint8 codes with dist.* calls (a "
                "function imported by name from torch.distributed is not seen).",
            )


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
        results = run_on_ranks(
            check,
            _run_quantized,
            fns,
            cases,
            world_size=p,
            timeout=timeout,
            what=f"your quantize, dequantize or {name} (world size {p}, {len(cases)} cases)",
        )
        results = _records(check, results)
        for i, case in enumerate(cases):
            with verdict.case():
                _judge_quantized(check, name, case, [results[r][i] for r in range(p)])
        count += len(cases)
    sizes = ", ".join(str(p) for p in sorted(set(world_sizes)))
    verdict.conclude(
        f"{count} case(s) on {sizes} rank(s), shapes {shapes}: the round trip within "
        "max|x| / 254, the sum within max(2, P) * A / 254 and the same on every rank, and "
        "every rank's bytes within the payload and scale budgets"
    )


# --- PowerSGD: the reference ---------------------------------------------------------------


def initial_q(m: int, r: int, seed: int) -> torch.Tensor:
    """The Q every rank starts from (float32): the same seeded normal matrix on every rank."""
    return torch.randn(m, r, generator=torch.Generator().manual_seed(seed))


def powersgd_reference(
    grads: list[list[torch.Tensor]],
    r: int,
    q0: torch.Tensor,
    *,
    error_feedback: bool = True,
    warm_start: bool = True,
    orthogonalize: bool = True,
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """PowerSGD in float64 on one process. grads[w][t] is rank w's gradient at step t.
    Returns (approximation per step, error memory per rank per step). The switches turn
    parts of the algorithm off, to recognise a student's mistake."""
    ranks, steps = len(grads), len(grads[0])
    errors = [torch.zeros_like(grads[w][0], dtype=torch.float64) for w in range(ranks)]
    q = q0.double()
    approximations, memories = [], [[] for _ in range(ranks)]
    for t in range(steps):
        local = [grads[w][t].double() + (errors[w] if error_feedback else 0) for w in range(ranks)]
        mean = sum(local) / ranks  # what the two all-reduces of the algorithm compute
        p = mean @ (q if warm_start or t == 0 else q0.double())
        if orthogonalize:
            p = torch.linalg.qr(p).Q
        q = mean.T @ p
        approximation = p @ q.T
        approximations.append(approximation)
        for w in range(ranks):
            errors[w] = local[w] - approximation
            memories[w].append(errors[w])
    return approximations, memories


# --- PowerSGD: what runs on each rank ------------------------------------------------------


@dataclass(frozen=True)
class PCase:
    """One run of PowerSGD: world size, matrix shape, approximation rank, seed, steps."""

    world_size: int
    shape: tuple[int, int]
    rank: int
    seed: int
    steps: int
    dtype: torch.dtype = torch.float32

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"world size {self.world_size}, {self.shape[0]}x{self.shape[1]} {dtype} matrix, "
            f"rank {self.rank}, seed {self.seed}"
        )

    @property
    def effective_rank(self) -> int:
        return min(self.rank, *self.shape)


def _gradient(case: PCase, r: int, t: int) -> torch.Tensor:
    """Rank r's gradient at step t: a shared low-rank part (what the ranks agree on) plus
    rank-specific noise, so that warm start and error feedback both matter."""
    n, m = case.shape
    shared = torch.Generator().manual_seed(104_729 * case.seed + 17 * t)
    own = torch.Generator().manual_seed(104_729 * case.seed + 17 * t + 7 * (r + 1) + 1)
    u, v = torch.randn(n, 2, generator=shared), torch.randn(2, m, generator=shared)
    return (u @ v + 0.5 * torch.randn(n, m, generator=own)).to(case.dtype)


def _run_powersgd(powersgd_class: Callable, cases: list[PCase]) -> dict:
    with Provenance(LECTURE) as seen:
        records = _powersgd_records(powersgd_class, cases)
    return {"records": records, "copied": seen.complaint()}


def _powersgd_records(powersgd_class: Callable, cases: list[PCase]) -> list[list[dict]]:
    out = []
    with CommCounter():
        for case in cases:
            compressor = powersgd_class(case.rank, seed=case.seed)
            steps = []
            for t in range(case.steps):
                grad = _gradient(case, rank(), t)
                with CommCounter() as counter:
                    try:
                        approximation = compressor.compress_all_reduce(grad.clone())
                    except BaseException as exc:
                        if hasattr(exc, "add_note"):
                            exc.add_note(f"(while checking: {case}, step {t})")
                        raise
                error = getattr(compressor, "error", None)
                steps.append(
                    {
                        "approximation": approximation.detach().clone()
                        if isinstance(approximation, torch.Tensor)
                        else approximation,
                        "error": error.detach().clone()
                        if isinstance(error, torch.Tensor)
                        else error,
                        "sent": counter.bytes_sent,
                        "calls": dict(counter.calls),
                    }
                )
            out.append(steps)
    return out


# --- PowerSGD: judging ---------------------------------------------------------------------

# (rtol, atol as a fraction of the largest |entry|) against the float64 reference. Float32
# Gram-Schmidt or QR against float64 QR differ by ~1e-6 relative on these small matrices.
P_TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float64: (1e-9, 1e-9)}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    rtol, atol = P_TOLERANCE[dtype]
    scale = max(want.abs().max().item(), 1e-30)
    return bool(torch.allclose(got.double(), want.double(), rtol=rtol, atol=atol * scale))


def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want.double()).abs().max().item()


def _powersgd_hint(case: PCase, t: int, got: torch.Tensor, grads, q0) -> str:
    """Which part of the algorithm the result is missing, by trying references without it."""
    r = case.effective_rank
    variants = [
        (
            {"error_feedback": False},
            "it matches PowerSGD without error feedback: add the "
            "error memory to the gradient (M = grad + error) and keep error = M - approximation",
        ),
        (
            {"warm_start": False},
            "it matches PowerSGD restarting from the initial Q at every "
            "step: keep the all-reduced Q and use it as the next step's Q (warm start)",
        ),
        (
            {"orthogonalize": False},
            "it matches PowerSGD without orthogonalization: replace P "
            "by an orthonormal basis of its columns (torch.linalg.qr(P).Q) before Q = M^T P",
        ),
    ]
    for options, text in variants:
        want = powersgd_reference(grads, r, q0, **options)[0][t]
        if _close(got, want, case.dtype):
            return text
    want = powersgd_reference(grads, r, q0)[0][t]
    p = case.world_size
    if p > 1 and _close(got, p * want, case.dtype):
        return f"it is {p} (the world size) times the reference: all-reduce sums; divide by it"
    return (
        "the steps are M = grad + error; P = M Q; all-reduce mean of P; orthogonalize P; "
        "Q = M^T P; all-reduce mean of Q; approximation = P Q^T; error = M - approximation"
    )


def _judge_powersgd(check: str, case: PCase, records: list[list[dict]]) -> None:
    __tracebackhide__ = True
    p, (n, m), r = case.world_size, case.shape, case.effective_rank
    grads = [[_gradient(case, w, t) for t in range(case.steps)] for w in range(p)]
    q0 = initial_q(m, r, case.seed)
    reference, _ = powersgd_reference(grads, r, q0)
    itemsize = torch.empty((), dtype=case.dtype).element_size()
    compressed = all_reduce_bytes((n + m) * r * itemsize, p)
    for t in range(case.steps):
        at = f"{case}, step {t}"
        for w in range(p):
            got = records[w][t]["approximation"]
            if not isinstance(got, torch.Tensor) or got.shape != (n, m) or got.dtype != case.dtype:
                what = (got.dtype, tuple(got.shape)) if isinstance(got, torch.Tensor) else got
                fail(
                    check,
                    f"{at}: rank {w}'s compress_all_reduce returned {what}; expected a "
                    f"{n}x{m} tensor of the gradient's dtype {case.dtype}",
                )
        first = records[0][t]["approximation"]
        for w in range(1, p):
            got = records[w][t]["approximation"]
            if not _close(got, first, case.dtype):
                fail(
                    check,
                    f"{at}: rank {w}'s approximation differs from rank 0's by up to "
                    f"{_max_error(got, first):.3g}; every rank must apply the same update. "
                    "Are both P and Q all-reduced (averaged) before P Q^T is formed?",
                )
        mean_grad = sum(grads[w][t].double() for w in range(p)) / p
        if r == min(n, m) and not _close(first, mean_grad, case.dtype):
            fail(
                check,
                f"{at}: with rank {case.rank} >= min(n, m) = {min(n, m)} PowerSGD is exact, "
                f"so the result must be the mean gradient over the ranks; it is off by up to "
                f"{_max_error(first, mean_grad):.3g}. " + _powersgd_hint(case, t, first, grads, q0),
            )
        if not _close(first, reference[t], case.dtype):
            rtol, atol = P_TOLERANCE[case.dtype]
            fail(
                check,
                f"{at}: the approximation differs from the float64 reference by up to "
                f"{_max_error(first, reference[t]):.3g} (allowed rtol {rtol:g}, atol {atol:g} "
                "x its largest entry); " + _powersgd_hint(case, t, first, grads, q0),
            )
        for w in range(p):
            error = records[w][t]["error"]
            if not isinstance(error, torch.Tensor) or error.shape != (n, m):
                fail(
                    check,
                    f"{at}: rank {w}'s self.error is {type(error).__name__}; after each call "
                    f"it must hold the {n}x{m} error memory M - approximation",
                )
            applied = sum(records[w][s]["approximation"].double() for s in range(t + 1))
            total = sum(grads[w][s].double() for s in range(t + 1))
            if not _close(error.double() + applied, total, case.dtype):
                fail(
                    check,
                    f"{at}: on rank {w}, error memory + sum of the updates so far differs from "
                    f"the sum of the gradients so far by up to "
                    f"{_max_error(error.double() + applied, total):.3g}; nothing may be lost: "
                    "error = (grad + previous error) - approximation, kept per rank",
                )
        for w in range(p):
            sent = records[w][t]["sent"]
            calls = ", ".join(f"{op} x{k}" for op, k in sorted(records[w][t]["calls"].items()))
            if sent > compressed:
                fail(
                    check,
                    f"{at}: rank {w} sent {sent} bytes ({calls}); all-reducing P ({n}x{r}) and "
                    f"Q ({m}x{r}) sends 2(P-1)/P (n + m) r = {compressed} bytes, while the "
                    f"whole {n}x{m} matrix would send {all_reduce_bytes(n * m * itemsize, p)}. "
                    "All-reduce only P and Q, never M itself.",
                )
            if p > 1 and sent == 0:
                fail(
                    check,
                    f"{at}: rank {w} sent nothing through torch.distributed; all-reduce P and "
                    "Q with dist.all_reduce (a function imported by name is not seen)",
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
        results = run_on_ranks(
            check,
            _run_powersgd,
            powersgd_class,
            cases,
            world_size=p,
            timeout=timeout,
            what=f"your {name} (world size {p}, {len(cases)} cases)",
        )
        results = _records(check, results)
        for i, case in enumerate(cases):
            with verdict.case():
                _judge_powersgd(check, case, [results[w][i] for w in range(p)])
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
