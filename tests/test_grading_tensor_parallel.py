"""Assignment 9's tensor-parallel checks accept right implementations and reject wrong ones."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib import rank, world_size
from course_lib.grading import (
    CheckFailed,
    check_column_parallel_linear,
    check_parallel_attention,
    check_parallel_mlp,
    check_row_parallel_linear,
)
from course_lib.grading.tensor_parallel import (
    Case,
    assemble,
    dense_layer,
    expected_shards,
    head_rows,
)
from tests.adapters import planted, solution
from tests.cheats.a09_tensor_parallel import (
    MLP_COPIED_INTO_LINEARS,
    MLP_FULL_COPY,
    MLP_SHARD_VIEWS,
)

# --- right implementations: the solution notebook's, and attention written differently ----

A09 = solution("tensor_parallel")
CopyToParallel, ReduceFromParallel = A09.CopyToParallel, A09.ReduceFromParallel
GatherFromParallel = A09.GatherFromParallel
ColumnParallelLinear, RowParallelLinear = A09.ColumnParallelLinear, A09.RowParallelLinear
ParallelMLP, ParallelSelfAttention = A09.ParallelMLP, A09.ParallelSelfAttention


class AttentionColumnQKV(nn.Module):
    """Right, in another style: the dense q, k, v rows reordered so that this rank's heads form
    block r, taken by a column-parallel layer (no grader helper: answers may not call them)."""

    def __init__(self, attn):
        super().__init__()
        d_model = attn.qkv.in_features
        self.local_heads = attn.n_heads // world_size()
        # Reorder the dense rows so that this rank's q, k, v rows form block r.
        P = world_size()
        features = [torch.arange(r * d_model // P, (r + 1) * d_model // P) for r in range(P)]
        order = torch.cat([torch.cat([f, d_model + f, 2 * d_model + f]) for f in features])
        dense = nn.Linear(d_model, 3 * d_model, dtype=attn.qkv.weight.dtype)
        with torch.no_grad():
            dense.weight.copy_(attn.qkv.weight[order])
            dense.bias.copy_(attn.qkv.bias[order])
        self.qkv = ColumnParallelLinear(dense)
        self.proj = RowParallelLinear(attn.proj)

    def forward(self, x):
        batch, time, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        head_dim = q.shape[-1] // self.local_heads
        q, k, v = (
            t.view(batch, time, self.local_heads, head_dim).transpose(1, 2) for t in (q, k, v)
        )
        scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
        future = torch.ones(time, time, dtype=torch.bool).triu(1)
        out = scores.masked_fill(future, float("-inf")).softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(batch, time, -1))


class TorchSDPAAttention(AttentionColumnQKV):
    """Right, in another style: torch's scaled_dot_product_attention for the local heads."""

    def forward(self, x):
        batch, time, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.unflatten(-1, (self.local_heads, -1)).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).flatten(-2))


# --- wrong implementations ----------------------------------------------------------------


class ColumnNoBackwardAllReduce(ColumnParallelLinear):
    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        return GatherFromParallel.apply(y) if self.gather_output else y


class ColumnStridedShard(ColumnParallelLinear):
    def __init__(self, linear, gather_output=False):
        super().__init__(linear, gather_output)
        with torch.no_grad():
            self.weight = nn.Parameter(linear.weight[rank() :: world_size()].clone())


class ColumnGatherSumsGradient(ColumnParallelLinear):
    """The all-gather's backward all-reduces instead of taking its own block: P times."""

    def forward(self, x):
        y = F.linear(CopyToParallel.apply(x), self.weight, self.bias)
        if self.gather_output:
            y = GatherFromParallel.apply(y)
            return CopyToParallel.apply(y)
        return y


class RowBiasOnEveryRank(RowParallelLinear):
    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        return ReduceFromParallel.apply(y)


class RowNoAllReduce(RowParallelLinear):
    def forward(self, x):
        y = F.linear(x, self.weight)
        return y if self.bias is None else y + self.bias


class RowAllReduceInBackwardToo(RowParallelLinear):
    def forward(self, x):
        y = ReduceFromParallel.apply(F.linear(CopyToParallel.apply(x), self.weight))
        y = CopyToParallel.apply(y)
        return y if self.bias is None else y + self.bias


class MLPGatheredInTheMiddle(ParallelMLP):
    """Right numbers, but an all-gather between the layers and a dense second layer."""

    def __init__(self, block):
        super().__init__(block)
        self.fc = ColumnParallelLinear(block.fc, gather_output=True)

    def forward(self, x):
        h = F.gelu(self.fc(x))
        n = h.shape[-1] // world_size()
        return self.proj(h[..., rank() * n : (rank() + 1) * n])


class MLPNoBackwardAllReduce(ParallelMLP):
    def __init__(self, block):
        super().__init__(block)
        self.fc = ColumnNoBackwardAllReduce(block.fc)


class MLPBiasOnEveryRank(ParallelMLP):
    def __init__(self, block):
        super().__init__(block)
        self.proj = RowBiasOnEveryRank(block.proj)


class AttentionChunkedQKV(AttentionColumnQKV):
    """Heads split wrongly: block r of all 3*d rows, which mixes q, k and v."""

    def __init__(self, attn):
        super().__init__(attn)
        self.qkv = ColumnParallelLinear(attn.qkv)


class AttentionAllHeadsEverywhere(AttentionColumnQKV):
    """Every rank computes all heads' output for its block but forgets the local head count."""

    def forward(self, x):
        self.local_heads = self.local_heads * world_size()
        try:
            return super().forward(x)
        finally:
            self.local_heads //= world_size()


class AttentionBiasOnEveryRank(AttentionColumnQKV):
    def __init__(self, attn):
        super().__init__(attn)
        self.proj = RowBiasOnEveryRank(attn.proj)


def not_implemented(*args, **kwargs):
    raise NotImplementedError()


# --- cheats: right numbers without the work -----------------------------------------------


class ColumnFullCopy(ColumnParallelLinear):
    """gather_output=True without gathering: the other ranks' features come from a full copy
    of the dense weights kept on the side (a dummy all-gather looks like the real one); this
    rank's block is computed honestly, so the gradients are right."""

    def __init__(self, linear, gather_output=False):
        super().__init__(linear, gather_output)
        self.full = [linear.weight.detach().clone(), linear.bias]  # a list: not registered

    def forward(self, x):
        y = F.linear(CopyToParallel.apply(x), self.weight, self.bias)
        if not self.gather_output:
            return y
        GatherFromParallel.apply(torch.zeros(1, dtype=x.dtype))
        weight, bias = self.full
        full = F.linear(x.detach(), weight, None if bias is None else bias.detach())
        n = y.shape[-1]
        return torch.cat([full[..., : rank() * n], y, full[..., (rank() + 1) * n :]], dim=-1)


# The dense MLP, kept whole, computes the output; the shards get Megatron's local gradients
# through a path whose value is zero (the cheat's own text, planted in the solution).
MLPFullCopy = planted("tensor_parallel", "parallel_mlp", MLP_FULL_COPY).ParallelMLP
# Right numbers and calls, but the shards are views of the dense block (the cheat's text).
MLPShardViews = planted("tensor_parallel", "parallel_mlp", MLP_SHARD_VIEWS).ParallelMLP
# Right: fresh linear layers filled with copy_ (the alternative's text).
MLPCopiedIntoLinears = planted(
    "tensor_parallel", "parallel_mlp", MLP_COPIED_INTO_LINEARS
).ParallelMLP


class RowSharesTheBias(RowParallelLinear):
    """Right numbers and calls, but the bias is the dense layer's own Parameter, not a copy:
    backward writes the dense layer's .grad."""

    def __init__(self, linear):
        super().__init__(linear)
        self.bias = linear.bias


class ColumnLecture(nn.Module):
    """The lecture's layer behind the interface."""

    def __init__(self, linear, gather_output=False):
        super().__init__()
        import course_lib.tensor_parallel as lecture

        self.layer = lecture.ColumnParallelLinear(linear, gather_output=gather_output)
        self.weight, self.bias = self.layer.weight, self.layer.bias

    def forward(self, x):
        return self.layer(x)


class RowAllGatherThenLocal(RowParallelLinear):
    """Right numbers: gathers every rank's input block and the weight blocks, then computes
    the whole product locally (an all-gather where one all-reduce is asked)."""

    def forward(self, x):
        xs = GatherFromParallel.apply(x)
        weights = [torch.empty_like(self.weight) for _ in range(world_size())]
        dist.all_gather(weights, self.weight.detach().contiguous())
        weights[rank()] = self.weight
        return F.linear(xs, torch.cat(weights, dim=1), self.bias)


# --- tests --------------------------------------------------------------------------------


def test_shards_of_the_dense_layer_put_back_together_are_the_dense_layer():
    # The check's expected shards, concatenated over the ranks, give the dense tensors back.
    for kind in ("column", "row", "mlp", "attention"):
        case = Case(kind, in_features=16, out_features=24, n_heads=4)
        params = {n: p.detach() for n, p in dense_layer(case).named_parameters()}
        for P in (1, 2, 4):
            shards = [expected_shards(case, params, r, P) for r in range(P)]
            for name, full in params.items():
                parts = [s[name] for s in shards]
                if kind == "row" and name == "weight" or name == "proj.weight":
                    assert torch.equal(torch.cat(parts, dim=1), full), (kind, name, P)
                elif name in ("bias", "proj.bias") and kind != "column":
                    assert all(torch.equal(p, full) for p in parts), (kind, name, P)
                elif name.startswith("qkv"):
                    order = torch.cat([head_rows(16, r, P) for r in range(P)])
                    assert torch.equal(torch.cat(parts), full[order]), (kind, name, P)
                    assert sorted(order.tolist()) == list(range(48))
                else:
                    assert torch.equal(torch.cat(parts), full), (kind, name, P)


def test_assemble_writes_each_ranks_shard_back_in_its_place():
    # The inverse of expected_shards: nudged shards land where they came from, nothing else.
    for kind in ("column", "row", "mlp", "attention"):
        case = Case(kind, in_features=16, out_features=24, n_heads=4)
        params = {n: p.detach() for n, p in dense_layer(case).named_parameters()}
        for P in (1, 2, 4):
            shards = [expected_shards(case, params, r, P) for r in range(P)]
            back = assemble(case, params, shards)
            assert all(torch.equal(back[n], params[n]) for n in params), (kind, P)
            nudged = [{n: t + 1 for n, t in shard.items()} for shard in shards]
            moved = assemble(case, params, nudged)
            assert all(torch.equal(moved[n], params[n] + 1) for n in params), (kind, P)


def test_head_rows_are_the_q_k_v_rows_of_the_ranks_heads():
    # d_model 8, 4 heads of 2 on 2 ranks: rank 1 owns heads 2, 3 = features 4..7 of q, k, v.
    assert head_rows(8, 1, 2).tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]


def test_column_parallel_linear_accepts_a_right_implementation(capsys):
    check_column_parallel_linear(ColumnParallelLinear, seeds=(0, 1))
    assert capsys.readouterr().out.startswith(
        "check_column_parallel_linear: passed. Verified 6 column-parallel linear case(s) on "
        "1, 2, 4 rank(s)"
    )


def test_row_parallel_linear_accepts_a_right_implementation():
    check_row_parallel_linear(RowParallelLinear, seeds=(0, 1))


@pytest.mark.parametrize("cls", [ParallelMLP, MLPCopiedIntoLinears])
def test_parallel_mlp_accepts_right_implementations(cls):
    check_parallel_mlp(cls, seeds=(0, 1))


@pytest.mark.parametrize("cls", [ParallelSelfAttention, AttentionColumnQKV, TorchSDPAAttention])
def test_parallel_attention_accepts_right_implementations(cls):
    check_parallel_attention(cls, seeds=(0, 1))


@pytest.mark.parametrize(
    "check, cls, message",
    [
        (
            check_column_parallel_linear,
            ColumnNoBackwardAllReduce,
            "all-reduces the gradient in backward",
        ),
        (check_column_parallel_linear, ColumnStridedShard, "it holds every P-th row"),
        (check_column_parallel_linear, ColumnGatherSumsGradient, "gather_output=True"),
        (check_column_parallel_linear, not_implemented, "raised NotImplementedError"),
        (check_row_parallel_linear, RowBiasOnEveryRank, "extra copies of the bias"),
        (check_row_parallel_linear, RowNoAllReduce, "summed with one all-reduce in forward"),
        (check_row_parallel_linear, RowAllReduceInBackwardToo, "the input's gradient differs"),
        (check_parallel_mlp, MLPNoBackwardAllReduce, "all-reduces the gradient in backward"),
        (check_parallel_mlp, MLPBiasOnEveryRank, "extra copies of the bias"),
        (check_parallel_mlp, MLPGatheredInTheMiddle, "'all_gather': 1"),
        (check_parallel_attention, AttentionChunkedQKV, "mixes queries, keys and values"),
        (check_parallel_attention, AttentionAllHeadsEverywhere, "forward output differs"),
        (check_parallel_attention, AttentionBiasOnEveryRank, "extra copies of the bias"),
        (check_column_parallel_linear, ColumnFullCopy, "the forward output differs"),
        (check_parallel_mlp, MLPFullCopy, "after the check changed the shards"),
        (check_column_parallel_linear, ColumnLecture, "course_lib.tensor_parallel."),
        (check_row_parallel_linear, RowAllGatherThenLocal, "expected {'all_reduce': 1}"),
        (check_parallel_mlp, MLPShardViews, "the dense layer your layer was built from changed"),
        (check_row_parallel_linear, RowSharesTheBias, "the dense layer's bias got a gradient"),
    ],
)
def test_checks_reject_wrong_implementations(check, cls, message):
    with pytest.raises(CheckFailed) as info:
        check(cls, timeout=15)
    assert str(info.value).startswith(check.__name__ + ": ")
    assert message in str(info.value)


@pytest.mark.parametrize(
    "check, cls",
    [
        (check_row_parallel_linear, RowAllGatherThenLocal),
        (check_parallel_mlp, MLPGatheredInTheMiddle),
    ],
)
def test_right_numbers_with_other_collectives_earn_half(check, cls):
    with pytest.raises(CheckFailed) as info:
        check(cls)
    assert info.value.failed == {"communication"} and info.value.score == 0.5
    assert "Partial credit: result passed (50%), communication failed (50%)" in str(info.value)


def test_a_failure_names_rank_layer_and_tolerance():
    with pytest.raises(CheckFailed) as info:
        check_row_parallel_linear(RowBiasOnEveryRank)
    text = str(info.value)
    assert "rank 0 (nn.Linear(12, 8), seed 0, input (3, 5, 12), on 2 rank(s))" in text
    assert "(allowed atol=1e-10 + rtol=1e-10 * |expected|)" in text


def test_one_rank_needs_no_communication_but_two_do():
    # On one rank every collective is the identity: the bugs show only from 2 ranks on.
    check_column_parallel_linear(ColumnNoBackwardAllReduce, world_sizes=(1,))
    with pytest.raises(CheckFailed, match="on 2 rank"):
        check_column_parallel_linear(ColumnNoBackwardAllReduce, world_sizes=(2,))


def test_bad_world_size_is_refused():
    with pytest.raises(ValueError, match="use 1, 2 or 4"):
        check_parallel_mlp(ParallelMLP, world_sizes=(3,))
