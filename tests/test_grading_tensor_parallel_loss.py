"""Assignment 9's Part 5 check: the vocabulary-parallel loss, right designs accepted, wrong
numbers, changed arguments and gathered logits rejected."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import rank
from course_lib.grading import (
    CheckFailed,
    check_vocab_parallel_cross_entropy,
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
    LOSS_FROM_THE_CALLERS_FRAME,
    LOSS_IN_PLACE_ON_COPIES,
    LOSS_ONE_ALL_GATHER,
    LOSS_SHIFTS_TARGETS,
)

A09 = solution("tensor_parallel")
GatherFromParallel = A09.GatherFromParallel


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
