"""Assignment 3's checks accept right implementations and reject wrong ones, with the hint
and the partial credit each mistake deserves."""

from __future__ import annotations

import inspect
import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn

import course_lib.data_parallel as lecture
from course_lib import rank, world_size
from course_lib.grading import CheckFailed, check_ddp, check_sync_gradients
from course_lib.grading._harness import grading_pool
from course_lib.grading.data_parallel import (
    FORBIDDEN,
    AllReduceLog,
    DDPRun,
    ProbeModel,
    bucket_layout,
    buckets,
    shard_sizes,
)
from course_lib.grading.data_parallel_runs import BUCKET_ELEMENTS, MB, draw_shard
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
    namespace = dict(vars(lecture))
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
        (sync_no_none_check, "raised AttributeError on rank "),  # any: all fail at once
        (sync_total_of_first_step, ", step 2 ("),
        (sync_with_lecture_code, "runs course_lib.data_parallel.allreduce_gradients"),
        (sync_with_pasted_lecture_code, "runs course_lib.data_parallel.allreduce_gradients"),
        (not_implemented, "raised NotImplementedError"),
    ],
)
def test_sync_gradients_rejects_wrong_implementations(fn, message):
    with pytest.raises(CheckFailed) as info:
        check_sync_gradients(fn, timeout=20)  # as check_ddp's, below
    assert str(info.value).startswith("check_sync_gradients: ")
    assert message in str(info.value)
    assert info.value.score == 0
    assert "bucket" not in str(info.value)  # part 1 has none


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


def test_the_default_shards_are_uneven_and_change_every_step():
    for ranks, batch in ((4, 16), (3, 10), (2, 16)):
        run = DDPRun(batch_size=batch)
        splits = [shard_sizes(run, ranks, s) for s in range(3)]
        assert [sum(sizes) for sizes in splits] == [batch, batch, 3 * batch // 4]
        assert all(min(sizes) >= 1 and len(set(sizes)) > 1 for sizes in splits), splits
        assert len({tuple(sizes) for sizes in splits}) == 3, splits
    assert shard_sizes(DDPRun(batch_size=4, steps=1), 4, 0) == [1, 1, 1, 1]


def test_every_rank_draws_samples_nobody_can_predict():
    x1, _ = draw_shard(DDPRun(), 3)
    x2, _ = draw_shard(DDPRun(), 3)
    assert x1.shape == (3, 8) and not torch.equal(x1, x2)


# --- DDP ----------------------------------------------------------------------------------


def rule_buckets(params, cap_bytes, order="reverse", new_at=lambda size, cap: size > cap):
    """The notebook's bucket rule, or a variant of it: lists of parameters. (Written apart
    from the grader's `buckets`, which answers would be refused for running.)"""
    out, size = [[]], 0
    trainable = [p for p in params if p.requires_grad]
    for p in reversed(trainable) if order == "reverse" else trainable:
        n = p.numel() * p.element_size()
        if out[-1] and new_at(size + n, cap_bytes):
            out.append([])
            size = 0
        out[-1].append(p)
        size += n
    return [b for b in out if b]


DDP = A03.DDP
# Right, in another style: the same buckets, each a preallocated buffer laid out
# first-registered first, ReduceOp.AVG through a name bound at import, readiness by sets.
DDPOtherStyle = planted("data_parallel", "ddp", cheats.OTHER_STYLE).DDP
# torch's own DDP behind the assignment's interface: not the student's work.
TorchDDP = planted("data_parallel", "ddp", cheats.TORCH_DDP).DDP


class TemplateDDP(nn.Module):
    """Right, in another style: DDP cut into small methods (buckets by the assignment's rule,
    flattened with torch.cat when full), so that each wrong DDP below changes one of them."""

    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__()
        self.module = module
        self.broadcast_state()
        self.buckets = self.make_buckets(bucket_cap_mb)
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.ready = [0] * len(self.buckets)
        self.pending = {}
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self.grad_ready)

    def broadcast_state(self):
        with torch.no_grad():
            for t in [*self.module.parameters(), *self.module.buffers()]:
                dist.broadcast(t, src=0)

    def make_buckets(self, bucket_cap_mb):
        return rule_buckets(self.module.parameters(), bucket_cap_mb * MB)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def grad_ready(self, param):
        i = self.bucket_of[id(param)]
        self.ready[i] += 1
        if self.ready[i] == len(self.buckets[i]):
            self.launch(i)

    def flatten(self, i):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[i]]
        return torch.cat([g.reshape(-1) for g in grads])

    def launch(self, i):
        flat = self.flatten(i)
        self.pending[i] = (dist.all_reduce(flat, async_op=True), flat)

    def flush_incomplete(self):
        for i in range(len(self.buckets)):
            if i not in self.pending:
                self.launch(i)

    def average(self, flat):
        flat /= world_size()

    def write_back(self, i, flat):
        offset = 0
        for p in self.buckets[i]:
            if p.grad is not None:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def finish_gradient_synchronization(self):
        self.flush_incomplete()
        for i, (work, flat) in sorted(self.pending.items()):
            work.wait()
            self.average(flat)
            self.write_back(i, flat)
        self.pending = {}
        self.ready = [0] * len(self.buckets)


class DDPGradersBuckets(TemplateDDP):
    """Forms its buckets with the grader's own rule."""

    def make_buckets(self, bucket_cap_mb):
        return buckets(list(self.module.parameters()), bucket_cap_mb * MB)


class DDPGroupObject(TemplateDDP):
    """Right: launches through the process-group object, which returns a Work at once."""

    def launch(self, i):
        flat = self.flatten(i)
        self.pending[i] = (dist.group.WORLD.allreduce([flat]), flat)


class DDPSum(TemplateDDP):
    def average(self, flat):
        pass


class DDPRank0Average(TemplateDDP):
    def average(self, flat):
        if rank() == 0:
            flat /= world_size()


class DDPNoBroadcast(TemplateDDP):
    def broadcast_state(self):
        pass


class DDPParamsOnlyBroadcast(TemplateDDP):
    def broadcast_state(self):
        with torch.no_grad():
            for p in self.module.parameters():
                dist.broadcast(p, src=0)


class DDPAllAtTheEnd(TemplateDDP):
    """Right buckets, but all sent after backward: no overlap."""

    def grad_ready(self, param):
        pass


class DDPOneCallAtTheEnd(TemplateDDP):
    """One all-reduce of everything after backward: neither buckets nor overlap."""

    def make_buckets(self, bucket_cap_mb):
        return [[p for p in reversed(list(self.module.parameters())) if p.requires_grad]]

    def grad_ready(self, param):
        pass


class DDPPerParameter(TemplateDDP):
    def make_buckets(self, bucket_cap_mb):
        return [[p] for p in reversed(list(self.module.parameters())) if p.requires_grad]


class DDPForwardOrder(TemplateDDP):
    def make_buckets(self, bucket_cap_mb):
        return rule_buckets(self.module.parameters(), bucket_cap_mb * MB, order="forward")


class DDPDecimalMegabyte(TemplateDDP):
    def make_buckets(self, bucket_cap_mb):
        return rule_buckets(self.module.parameters(), bucket_cap_mb * 1e6)


class DDPNewBucketAtTheCap(TemplateDDP):
    """Starts a new bucket when the next parameter would *reach* the cap (>=, not >)."""

    def make_buckets(self, bucket_cap_mb):
        at_cap = lambda size, cap: size >= cap
        return rule_buckets(self.module.parameters(), bucket_cap_mb * MB, new_at=at_cap)


def torch_rule_buckets(params, cap_bytes):
    """torch's rule: add the parameter, close the bucket once it reaches the cap."""
    out, size = [[]], 0
    for p in reversed([p for p in params if p.requires_grad]):
        out[-1].append(p)
        size += p.numel() * p.element_size()
        if size >= cap_bytes:
            out.append([])
            size = 0
    return [b for b in out if b]


class DDPTorchRule(TemplateDDP):
    def make_buckets(self, bucket_cap_mb):
        return torch_rule_buckets(self.module.parameters(), bucket_cap_mb * MB)


class DDPNoWriteBack(TemplateDDP):
    def write_back(self, i, flat):
        pass


class DDPWaitsForEveryGradient(TemplateDDP):
    """Deadlocks: waits for the bucket holding the parameter that never gets a gradient."""

    def flush_incomplete(self):
        while len(self.pending) < len(self.buckets):
            time.sleep(0.01)


class DDPSynchronousInHook(TemplateDDP):
    def launch(self, i):
        flat = self.flatten(i)
        dist.all_reduce(flat)
        self.pending[i] = (_Done(), flat)


class DDPWaitsInHook(TemplateDDP):
    def launch(self, i):
        super().launch(i)
        self.pending[i][0].wait()


class _Done:
    def wait(self):
        pass


class DDPZeroGradForUnused(TemplateDDP):
    def write_back(self, i, flat):
        offset = 0
        for p in self.buckets[i]:
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()


class DDPHidesParameters(TemplateDDP):
    """Keeps the model out of nn.Module's sight: the wrapper has no parameters at all."""

    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__(module, bucket_cap_mb)
        self.__dict__["hidden"] = self._modules.pop("module")

    def forward(self, *args, **kwargs):
        return self.hidden(*args, **kwargs)


class DDPBucketsFrozen(TemplateDDP):
    def make_buckets(self, bucket_cap_mb):
        return [[p] for p in reversed(list(self.module.parameters()))]

    def write_back(self, i, flat):
        p = self.buckets[i][0]
        if p.requires_grad:
            super().write_back(i, flat)


class DDPZeroGradDoesNothing(TemplateDDP):
    def zero_grad(self, set_to_none=True):
        pass


# The cheat "one all-reduce after backward": every gradient in one flat all-reduce.
OneAllReduce = planted("data_parallel", "ddp", cheats.ONE_ALL_REDUCE_AFTER_BACKWARD).DDP


class DDPFakeBuckets(TemplateDDP):
    """A cheat: all-reduces of zeros during backward for show, the real average in one
    synchronous call afterwards."""

    def launch(self, i):
        flat = torch.zeros(sum(p.numel() for p in self.buckets[i]))
        self.pending[i] = (dist.all_reduce(flat, async_op=True), flat)

    def write_back(self, i, flat):
        pass

    def finish_gradient_synchronization(self):
        super().finish_gradient_synchronization()  # waits for the show
        self.average_for_real()

    def average_for_real(self):
        OneAllReduce.finish_gradient_synchronization(self)


class DDPAveragesWithAllGather(DDPFakeBuckets):
    """A cheat: the show all-reduces carry zeros; the gradients travel by all-gather, through
    the group object."""

    def average_for_real(self):
        for p in self.module.parameters():
            if p.grad is not None:
                gathered = torch.zeros(world_size() * p.shape[0], *p.shape[1:], dtype=p.dtype)
                dist.group.WORLD._allgather_base(gathered, p.grad.contiguous()).wait()
                p.grad.copy_(gathered.view(world_size(), *p.shape).mean(dim=0))


class DDPWithLectureCode(TemplateDDP):
    """No buckets of its own: the lecture's allreduce_gradients after backward."""

    def grad_ready(self, param):
        pass

    def finish_gradient_synchronization(self):
        lecture.allreduce_gradients(self.module)


class DDPNoCommunication(TemplateDDP):
    """Each rank keeps its own gradients."""

    def finish_gradient_synchronization(self):
        pass


@pytest.mark.parametrize("cls", [DDP, TemplateDDP, DDPOtherStyle, DDPGroupObject])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"world_size": 1},
        {"world_size": 2, "batch_size": 7, "seed": 3},
        {"world_size": 3, "dtype": torch.float64},
        {"world_size": 2, "models": ("gpt",), "optimizers": ("sgd",), "steps": 2, "batch_size": 4},
        {"world_size": 2, "models": ("mlp",), "bucket_cap_mb": 1024 / MB},
    ],
)
def test_ddp_accepts_right_implementations(cls, options, capsys):
    check_ddp(cls, **options)
    assert capsys.readouterr().out.startswith("check_ddp: passed. Verified ")


def test_ddp_float64_matches_to_1e10():
    # The fp64 tolerance really is near 1e-10: a sum instead of a mean fails it too.
    check_ddp(DDP, dtype=torch.float64, world_size=2)
    with pytest.raises(CheckFailed, match="rtol=1e-10"):
        check_ddp(DDPSum, dtype=torch.float64, world_size=2)


@pytest.mark.parametrize(
    "cls, message",
    [
        (DDPSum, "did you divide the all-reduced sum by the world size, on every rank?"),
        (DDPRank0Average, "rank 1, step 0"),
        (DDPNoBroadcast, "with torch.no_grad(): dist.broadcast(tensor, src=0)"),
        (DDPParamsOnlyBroadcast, "a buffer differs from rank 0's initial one: 'module.shift'"),
        (DDPNoWriteBack, "are the averaged values written back into each parameter's .grad?"),
        (DDPWaitsForEveryGradient, "'unused.weight' never gets a gradient"),
        (DDPZeroGradForUnused, "'module.unused.weight' got no gradient in backward on any rank"),
        (DDPBucketsFrozen, "the gradients of the trainable parameters are 2416 bytes"),
        (DDPHidesParameters, "named_parameters() gives [], expected ['module.gain', "),
        (DDPZeroGradDoesNothing, "gradients accumulate across steps"),
        (DDPFakeBuckets, "the all-reduces carried 4688 bytes"),
        (DDPAveragesWithAllGather, "the step used all_gather_into_tensor"),
        (DDPOneCallAtTheEnd, "all-reduces of [2416] bytes"),
        (DDPNoCommunication, "it is still this rank's own gradient"),
        (TorchDDP, "runs torch.nn.parallel.DistributedDataParallel, PyTorch's own"),
        (DDPWithLectureCode, "runs course_lib.data_parallel.allreduce_gradients"),
        (DDPGradersBuckets, "runs course_lib.grading.data_parallel.buckets, the course's own"),
        (not_implemented, "raised NotImplementedError"),
    ],
)
def test_ddp_gives_nothing_for_a_wrong_result_or_no_bucketed_overlap(cls, message):
    start = time.monotonic()
    with pytest.raises(CheckFailed) as info:
        # 20 s: a wrong answer's run, on fresh ranks of a busy machine (after the restart of
        # a failed case, next to the grading course's build), took over 10 s.
        check_ddp(cls, timeout=20)
    assert str(info.value).startswith("check_ddp: ")
    assert message in str(info.value)
    assert info.value.score == 0
    assert time.monotonic() - start < 60  # a hang too fails within its timeout


@pytest.mark.parametrize(
    "cls, failed, message",
    [
        (DDPPerParameter, "buckets", "the rule gives 5 buckets of [48, 208, 240, 768, 1152] bytes"),
        (DDPForwardOrder, "buckets", "Take the trainable parameters last registered first"),
        (DDPDecimalMegabyte, "buckets", "1 MB = 2**20 bytes"),
        (DDPNewBucketAtTheCap, "buckets", "(240 bytes) the rule gives 5 buckets"),
        (DDPTorchRule, "buckets", "all-reduces of "),
        (DDPAllAtTheEnd, "overlap", "were launched after backward"),
        (DDPSynchronousInHook, "overlap", "backward waited for an all-reduce"),
        (DDPWaitsInHook, "overlap", "backward waited for an all-reduce"),
    ],
)
def test_ddp_gives_half_for_right_training_with_only_one_of_buckets_and_overlap(
    cls, failed, message
):
    with pytest.raises(CheckFailed) as info:
        check_ddp(cls)
    text = str(info.value)
    assert info.value.failed == {failed} and info.value.score == 0.5, text
    assert message in text
    assert f"{failed} failed (50%)" in text and "Partial credit: " in text
    assert "50% of this part's points" in text


def test_ddp_missing_broadcast_names_rank_and_parameter():
    with pytest.raises(CheckFailed) as info:
        check_ddp(DDPNoBroadcast, world_size=2)
    text = str(info.value)
    assert "rank 1 (probe model, SGD, float32, seed 0, batches of 16 (the last 12) on 2" in text
    assert "a parameter differs from rank 0's initial one: 'module.gain' differs" in text


def test_ddp_failure_on_gradients_names_step_and_tolerance():
    with pytest.raises(CheckFailed) as info:
        check_ddp(DDPSum, models=("mlp",), optimizers=("adamw",), world_size=2)
    text = str(info.value)
    where = "(mlp model, AdamW, float32, seed 0, batches of 16 (the last 12) on 2 ranks)"
    assert f"rank 0, step 0 {where}" in text
    assert "the gradient after finish_gradient_synchronization differs" in text
    assert "(allowed atol=1e-06 + rtol=1e-05 * |expected|)" in text


def test_bad_arguments_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="leaves some of 4 ranks without data"):
        check_ddp(DDP, batch_size=3)
    with pytest.raises(ValueError, match="unknown optimizer 'adam'"):
        check_sync_gradients(sync_gradients, optimizers=("adam",))
    with pytest.raises(ValueError, match="dtype must be"):
        check_sync_gradients(sync_gradients, dtype=torch.float16)


# --- the bucket rule and the probe model --------------------------------------------------


def _sizes(groups):
    return Counter(sum(p.numel() * p.element_size() for p in b) for b in groups)


def test_probe_model_has_what_the_ddp_check_needs():
    model = ProbeModel()
    sizes = [p.numel() for p in model.parameters()]
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen == ["gain"] and len(set(sizes)) >= 6  # uneven sizes
    model(torch.randn(3, 8)).sum().backward()
    assert model.unused.weight.grad is None and model.gain.grad is None
    assert model.inp.weight.grad is not None and len(list(model.buffers())) == 1
    cap = BUCKET_ELEMENTS["probe"] * 4  # bytes, float32
    layout = bucket_layout(model, cap / MB)
    assert layout == [
        ["out.bias", "out.weight"],
        ["mid.bias"],
        ["mid.weight"],
        ["unused.weight", "inp.bias"],  # 240 bytes: fills the cap exactly
        ["inp.weight"],
    ]


def test_the_default_probe_cap_tells_every_other_bucket_rule_apart():
    """The visible test catches the rules the notebook excludes: forward order, 1 MB =
    10^6 bytes, a new bucket at the cap (>=) and torch's close-once-reached rule."""
    params = list(ProbeModel().parameters())
    cap = BUCKET_ELEMENTS["probe"] * 4
    right = _sizes(buckets(params, cap))
    assert right == _sizes(rule_buckets(params, cap))
    variants = {
        "forward": _sizes(rule_buckets(params, cap, order="forward")),
        "1e6": _sizes(rule_buckets(params, cap * 10**6 / MB)),
        ">=": _sizes(rule_buckets(params, cap, new_at=lambda size, cap: size >= cap)),
        "torch": _sizes(torch_rule_buckets(params, cap)),
    }
    assert all(v != right for v in variants.values()), variants


# --- AllReduceLog -------------------------------------------------------------------------


def _every_route_logged():
    from torch.distributed import all_reduce

    with AllReduceLog() as log:
        log.phase = "a"
        all_reduce(torch.ones(3))  # a name bound before the log: synchronous
        log.phase = "b"
        dist.group.WORLD.allreduce([torch.ones(5)]).wait()  # the group object
        log.phase = "c"
        dist.all_reduce(torch.ones(2, dtype=torch.float64), async_op=True).wait()
        dist.broadcast(torch.ones(1), src=0)
        model = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))  # C++ reducer
        model(torch.ones(1, 2)).sum().backward()
    restored = dist.Work.wait is log._saved[0][1]
    calls = [[c.nbytes, c.async_op, c.phase] for c in log.calls]
    others = [list(other) for other in log.others]
    return {"calls": calls, "waits": log.waits, "others": others, "restored": restored}


def test_all_reduce_log_sees_every_route_and_every_wait_on_grading_ranks():
    result = grading_pool(2).launch(_every_route_logged, timeout=60)[0]
    # The pre-bound all_reduce is seen at the process group, which hands torch's function a
    # Work to wait for: it looks async there, but its wait is logged.
    assert result["calls"][:3] == [[12, True, "a"], [20, True, "b"], [16, True, "c"]]
    assert len(result["calls"]) >= 4  # and DDP's bucket, reduced from C++
    assert result["waits"][:3] == ["a", "b", "c"]
    assert ["broadcast", "c"] in result["others"]
    assert result["restored"]


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
