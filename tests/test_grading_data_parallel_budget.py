"""Assignment 3, Part 3 (open): `check_communicate_less` accepts right answers of every kind
(local SGD, half-precision averaging, a warm-up) and rejects each rule's breakers: too many
bytes (per-step averaging, gathering the samples), ranks that differ, a poor loss (one average
at the end) and the lecture's code."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import world_size
from course_lib.grading import CheckFailed, check_communicate_less
from course_lib.grading.data_parallel_budget import budget_bytes, draw_batches
from tests.adapters import planted, solution
from tests.cheats import a03_data_parallel as cheats

A03 = solution("data_parallel")


def less_cheat(source):
    """The `communicate_less` a notebook holding tests/cheats' `source` would define."""
    return planted("data_parallel", "communicate_less", source).communicate_less


communicate_less = A03.communicate_less  # local SGD: parameters averaged every 4 steps
# Right answers written differently: the parameters averaged every 2 steps in float16 (twice
# the averages for the same bytes), and local SGD every 8 steps after 4 steps of per-step
# averaging (one all-reduce per tensor).
less_in_half_precision = less_cheat(cheats.HALF_PRECISION_EVERY_2)
less_with_warm_up = less_cheat(cheats.WARM_UP_THEN_EVERY_8)
# ... and every 4 steps by a ring of isend/irecv (bytes exact, the sockets' count checked).
less_by_a_ring = less_cheat(cheats.RING_OF_SENDS)
# Cheats: local SGD through the lecture's average_parameters; one average at the end.
less_with_lecture_code = less_cheat(cheats.LECTURE_AVERAGING_EVERY_4)
less_once_at_the_end = less_cheat(cheats.AVERAGE_ONCE_AT_THE_END)
# Cheats at the count (issue 28): per-step all-reduce with the rank's counters emptied (the
# launcher counts the calls), and on the counted group's inner group (the kernel counts the
# bytes on the sockets).
less_counters_emptied = less_cheat(cheats.PER_STEP_COUNTERS_EMPTIED)
less_inner_group = less_cheat(cheats.PER_STEP_INNER_GROUP)


def less_per_step(model, optimizer, batches):
    """Every gradient averaged at every step, in one flat all-reduce: 4x the budget."""
    params = list(model.parameters())
    for x, y in batches:
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat /= world_size()
        for p, part in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.grad.copy_(part.view_as(p))
        optimizer.step()


def less_by_gathering_inputs(model, optimizer, batches):
    """Every rank gathers every rank's samples (inputs in 8 bits, targets in 16) and trains on
    the whole batch: the per-step baseline's model, without a byte of gradients, but the
    samples alone cost several times the budget."""
    scale = 8 / 127
    for x, y in batches:
        xs = [torch.empty_like(x, dtype=torch.int8) for _ in range(world_size())]
        ys = [torch.empty_like(y, dtype=torch.float16) for _ in range(world_size())]
        dist.all_gather(xs, (x / scale).round().clamp(-127, 127).to(torch.int8))
        dist.all_gather(ys, y.half())
        optimizer.zero_grad()
        whole_x = torch.cat(xs).float() * scale
        F.mse_loss(model(whole_x), torch.cat(ys).float()).backward()
        optimizer.step()


def less_alone(model, optimizer, batches):
    """No communication at all: 0 bytes, but the ranks drift apart."""
    for x, y in batches:
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()


@pytest.mark.parametrize(
    "fn",
    [communicate_less, less_in_half_precision, less_with_warm_up, less_by_a_ring],
    ids=["k4", "fp16", "warm", "ring"],
)
def test_check_communicate_less_accepts_right_answers_of_every_kind(fn, capsys):
    check_communicate_less(fn)
    out = capsys.readouterr().out
    assert out.startswith("check_communicate_less: passed. Verified 128 steps of Adam"), out
    assert "P = 2: " in out and "P = 4: " in out and "(at most 25% and 5x)" in out


@pytest.mark.parametrize(
    "fn, message",
    [
        # Bytes: every gradient (and Part 1's count) at every step, over 4x the budget.
        (less_per_step, "bytes, over the budget of 188,928 (0.25 of 128 all-reduces"),
        # Bytes: the samples themselves, even in 8 and 16 bits.
        (less_by_gathering_inputs, "bytes, over the budget of 188,928"),
        # Same model: no communication leaves the ranks about 0.8 apart.
        (less_alone, "differs from rank 0's by"),
        # Loss: one average at the end, many times the baseline's loss.
        (less_once_at_the_end, "x the per-step baseline's"),
        # Provenance: the lecture's code, whatever the bytes and the loss.
        (less_with_lecture_code, "runs course_lib.data_parallel.average_parameters"),
        # Bytes, though the rank's own counters were emptied around every call.
        (less_counters_emptied, "bytes, over the budget of 188,928"),
        # Tampering: calls the launcher never heard of, whose bytes the kernel counted.
        (less_inner_group, "that none of its send/recv calls account for"),
    ],
    ids=["per-step", "gather-samples", "alone", "once-at-end", "lecture", "emptied", "inner"],
)
def test_check_communicate_less_rejects(fn, message):
    with pytest.raises(CheckFailed) as info:
        check_communicate_less(fn)
    assert str(info.value).startswith("check_communicate_less: ")
    assert message in str(info.value)
    assert info.value.score == 0


def test_the_byte_budget_is_a_quarter_of_per_step_all_reduce():
    """Against the ring formula written out: 1,476 float32 gradients, 128 steps."""
    for ranks in (2, 4):
        per_step = 2 * (ranks - 1) / ranks * 1476 * 4
        assert budget_bytes(128, ranks) == int(0.25 * 128 * per_step)


def test_the_ranks_regions_differ_and_the_samples_are_secret():
    a = draw_batches(2, 3, 0, 2, secret=1)
    b = draw_batches(2, 3, 1, 2, secret=1)
    c = draw_batches(2, 3, 0, 2, secret=2)
    assert a[0][0][:, 0].mean() < -1 and b[0][0][:, 0].mean() > 1  # centred on -2 and 2
    assert not torch.equal(a[0][0], c[0][0])
    assert [tuple(x.shape) for x, _ in a] == [(1024, 8)] * 3
