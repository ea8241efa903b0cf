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
    check_vocab_parallel_cross_entropy,
)
from course_lib.grading.tensor_parallel import (
    Case,
    assemble,
    dense_layer,
    expected_shards,
    head_rows,
)
from course_lib.grading.tensor_parallel_loss import (
    NUMBERS_PER_TOKEN,
    VOCAB,
    budget_bytes,
    draw_loss,
    gathered_logits_bytes,
    loss_cases,
)
from tests.adapters import mutant, planted, solution
from tests.cheats.a09_tensor_parallel import (
    LECTURE_LOSS,
    LOSS_COUNTERS_EMPTIED,
    LOSS_FROM_THE_CALLERS_FRAME,
    LOSS_IN_PLACE_ON_COPIES,
    LOSS_INNER_GROUP,
    LOSS_ONE_ALL_GATHER,
    LOSS_SHIFTS_TARGETS,
    MLP_COPIED_INTO_LINEARS,
    MLP_FULL_COPY,
    MLP_INNER_GROUP_FORGED,
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


# --- Part 5 (open): the loss without the full logits ---------------------------------------

vocab_loss = A09.vocab_parallel_cross_entropy


class ThreeAllReducesLoss(torch.autograd.Function):
    """Right, in another style: an autograd function with three all-reduces (maximum, sum of
    exponentials, target logit) and a backward without communication."""

    @staticmethod
    def forward(ctx, logits, targets):
        width = logits.shape[1]
        first = rank() * width
        top = logits.max(dim=1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        probs = (logits - top[:, None]).exp()
        total = probs.sum(dim=1)
        dist.all_reduce(total)
        probs /= total[:, None]
        owned = (targets >= first) & (targets < first + width)
        index = torch.where(owned, targets - first, 0)
        target = torch.where(owned, logits[torch.arange(len(targets)), index] - top, 0.0)
        dist.all_reduce(target)
        ctx.save_for_backward(probs, index, owned)
        return (total.log() - target).mean()

    @staticmethod
    def backward(ctx, grad):
        probs, index, owned = ctx.saved_tensors
        grad_logits = probs.clone()
        rows = torch.arange(len(index))[owned]
        grad_logits[rows, index[owned]] -= 1.0
        return grad_logits * grad / len(index), None


def loss_three_all_reduces(local_logits, targets):
    return ThreeAllReducesLoss.apply(local_logits, targets)


loss_one_all_gather = planted("tensor_parallel", "vocab_loss", LOSS_ONE_ALL_GATHER)
loss_lecture = planted("tensor_parallel", "vocab_loss", LECTURE_LOSS)


def loss_gathering_the_logits(local_logits, targets):
    """Right numbers, over the byte budget: every rank gathers the whole logits."""
    return F.cross_entropy(GatherFromParallel.apply(local_logits), targets)


# Right on ordinary logits, inf or nan near 1000: exp() of the logits as they are.
loss_without_max = mutant(
    "tensor_parallel",
    "vocab_loss",
    ("shifted = local_logits - top[:, None]", "shifted = local_logits"),
).vocab_parallel_cross_entropy
# Each rank subtracts its own maximum and the ranks add up sums taken at different shifts.
loss_local_max = mutant(
    "tensor_parallel", "vocab_loss", ("dist.all_reduce(top, op=dist.ReduceOp.MAX)", "pass")
).vocab_parallel_cross_entropy
# The sum over the tokens instead of the mean.
loss_summed = mutant(
    "tensor_parallel",
    "vocab_loss",
    ("return (sums[0].log() - sums[1]).mean()", "return (sums[0].log() - sums[1]).sum()"),
).vocab_parallel_cross_entropy


def test_the_budget_lets_statistics_through_and_stops_the_logits():
    # 12 float64 numbers per token; the gathered logits, (P-1) V/P per token, exceed it on
    # every world size the check runs, with V = 96.
    assert budget_bytes(10) == NUMBERS_PER_TOKEN * 10 * 8 == 960
    assert gathered_logits_bytes(10, VOCAB, 2) == 48 * 10 * 8
    for P in (2, 3, 4):
        assert gathered_logits_bytes(10, VOCAB, P) > budget_bytes(10)
        three_all_reduces = 3 * 2 * (P - 1) / P  # numbers per token, ring all-reduce
        one_all_gather_of_triples = 3 * (P - 1)
        assert max(three_all_reduces, one_all_gather_of_triples) <= NUMBERS_PER_TOKEN


def test_the_large_logits_case_overflows_a_naive_exp():
    # Without a maximum subtracted, exp() is inf in float64; torch's reference stays finite.
    case = next(c for c in loss_cases(0) if c.offset)
    logits, targets = draw_loss(case, 12345, 4)
    assert logits.shape == (case.tokens, VOCAB) and torch.exp(logits).isinf().any()
    assert torch.isfinite(F.cross_entropy(logits, targets))


# Right numbers, but the arguments changed in place: the targets shifted to this rank's
# columns (the cheat's text); the logits shifted by their maximum under no_grad; the same
# through a detached view (detach() shares the logits' memory).
loss_shifts_targets = planted(
    "tensor_parallel", "vocab_loss", LOSS_SHIFTS_TARGETS
).vocab_parallel_cross_entropy
loss_shifts_logits = mutant(
    "tensor_parallel",
    "vocab_loss",
    (
        "shifted = local_logits - top[:, None]",
        "with torch.no_grad():\n        local_logits -= top[:, None]\n    shifted = local_logits",
    ),
).vocab_parallel_cross_entropy
loss_shifts_a_detached_view = mutant(
    "tensor_parallel",
    "vocab_loss",
    (
        "top = local_logits.max(dim=-1).values",
        "top = local_logits.max(dim=-1).values\n"
        "        view = local_logits.detach()\n"
        "        view -= view.max(dim=-1, keepdim=True).values",
    ),
).vocab_parallel_cross_entropy
# No messages: the whole logits from the check's frames (the cheat's text).
loss_from_the_callers_frame = planted(
    "tensor_parallel", "vocab_loss", LOSS_FROM_THE_CALLERS_FRAME
).vocab_parallel_cross_entropy
# Right: in-place arithmetic on copies of its own (the alternative's text).
loss_in_place_on_copies = planted(
    "tensor_parallel", "vocab_loss", LOSS_IN_PLACE_ON_COPIES
).vocab_parallel_cross_entropy


def test_vocab_loss_accepts_the_solution(capsys):
    check_vocab_parallel_cross_entropy(vocab_loss, world_sizes=(1, 2, 3, 4))
    out = capsys.readouterr().out
    assert out.startswith("check_vocab_parallel_cross_entropy: passed. Verified 3 cases"), out
    assert "at most 4.5 numbers per token (budget 12)" in out  # 2 all-reduces, 3 numbers


@pytest.mark.parametrize(
    "fn",
    [
        loss_three_all_reduces,
        loss_one_all_gather.vocab_parallel_cross_entropy,
        loss_in_place_on_copies,
    ],
)
def test_vocab_loss_accepts_other_designs(fn):
    check_vocab_parallel_cross_entropy(fn, world_sizes=(2, 3), seeds=(0, 1))


@pytest.mark.parametrize(
    "fn, message",
    [
        (loss_gathering_the_logits, "Gathering the logits would send"),  # the byte budget
        (loss_without_max, "exp() of a logit above 709 is inf"),  # the large-logit case
        (loss_local_max, "against F.cross_entropy on the whole logits"),  # the loss
        (loss_summed, "the loss is the mean over the tokens"),  # the loss
        (loss_lecture.vocab_parallel_cross_entropy, "course_lib.tensor_parallel."),
        (loss_shifts_targets, "changed targets in place (24 of 24 entries differ after the call)"),
        (loss_shifts_logits, "changed local_logits in place"),
        (loss_shifts_a_detached_view, "changed local_logits in place"),
        (loss_from_the_callers_frame, "against F.cross_entropy on the whole logits"),
    ],
)
def test_vocab_loss_rejects(fn, message):
    with pytest.raises(CheckFailed) as info:
        check_vocab_parallel_cross_entropy(fn, timeout=15)
    assert str(info.value).startswith("check_vocab_parallel_cross_entropy: ")
    assert message in str(info.value)
    assert info.value.score == 0


def test_vocab_loss_over_budget_is_only_the_bytes():
    # Right numbers, so only the measurement fails, and the part scores 0 all the same.
    with pytest.raises(CheckFailed) as info:
        check_vocab_parallel_cross_entropy(loss_gathering_the_logits, world_sizes=(4,))
    assert info.value.failed == {"bytes"} and info.value.score == 0
    assert f"at most {budget_bytes(24):,} allowed" in str(info.value)


# --- what a verdict trusts: nothing computed, drawn or counted on the ranks ---------------

# Right numbers; its forward all-gathers the partial outputs with the rank's counters emptied
# around the call, and makes an all-reduce of nothing for the counters to see.
RowAllGatherHidden = planted(
    "tensor_parallel",
    "row_parallel",
    """
import course_lib.comm as comm


class RowParallelLinear(nn.Module):
    def __init__(self, linear):
        super().__init__()
        n, P, r = linear.in_features, world_size(), rank()
        self.weight = nn.Parameter(linear.weight.detach()[:, r * n // P : (r + 1) * n // P].clone())
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        partial = F.linear(x, self.weight)
        pieces = [torch.empty_like(partial) for _ in range(world_size())]
        counters = list(comm._active)
        comm._active.clear()
        try:
            dist.all_gather(pieces, partial.detach())
        finally:
            comm._active.extend(counters)
        dist.all_reduce(torch.zeros(1, dtype=x.dtype))
        total = sum(pieces) - partial.detach() + partial  # this rank's part in autograd
        return total if self.bias is None else total + self.bias
""",
).RowParallelLinear
MLPInnerGroupForged = planted("tensor_parallel", "parallel_mlp", MLP_INNER_GROUP_FORGED).ParallelMLP
loss_counters_emptied = planted(
    "tensor_parallel", "vocab_loss", LOSS_COUNTERS_EMPTIED
).vocab_parallel_cross_entropy
loss_inner_group = planted(
    "tensor_parallel", "vocab_loss", LOSS_INNER_GROUP
).vocab_parallel_cross_entropy


def test_layer_calls_hidden_from_the_ranks_counters_are_still_judged():
    # The launcher saw the all-gather: right numbers, Megatron's calls not, half the points.
    with pytest.raises(CheckFailed) as info:
        check_row_parallel_linear(RowAllGatherHidden, world_sizes=(2,), timeout=15)
    assert info.value.failed == {"communication"} and info.value.score == 0.5
    assert "forward pass made these collective calls: {'all_gather': 1, 'all_reduce': 1}" in str(
        info.value
    )


def test_layer_calls_on_the_inner_group_with_forged_counters_score_zero():
    # No call reported, bytes on the sockets all the same: tampering, the part scores 0.
    with pytest.raises(CheckFailed) as info:
        check_parallel_mlp(MLPInnerGroupForged, world_sizes=(2,), timeout=15)
    assert info.value.tampering and info.value.score == 0
    assert "none of its send/recv calls account for" in str(info.value)


@pytest.mark.parametrize(
    "fn, message",
    [
        (loss_counters_emptied, "Gathering the logits would send"),
        (loss_inner_group, "none of its send/recv calls account for"),
    ],
)
def test_loss_bytes_hidden_from_the_ranks_counters_are_still_judged(fn, message):
    with pytest.raises(CheckFailed) as info:
        check_vocab_parallel_cross_entropy(fn, world_sizes=(2,), timeout=15)
    assert message in str(info.value) and info.value.score == 0


class ColumnLooksForOthersShards(ColumnParallelLinear):
    """Right, and it refuses to run if any other rank's weights are within its reach: on its
    dense layer, or anywhere on its rank's heap (a tensor shaped like the dense weight with
    rows outside this rank's block that are not zero)."""

    def __init__(self, linear, gather_output=False):
        import gc

        super().__init__(linear, gather_output)
        rows = self.weight.shape[0]
        mine = slice(rank() * rows, (rank() + 1) * rows)
        for obj in [linear.weight, *gc.get_objects()]:
            if isinstance(obj, torch.Tensor) and obj.shape == linear.weight.shape:
                others = obj.detach().clone()
                others[mine] = 0
                if others.any():
                    raise ValueError("another rank's rows of the dense weight are on this rank")


def test_a_rank_holds_only_its_own_shard_of_the_weights():
    check_column_parallel_linear(ColumnLooksForOthersShards, world_sizes=(2, 4), timeout=30)


def test_every_call_draws_new_weights_and_inputs():
    # Two calls of the same case share no weights: they come from a secret, new each time.
    from course_lib.grading._harness import new_secret
    from course_lib.grading.tensor_parallel_shards import draw

    case = Case("mlp", in_features=8, out_features=16)
    first, second = draw(case, new_secret(), 2), draw(case, new_secret(), 2)
    assert not torch.equal(first.params["fc.weight"], second.params["fc.weight"])
    assert not torch.equal(first.x, second.x)
