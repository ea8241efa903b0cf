"""Assignment 7's checks accept right ZeRO implementations and reject wrong ones."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_lib import rank, world_size
from course_lib.grading import CheckFailed, check_zero1, check_zero2, check_zero3
from course_lib.grading.zero import (
    SMALL,
    chunk_of,
    chunk_range,
    held_bytes,
    measure_memory,
    optimizer_state_bytes,
    shard_bytes,
)
from course_lib.grading.zero_ranks import ZeroRun, _weighted_loss, build_model, global_batches
from course_lib.models import TinyGPT, count_parameters
from tests.adapters import mutant, planted, solution
from tests.cheats.a07_zero import (
    FULL_STATE_ZERO1,
    ZERO1_COPIED_PARAM_GROUPS,
    ZERO1_PARAM_GROUPS_ATTRIBUTE,
    ZERO2_BUFFERS_MADE_BEFORE,
    ZERO2_ONE_BUFFER,
    ZERO2_OVERWRITES,
    ZERO2_SHARDS_AT_THE_END,
    ZERO3_GATHER_INTO_A_LIST,
)

# --- right implementations: the solution notebook's, and others written differently -------

A07 = solution("zero")
ShardedOptimizer, ShardedGradOptimizer = A07.ShardedOptimizer, A07.ShardedGradOptimizer
shard_module, padded = A07.shard_module, A07.padded


class FlatShardedOptimizer:
    """ZeRO-1 with one flat buffer for the whole model (global flat sharding, all-reduce
    then slice, all_gather into a list), subclassing nothing."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.params = list(params)
        total = sum(p.numel() for p in self.params)
        self.chunk = math.ceil(total / world_size())
        flat = torch.zeros(self.chunk * world_size(), dtype=self.params[0].dtype)
        flat[:total] = torch.cat([p.detach().reshape(-1) for p in self.params])
        lo = rank() * self.chunk
        self.shard = nn.Parameter(flat[lo : lo + self.chunk].clone())
        self.inner = optimizer_cls([self.shard], **kwargs)
        self.param_groups = self.inner.param_groups

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        total = sum(p.numel() for p in self.params)
        flat = torch.zeros(self.chunk * world_size(), dtype=self.shard.dtype)
        flat[:total] = torch.cat([p.grad.reshape(-1) for p in self.params])
        dist.all_reduce(flat)
        lo = rank() * self.chunk
        self.shard.grad = flat[lo : lo + self.chunk] / world_size()
        self.inner.step()
        pieces = [torch.empty_like(self.shard) for _ in range(world_size())]
        dist.all_gather(pieces, self.shard.detach())
        full = torch.cat(pieces)[:total]
        offset = 0
        for p in self.params:
            p.copy_(full[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


class AllReduceGradOptimizer(ShardedGradOptimizer):
    """ZeRO-2 where the hook all-reduces and keeps its slice (more traffic, same memory)."""

    def grad_ready(self, shard, param):
        flat = padded(param.grad)
        dist.all_reduce(flat)
        c = shard.numel()
        chunk = flat[rank() * c : (rank() + 1) * c].clone() / world_size()
        shard.grad = chunk if shard.grad is None else shard.grad + chunk
        param.grad = None


class TorchAdamWOnly(ShardedOptimizer):
    def __init__(self, params, optimizer_cls, **kwargs):
        assert optimizer_cls is torch.optim.AdamW, optimizer_cls
        super().__init__(params, optimizer_cls, **kwargs)


# --- wrong implementations: named mutations of the solution ------------------------------

# ZeRO-1 whose shards have numel // P + 1 elements: one too many whenever P divides numel.
OverlappingShardOptimizer = mutant(
    "zero",
    "helpers",
    ("chunk = math.ceil(flat.numel() / world_size())", "chunk = flat.numel() // world_size() + 1"),
).ShardedOptimizer
# ZeRO-1 that sums the gradient shards instead of averaging them.
SummedOptimizer = mutant(
    "zero", "helpers", ("return out / world_size()", "return out")
).ShardedOptimizer
# ZeRO-1 that copies back only its own shard's elements: the ranks drift apart.
NoGatherOptimizer = mutant(
    "zero",
    "zero1",
    (
        "p.copy_(gather_full(shard, p.shape))",
        "c, numel = shard.numel(), p.numel()\n"
        "            lo, hi = min(rank() * c, numel), min((rank() + 1) * c, numel)\n"
        "            p.view(-1)[lo:hi] = shard.detach()[: hi - lo]",
    ),
).ShardedOptimizer
# ZeRO-2 that reduce-scatters in the hook but forgets to free the full gradient.
KeepsFullGradOptimizer = mutant(
    "zero", "zero2", ("param.grad = None  # the full gradient is gone", "pass  #")
).ShardedGradOptimizer
# ZeRO-2 whose second backward before a step overwrites the gradient shard (the cheat of
# tests/cheats/a07_zero.py is the same mistake, written out).
OverwritingGradOptimizer = mutant(
    "zero",
    "zero2",
    ("shard.grad = grad if shard.grad is None else shard.grad + grad", "shard.grad = grad"),
).ShardedGradOptimizer
# ZeRO-2 whose zero_grad() leaves the shards' .grad: the next step's gradients add to them.
KeepsShardGradsOptimizer = mutant(
    "zero", "zero1", ("        self.optimizer.zero_grad()\n", "")
).ShardedGradOptimizer
# ZeRO-2 whose hook takes the memory meter off torch's dispatch stack around its
# reduce-scatter (the memory it allocates meanwhile is hidden).
MeterOffGradOptimizer = mutant(
    "zero",
    "zero2",
    (
        "        grad = reduce_scatter_mean(param.grad)\n",
        "        meter = torch.utils._python_dispatch._pop_mode()\n"
        "        grad = reduce_scatter_mean(param.grad)\n"
        "        torch.utils._python_dispatch._push_mode(meter)\n",
    ),
).ShardedGradOptimizer
# ZeRO-2 that removes every post-accumulate-grad hook made before its own (the check's).
UnhookingGradOptimizer = mutant(
    "zero",
    "zero2",
    (
        "        for p, shard in zip(self.params, self.shards, strict=True):\n"
        "            p.register",
        "        for p, shard in zip(self.params, self.shards, strict=True):\n"
        "            p._post_accumulate_grad_hooks = None\n"
        "            p.register",
    ),
).ShardedGradOptimizer
# ZeRO-3 that keeps each layer's gathered parameters after its forward.
keep_gathered = mutant(
    "zero",
    "zero3",
    ("    for name in module.full_shapes:\n        del module.__dict__[name]\n", ""),
).shard_module
# ZeRO-3 whose full parameters stay in autograd's saved tensors until backward.
no_regather = mutant(
    "zero",
    "zero3",
    ("    module.saving.__enter__()\n", ""),
    ("    module.saving.__exit__(None, None, None)\n", ""),
).shard_module
# ZeRO-3 that frees the model's gathered parameters but keeps them in a dict of its own
# (`STASH`), and the same calling gc.freeze() after each layer: frozen objects are skipped by
# the garbage collector's scans, which the memory checks are built on.
FREE = "    for name in module.full_shapes:\n        del"
STASHED = "    STASH[id(module)] = dict(module.gathered)\n"
keep_privately = mutant(
    "zero",
    "zero3",
    ("def free_layer(", "STASH = {}\n\n\ndef free_layer("),
    (FREE, STASHED + FREE),
).shard_module
keep_privately_frozen = mutant(
    "zero",
    "zero3",
    ("def free_layer(", "import gc\n\nSTASH = {}\n\n\ndef free_layer("),
    (FREE, STASHED + "    gc.freeze()\n" + FREE),
).shard_module
# ...and the same reaching the real gc.freeze past the worker's own (which notes the call).
keep_privately_really_frozen = mutant(
    "zero",
    "zero3",
    ("def free_layer(", "import course_lib._worker\n\nSTASH = {}\n\n\ndef free_layer("),
    (FREE, STASHED + "    course_lib._worker._real_freeze()\n" + FREE),
).shard_module
# ZeRO-3 whose shards are views of the padded full parameter (which stays alive).
view_shards = mutant(
    "zero",
    "helpers",
    ("[rank() * chunk : (rank() + 1) * chunk].clone()", "[rank() * chunk : (rank() + 1) * chunk]"),
).shard_module
# ZeRO-3 whose gradient shards are summed over the ranks, not averaged.
summed_zero3 = mutant(
    "zero",
    "zero3",
    (
        "return reduce_scatter_mean(grad), None",
        "return reduce_scatter_mean(grad) * world_size(), None",
    ),
).shard_module


# --- wrong implementations: other designs ------------------------------------------------


# Every rank keeps optimizer state for the whole model (plain DP with averaging): the cheat
# "ZeRO-1 without sharding" of tests/cheats/a07_zero.py, in the zero1 cell it is planted in.
FullStateOptimizer = planted("zero", "zero1", FULL_STATE_ZERO1).ShardedOptimizer


class FloorShardOptimizer:
    """Shards of numel // P elements: the last numel % P elements belong to no rank."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.params = list(params)
        chunks = [max(1, p.numel() // world_size()) for p in self.params]
        self.shards = [
            nn.Parameter(p.detach().reshape(-1)[rank() * c : (rank() + 1) * c].clone())
            for p, c in zip(self.params, chunks, strict=True)
        ]
        self.optimizer = optimizer_cls(self.shards, **kwargs)
        self.param_groups = self.optimizer.param_groups

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        for p, shard in zip(self.params, self.shards, strict=True):
            c = shard.numel()
            flat = p.grad.reshape(-1)[: c * world_size()].contiguous()
            shard.grad = torch.empty(c, dtype=flat.dtype)
            dist.reduce_scatter_single(shard.grad, flat)
            shard.grad /= world_size()
        self.optimizer.step()
        for p, shard in zip(self.params, self.shards, strict=True):
            out = torch.empty(shard.numel() * world_size(), dtype=shard.dtype)
            dist.all_gather_single(out, shard.detach())
            p.view(-1)[: out.numel()] = out


class NoParamGroups(ShardedOptimizer):
    param_groups = None


class HiddenFullGradOptimizer(ShardedGradOptimizer):
    """Right ZeRO-2 where the check usually looks (shards get their chunk, param.grad is
    freed), but every full gradient is also kept in a private dict until step(): the full
    gradients of all parameters coexist, which ZeRO-2 exists to avoid."""

    kept: dict = {}  # a class attribute: not on the instance the check inspects

    def grad_ready(self, shard, param):
        type(self).kept[id(param)] = param.grad
        super().grad_ready(shard, param)

    @torch.no_grad()
    def step(self):
        type(self).kept.clear()
        super().step()


def unsharded(model):
    return model


def not_implemented(*args, **kwargs):
    raise NotImplementedError()


# --- the checks accept right code ---------------------------------------------------------


@pytest.mark.parametrize("world", [4, 3, 2, 1])
def test_checks_accept_the_reference_solution(world):
    steps = 3 if world == 4 else 2
    check_zero1(ShardedOptimizer, world_size=world, steps=steps)
    check_zero2(ShardedGradOptimizer, world_size=world, seed=1, steps=steps)
    check_zero3(shard_module, world_size=world, seed=2, steps=steps)


def test_checks_accept_other_right_styles():
    check_zero1(FlatShardedOptimizer, steps=4)
    check_zero2(AllReduceGradOptimizer)
    # The alternatives of tests/cheats/a07_zero.py that the new rules bear on.
    check_zero1(planted("zero", "zero1", ZERO1_PARAM_GROUPS_ATTRIBUTE).ShardedOptimizer)
    check_zero2(planted("zero", "zero2", ZERO2_ONE_BUFFER).ShardedGradOptimizer, steps=4)
    check_zero3(planted("zero", "zero3", ZERO3_GATHER_INTO_A_LIST).shard_module)


def test_a_passing_check_says_what_it_verified_with_the_bytes_it_measured(capsys):
    check_zero2(ShardedGradOptimizer, world_size=2, steps=1)
    check_zero3(shard_module, world_size=2, steps=1)
    out = capsys.readouterr().out.splitlines()
    model = TinyGPT(SMALL, dtype=torch.float64)
    state = shard_bytes(model, 2, values_per_element=2)
    assert out[0].startswith("check_zero2: passed. Verified 1 steps (TinyGPT(SMALL)")
    assert f"a rank's optimizer state took at most {state:,} of the {state:,} bytes" in out[0]
    assert f"gradients at most {shard_bytes(model, 2):,} of {shard_bytes(model, 2):,}" in out[0]
    assert out[1].startswith("check_zero3: passed. Verified 1 steps")
    assert f"held at most {shard_bytes(model, 2):,} of the {shard_bytes(model, 2):,}" in out[1]


def test_the_ranks_step_with_torch_optim_adamw_as_the_reference_does():
    check_zero1(TorchAdamWOnly, world_size=2, steps=1)


# --- ... and reject wrong code --------------------------------------------------------------


@pytest.mark.parametrize(
    "impl, message",
    [
        (FullStateOptimizer, "bytes of optimizer state; at most"),
        (NoGatherOptimizer, "the ranks hold different parameters"),
        (SummedOptimizer, "gradients 4 (the world size) times too large"),
        (FloorShardOptimizer, "was never updated: no rank stepped it"),
        (OverlappingShardOptimizer, "bytes of optimizer state; at most"),
        (NoParamGroups, "optimizer.param_groups[0]['lr'] is None"),
        (
            planted("zero", "zero1", ZERO1_COPIED_PARAM_GROUPS).ShardedOptimizer,
            "before step 2 the check set the learning rate to 0.005 through your optimizer's",
        ),
        (not_implemented, "your ShardedOptimizer raised NotImplementedError on rank "),
    ],
)
def test_check_zero1_rejects(impl, message):
    with pytest.raises(CheckFailed) as info:
        check_zero1(impl, steps=3)
    assert str(info.value).startswith("check_zero1: ")
    assert message in str(info.value)


@pytest.mark.parametrize(
    "impl, message",
    [
        (ShardedOptimizer, "bytes of gradients (measured after backward); at most"),
        (KeepsFullGradOptimizer, "bytes of gradients (measured after backward); at most"),
        (FullStateOptimizer, "bytes of gradients (measured after backward); at most"),
        (NoGatherOptimizer, "the ranks hold different parameters"),
        (HiddenFullGradOptimizer, "bytes of tensors kept from backward"),
        (not_implemented, "your ShardedGradOptimizer raised NotImplementedError"),
        (OverwritingGradOptimizer, "the second must add its chunk to the shard's .grad"),
        (KeepsShardGradsOptimizer, "zero_grad() clears the shards' .grad"),
        (
            planted("zero", "zero2", ZERO2_OVERWRITES).ShardedGradOptimizer,
            "Step 1 ran two backwards before step(): do both add up in the gradients?",
        ),
        (
            planted("zero", "zero2", ZERO2_SHARDS_AT_THE_END).ShardedGradOptimizer,
            "step 0, backward 1 of 1 (TinyGPT(SMALL)",
        ),
        (
            planted("zero", "zero2", ZERO2_BUFFERS_MADE_BEFORE).ShardedGradOptimizer,
            "when the gradient of 'embed.tokens.weight' was ready, 67,472 bytes were alive "
            "beyond what the unsharded model's backward holds at that moment",
        ),
        (MeterOffGradOptimizer, "the memory meter was switched off during backward"),
        (UnhookingGradOptimizer, "the check's hook never saw the gradient of"),
    ],
)
def test_check_zero2_rejects(impl, message):
    with pytest.raises(CheckFailed) as info:
        check_zero2(impl, steps=2)
    assert str(info.value).startswith("check_zero2: ")
    assert message in str(info.value)


@pytest.mark.parametrize(
    "impl, message",
    [
        (keep_gathered, "parameters (held by the model after forward); at most"),
        (view_shards, "parameters (held by the model after forward); at most"),
        (keep_privately, "are alive outside the model's shards, in tensors Python can reach"),
        (keep_privately_frozen, "are alive outside the model's shards, in tensors Python"),
        (keep_privately_really_frozen, "are alive outside the model's shards, in tensors"),
        (no_regather, "during backward it all-gathered 0 bytes"),
        (summed_zero3, "it is 4 (the world size) times the average"),
        (unsharded, "expected a 1-D shard of ceil(638 / 4) = 160 elements"),
        (not_implemented, "your shard_module raised NotImplementedError"),
    ],
)
def test_check_zero3_rejects(impl, message):
    with pytest.raises(CheckFailed) as info:
        check_zero3(impl, steps=2)
    assert str(info.value).startswith("check_zero3: ")
    assert message in str(info.value)


def test_failures_name_rank_step_parameter_and_tolerance():
    with pytest.raises(CheckFailed) as info:
        check_zero1(SummedOptimizer, world_size=2, steps=2)
    text = str(info.value)
    assert "rank 0, after step 0 (TinyGPT(SMALL), AdamW, float64, seed 0" in text
    assert "'embed.tokens.weight' differs: max abs error" in text
    assert "(allowed atol=1e-10 + rtol=1e-10 * |expected|)" in text
    with pytest.raises(CheckFailed) as info:
        check_zero1(FullStateOptimizer, world_size=2, steps=1)
    model = TinyGPT(SMALL, dtype=torch.float64)
    full, allowed = 16 * count_parameters(model), shard_bytes(model, 2, values_per_element=2)
    assert "rank 0 (after step 0, TinyGPT(SMALL)" in str(info.value)
    assert f"holds {full:,} bytes of optimizer state; at most {allowed:,}" in str(info.value)


def test_a_failing_check_lists_each_failing_property():
    # Plain data parallelism as ZeRO-2: full gradients after backward, full optimizer state.
    with pytest.raises(CheckFailed) as info:
        check_zero2(FullStateOptimizer, world_size=2, steps=1)
    text = str(info.value)
    assert "[result] failed in 4 case(s):" in text
    assert "bytes of optimizer state" in text and "bytes of gradients" in text
    assert "bytes of tensors kept from backward" in text
    assert "... and 1 more" in text  # the bytes during backward: only 3 cases are shown


def test_a_bad_world_size_or_batch_is_refused_before_running():
    with pytest.raises(ValueError, match="multiple of world_size=4"):
        check_zero1(ShardedOptimizer, batch_size=10)
    with pytest.raises(ValueError, match="world_size must be 1..8"):
        check_zero3(shard_module, world_size=0)


# --- the pieces the checks rely on --------------------------------------------------------


@pytest.mark.parametrize("numel", [1, 3, 22, 37, 638])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 7])
def test_chunk_ranges_cover_every_element_once_within_one_of_numel_over_p(numel, p):
    ranges = [chunk_range(numel, r, p) for r in range(p)]
    covered = [i for lo, hi in ranges for i in range(lo, hi)]
    assert covered == list(range(numel))
    assert all(hi - lo <= numel / p + 1 for lo, hi in ranges)
    full = torch.arange(float(numel))
    chunks = torch.cat([chunk_of(full, r, p) for r in range(p)])
    assert torch.equal(chunks[:numel], full) and not chunks[numel:].any()


def test_memory_is_counted_per_storage():
    model = nn.Linear(10, 10, bias=False)  # 400 bytes
    assert held_bytes(model) == 400
    model.weight = nn.Parameter(torch.zeros(100)[:25])  # a view keeps all 100 floats
    assert held_bytes(model) == 400
    model.extra = [torch.zeros(10, dtype=torch.float64)]
    assert held_bytes(model) == 480
    opt = torch.optim.AdamW([nn.Parameter(torch.ones(6))], foreach=False)
    opt.param_groups[0]["params"][0].grad = torch.ones(6)
    opt.step()
    assert optimizer_state_bytes({"inner": [opt]}) == 2 * 6 * 4  # the step counter excluded


def test_measured_memory_follows_the_zero_formulas():
    model = TinyGPT(SMALL, dtype=torch.float64)
    n_bytes = 8 * count_parameters(model)
    p = 2
    shard = shard_bytes(model, p)
    plain = measure_memory(None, 0, world_size=p)
    assert (
        plain == [{"parameters": n_bytes, "gradients": n_bytes, "optimizer state": 2 * n_bytes}] * p
    )
    expected = {
        1: {"parameters": n_bytes, "gradients": n_bytes, "optimizer state": 2 * shard},
        2: {"parameters": n_bytes, "gradients": shard, "optimizer state": 2 * shard},
        3: {"parameters": shard, "gradients": shard, "optimizer state": 2 * shard},
    }
    impls = {1: ShardedOptimizer, 2: ShardedGradOptimizer, 3: shard_module}
    for stage, impl in impls.items():
        measured = measure_memory(impl, stage, world_size=p)
        assert measured == [expected[stage]] * p, stage


def test_two_backwards_add_up_to_the_mean_over_the_share():
    run = ZeroRun(accumulate=True)
    x, y = global_batches(run)[1]
    pieces = run.backwards(1, x[:3], y[:3])
    assert [(len(xs), weight) for xs, _, weight in pieces] == [(2, 2 / 3), (1, 1 / 3)]
    assert len(run.backwards(0, x, y)) == 1 and len(run.backwards(1, x[:1], y[:1])) == 1
    model = build_model(run)
    for xs, ys, weight in pieces:
        _weighted_loss(model, xs, ys, weight).backward()
    accumulated = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    _weighted_loss(model, x[:3], y[:3], 1.0).backward()
    for got, want in zip(accumulated, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)  # float64 rounding
