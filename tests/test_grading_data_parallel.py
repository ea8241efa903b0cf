"""Assignment 2's checks accept right implementations and reject wrong ones."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_lib import rank, world_size
from course_lib.grading import CheckFailed, check_ddp, check_sync_gradients
from course_lib.grading.data_parallel import (
    MB,
    ProbeModel,
    bucket_layout,
    buckets,
)

# --- sync_gradients -----------------------------------------------------------------------


def sync_gradients(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world_size()


def sync_gradients_flat(model):
    """Right, in another style: one all-reduce of all gradients flattened into one buffer."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def sync_sum(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def sync_rank0_only(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            if rank() == 0:
                p.grad /= world_size()


def sync_nothing(model):
    pass


def sync_no_none_check(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world_size()


def not_implemented(*args, **kwargs):
    raise NotImplementedError()


@pytest.mark.parametrize("fn", [sync_gradients, sync_gradients_flat])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"world_size": 1},
        {"world_size": 3, "batch_size": 10},  # uneven shards: 4, 3, 3
        {"world_size": 2, "dtype": torch.float64, "seed": 5},
    ],
)
def test_sync_gradients_accepts_right_implementations(fn, options):
    check_sync_gradients(fn, **options)


@pytest.mark.parametrize(
    "fn, message",
    [
        (sync_sum, "did you divide the all-reduced sum by the world size, on every rank?"),
        (sync_rank0_only, "rank 1, step 0"),
        (sync_nothing, "no dist.all_reduce call was seen"),
        (sync_no_none_check, "raised AttributeError on rank 0"),
        (not_implemented, "raised NotImplementedError"),
    ],
)
def test_sync_gradients_rejects_wrong_implementations(fn, message):
    with pytest.raises(CheckFailed) as info:
        check_sync_gradients(fn, timeout=10)
    assert str(info.value).startswith("check_sync_gradients: ")
    assert message in str(info.value)


def test_sync_gradients_failure_names_rank_step_parameter_and_tolerance():
    with pytest.raises(CheckFailed) as info:
        check_sync_gradients(sync_sum, models=("mlp",), optimizers=("sgd",))
    text = str(info.value)
    assert "rank 0, step 0 (mlp model, SGD, float32, seed 0, batch of 16 on 4 ranks)" in text
    assert "'layers.0.weight' differs: max abs error" in text
    assert "(allowed atol=1e-06 + rtol=1e-05 * |expected|)" in text


# --- DDP ----------------------------------------------------------------------------------


class DDP(nn.Module):
    """Right: buckets by the assignment's rule, flattened with torch.cat when full."""

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
        for t in [*self.module.parameters(), *self.module.buffers()]:
            dist.broadcast(t.data, src=0)

    def make_buckets(self, bucket_cap_mb):
        return buckets(list(self.module.parameters()), bucket_cap_mb * MB, close_at_cap=False)

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


class DDPTorchRule(nn.Module):
    """Right, in another style: torch's bucketing rule (close a bucket once it reaches the
    cap), one preallocated flat buffer per bucket, ReduceOp.AVG, readiness by sets."""

    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__()
        self.module = module
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=0)
        params = list(module.parameters())
        self.buckets = buckets(params, bucket_cap_mb * MB, close_at_cap=True)
        sizes = [sum(p.numel() for p in bucket) for bucket in self.buckets]
        self.buffers = [torch.zeros(n, dtype=params[0].dtype) for n in sizes]
        self.waiting = [set(map(id, b)) for b in self.buckets]
        self.works = [None] * len(self.buckets)
        for i, bucket in enumerate(self.buckets):
            for p in bucket:
                p.register_post_accumulate_grad_hook(lambda p, i=i: self._ready(i, p))

    def forward(self, x):
        return self.module(x)

    def _ready(self, i, p):
        self.waiting[i].discard(id(p))
        if not self.waiting[i]:
            self._send(i)

    def _send(self, i):
        offset = 0
        for p in self.buckets[i]:
            view = self.buffers[i][offset : offset + p.numel()]
            view.copy_(p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(view))
            offset += p.numel()
        self.works[i] = dist.all_reduce(self.buffers[i], op=dist.ReduceOp.AVG, async_op=True)

    def finish_gradient_synchronization(self):
        for i, work in enumerate(self.works):
            if work is None:
                self._send(i)
        for i, bucket in enumerate(self.buckets):
            self.works[i].wait()
            offset = 0
            for p in bucket:
                if p.grad is not None:
                    p.grad.view(-1).copy_(self.buffers[i][offset : offset + p.numel()])
                offset += p.numel()
        self.works = [None] * len(self.buckets)
        self.waiting = [set(map(id, b)) for b in self.buckets]


class TorchDDP(nn.parallel.DistributedDataParallel):
    """A thin adapter around torch's own DDP: right numbers, but its all-reduces happen in
    C++ where the check cannot see them."""

    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__(module, bucket_cap_mb=bucket_cap_mb, find_unused_parameters=True)

    def finish_gradient_synchronization(self):
        pass


class DDPSum(DDP):
    def average(self, flat):
        pass


class DDPRank0Average(DDP):
    def average(self, flat):
        if rank() == 0:
            flat /= world_size()


class DDPNoBroadcast(DDP):
    def broadcast_state(self):
        pass


class DDPParamsOnlyBroadcast(DDP):
    def broadcast_state(self):
        for p in self.module.parameters():
            dist.broadcast(p.data, src=0)


class DDPAllAtTheEnd(DDP):
    """Waits for backward to end before sending anything: no overlap."""

    def grad_ready(self, param):
        pass


class DDPPerParameter(DDP):
    def make_buckets(self, bucket_cap_mb):
        return [[p] for p in reversed(list(self.module.parameters())) if p.requires_grad]


class DDPOneBucket(DDP):
    def make_buckets(self, bucket_cap_mb):
        return [[p for p in reversed(list(self.module.parameters())) if p.requires_grad]]


class DDPNoWriteBack(DDP):
    def write_back(self, i, flat):
        pass


class DDPWaitsForEveryGradient(DDP):
    """Deadlocks: waits for the bucket holding the parameter that never gets a gradient."""

    def flush_incomplete(self):
        while len(self.pending) < len(self.buckets):
            time.sleep(0.01)


class DDPSynchronousInHook(DDP):
    def launch(self, i):
        flat = self.flatten(i)
        dist.all_reduce(flat)
        self.pending[i] = (_Done(), flat)


class _Done:
    def wait(self):
        pass


class DDPZeroGradForUnused(DDP):
    def write_back(self, i, flat):
        offset = 0
        for p in self.buckets[i]:
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()


class DDPHidesParameters(DDP):
    """Keeps the model out of nn.Module's sight: the wrapper has no parameters at all."""

    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__(module, bucket_cap_mb)
        self.__dict__["hidden"] = self._modules.pop("module")

    def forward(self, *args, **kwargs):
        return self.hidden(*args, **kwargs)


class DDPBucketsFrozen(DDP):
    def make_buckets(self, bucket_cap_mb):
        return [[p] for p in reversed(list(self.module.parameters()))]

    def write_back(self, i, flat):
        p = self.buckets[i][0]
        if p.requires_grad:
            super().write_back(i, flat)


def test_probe_model_has_what_the_ddp_check_needs():
    model = ProbeModel()
    sizes = [p.numel() for p in model.parameters()]
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen == ["gain"] and len(set(sizes)) >= 6  # uneven sizes
    model(torch.randn(3, 8)).sum().backward()
    assert model.unused.weight.grad is None and model.gain.grad is None
    assert model.inp.weight.grad is not None and len(list(model.buffers())) == 1
    # The default cap (100 float32 elements) is smaller than the largest parameter, and the
    # rule makes several buckets holding several parameters each.
    layout = bucket_layout(model, 100 * 4 / MB)
    assert layout == [
        ["out.bias", "out.weight", "mid.bias"],
        ["mid.weight"],
        ["unused.weight", "inp.bias"],
        ["inp.weight"],
    ]
    assert len(buckets(list(model.parameters()), 400, close_at_cap=True)) == 2


@pytest.mark.parametrize("cls", [DDP, DDPTorchRule])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"world_size": 1},
        {"world_size": 2, "batch_size": 7, "seed": 3},  # uneven shards: 4, 3
        {"world_size": 3, "dtype": torch.float64},
        {"world_size": 2, "models": ("gpt",), "optimizers": ("sgd",), "steps": 2, "batch_size": 4},
    ],
)
def test_ddp_accepts_right_implementations(cls, options):
    check_ddp(cls, **options)


def test_ddp_float64_matches_to_1e10():
    # The fp64 tolerance really is near 1e-10: a sum instead of a mean fails it too.
    check_ddp(DDP, dtype=torch.float64, world_size=2)
    with pytest.raises(CheckFailed, match="rtol=1e-10"):
        check_ddp(DDPSum, dtype=torch.float64, world_size=2)


def test_torch_ddp_adapter_is_right_but_its_reducer_is_invisible_to_the_overlap_check():
    # Training matches (the numbers are checked before the communication), then the check
    # says why it cannot accept torch's C++ reducer.
    with pytest.raises(CheckFailed) as info:
        check_ddp(TorchDDP, world_size=2)
    assert "torch's DistributedDataParallel reduces from C++" in str(info.value)


@pytest.mark.parametrize(
    "cls, message",
    [
        (DDPSum, "did you divide the all-reduced sum by the world size, on every rank?"),
        (DDPRank0Average, "rank 1, step 0"),
        (DDPNoBroadcast, "broadcast rank 0's parameters and buffers at construction"),
        (DDPParamsOnlyBroadcast, "a buffer differs from rank 0's initial one: 'module.shift'"),
        (DDPAllAtTheEnd, "no all-reduce had started when backward computed the input's"),
        (DDPPerParameter, "7 all-reduce calls (one per parameter)"),
        (DDPOneBucket, "1 all-reduce calls; with bucket_cap_mb="),
        (DDPNoWriteBack, "are the averaged values written back into each parameter's .grad?"),
        (DDPWaitsForEveryGradient, "'unused.weight' never gets a gradient"),
        (DDPSynchronousInHook, "without async_op=True"),
        (DDPZeroGradForUnused, "'module.unused.weight' got no gradient in backward on any rank"),
        (DDPBucketsFrozen, "the trainable parameters have 574 (each exactly once; frozen"),
        (DDPHidesParameters, "named_parameters() gives [], expected ['module.gain', "),
        (not_implemented, "raised NotImplementedError"),
    ],
)
def test_ddp_rejects_wrong_implementations(cls, message):
    start = time.monotonic()
    with pytest.raises(CheckFailed) as info:
        check_ddp(cls, timeout=5)
    assert str(info.value).startswith("check_ddp: ")
    assert message in str(info.value)
    assert time.monotonic() - start < 30  # the deadlock too fails within its timeout


def test_ddp_missing_broadcast_names_rank_and_parameter():
    with pytest.raises(CheckFailed) as info:
        check_ddp(DDPNoBroadcast, world_size=2)
    text = str(info.value)
    assert "rank 1 (probe model, SGD, float32, seed 0, batch of 16 on 2 ranks)" in text
    assert "a parameter differs from rank 0's initial one: 'module.gain' differs" in text


def test_ddp_failure_on_gradients_names_step_and_tolerance():
    with pytest.raises(CheckFailed) as info:
        check_ddp(DDPSum, models=("mlp",), optimizers=("adamw",), world_size=2)
    text = str(info.value)
    assert "rank 0, step 0 (mlp model, AdamW, float32, seed 0, batch of 16 on 2 ranks)" in text
    assert "the gradient after finish_gradient_synchronization differs" in text
    assert "(allowed atol=1e-06 + rtol=1e-05 * |expected|)" in text


def test_bad_arguments_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="leaves some of 4 ranks without data"):
        check_ddp(DDP, batch_size=3)
    with pytest.raises(ValueError, match="check TinyGPT with optimizers=\\('sgd',\\)"):
        check_ddp(DDP, models=("gpt",))
    with pytest.raises(ValueError, match="unknown optimizer 'adam'"):
        check_sync_gradients(sync_gradients, optimizers=("adam",))
    with pytest.raises(ValueError, match="dtype must be"):
        check_sync_gradients(sync_gradients, dtype=torch.float16)
