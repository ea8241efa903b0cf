"""Assignment 5's cheats (each scores 0 on its part) and right answers written differently
(full marks). More are proven in tests/test_grading_compression.py (the lecture's functions
called), which also runs check_powersgd on POWERSGD_GRAM_SCHMIDT and check_compressed_training
on every compressor below (the ones not listed in CHEATS / ALTERNATIVES too)."""

from __future__ import annotations

from tests.cheats import Alternative, Cheat

FP32_THROUGH_PREBOUND = '''
from torch.distributed import all_reduce as early_all_reduce


def quantized_all_reduce(tensor):
    """The exact sum in float32, through a name bound before the check could wrap it."""
    total = tensor.clone()
    early_all_reduce(total)
    return total
'''


NO_ERROR_FEEDBACK = '''
class PowerSGD:
    """Warm start, but what compression leaves out is dropped: an `error` that stays zero,
    for show."""

    def __init__(self, rank, seed=0):
        self.rank, self.seed, self.Q = rank, seed, None
        self.error = None

    def compress_all_reduce(self, grad):
        self.error = torch.zeros_like(grad)
        n, m = grad.shape
        if self.Q is None:
            r = min(self.rank, n, m)
            generator = torch.Generator().manual_seed(self.seed)
            self.Q = torch.randn(m, r, generator=generator).to(grad.dtype)
        P = grad @ self.Q
        dist.all_reduce(P)
        P = torch.linalg.qr(P / world_size()).Q
        Q = grad.T @ P
        dist.all_reduce(Q)
        self.Q = Q / world_size()
        return P @ self.Q.T
'''


POWERSGD_GRAM_SCHMIDT = """
class PowerSGD:
    def __init__(self, rank, seed=0):
        self.rank, self.seed = rank, seed
        self.Q, self.error = None, None

    def compress_all_reduce(self, grad):
        n, m = grad.shape
        if self.Q is None:
            r = min(self.rank, n, m)
            generator = torch.Generator().manual_seed(self.seed)
            self.Q = torch.randn(m, r, generator=generator).to(grad.dtype)
            self.error = torch.zeros_like(grad)
        M = grad + self.error
        P = M @ self.Q
        dist.all_reduce(P)
        P = P / world_size()
        columns = []
        for i in range(P.shape[1]):
            v = P[:, i].clone()
            for u in columns:
                v = v - (u @ v) * u
            columns.append(v / v.norm())
        P = torch.stack(columns, dim=1)
        Q = M.T @ P
        dist.all_reduce(Q)
        self.Q = Q / world_size()
        approximation = P @ self.Q.T
        self.error = M - approximation
        return approximation
"""


# --- Part 3 (open): compressors -------------------------------------------------------------

LECTURE_TOP_K = '''
from course_lib import compression


class Compressor:
    """The lecture's top-1% compressor with error feedback, wrapped: fewer bytes and the
    loss, but not the student's code."""

    def __init__(self):
        self.top_k, self.error = compression.TopK(0.01), None

    def average(self, grads):
        flat = torch.cat([g.reshape(-1) for g in grads])
        payload, self.error = compression.compress_with_feedback(flat, self.error, self.top_k)
        mean = compression.compressed_mean(payload, flat.numel(), self.top_k)
        parts = mean.split([g.numel() for g in grads])
        return [part.view_as(g) for part, g in zip(parts, grads, strict=True)]
'''


FLOAT32_ALL_REDUCE = '''
class Compressor:
    """No compression: the float32 mean, all-reduced (the same loss, 12x too many bytes)."""

    def average(self, grads):
        out = []
        for g in grads:
            dist.all_reduce(g)
            out.append(g / world_size())
        return out
'''


EIGHT_BIT = '''
class Compressor:
    """Part 1's 8-bit all-reduce on each gradient: about 4x fewer bytes, not 12x."""

    def average(self, grads):
        return [quantized_all_reduce(g) / world_size() for g in grads]
'''


TOP_K_NO_FEEDBACK = '''
class Compressor:
    """Top-1% values and indices, all-gathered, but what is left out is dropped: 25x fewer
    bytes, and a final loss about 45% above float32's."""

    def average(self, grads):
        flat = torch.cat([g.reshape(-1) for g in grads])
        k = max(1, flat.numel() // 100)
        indices = flat.abs().topk(k).indices
        P = world_size()
        all_indices = torch.empty(P * k, dtype=torch.int32)
        all_values = torch.empty(P * k)
        dist.all_gather_single(all_indices, indices.to(torch.int32))
        dist.all_gather_single(all_values, flat[indices])
        mean = torch.zeros_like(flat).index_add_(0, all_indices.long(), all_values) / P
        parts = mean.split([g.numel() for g in grads])
        return [part.view_as(g) for part, g in zip(parts, grads, strict=True)]
'''


OWN_GRADIENT = '''
class Compressor:
    """Nothing sent: each rank applies its own gradient. It trains (its shard is a fair
    sample), but the ranks' models drift apart."""

    def average(self, grads):
        return grads
'''


POWERSGD_RANK_1 = '''
class Compressor:
    """Part 2's PowerSGD at rank 1 for each weight matrix (its own error feedback), the
    biases all-reduced in float32: about 13x fewer bytes."""

    def __init__(self):
        self.matrices = {}

    def average(self, grads):
        out = []
        for i, g in enumerate(grads):
            if g.dim() == 2:
                out.append(self.matrices.setdefault(i, PowerSGD(1, seed=i)).compress_all_reduce(g))
            else:
                dist.all_reduce(g)
                out.append(g / world_size())
        return out
'''


SIGN_WITH_FEEDBACK = '''
class Compressor:
    """1-bit: each rank sends the signs of (gradient + error), 8 to a byte, and one scale,
    mean |.|; error feedback keeps the difference. About 16x fewer bytes on 4 ranks."""

    def __init__(self):
        self.error = None

    def average(self, grads):
        flat = torch.cat([g.reshape(-1) for g in grads])
        n, P = flat.numel(), world_size()
        corrected = flat if self.error is None else flat + self.error
        scale = corrected.abs().mean().reshape(1)
        positive = corrected >= 0
        self.error = corrected - torch.where(positive, scale, -scale)
        bits = torch.cat([positive, positive.new_zeros(-n % 8)]).view(-1, 8).to(torch.uint8)
        shifts = torch.arange(8, dtype=torch.uint8)
        packed = (bits << shifts).sum(dim=1, dtype=torch.uint8)
        all_packed = torch.empty(P * packed.numel(), dtype=torch.uint8)
        scales = torch.empty(P)
        dist.all_gather_single(all_packed, packed)
        dist.all_gather_single(scales, scale)
        mean = torch.zeros(n)
        for r, row in enumerate(all_packed.view(P, -1)):
            signs = ((row[:, None] >> shifts) & 1).reshape(-1)[:n].bool()
            mean += torch.where(signs, scales[r], -scales[r])
        mean /= P
        parts = mean.split([g.numel() for g in grads])
        return [part.view_as(g) for part, g in zip(parts, grads, strict=True)]
'''


CHEATS = [
    Cheat(
        "float32 sum through a pre-bound all-reduce",
        "quantized_all_reduce",
        FP32_THROUGH_PREBOUND,
        frozenset({"test_quantized_all_reduce"}),
    ),
    Cheat(
        "PowerSGD without error feedback",
        "powersgd",
        NO_ERROR_FEEDBACK,
        frozenset({"test_powersgd"}),
    ),
    Cheat(
        "the lecture's top-k with error feedback, wrapped",
        "compressor",
        LECTURE_TOP_K,
        frozenset({"test_compressed_training"}),
    ),
]

ALTERNATIVES = [
    Alternative("PowerSGD with Gram-Schmidt", "powersgd", POWERSGD_GRAM_SCHMIDT),
    Alternative("Part 2's PowerSGD at rank 1 as the compressor", "compressor", POWERSGD_RANK_1),
]
