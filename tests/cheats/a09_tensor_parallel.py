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


LECTURE_LOSS = '''
import course_lib.tensor_parallel as tp_lecture


def vocab_parallel_cross_entropy(local_logits, targets):
    """The lecture's per-token loss, averaged."""
    return tp_lecture.vocab_parallel_cross_entropy(local_logits, targets).mean()
'''


# Part 5 in another design: one all-gather of each rank's (log-sum-exp of its block, target
# logit or 0) per token, then the whole log-sum-exp computed locally; plain autograd.
LOSS_ONE_ALL_GATHER = """
def vocab_parallel_cross_entropy(local_logits, targets):
    n, width = local_logits.shape
    first = rank() * width
    biggest = local_logits.detach().max(dim=-1).values  # this rank's own maximum only
    block_lse = biggest + (local_logits - biggest[:, None]).exp().sum(dim=-1).log()
    owned = (targets >= first) & (targets < first + width)
    index = torch.where(owned, targets - first, 0)
    target = torch.where(owned, local_logits.gather(1, index[:, None]).squeeze(1), 0.0)
    stats = torch.stack([block_lse.detach(), target.detach()], dim=1)  # (n, 2)
    everyone = torch.empty(world_size() * n, 2, dtype=stats.dtype)
    dist.all_gather_into_tensor(everyone, stats)
    everyone = everyone.view(world_size(), n, 2)
    lse = torch.logsumexp(everyone[..., 0], dim=0)
    # d lse / d block_lse = exp(block_lse - lse): the value from all ranks, the gradient of
    # this rank's own terms.
    weight = (block_lse.detach() - lse).exp()
    per_token = lse + weight * (block_lse - block_lse.detach())
    per_token = per_token - everyone[..., 1].sum(dim=0) - (target - target.detach())
    return per_token.mean()
"""


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
        "the lecture's vocabulary-parallel loss, averaged",
        "vocab_loss",
        LECTURE_LOSS,
        frozenset({"test_vocab_loss"}),
    ),
]

ALTERNATIVES = [
    Alternative(
        "loss from one all-gather of per-rank statistics", "vocab_loss", LOSS_ONE_ALL_GATHER
    ),
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
