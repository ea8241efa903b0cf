"""Assignment 7's memory while the work runs (grading/zero_peak.py, zero_meter.py): the
meter, the plain model's needs measured in the checking process, and ZeRO-3's peak check.
(check_zero2's samples during backward are held to right and wrong answers with the rest of
check_zero2, in test_grading_zero.py.)"""

from __future__ import annotations

import pytest
import torch

from course_lib import data, launch, rank, world_size
from course_lib.grading import CheckFailed, check_zero3_peak
from course_lib.grading.zero import SMALL, shard_bytes
from course_lib.grading.zero_meter import GradientMeter, _Meter
from course_lib.grading.zero_peak import (
    LAYERS_ALLOWED,
    _plain_backward_samples,
    _plain_step_need,
    _step_peak,
    budget,
    largest_layer_bytes,
)
from course_lib.grading.zero_ranks import ZeroRun, _weighted_loss, build_model, global_batches
from course_lib.models import TinyGPT, lm_loss
from tests.adapters import mutant, planted
from tests.cheats.a07_zero import ZERO3_BUFFERS_MADE_ONCE, ZERO3_GATHER_INTO_A_LIST
from tests.test_grading_zero import no_regather, shard_module

# --- the meter ------------------------------------------------------------------------------


def test_the_meter_counts_a_buffer_made_before_from_the_moment_it_is_written():
    buffer, made = torch.zeros(100, dtype=torch.float64), torch.ones(10, dtype=torch.float64)
    with _Meter() as meter:
        buffer[:10].copy_(made)  # a view of the buffer: the whole storage counts, once
        buffer.add_(1.0)
        new = buffer * 2  # created: counts too
        del new
        view = buffer[5:]
        view.mul_(3.0)
    assert meter.peak == 800 + 800
    with _Meter() as untouched:
        _ = made.sum()  # only read: the buffer is never written here
    assert untouched.peak == 8


def _samples(keep: bool) -> dict[int, int]:
    """The bytes a GradientMeter saw alive each time a gradient of the plain model was ready,
    when a later hook keeps every full gradient (in a list) or drops it."""
    model = TinyGPT(SMALL, dtype=torch.float64)
    sampler, kept = GradientMeter(model), []

    def after(p):
        if keep:
            kept.append(p.grad)
        p.grad = None

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(after)
    x, y = global_batches(ZeroRun())[0]
    loss = lm_loss(model(x[:3]), y[:3])
    with sampler.backward():
        loss.backward()
    return sampler.record()["ready"]


def test_each_gradient_kept_shows_in_every_later_sample():
    model = TinyGPT(SMALL, dtype=torch.float64)
    sizes = [p.numel() * 8 for p in model.parameters()]
    dropped, kept = _samples(False), _samples(True)
    assert sorted(dropped) == list(range(len(sizes)))  # every parameter's gradient, once
    order = list(dropped)  # the order backward finished them in
    for n, i in enumerate(order):
        assert kept[i] - dropped[i] == sum(sizes[j] for j in order[:n]), i


def _needs_on_ranks(run: ZeroRun) -> list:
    """On each rank, what the checks measure in the checking process instead: the plain
    model's backward samples (each full gradient dropped when ready) and its step's need."""
    ranks, me = world_size(), rank()
    model = build_model(run)
    sampler = GradientMeter(model)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    backward, step = [], []
    for s, (x, y) in enumerate(global_batches(run)):
        x, y = data.shard(x, me, ranks), data.shard(y, me, ranks)
        records = []
        for xs, ys, weight in run.backwards(s, x, y):
            loss = _weighted_loss(model, xs, ys, weight)
            with sampler.backward():
                loss.backward()
            records.append(sampler.record())
        backward.append(tuple(records))
        plain = build_model(run)
        measured = _step_peak(plain, x, y)
        step.append((measured["peak"] - shard_bytes(plain, 1), measured["ops"]))
    return [backward, step]


@pytest.mark.parametrize("world", [4, 3])
def test_the_plain_needs_measured_in_the_checking_process_are_a_ranks(world):
    """The references of the memory checks are measured here, not on the ranks: they must be
    what a rank measures on its own share (bytes depend on the shapes only)."""
    run = ZeroRun(seed=world, steps=2, accumulate=True)
    on_ranks = launch(_needs_on_ranks, run, world_size=world, timeout=60)
    for r, (backward, step) in enumerate(on_ranks):
        for s in range(run.steps):
            assert backward[s] == _plain_backward_samples(run, s, r, world), (r, s)
            assert step[s] == _plain_step_need(run, s, r, world), (r, s)
    assert len(backward[1]) == 2  # step 1 ran two backwards


# --- Part 4: ZeRO-3 at its peak -------------------------------------------------------------

# ZeRO-3 whose full weights stay in autograd's saved tensors, with the memory meter taken off
# torch's dispatch stack from each layer's pre-hook to its forward hook.
POP = "torch.utils._python_dispatch._pop_mode() if torch._C._len_torch_dispatch_stack() else None"
meter_off = mutant(
    "zero",
    "zero3",
    ("    module.saving.__enter__()\n", f"    module.meter = {POP}\n"),
    (
        "    module.saving.__exit__(None, None, None)\n",
        "    if module.meter is not None:\n"
        "        torch.utils._python_dispatch._push_mode(module.meter)\n",
    ),
).shard_module


@pytest.mark.parametrize("world", [4, 3, 2, 1])
def test_check_zero3_peak_accepts_the_solution(world, capsys):
    check_zero3_peak(shard_module, world_size=world, seed=world, steps=1)
    out = capsys.readouterr().out
    assert out.startswith("check_zero3_peak: passed. Verified 1 steps"), out
    assert "peaked at most at" in out and "of its budget" in out


def test_check_zero3_peak_accepts_a_gather_into_a_list():
    check_zero3_peak(planted("zero", "zero3", ZERO3_GATHER_INTO_A_LIST).shard_module, steps=1)


@pytest.mark.parametrize(
    "impl, message",
    [
        (no_regather, "gradient shards and 3 x 12,144 for the largest layer's full parameters"),
        (meter_off, "the memory meter was switched off during the step"),
        (
            planted("zero", "zero3", ZERO3_BUFFERS_MADE_ONCE).shard_module,
            "gradient shards and 3 x 12,144 for the largest layer's full parameters",
        ),
    ],
)
def test_check_zero3_peak_rejects(impl, message):
    with pytest.raises(CheckFailed) as info:
        check_zero3_peak(impl, steps=1)
    assert str(info.value).startswith("check_zero3_peak: ")
    assert message in str(info.value)


def test_the_peak_budget_is_the_unsharded_need_plus_shards_plus_three_layers():
    model = TinyGPT(SMALL, dtype=torch.float64)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) * 8 for m in model.modules())
    assert largest_layer_bytes(model) == largest == 12_144  # the attention's qkv: 22 x 66 + 66
    assert budget(1000, model, 4) == 1000 + shard_bytes(model, 4) + LAYERS_ALLOWED * largest
