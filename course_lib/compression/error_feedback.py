"""Top-k and 1-bit compression with error feedback: the compressors (`TopK`, `Sign`), one
error-feedback step, the mean of every rank's payload, and the DDP hooks built on them (error
feedback, signSGD with majority vote, deep gradient compression); `EFMomentumSGD`, momentum on
the decompressed average."""

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.compression.quantization import _done

# --- top-k and 1-bit compressors, error feedback -----------------------------------------


@dataclass
class TopK:
    """Keep the `fraction` of entries largest in magnitude; send their values and indices."""

    fraction: float

    def k(self, numel: int) -> int:
        return max(1, round(self.fraction * numel))

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 payload: k values, then their k indices as int32 bit patterns."""
        indices = x.abs().topk(self.k(x.numel())).indices
        bits = indices.to(torch.int32).view(torch.float32)  # same 4 bytes, reinterpreted
        return torch.cat([x[indices], bits])

    def decompress(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        values, bits = payload.view(2, -1)
        dense = torch.zeros(numel, dtype=payload.dtype, device=payload.device)
        return dense.index_put_((bits.view(torch.int32).long(),), values)

    def payload_bytes(self, numel: int) -> int:
        return 8 * self.k(numel)


@dataclass
class Sign:
    """1-bit compression: sign(x) times the mean |x|, the signs packed 8 to a byte."""

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 payload: the fp32 scale as 4 bytes, then ceil(N / 8) bytes of signs."""
        scale = x.abs().mean().reshape(1)
        bits = F.pad(x >= 0, (0, -x.numel() % 8)).view(-1, 8).to(torch.uint8)
        packed = (bits << torch.arange(8, dtype=torch.uint8, device=x.device)).sum(
            dim=1, dtype=torch.uint8
        )
        return torch.cat([scale.view(torch.uint8), packed])

    def decompress(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        scale = payload[:4].clone().view(torch.float32)  # a copy: aligned for the view
        shifts = torch.arange(8, dtype=torch.uint8, device=payload.device)
        bits = (payload[4:, None] >> shifts) & 1
        signs = bits.view(-1)[:numel].float() * 2 - 1
        return signs * scale

    def payload_bytes(self, numel: int) -> int:
        return 4 + math.ceil(numel / 8)


BiasedCompressor = TopK | Sign


def compress_with_feedback(
    grad: torch.Tensor, error: torch.Tensor | None, compressor: BiasedCompressor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One error-feedback step: compress delta = grad + error; return (payload, new error).

    The new error is delta - C(delta): what compression dropped this step is added back to
    the next step's gradient instead of being lost."""
    delta = grad if error is None else grad + error
    payload = compressor.compress(delta)
    return payload, delta - compressor.decompress(payload, delta.numel())


@dataclass
class FeedbackState:
    """State of `feedback_hook`: the compressor, and each bucket's error memory."""

    compressor: BiasedCompressor
    error_feedback: bool = True
    errors: dict[int, torch.Tensor] = field(default_factory=dict)


def gather_payloads(payload: torch.Tensor) -> torch.Tensor:
    """All-gather every rank's payload (all the same size): one row per rank."""
    p = dist.get_world_size()
    gathered = torch.empty(p * payload.numel(), dtype=payload.dtype, device=payload.device)
    dist.all_gather_single(gathered, payload)
    return gathered.view(p, -1)


def compressed_mean(
    payload: torch.Tensor, numel: int, compressor: BiasedCompressor
) -> torch.Tensor:
    """All-gather every rank's payload; return the mean of the decompressed payloads."""
    rows = gather_payloads(payload)
    return sum(compressor.decompress(row, numel) for row in rows) / len(rows)


def feedback_hook(
    state: FeedbackState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: compressed gradients, all-gathered and averaged, with or without
    error feedback (`state.error_feedback`)."""
    grads = bucket.buffer()
    error = state.errors.get(bucket.index()) if state.error_feedback else None
    payload, new_error = compress_with_feedback(grads, error, state.compressor)
    if state.error_feedback:
        state.errors[bucket.index()] = new_error
    grads.copy_(compressed_mean(payload, grads.numel(), state.compressor))
    return _done(grads)


def majority_vote_hook(_state: None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook for signSGD with majority vote (Bernstein et al., 2018): every rank sends
    the signs of its gradient (1 bit each), and every rank applies the sign of their sum, the
    majority's direction, +1, -1 or 0 on a tie (one bit cannot say 0: a zero entry votes +1).
    No error feedback: the vote is the update."""
    grads, sign = bucket.buffer(), Sign()
    rows = gather_payloads(sign.compress(grads))
    votes = sum(sign.decompress(row, grads.numel()).sign() for row in rows)
    grads.copy_(votes.sign())
    return _done(grads)


@dataclass
class DGCState:
    """State of `dgc_hook`: the top-k compressor, the momentum, and per bucket the local
    velocity u and the accumulated update v that waits to be sent."""

    compressor: TopK
    momentum: float = 0.9
    velocity: dict[int, torch.Tensor] = field(default_factory=dict)
    accumulated: dict[int, torch.Tensor] = field(default_factory=dict)


def dgc_hook(state: DGCState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook for deep gradient compression (Lin et al., 2018) with momentum
    correction: momentum runs on each rank *before* compression (u = m u + g), the velocity
    accumulates locally (v = v + u), the top-k of v is sent, and what was sent is cleared from
    both u and v (momentum factor masking), so a stale velocity does not push it again. Use
    it with plain SGD: the momentum is already in the update. (The paper's warm-up of the
    sparsity and its gradient clipping are left out.)"""
    grads, i = bucket.buffer(), bucket.index()
    u = state.velocity.setdefault(i, torch.zeros_like(grads))
    v = state.accumulated.setdefault(i, torch.zeros_like(grads))
    u.mul_(state.momentum).add_(grads)
    v.add_(u)
    payload = state.compressor.compress(v)
    sent = payload.view(2, -1)[1].view(torch.int32).long()  # the indices TopK sent
    u[sent], v[sent] = 0.0, 0.0
    grads.copy_(compressed_mean(payload, grads.numel(), state.compressor))
    return _done(grads)


class EFMomentumSGD(torch.optim.Optimizer):
    """SGD with momentum as error-feedback compression applies it (PowerSGD's paper,
    algorithm 2): on the decompressed average Delta' every rank received, m = lambda m + Delta'
    and x = x - lr (Delta' + m). The momentum sees only the aggregate, identical on all ranks,
    so the copies stay equal, and the error memory keeps only what compression dropped."""

    def __init__(self, params, lr: float, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("momentum", torch.zeros_like(p))
                m.mul_(group["momentum"]).add_(p.grad)
                p.sub_(group["lr"] * (p.grad + m))
