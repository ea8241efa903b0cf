"""Assignment 3's cheats (each scores 0 on its part) and right answers written differently
(full marks). More are proven in tests/test_grading_gossip.py and
tests/test_grading_compression.py (the lectures' functions called)."""

from __future__ import annotations

from tests.cheats import Alternative, Cheat

PUSH_SUM_ALL_GATHER = '''
def push_sum_step(x, w, out_neighbors, in_neighbors):
    """Right numbers from an all-gather of every rank's x, w and out-degree."""
    p = world_size()
    mine = torch.cat([x.double(), w.double().reshape(1), torch.tensor([len(out_neighbors)])])
    everyone = [torch.empty_like(mine) for _ in range(p)]
    dist.all_gather(everyone, mine)
    new = mine[:-1] / (len(out_neighbors) + 1)
    for j in in_neighbors:
        new = new + everyone[j][:-1] / (everyone[j][-1] + 1)
    return new[:-1].to(x.dtype), new[-1].to(w.dtype).reshape(w.shape)
'''

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

CHEATS = [
    Cheat(
        "push-sum by all-gather", "push_sum_step", PUSH_SUM_ALL_GATHER, frozenset({"test_push_sum"})
    ),
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
    Alternative(
        "push-sum with x and w in two messages and batch_isend_irecv",
        "push_sum_step",
        """
def push_sum_step(x, w, out_neighbors, in_neighbors):
    share = 1.0 / (len(out_neighbors) + 1)
    sx, sw = x * share, (w * share).reshape(1)
    xs = [torch.empty_like(sx) for _ in in_neighbors]
    ws = [torch.empty_like(sw) for _ in in_neighbors]
    ops = [dist.P2POp(dist.isend, t, dst) for dst in out_neighbors for t in (sx, sw)]
    for src, bx, bw in zip(in_neighbors, xs, ws):
        ops += [dist.P2POp(dist.irecv, bx, src), dist.P2POp(dist.irecv, bw, src)]
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()
    return sx + sum(xs), (sw + sum(ws)).reshape(())
""",
    ),
    Alternative(
        "PowerSGD with Gram-Schmidt",
        "powersgd",
        """
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
""",
    ),
]
