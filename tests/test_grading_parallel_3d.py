"""The capstone's 2-D (DP x TP) training check (Part 2) accepts right training and rejects
wrong ones, and trusts nothing a rank keeps. The grid is in test_grading_parallel_3d_grid.py,
Part 4 in test_grading_parallel_3d_zero.py."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib import tensor_parallel as tpl
from course_lib.grading import CheckFailed, check_2d_training
from course_lib.runtime import world_size
from tests.adapters import mutant, planted, solution
from tests.cheats import a10_parallel_3d as cheats

# --- right implementations ----------------------------------------------------------------


A10 = solution("parallel_3d")
make_groups, GPT2D, train_step = A10.make_groups, A10.GPT2D, A10.train_step
# Right, in another style (an alternative in tests/cheats): one flat all-reduce with
# ReduceOp.AVG, and the loss all-reduced too, for logging, in the DP group.
train_step_flat_avg = planted("parallel_3d", "train_step", cheats.FLAT_AVG_TRAIN_STEP).train_step


# Tensor-parallel layers of one's own (Assignment 9 style), with a switch for the bug.
class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class OwnBlock(nn.Module):
    """A block with hand-written TP attention and MLP; `reduce_rows=False` is the bug."""

    reduce_rows = True

    def __init__(self, block, group):
        super().__init__()
        t, size = dist.get_rank(group), dist.get_world_size(group)
        self.group = group
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        self.attn, self.mlp = nn.Module(), nn.Module()
        self.heads = block.attn.n_heads // size
        d = block.attn.proj.in_features
        w, b = block.attn.qkv.weight.detach(), block.attn.qkv.bias.detach()
        rows = [torch.arange(i * d, (i + 1) * d).chunk(size)[t] for i in range(3)]
        rows = torch.cat(rows)
        self.attn.qkv = nn.Linear(d, len(rows), dtype=w.dtype)
        self.attn.qkv.weight.data, self.attn.qkv.bias.data = w[rows].clone(), b[rows].clone()
        self.attn.proj = self._row(block.attn.proj, t, size)
        fc = block.mlp.fc
        self.mlp.fc = nn.Linear(d, fc.out_features // size, dtype=w.dtype)
        self.mlp.fc.weight.data = fc.weight.detach().chunk(size, 0)[t].clone()
        self.mlp.fc.bias.data = fc.bias.detach().chunk(size, 0)[t].clone()
        self.mlp.proj = self._row(block.mlp.proj, t, size)

    @staticmethod
    def _row(linear, t, size):
        row = nn.Linear(linear.in_features // size, linear.out_features, dtype=linear.weight.dtype)
        row.weight.data = linear.weight.detach().chunk(size, 1)[t].clone()
        row.bias.data = linear.bias.detach().clone()
        return row

    def _row_out(self, linear, x):
        y = F.linear(x, linear.weight)
        y = _Reduce.apply(y, self.group) if self.reduce_rows else y
        return y + linear.bias

    def forward(self, x):
        b, s, _ = x.shape
        h = _Copy.apply(self.ln1(x), self.group)
        width = self.attn.qkv.out_features // 3
        q, k, v = self.attn.qkv(h).split(width, dim=-1)
        q, k, v = (z.view(b, s, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)
        out = (scores.masked_fill(mask, float("-inf")).softmax(-1) @ v).transpose(1, 2)
        x = x + self._row_out(self.attn.proj, out.reshape(b, s, width))
        h = F.gelu(self.mlp.fc(_Copy.apply(self.ln2(x), self.group)))
        return x + self._row_out(self.mlp.proj, h)


class GPT2DOwn(GPT2D):
    block = OwnBlock

    def __init__(self, model, tp_group, dp_group):
        nn.Module.__init__(self)
        self.embed, self.head = model.embed, model.head
        self.blocks = nn.ModuleList(self.block(b, tp_group) for b in model.blocks)


# --- wrong implementations ----------------------------------------------------------------


def make_groups_swapped(tp):
    tp_group, dp_group = make_groups(tp)
    return dp_group, tp_group


class NoRowReduceBlock(OwnBlock):
    reduce_rows = False


class GPT2DNoRowReduce(GPT2DOwn):
    block = NoRowReduceBlock


class GPT2DWorldTP(GPT2D):
    """Builds the TP layers on the default group (every rank) instead of the TP group."""

    def __init__(self, model, tp_group, dp_group):
        super().__init__(model, None, dp_group)


class GPT2DRenamed(nn.Module):
    """Right numbers, but the blocks are stored as `layers`: the shards cannot be found."""

    def __init__(self, model, tp_group, dp_group):
        super().__init__()
        self.embed, self.head = model.embed, model.head
        self.layers = nn.ModuleList(tpl.ParallelBlock(b, tp_group) for b in model.blocks)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.layers:
            x = block(x)
        return self.head(x)


# Named mutations of the solution's train_step: gradients averaged over the whole world (with
# the DP size's scale), summed and not averaged, not synchronised at all; every rank on the
# whole batch; shards chosen by the global rank instead of the DP rank.
SHARDS = "shard(x, dp_rank, dp_size), shard(y, dp_rank, dp_size)"
train_step_world = mutant(
    "parallel_3d",
    "train_step",
    ("dist.all_reduce(p.grad, group=dp_group)", "dist.all_reduce(p.grad)"),
    ("p.grad /= dp_size", "p.grad /= world_size()"),
).train_step
train_step_sum = mutant(
    "parallel_3d", "train_step", ("        p.grad /= dp_size", "        pass  #")
).train_step
train_step_no_sync = mutant(
    "parallel_3d",
    "train_step",
    (
        "    for p in model.parameters():\n        dist.all_reduce",
        "    for p in []:\n        dist.all_reduce",
    ),
).train_step
train_step_same_batch = mutant("parallel_3d", "train_step", (SHARDS, "x, y")).train_step
train_step_global_rank_shard = mutant(
    "parallel_3d",
    "train_step",
    (SHARDS, "shard(x, rank(), world_size()), shard(y, rank(), world_size())"),
).train_step


# A cheat: shows the model its shard, then trains every rank on the whole batch by calling
# forward directly (the check's hooks skipped): no DP all-reduce needed, if the whole batch
# were real.
train_step_whole_batch_unseen = planted(
    "parallel_3d", "train_step", cheats.WHOLE_BATCH_EVERYWHERE
).train_step


def not_implemented(*args, **kwargs):
    raise NotImplementedError()


def make_groups_from_planner(tp_size):
    """Right, but lecture 10's new_groups does the work."""
    from course_lib.parallel_3d import ProcessGrid, new_groups

    mine = new_groups(ProcessGrid(tp_size, 1, world_size() // tp_size))
    return mine["tp"], mine["dp"]


class _OneStageGrid:
    """What lecture 10's step_3d reads of a grid, for one pipeline stage."""

    pp = 1

    def __init__(self, dp: int) -> None:
        self.dp = dp

    def coords(self, rank: int) -> dict:
        return {"pp": 0}

    def group_of(self, rank: int, kind: str) -> list[int]:
        return [rank]


def train_step_lecture_3d(model, optimizer, x, y, dp_group):
    """Lecture 10's whole 3-D step, with one pipeline stage, does the work (a cheat)."""
    from course_lib.measure.parallel_3d import step_3d

    grid = _OneStageGrid(dist.get_world_size(dp_group))
    step_3d(model, x, y, 1, grid, {"dp": dp_group}, optimizer)


# --- 2-D training -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "impl, options",
    [
        ((make_groups, GPT2D, train_step), {}),
        ((make_groups, GPT2DOwn, train_step_flat_avg), {"seed": 2, "steps": 2}),
        ((make_groups, GPT2D, train_step), {"tp_size": 1}),  # DP only, 4 x 1
        ((make_groups, GPT2D, train_step_flat_avg), {"tp_size": 4}),  # TP only, 1 x 4
        ((make_groups, GPT2D, train_step), {"world_size": 2, "batch_size": 4}),
    ],
)
def test_2d_training_accepts_right_implementations(impl, options, capsys):
    check_2d_training(*impl, **options)
    assert capsys.readouterr().out.startswith("check_2d_training: passed. Verified ")


@pytest.mark.parametrize(
    "impl, message",
    [
        (
            (make_groups, GPT2D, train_step_world),
            "went over ranks [0, 1, 2, 3] (the default group, every rank)",
        ),
        ((make_groups_swapped, GPT2D, train_step), "they are swapped"),
        (
            (make_groups, GPT2D, train_step_sum),
            "the update is 2 (the DP size) times the full-batch one",
        ),
        ((make_groups, GPT2D, train_step_no_sync), "the update uses this DP rank's own"),
        ((make_groups, GPT2D, train_step_same_batch), "every rank's model saw the whole batch"),
        ((make_groups, GPT2D, train_step_global_rank_shard), "form a TP group but their"),
        ((make_groups, GPT2D, train_step_whole_batch_unseen), "after train_step, "),
        (
            (make_groups, GPT2DNoRowReduce, train_step),
            "forward made 0 collective calls in the TP group",
        ),
        (
            (make_groups, GPT2DWorldTP, train_step),
            "all_reduce in forward went over ranks [0, 1, 2, 3]",
        ),
        ((make_groups, GPT2DRenamed, train_step), "right after GPT2D(...), parameter names"),
        ((not_implemented, GPT2D, train_step), "raised NotImplementedError on rank "),
        ((make_groups_from_planner, GPT2D, train_step), "runs course_lib.parallel_3d."),
        (
            (make_groups, GPT2D, train_step_lecture_3d),
            "runs course_lib.measure.parallel_3d.step_3d",
        ),
    ],
)
def test_2d_training_rejects_wrong_implementations(impl, message):
    with pytest.raises(CheckFailed) as info:
        check_2d_training(*impl, timeout=20)
    assert str(info.value).startswith("check_2d_training: ")
    assert message in str(info.value)


def test_2d_training_failure_names_rank_step_and_tolerance():
    with pytest.raises(CheckFailed) as info:
        check_2d_training(make_groups, GPT2D, train_step_sum)
    text = str(info.value)
    where = "(DP x TP = 2 x 2, TinyGPT of secret weights, float64, SGD, batch of 8)"
    assert f"rank 0, step 0 {where}" in text
    assert "(allowed atol=1e-10 + rtol=1e-10 * |expected|)" in text


def test_bad_arguments_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="tp_size=3 must divide world_size=4"):
        check_2d_training(make_groups, GPT2D, train_step, tp_size=3)
    with pytest.raises(ValueError, match="must divide evenly over the DP groups"):
        check_2d_training(make_groups, GPT2D, train_step, batch_size=5)


def test_2d_training_trusts_no_batch_kept_on_a_rank():
    """The batches are drawn, and the reference trained, in the checking process: a rank
    that zeroes every batch it can find in its callers' frames (so that every DP group would
    train on the same rows and the DP all-reduce could go) changes only its own copy."""
    thief = planted("parallel_3d", "train_step", cheats.SAME_ROWS_EVERYWHERE).train_step
    with pytest.raises(CheckFailed) as info:
        check_2d_training(make_groups, GPT2D, thief)
    assert "rank 0, step 0 " in str(info.value)
    assert "after train_step" in str(info.value)


def test_2d_training_judges_groups_by_the_launchers_tallies():
    """A call the rank's code takes back out of the call log kept on the rank (in the check's
    frame) is still in the launcher's tallies, which decide the groups."""
    hidden = planted("parallel_3d", "train_step", cheats.WORLD_BEHIND_THE_LOG).train_step
    with pytest.raises(CheckFailed) as info:
        check_2d_training(make_groups, GPT2D, hidden)
    text = str(info.value)
    assert "rank 0, step 0 " in text
    assert "all_reduce went over ranks [0, 1, 2, 3] (the default group, every rank)" in text
