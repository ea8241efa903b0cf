"""Assignment 5's compression checks accept right implementations and reject wrong ones;
the PowerSGD reference agrees with torch's own powerSGD_hook. Part 3's check is tested in
test_grading_compression_budget.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from course_lib import launch, rank, world_size
from course_lib.grading import (
    CheckFailed,
    check_powersgd,
    check_quantized_all_reduce,
)
from course_lib.grading.compression import BytesByKind, powersgd_reference
from course_lib.grading.compression_cases import PCase, p_gradients
from course_lib.grading.compression_powersgd import (
    P_TOLERANCE,
    float32_holds,
    gram_schmidt,
    initial_q,
)
from tests.adapters import planted, solution
from tests.cheats.a05_compression import POWERSGD_GRAM_SCHMIDT

SOLVED = solution("compression")
quantize, dequantize = SOLVED.quantize, SOLVED.dequantize
quantized_all_reduce, PowerSGD = SOLVED.quantized_all_reduce, SOLVED.PowerSGD


def expect_failure(check, fns, message: str, **options) -> str:
    with pytest.raises(CheckFailed) as info:
        check(*fns, **options)
    text = str(info.value)
    assert message in text, text
    return text


# --- quantization: right implementations --------------------------------------------------


def quantize_uint8(x):
    """Right, another way: asymmetric uint8 codes, scale = (offset, step)."""
    low = x.min()
    step = ((x.max() - low) / 255).clamp_min(1e-30)
    codes = torch.round((x - low) / step).clamp(0, 255).to(torch.uint8)
    return codes, torch.stack([low, step])


def dequantize_uint8(payload):
    codes, (low, step) = payload
    return codes.float() * step + low


def ring_quantized_all_reduce(tensor):
    """Right, another way: a ring of send/recv that re-quantizes partial sums at each step."""
    p, me, numel = world_size(), rank(), tensor.numel()
    flat = torch.zeros(-(-numel // p) * p)  # padded: equal chunks, none empty
    flat[:numel] = tensor.reshape(-1)
    chunks = list(flat.chunk(p))
    right, left = (me + 1) % p, (me - 1) % p
    for step in range(p - 1):  # reduce-scatter: chunk (me - step) travels right
        out, into = (me - step) % p, (me - step - 1) % p
        q, s = quantize(chunks[out])
        got, got_s = torch.empty_like(chunks[into], dtype=torch.int8), torch.empty(1)
        reqs = [dist.isend(q, right), dist.isend(s, right)]
        reqs += [dist.irecv(got, left), dist.irecv(got_s, left)]
        for r in reqs:
            r.wait()
        chunks[into] = chunks[into] + dequantize((got, got_s))
    done = (me + 1) % p  # the chunk this rank finished; quantize it once, everyone uses codes
    q, s = quantize(chunks[done])
    chunks[done] = dequantize((q, s))
    for step in range(p - 1):  # all-gather: forward the codes as they are
        into = (me - step) % p
        got, got_s = torch.empty_like(chunks[into], dtype=torch.int8), torch.empty(1)
        reqs = [dist.isend(q, right), dist.isend(s, right)]
        reqs += [dist.irecv(got, left), dist.irecv(got_s, left)]
        for r in reqs:
            r.wait()
        q, s = got, got_s
        chunks[into] = dequantize((q, s))
    return torch.cat(chunks)[:numel].view_as(tensor)


@pytest.mark.parametrize(
    "fns",
    [
        (quantize, dequantize, quantized_all_reduce),
        (quantize_uint8, dequantize_uint8, quantized_all_reduce),
        (quantize, dequantize, ring_quantized_all_reduce),
    ],
    ids=["solution", "uint8-offset", "ring"],
)
def test_quantized_all_reduce_accepts_right_implementations(fns, capsys):
    check_quantized_all_reduce(*fns, shapes=((1,), (7,), (300,), (30, 33)))
    assert capsys.readouterr().out.startswith(
        "check_quantized_all_reduce: passed. Verified 32 case(s) on 1, 2, 3, 4 rank(s)"
    )


# --- quantization: wrong implementations ---------------------------------------------------


def quantize_wrong_scale(x):
    scale = (x.abs().max() / 255).clamp_min(1e-30)  # uint8's range, but int8 codes
    return torch.round(x / scale).clamp(-127, 127).to(torch.int8), scale.reshape(1)


def quantize_no_clamp(x):
    scale = (x.abs().max() / 128).clamp_min(1e-30)  # 128 levels: the maximum becomes 128
    return torch.round(x / scale).to(torch.int8), scale.reshape(1)


def all_reduce_fp32(tensor):
    result = tensor.clone()
    dist.all_reduce(result)
    return result


def all_gather_codes(tensor):
    """Sends 8-bit codes, but every rank's whole tensor: (P-1) N bytes, twice the budget."""
    q, scale = quantize(tensor.reshape(-1))
    codes = [torch.empty_like(q) for _ in range(world_size())]
    scales = [torch.empty_like(scale) for _ in range(world_size())]
    dist.all_gather(codes, q)
    dist.all_gather(scales, scale)
    return sum(dequantize(pair) for pair in zip(codes, scales, strict=True)).view_as(tensor)


def own_chunk_in_fp32(tensor):
    """Each rank keeps its own summed chunk in float32: results differ between ranks."""
    p, me, numel = world_size(), rank(), tensor.numel()
    n = -(-numel // p)
    flat = torch.zeros(p * n)
    flat[:numel] = tensor.reshape(-1)
    q, scale = quantize(flat)
    codes, scales = torch.empty_like(q), torch.empty(p)
    dist.all_to_all_single(codes, q)
    dist.all_gather_single(scales, scale)
    chunk = sum(dequantize((codes[j * n : (j + 1) * n], scales[j : j + 1])) for j in range(p))
    q, scale = quantize(chunk)
    gathered = torch.empty(p * n, dtype=torch.int8)
    dist.all_gather_single(gathered, q)
    dist.all_gather_single(scales, scale)
    parts = [dequantize((gathered[j * n : (j + 1) * n], scales[j : j + 1])) for j in range(p)]
    parts[me] = chunk
    return torch.cat(parts)[:numel].view_as(tensor)


def not_implemented(*args, **kwargs):
    raise NotImplementedError()


@pytest.mark.parametrize(
    "fns, message",
    [
        ((quantize_wrong_scale, dequantize, quantized_all_reduce), "allow at most max|x| / 254"),
        ((quantize_no_clamp, dequantize, quantized_all_reduce), "A code is -128"),
        ((quantize, dequantize, all_reduce_fp32), "bytes in tensors that are not 8-bit (float32)"),
        ((quantize, dequantize, all_gather_codes), "bytes of 8-bit codes; a ring all-reduce"),
        ((quantize, dequantize, own_chunk_in_fp32), "rank 1's result differs from rank 0's"),
        ((not_implemented, dequantize, quantized_all_reduce), "raised NotImplementedError"),
        ((quantize, dequantize, not_implemented), "raised NotImplementedError"),
    ],
    ids=["wrong-scale", "no-clamp", "fp32", "all-gather", "per-rank", "ni-q", "ni"],
)
def test_quantized_all_reduce_rejects_wrong_implementations(fns, message):
    text = expect_failure(check_quantized_all_reduce, fns, message, timeout=10)
    assert text.startswith("check_quantized_all_reduce: ")


def test_bytes_by_kind_books_each_call_by_dtype():
    def run():
        with BytesByKind() as kinds:
            dist.all_reduce(torch.zeros(100, dtype=torch.int8))
            dist.all_reduce(torch.zeros(10))
        return dict(kinds.sent)

    # ring all-reduce on 2 ranks sends N bytes: 100 int8, 10 float32 = 40 bytes
    assert launch(run, world_size=2, timeout=30)[0] == {"8-bit": 100, "float32": 40}


# --- PowerSGD: right and wrong implementations ---------------------------------------------


# Right, another way: Gram-Schmidt instead of QR.
PowerSGDGramSchmidt = planted("compression", "powersgd", POWERSGD_GRAM_SCHMIDT).PowerSGD


def _patched(**changes):
    """PowerSGD with one line of the algorithm changed."""

    class Wrong(PowerSGD):
        def compress_all_reduce(self, grad):
            n, m = grad.shape
            if self.Q is None or changes.get("cold_start"):
                r = min(self.rank, n, m)
                g = torch.Generator().manual_seed(self.seed)
                self.Q = torch.randn(m, r, generator=g).to(grad.dtype)
                if self.error is None or changes.get("forget_error"):
                    self.error = torch.zeros_like(grad)
            matrix = grad + (0 if changes.get("forget_error") else self.error)
            if changes.get("full_matrix"):
                matrix = matrix.clone()
                dist.all_reduce(matrix)
                matrix /= world_size()
            p = matrix @ self.Q
            if not changes.get("full_matrix"):
                dist.all_reduce(p)
                p /= world_size()
            if not changes.get("no_orthogonalize"):
                p = torch.linalg.qr(p).Q
            q = matrix.T @ p
            if not changes.get("full_matrix") and not changes.get("local_q"):
                dist.all_reduce(q)
                if not changes.get("sum"):
                    q /= world_size()
            approximation = p @ q.T
            self.Q = q
            self.error = grad + self.error - approximation
            return approximation

    return Wrong


@pytest.mark.parametrize("cls", [PowerSGD, PowerSGDGramSchmidt], ids=["solution", "gram-schmidt"])
def test_powersgd_accepts_right_implementations(cls, capsys):
    check_powersgd(cls, shapes=((8, 6), (3, 10)))
    check_powersgd(cls, dtype=torch.float64, world_sizes=(3,), ranks=(2,), steps=4)
    out = capsys.readouterr().out
    assert "check_powersgd: passed. Verified 1 case(s) on 3 rank(s)" in out


def test_the_checks_draw_only_gradients_float32_can_be_held_to_the_tolerance():
    """On one secret draw (422) the reference itself, run in float32 with Gram-Schmidt, is
    3e-4 off the float64 one at some step (rtol 1e-4): a right student answer would have
    failed there. float32_holds turns such draws down, and accepts the usual ones."""
    case = PCase(4, (3, 10), 2, 0, 4)
    q0 = initial_q(10, 2, 0)
    bad = p_gradients([case], 422)[0]
    want, _ = powersgd_reference(bad, 2, q0)
    got, _ = powersgd_reference(bad, 2, q0, dtype=torch.float32, orthogonalise=gram_schmidt)
    worst = max(
        ((g.double() - w).abs().max() / w.abs().max()).item()
        for g, w in zip(got, want, strict=True)
    )
    assert worst > P_TOLERANCE[torch.float32][0]
    assert not float32_holds(case, bad)
    assert sum(float32_holds(case, p_gradients([case], s)[0]) for s in range(50)) >= 45


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"forget_error": True}, "without error feedback"),
        ({"no_orthogonalize": True}, "without orthogonalization"),
        ({"cold_start": True}, "warm start"),
        ({"full_matrix": True}, "All-reduce only P and Q, never M itself"),
        ({"local_q": True}, "rank 1's approximation differs from rank 0's"),
        ({"sum": True}, "times the reference: all-reduce sums"),
    ],
    ids=lambda v: "-".join(v) if isinstance(v, dict) else None,
)
def test_powersgd_rejects_wrong_implementations(changes, message):
    expect_failure(check_powersgd, (_patched(**changes),), message, world_sizes=(1, 2, 4))


def test_powersgd_failure_names_case_and_step():
    text = expect_failure(
        check_powersgd, (_patched(forget_error=True),), "step 1", world_sizes=(2,), ranks=(1,)
    )
    assert "world size 2, 8x6 float32 matrix, rank 1, seed 0, step 1" in text


# --- the reference against torch's powerSGD_hook -------------------------------------------


def ddp_powersgd_gradients(seed: int, rank_r: int, steps: int) -> list[torch.Tensor]:
    """Train-free DDP run: a bias-free 5x6 linear layer whose gradient is a chosen matrix
    (input = identity, loss = sum(output * target) makes grad W = target^T), reduced by
    torch's powerSGD_hook; returns .grad after each backward."""
    import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as powersgd
    from torch import nn

    torch.manual_seed(0)
    model = nn.Linear(6, 5, bias=False).double()
    ddp = nn.parallel.DistributedDataParallel(model)
    state = powersgd.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=rank_r,
        start_powerSGD_iter=2,
        min_compression_rate=1,
        use_error_feedback=True,
        warm_start=True,
        random_seed=seed,
    )
    ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    grads = []
    for t in range(steps):
        target = hook_gradient(seed, rank(), t).T  # (6, 5)
        ddp.zero_grad()
        (ddp(torch.eye(6, dtype=torch.float64)) * target).sum().backward()
        grads.append(model.weight.grad.clone())
    return grads


def hook_gradient(seed: int, r: int, t: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + 10 * t + r)
    return torch.randn(5, 6, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("seed, rank_r", [(0, 1), (3, 2)])
def test_reference_matches_torch_powersgd_hook(seed, rank_r):
    ranks, warmup, steps = 2, 2, 5
    got = launch(ddp_powersgd_gradients, seed, rank_r, steps, world_size=ranks, timeout=60)
    grads = [[hook_gradient(seed, w, t) for t in range(steps)] for w in range(ranks)]
    for t in range(warmup):  # torch's hook: plain all-reduce before start_powerSGD_iter
        torch.testing.assert_close(got[0][t], (grads[0][t] + grads[1][t]) / 2)
    # The hook's first Q: one draw from numpy's RandomState(seed) seeds torch's generator.
    torch.manual_seed(np.random.RandomState(seed).randint(1_000_000_000))
    q0 = torch.randn(1, 6, rank_r, dtype=torch.float64)[0]
    want, _ = powersgd_reference([g[warmup:] for g in grads], rank_r, q0)
    for t in range(steps - warmup):
        for w in range(ranks):
            torch.testing.assert_close(got[w][warmup + t], want[t], rtol=1e-10, atol=1e-10)
    # And the approximation is really lossy here, so the agreement is not trivial.
    mean = (grads[0][warmup] + grads[1][warmup]) / 2
    assert (want[0] - mean).abs().max() > 0.1


def lecture_quantized_all_reduce(tensor):
    """Right, but it quantizes with the lecture's `int8_chunks` (torch's quantization)."""
    from course_lib import compression

    compression.int8_chunks(tensor)
    return quantized_all_reduce(tensor)


def test_the_lectures_quantization_is_refused():
    expect_failure(
        check_quantized_all_reduce,
        (quantize, dequantize, lecture_quantized_all_reduce),
        "runs course_lib.compression.int8_chunks",
        timeout=10,
    )
