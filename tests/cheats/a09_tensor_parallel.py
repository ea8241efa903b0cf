"""Assignment 9's cheats (each scores 0 on its part) and right answers written differently
(full marks). More are proven in tests/test_grading_tensor_parallel.py (a column layer
gathering from a full copy, a row layer that all-gathers instead of all-reducing, the lecture's
layers), to keep the graded notebooks few."""

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
        return tp_lecture.ParallelSelfAttention(attn)
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
]
