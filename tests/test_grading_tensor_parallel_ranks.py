"""What Assignment 9's ranks hold and count (grading/tensor_parallel_ranks.py): the checks
trust nothing computed, drawn or counted on the ranks. Each rank holds only its shard, the
weights and inputs are new at every call, and the calls and bytes are the launcher's (and
the kernel's), not counters on the rank that its code can empty or forge. Each test here
fails on checks that counted on the ranks."""

from __future__ import annotations

import pytest
import torch

from course_lib import rank
from course_lib.grading import (
    CheckFailed,
    check_column_parallel_linear,
    check_parallel_mlp,
    check_row_parallel_linear,
    check_vocab_parallel_cross_entropy,
)
from course_lib.grading.tensor_parallel import Case
from tests.adapters import planted, solution
from tests.cheats.a09_tensor_parallel import (
    LOSS_COUNTERS_EMPTIED,
    LOSS_INNER_GROUP,
    MLP_INNER_GROUP_FORGED,
)

A09 = solution("tensor_parallel")
ColumnParallelLinear = A09.ColumnParallelLinear


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
