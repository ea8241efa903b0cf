"""Assignment 5's cheats (each scores 0 on its part) and right answers written differently
(full marks). More are proven in tests/test_grading_compression.py (the lecture's functions
called), which also runs check_powersgd on POWERSGD_GRAM_SCHMIDT."""

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
]

ALTERNATIVES = [
    Alternative("PowerSGD with Gram-Schmidt", "powersgd", POWERSGD_GRAM_SCHMIDT),
]
