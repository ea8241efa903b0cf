"""Assignment 3's checks accept right implementations and reject wrong ones, with the hint
and the partial credit each mistake deserves."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn

import course_lib.data_parallel as lecture
from course_lib import rank, world_size
from course_lib.grading import CheckFailed, check_ddp, check_sync_gradients
from course_lib.grading.data_parallel import (
    FORBIDDEN,
    DDPRun,
    buckets,
    shard_sizes,
)
from course_lib.grading.provenance import Provenance
from tests.adapters import planted, solution
from tests.cheats import a03_data_parallel as cheats

# --- sync_gradients -----------------------------------------------------------------------


A03 = solution("data_parallel")
sync_gradients = A03.sync_gradients


def sync_cheat(source):
    """The `sync_gradients` a notebook holding tests/cheats' `source` would define."""
    return planted("data_parallel", "sync_gradients", source).sync_gradients


# Right, in other styles: one flat all-reduce with the count appended, through a name bound
# at import; the counts by all-gather, the gradients through the group object.
sync_gradients_flat = sync_cheat(cheats.ONE_FLAT_ALL_REDUCE)
sync_gradients_gathered_counts = sync_cheat(cheats.GATHERED_COUNTS)
# Cheats: the lecture's allreduce_gradients after weighting; the gradient recomputed from
# the samples found up the stack, without communicating (they are this rank's own only).
sync_with_lecture_code = sync_cheat(cheats.LECTURE_HELPER_WRAPPED)
sync_from_the_stack = sync_cheat(cheats.WHOLE_BATCH_ON_EVERY_RANK)


# Right, in other styles: send and recv only, through rank 0 (the kernel's count of the
# sockets' bytes must agree with the calls reported); every gradient all-gathered and averaged
# in float64.
sync_send_recv = sync_cheat(cheats.SEND_RECV_ONLY)
sync_gathered_in_float64 = sync_cheat(cheats.GATHERED_IN_FLOAT64)
# Cheats at what a rank holds, counts or runs (issue 28): the gradient of every sample in the
# frames and on the heap (the rank's own only), a zero all-reduced for show; the samples
# gathered and the grader's own reference loss run on them; torch's DDP constructed once.
sync_frames_and_heap = sync_cheat(cheats.FRAMES_AND_HEAP)
sync_graders_reference_loss = sync_cheat(cheats.GRADERS_REFERENCE_LOSS)
sync_torch_ddp = sync_cheat(cheats.TORCH_DDP_IN_SYNC)


def sync_weights_in_float32(model, num_samples):
    """Right in float32; in float64 its float32 weight rounds the gradient."""
    total = torch.tensor(float(num_samples))
    dist.all_reduce(total)
    for p in model.parameters():
        if p.grad is not None:
            p.grad *= num_samples / total
            dist.all_reduce(p.grad)


def sync_plain_average(model, num_samples):
    """The lecture's rule: right for equal shards only."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world_size()


def sync_weighted_sum(model, num_samples):
    for p in model.parameters():
        if p.grad is not None:
            p.grad *= num_samples
            dist.all_reduce(p.grad)


def sync_sum(model, num_samples):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def sync_rank0_only(model, num_samples):
    total = torch.tensor(float(num_samples))
    dist.all_reduce(total)
    for p in model.parameters():
        if p.grad is not None:
            p.grad *= num_samples
            dist.all_reduce(p.grad)
            if rank() == 0:
                p.grad /= total


def sync_nothing(model, num_samples):
    pass


def sync_no_none_check(model, num_samples):
    for p in model.parameters():
        dist.all_reduce(p.grad)


_first_total = {}


def sync_total_of_first_step(model, num_samples):
    """Learns the total once and keeps it; the shards change sizes every step."""
    if "total" not in _first_total:
        total = torch.tensor(float(num_samples))
        dist.all_reduce(total)
        _first_total["total"] = total
    for p in model.parameters():
        if p.grad is not None:
            p.grad *= num_samples / _first_total["total"]
            dist.all_reduce(p.grad)


def sync_with_pasted_lecture_code(model, num_samples):
    """Weights right, then the lecture's allreduce_gradients pasted under another name (made
    from its source on the rank)."""
    source = inspect.getsource(lecture.allreduce_gradients)
    source = source.replace("def allreduce_gradients", "def average_gradients")
    # the globals of the file that defines it (course_lib.data_parallel is a package)
    namespace = dict(vars(inspect.getmodule(lecture.allreduce_gradients)))
    exec(source, namespace)  # noqa: S102
    total = torch.tensor(num_samples)
    dist.all_reduce(total)
    for p in model.parameters():
        if p.grad is not None:
            p.grad *= num_samples * world_size() / total.item()
    namespace["average_gradients"](model)


def sync_then_round(model, num_samples):
    """Right up to rounding within the stated atol (1e-6): AdamW magnifies such differences
    into whole steps where a gradient is near 0, which must not cost a right answer."""
    sync_gradients(model, num_samples)
    for p in model.parameters():
        if p.grad is not None:
            p.grad += 5e-7


def sync_then_nudge_weights(model, num_samples):
    sync_gradients(model, num_samples)
    with torch.no_grad():
        for p in model.parameters():
            p += 1e-4


def not_implemented(*args, **kwargs):
    raise NotImplementedError()


@pytest.mark.parametrize(
    "fn", [sync_gradients, sync_gradients_flat, sync_gradients_gathered_counts]
)
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"world_size": 1},
        {"world_size": 3, "batch_size": 10, "seed": 2},
        {"world_size": 2, "dtype": torch.float64, "seed": 5},
    ],
)
def test_sync_gradients_accepts_right_implementations(fn, options, capsys):
    check_sync_gradients(fn, **options)
    out = capsys.readouterr().out
    assert out.startswith("check_sync_gradients: passed. Verified 4 training run(s)")


@pytest.mark.parametrize(
    "fn, message",
    [
        (sync_plain_average, "it is the plain average of the ranks' gradients"),
        (sync_weighted_sum, "it is sum_r n_r g_r: divide it by the total number of samples"),
        (sync_sum, "it is the sum of the ranks' gradients"),
        (sync_rank0_only, "rank 1, step 0"),
        (sync_nothing, "no collective call was seen during the step; it is still this rank's"),
        (sync_from_the_stack, "no collective call was seen during the step"),
        # torch's own error for a None tensor (on any rank: all fail at once)
        (sync_no_none_check, "raised TypeError on rank "),
        (sync_total_of_first_step, ", step 2 ("),
        (sync_with_lecture_code, "runs course_lib.data_parallel.allreduce_gradients"),
        (sync_with_pasted_lecture_code, "runs course_lib.data_parallel.allreduce_gradients"),
        (not_implemented, "raised NotImplementedError"),
        (sync_frames_and_heap, "differs from the full-batch gradient"),
        (sync_graders_reference_loss, "runs course_lib.grading.data_parallel_runs.per_sample_loss"),
        (sync_torch_ddp, "runs torch.nn.parallel.DistributedDataParallel, PyTorch's own"),
    ],
)
def test_sync_gradients_rejects_wrong_implementations(fn, message):
    with pytest.raises(CheckFailed) as info:
        check_sync_gradients(fn, timeout=20)  # as check_ddp's, below
    assert str(info.value).startswith("check_sync_gradients: ")
    assert message in str(info.value)
    assert info.value.score == 0
    assert "bucket" not in str(info.value)  # part 1 has none


@pytest.mark.parametrize("fn", [sync_send_recv, sync_gathered_in_float64])
@pytest.mark.parametrize("options", [{}, {"world_size": 3, "dtype": torch.float64, "seed": 2}])
def test_sync_gradients_accepts_point_to_point_and_local_averaging(fn, options, capsys):
    check_sync_gradients(fn, **options)
    assert capsys.readouterr().out.startswith("check_sync_gradients: passed.")


def test_rounding_within_the_tolerance_passes_even_where_adamw_magnifies_it(capsys):
    check_sync_gradients(sync_then_round, models=("mlp",), optimizers=("adamw",), steps=4)
    assert "check_sync_gradients: passed." in capsys.readouterr().out


def test_weights_changed_outside_the_optimizer_step_are_refused():
    with pytest.raises(CheckFailed) as info:
        check_sync_gradients(sync_then_nudge_weights, models=("mlp",), optimizers=("adamw",))
    assert "rank 0, step 0 (" in str(info.value)
    assert "after optimizer.step(), 'layers.0.weight' differs" in str(info.value)
    assert "does your code change parameters or gradients anywhere else?" in str(info.value)


def test_float32_weights_fail_in_float64_with_their_own_hint():
    check_sync_gradients(sync_weights_in_float32, world_size=2)
    with pytest.raises(CheckFailed, match="it is right up to float32 rounding"):
        check_sync_gradients(sync_weights_in_float32, world_size=2, dtype=torch.float64, seed=5)


def test_sync_gradients_failure_lists_every_failing_run_with_rank_step_and_tolerance():
    with pytest.raises(CheckFailed) as info:
        check_sync_gradients(sync_plain_average)
    text = str(info.value)
    assert "[result] failed in 4 case(s):" in text  # mlp and probe, SGD and AdamW
    sizes = shard_sizes(DDPRun(), 4, 0)
    where = "(mlp model, SGD, float32, seed 0, batches of 16 (the last 12) on 4 ranks)"
    assert f"rank 0, step 0 {where}" in text
    assert f"the shards here hold {sizes} samples" in text
    assert "(allowed atol=1e-06 + rtol=1e-05 * |expected|)" in text


def test_bad_arguments_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="leaves some of 4 ranks without data"):
        check_ddp(A03.DDP, batch_size=3)
    with pytest.raises(ValueError, match="unknown optimizer 'adam'"):
        check_sync_gradients(sync_gradients, optimizers=("adam",))
    with pytest.raises(ValueError, match="dtype must be"):
        check_sync_gradients(sync_gradients, dtype=torch.float16)


# --- provenance ---------------------------------------------------------------------------


def test_provenance_refuses_the_real_thing_but_not_idioms_or_context_managers():
    model = nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    with Provenance(FORBIDDEN["ddp"]) as seen:
        grads = [p.grad for p in model.parameters()]  # as in the lecture's `gradients`
        torch.cat([g.reshape(-1) for g in grads])  # as in its `flat_gradients`
        with torch.random.fork_rng(devices=[]):  # torch's DDP has @contextmanager methods
            pass
    assert seen.complaint() is None, seen.hits
    with Provenance(FORBIDDEN["ddp"]) as seen:
        lecture.flat_gradients(model)
    assert "runs course_lib.data_parallel.flat_gradients" in seen.complaint()
    with Provenance(FORBIDDEN["ddp"]) as seen:
        buckets(list(model.parameters()), 100)
    assert "course_lib.grading.data_parallel.buckets" in seen.complaint()
