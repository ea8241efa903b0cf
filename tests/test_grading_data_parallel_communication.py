"""Assignment 3, Part 2: check_ddp accepts right DDPs and refuses wrong ones, with the hint and
the partial credit (buckets, overlap) each mistake deserves; its communication comes from
the launcher's tallies."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import course_lib.data_parallel as lecture
from course_lib import rank, world_size
from course_lib.grading import CheckFailed, check_ddp
from course_lib.grading.data_parallel import (
    buckets,
)
from course_lib.grading.data_parallel_runs import MB
from tests.adapters import planted
from tests.cheats import a03_data_parallel as cheats
from tests.test_grading_data_parallel import A03, not_implemented

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
# Right: each bucket waited for through the Future of its Work.
DDPFutures = planted("data_parallel", "ddp", cheats.FUTURES).DDP
# Cheats at what a rank holds or counts (issue 28): rank 0's weights rebuilt from a seed found
# up the stack instead of a broadcast (the rank holds only its own); zeros all-reduced for
# show and the real average by an all-gather with the rank's counters emptied (the launcher
# counts it all the same).
DDPSameStartFromTheStack = planted("data_parallel", "ddp", cheats.SAME_START_FROM_THE_STACK).DDP
DDPHiddenAllGather = planted("data_parallel", "ddp", cheats.HIDDEN_ALL_GATHER).DDP


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


class DDPAllInTheLastHook(TemplateDDP):
    """Launches every bucket during backward, but all in the hook of the step's last gradient
    (for a model whose every parameter gets one): nothing overlaps the rest of backward."""

    def grad_ready(self, param):
        self.ready[0] += 1
        if self.ready[0] == len(self.bucket_of):
            for i in range(len(self.buckets)):
                self.launch(i)


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


@pytest.mark.parametrize("cls", [DDP, TemplateDDP, DDPOtherStyle, DDPGroupObject, DDPFutures])
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
        (DDPSameStartFromTheStack, "a parameter differs from rank 0's initial one"),
        (DDPHiddenAllGather, "the step used all_gather_into_tensor"),
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


def test_ddp_gives_half_when_every_bucket_waits_for_backward_s_last_gradient():
    with pytest.raises(CheckFailed) as info:
        check_ddp(DDPAllInTheLastHook, models=("mlp",))
    assert info.value.failed == {"overlap"} and info.value.score == 0.5
    assert "no all-reduce started before backward had computed its last gradient" in str(info.value)


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
