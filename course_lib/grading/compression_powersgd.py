"""Assignment 5's second part, PowerSGD: the single-process float64 reference and the judging,
in the checking process, of what the ranks report.

    initial_q, powersgd_reference       the Q every rank starts from; PowerSGD on one process
    float32_holds                       whether a draw lets a right float32 answer pass
    judge_powersgd                      one case: every rank, every step

The gradients are drawn here (`compression_cases.p_gradients`), each rank given only its own;
what each rank returned and kept in `self.error` comes back from it (`compression_ranks`),
and what it sent at each step is the launcher's tally.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from course_lib.costs import all_reduce_bytes
from course_lib.grading._harness import fail
from course_lib.grading.compression_cases import PCase
from course_lib.grading.compression_quantized import type_name
from course_lib.grading.traffic import Sent

# --- PowerSGD: the reference ---------------------------------------------------------------


def initial_q(m: int, r: int, seed: int) -> torch.Tensor:
    """The Q every rank starts from (float32): the same seeded normal matrix on every rank."""
    return torch.randn(m, r, generator=torch.Generator().manual_seed(seed))


def gram_schmidt(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning p's, one after another (modified Gram-Schmidt): the
    orthogonalisation the notebook allows beside QR, and the less stable of the two."""
    columns: list[torch.Tensor] = []
    for i in range(p.shape[1]):
        v = p[:, i].clone()
        for u in columns:
            v = v - (u @ v) * u
        columns.append(v / v.norm())
    return torch.stack(columns, dim=1)


def _qr(p: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(p).Q


def powersgd_reference(
    grads: list[list[torch.Tensor]],
    r: int,
    q0: torch.Tensor,
    *,
    error_feedback: bool = True,
    warm_start: bool = True,
    orthogonalize: bool = True,
    dtype: torch.dtype = torch.float64,
    orthogonalise: Callable[[torch.Tensor], torch.Tensor] = _qr,
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """PowerSGD on one process, in float64 (or `dtype`, to see what a right answer in that
    precision reaches). grads[w][t] is rank w's gradient at step t. Returns (approximation
    per step, error memory per rank per step). The switches turn parts of the algorithm off,
    to recognise a student's mistake."""
    ranks, steps = len(grads), len(grads[0])
    errors = [torch.zeros_like(grads[w][0], dtype=dtype) for w in range(ranks)]
    q = q0.to(dtype)
    approximations, memories = [], [[] for _ in range(ranks)]
    for t in range(steps):
        local = [grads[w][t].to(dtype) + (errors[w] if error_feedback else 0) for w in range(ranks)]
        mean = sum(local) / ranks  # what the two all-reduces of the algorithm compute
        p = mean @ (q if warm_start or t == 0 else q0.to(dtype))
        if orthogonalize:
            p = orthogonalise(p)
        q = mean.T @ p
        approximation = p @ q.T
        approximations.append(approximation)
        for w in range(ranks):
            errors[w] = local[w] - approximation
            memories[w].append(errors[w])
    return approximations, memories


# --- PowerSGD: judging ---------------------------------------------------------------------

# (rtol, atol as a fraction of the largest |entry|) against the float64 reference. Float32
# Gram-Schmidt or QR against float64 QR differ by ~1e-6 relative on most draws, but by far
# more where P = M Q is ill-conditioned: one draw put a right float32 Gram-Schmidt 4.7e-4 off.
# So the checks draw only gradients on which the reference itself, run in float32 with QR and
# with Gram-Schmidt, stays within a quarter of the tolerance (`float32_holds`).
P_TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float64: (1e-9, 1e-9)}


def float32_holds(case: PCase, grads: list[list[torch.Tensor]]) -> bool:
    """Whether PowerSGD run in the case's precision on these gradients, with QR and with
    Gram-Schmidt, stays within a quarter of P_TOLERANCE of the float64 reference at every
    step: a draw on which a right answer cannot fail for want of precision."""
    r = case.effective_rank
    q0 = initial_q(case.shape[1], r, case.seed)
    want, _ = powersgd_reference(grads, r, q0)
    rtol, atol = P_TOLERANCE[case.dtype]
    for orthogonalise in (_qr, gram_schmidt):
        got, _ = powersgd_reference(grads, r, q0, dtype=case.dtype, orthogonalise=orthogonalise)
        for g, w in zip(got, want, strict=True):
            scale = max(w.abs().max().item(), 1e-30)
            if not torch.allclose(g.double(), w, rtol=rtol / 4, atol=atol / 4 * scale):
                return False
    return True


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


def judge_powersgd(
    check: str,
    case: PCase,
    grads: list[list[torch.Tensor]],
    records: list[list[dict]],
    calls: list[list[list[Sent]]],
) -> None:
    """Fail on the first problem with one case, step by step: what each rank returned, the
    approximation against the float64 reference of the gradients drawn here (`grads[w][t]`),
    the error memory, the bytes sent (`calls[w][t]`, from the launcher's tallies)."""
    __tracebackhide__ = True
    p, r = case.world_size, case.effective_rank
    q0 = initial_q(case.shape[1], r, case.seed)
    reference, _ = powersgd_reference(grads, r, q0)
    for t in range(case.steps):
        at = f"{case}, step {t}"
        steps = [records[w][t] for w in range(p)]
        _judge_approximations(check, at, case, steps)
        first = steps[0]["approximation"]
        _judge_against_reference(check, at, case, t, first, reference[t], grads, q0)
        _judge_error_memory(check, at, case, t, records, grads)
        _judge_sent(check, at, case, [calls[w][t] for w in range(p)])


def _judge_approximations(check: str, at: str, case: PCase, steps: list[dict]) -> None:
    """Each rank returned an n x m tensor of the gradient's dtype, the same on every rank."""
    __tracebackhide__ = True
    p, (n, m) = case.world_size, case.shape
    for w in range(p):
        got = steps[w]["approximation"]
        if not isinstance(got, torch.Tensor) or got.shape != (n, m) or got.dtype != case.dtype:
            what = (got.dtype, tuple(got.shape)) if isinstance(got, torch.Tensor) else got
            fail(
                check,
                f"{at}: rank {w}'s compress_all_reduce returned {what}; expected a "
                f"{n}x{m} tensor of the gradient's dtype {case.dtype}",
            )
    first = steps[0]["approximation"]
    for w in range(1, p):
        got = steps[w]["approximation"]
        if not _close(got, first, case.dtype):
            fail(
                check,
                f"{at}: rank {w}'s approximation differs from rank 0's by up to "
                f"{_max_error(got, first):.3g}; every rank must apply the same update. "
                "Are both P and Q all-reduced (averaged) before P Q^T is formed?",
            )


def _judge_against_reference(
    check: str,
    at: str,
    case: PCase,
    t: int,
    first: torch.Tensor,
    reference: torch.Tensor,
    grads: list[list[torch.Tensor]],
    q0: torch.Tensor,
) -> None:
    """Step t's approximation (rank 0's) is the mean gradient where PowerSGD is exact, and
    the float64 reference's in any case; else a hint at the part of the algorithm it misses."""
    __tracebackhide__ = True
    p, (n, m) = case.world_size, case.shape
    mean_grad = sum(grads[w][t].double() for w in range(p)) / p
    if case.effective_rank == min(n, m) and not _close(first, mean_grad, case.dtype):
        fail(
            check,
            f"{at}: with rank {case.rank} >= min(n, m) = {min(n, m)} PowerSGD is exact, "
            f"so the result must be the mean gradient over the ranks; it is off by up to "
            f"{_max_error(first, mean_grad):.3g}. " + _powersgd_hint(case, t, first, grads, q0),
        )
    if not _close(first, reference, case.dtype):
        rtol, atol = P_TOLERANCE[case.dtype]
        fail(
            check,
            f"{at}: the approximation differs from the float64 reference by up to "
            f"{_max_error(first, reference):.3g} (allowed rtol {rtol:g}, atol {atol:g} "
            "x its largest entry); " + _powersgd_hint(case, t, first, grads, q0),
        )


def _judge_error_memory(
    check: str,
    at: str,
    case: PCase,
    t: int,
    records: list[list[dict]],
    grads: list[list[torch.Tensor]],
) -> None:
    """On every rank after step t: error memory + the updates so far = the gradients so far."""
    __tracebackhide__ = True
    p, (n, m) = case.world_size, case.shape
    for w in range(p):
        error = records[w][t]["error"]
        if not isinstance(error, torch.Tensor) or error.shape != (n, m):
            fail(
                check,
                f"{at}: rank {w}'s self.error is {type_name(error)}; after each call "
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


def _judge_sent(check: str, at: str, case: PCase, calls: list[list[Sent]]) -> None:
    """Each rank sent something, and no more than a ring all-reduce of P and Q: what the
    launcher was told of each call as it was made."""
    __tracebackhide__ = True
    p, (n, m), r = case.world_size, case.shape, case.effective_rank
    itemsize = torch.empty((), dtype=case.dtype).element_size()
    compressed = all_reduce_bytes((n + m) * r * itemsize, p)
    for w in range(p):
        sent = sum(call.sent for call in calls[w])
        ops = Counter(call.op for call in calls[w])
        seen = ", ".join(f"{op} x{k}" for op, k in sorted(ops.items()))
        if sent > compressed:
            fail(
                check,
                f"{at}: rank {w} sent {sent} bytes ({seen}); all-reducing P ({n}x{r}) and "
                f"Q ({m}x{r}) sends 2(P-1)/P (n + m) r = {compressed} bytes, while the "
                f"whole {n}x{m} matrix would send {all_reduce_bytes(n * m * itemsize, p)}. "
                "All-reduce only P and Q, never M itself.",
            )
        if p > 1 and sent == 0:
            fail(
                check,
                f"{at}: rank {w} sent nothing through torch.distributed; all-reduce P and "
                "Q with dist.all_reduce",
            )
