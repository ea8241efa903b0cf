"""Assignment 5's cheats (each scores 0 on its part) and right answers written differently
(full marks). More are proven in tests/test_grading_tensor_parallel.py and
tests/test_grading_pipeline.py (a column layer gathering from a full copy, a row layer that
all-gathers instead of all-reducing, the lecture's layers and partition), to keep the graded
notebooks few."""

from __future__ import annotations

from tests.cheats import Alternative, Cheat

MLP_FULL_COPY = '''
class ParallelMLP(nn.Module):
    """The dense MLP, kept whole, computes the output; the shards get Megatron's local
    gradients through a path whose value is zero; all-reduces of zeros look like Megatron's."""

    def __init__(self, block):
        super().__init__()
        self.fc = ColumnParallelLinear(block.fc)
        self.proj = RowParallelLinear(block.proj)
        self.dense = [block]  # in a list: not registered, not a parameter

    def forward(self, x):
        fc, proj = self.fc, self.proj
        local = F.linear(F.gelu(F.linear(x.detach(), fc.weight, fc.bias)), proj.weight)
        local = local + proj.bias
        dummy = CopyToParallel.apply(torch.zeros_like(x, requires_grad=True))
        out = self.dense[0](x + dummy)
        out = out + ReduceFromParallel.apply(torch.zeros_like(out)).detach()
        return out + (local - local.detach())
'''

LECTURE_ATTENTION = '''
import course_lib.tensor_parallel as tp_lecture


class ParallelSelfAttention(nn.Module):
    """The lecture's layer, handed over as this one."""

    def __new__(cls, attn):
        return tp_lecture.ParallelSelfAttention.from_dense(attn)
'''

LECTURE_PIPELINE = '''
from course_lib import pipeline as lecture


def pipeline_step(stage, inputs, targets, loss_fn, n_micro, schedule):
    """The lecture's trainer; only the loss is taken from what it returns."""
    log = lecture.pipeline_step(stage, inputs, targets, loss_fn, n_micro, schedule)
    return getattr(log, "loss", None)
'''

EXHAUSTIVE_PARTITION = '''
import itertools


def optimal_partition(layer_times, activation_sizes, n_machines, bandwidth=1.0, weight_sizes=None):
    """Right, but exponential: every cut and every split of the machines."""
    n = len(layer_times)
    weights = weight_sizes if weight_sizes is not None else [0.0] * n

    def stage_time(i, j, machines):
        sync = sum(2 * w / bandwidth for w in weights[i:j]) if machines > 1 else 0.0
        return max(sum(layer_times[i:j]), sync) / machines

    best = (float("inf"), None)
    for s in range(1, min(n, n_machines) + 1):
        for cuts in itertools.combinations(range(1, n), s - 1):
            bounds = (0, *cuts, n)
            for split in itertools.combinations(range(1, n_machines), s - 1):
                counts = [b - a for a, b in zip((0, *split), (*split, n_machines))]
                stages = [(bounds[t], bounds[t + 1], counts[t]) for t in range(s)]
                links = [2 * activation_sizes[b - 1] / bandwidth for _, b, _ in stages[:-1]]
                slowest = max([stage_time(*st) for st in stages] + links)
                if slowest < best[0]:
                    best = (slowest, stages)
    return best
'''

CHEATS = [
    Cheat(
        "MLP computed from a full copy",
        "parallel_mlp",
        MLP_FULL_COPY,
        frozenset({"test_parallel_mlp"}),
    ),
    Cheat(
        "the lecture's attention layer",
        "parallel_attention",
        LECTURE_ATTENTION,
        frozenset({"test_parallel_attention"}),
    ),
    Cheat(
        "the lecture's pipeline trainer",
        "pipeline_step",
        LECTURE_PIPELINE,
        frozenset({"test_gpipe", "test_1f1b"}),
    ),
    Cheat(
        "exponential search for the partition",
        "optimal_partition",
        EXHAUSTIVE_PARTITION,
        frozenset({"test_optimal_partition"}),
    ),
]

ALTERNATIVES = [
    Alternative(
        "row-parallel with its own autograd function and torch.matmul",
        "row_parallel",
        """
class _SumOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial):
        total = partial.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


class RowParallelLinear(nn.Module):
    def __init__(self, linear):
        super().__init__()
        n, P, r = linear.in_features, world_size(), rank()
        start, stop = r * n // P, (r + 1) * n // P
        self.weight = nn.Parameter(linear.weight.detach()[:, start:stop].clone())
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        y = _SumOverRanks.apply(torch.matmul(x, self.weight.t()))
        if self.bias is not None:
            y = y + self.bias
        return y
""",
    ),
    Alternative(
        "partition by memoized recursion",
        "optimal_partition",
        '''
from functools import lru_cache


def optimal_partition(layer_times, activation_sizes, n_machines, bandwidth=1.0, weight_sizes=None):
    n = len(layer_times)
    weights = list(weight_sizes) if weight_sizes is not None else [0.0] * n
    prefix_t, prefix_w = [0.0], [0.0]
    for t, w in zip(layer_times, weights):
        prefix_t.append(prefix_t[-1] + t)
        prefix_w.append(prefix_w[-1] + 2 * w / bandwidth)

    def stage(i, j, k):
        sync = sum(2 * w / bandwidth for w in weights[i:j]) if k > 1 else 0.0
        return max(sum(layer_times[i:j]), sync) / k

    @lru_cache(maxsize=None)
    def best(j, m):
        """(time, stages) for layers 0..j-1 on exactly m machines."""
        choice = (stage(0, j, m), ((0, j, m),))
        for i in range(1, j):
            for k in range(1, m):
                before, stages = best(i, m - k)
                slowest = max(before, 2 * activation_sizes[i - 1] / bandwidth, stage(i, j, k))
                if slowest < choice[0]:
                    choice = (slowest, (*stages, (i, j, k)))
        return choice

    time, stages = best(n, n_machines)
    return time, list(stages)
''',
    ),
]
