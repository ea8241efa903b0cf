"""Assignment 8's trainer check accepts right implementations and rejects wrong ones: the
numbers, the schedule's order, the manners (.grad added to, the loss's type, sends waited for)
and the messages. The notes the order is read from: tests/test_grading_pipeline_notes.py."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from course_lib import launch, rank, world_size
from course_lib.grading import CheckFailed, check_pipeline_trainer
from course_lib.grading.pipeline import recv_tensor, schedule_order, send_tensor
from tests.adapters import mutant, planted, solution
from tests.cheats.a08_pipeline import GPIPE_BACKWARDS_REVERSED, PIPELINE_BY_OP_LIST, REBUILT_MODEL

# --- the pipeline trainer -----------------------------------------------------------------


A08 = solution("pipeline")
pipeline_step = A08.pipeline_step
WARMUP = 'warmup = n_micro if schedule == "gpipe" else min(P - r - 1, n_micro)'
# Named mutations of the solution: the loss not divided by n_micro; 1F1B that runs every
# forward first (GPipe's memory); 1F1B with one warm-up forward too many.
step_unscaled = mutant(
    "pipeline", "pipeline_step", ("loss_fn(y, ys[i]) / n_micro", "loss_fn(y, ys[i])")
).pipeline_step
step_1f1b_keeps_everything = mutant(
    "pipeline", "pipeline_step", (WARMUP, "warmup = n_micro")
).pipeline_step
step_1f1b_one_too_many = mutant(
    "pipeline", "pipeline_step", ("min(P - r - 1, n_micro)", "min(P - r, n_micro)")
).pipeline_step
# Right numbers, wrong order or wrong manners: the backwards after the forwards in reverse
# micro-batch order (GPipe's, and 1F1B's cool-down); every micro-batch in reverse order;
# .grad zeroed first; the loss as a tensor; a float on every stage; sends never waited for.
COOL_DOWN = "for i in range(n_micro - warmup, n_micro):\n        backward(i)"
step_backwards_reversed = mutant(
    "pipeline",
    "pipeline_step",
    (COOL_DOWN, "for i in reversed(range(n_micro - warmup, n_micro)):\n        backward(i)"),
).pipeline_step
step_micro_batches_reversed = mutant(
    "pipeline",
    "pipeline_step",
    (
        "xs, ys = inputs.tensor_split(n_micro), targets.tensor_split(n_micro)",
        "xs, ys = inputs.tensor_split(n_micro)[::-1], targets.tensor_split(n_micro)[::-1]",
    ),
).pipeline_step
step_zeroes_first = mutant(
    "pipeline",
    "pipeline_step",
    ("r, P = rank(), world_size()", "stage.zero_grad()\n    r, P = rank(), world_size()"),
).pipeline_step
step_returns_a_tensor = mutant(
    "pipeline",
    "pipeline_step",
    ("return total if last else None", "return torch.tensor(total) if last else None"),
).pipeline_step
step_returns_everywhere = mutant(
    "pipeline", "pipeline_step", ("return total if last else None", "return total")
).pipeline_step
step_never_waits = mutant(
    "pipeline", "pipeline_step", ("for send in sends:\n        send.wait()", "pass")
).pipeline_step
step_shifted_activation = mutant(
    "pipeline",
    "pipeline_step",
    ("recv_tensor(r - 1).requires_grad_()", "(recv_tensor(r - 1) + 1e-3).requires_grad_()"),
).pipeline_step
# No messages at all: each stage rebuilds the model from the run's seed and computes the
# other stages itself (the cheat's own text); the stages' secret weights defeat it.
step_rebuilds_the_model = planted("pipeline", "pipeline_step", REBUILT_MODEL).pipeline_step


def step_zeroes_between_micro_batches(stage, *args):
    class Zeroing(torch.nn.Module):
        def forward(self, x):
            stage.zero_grad()
            return stage(x)

    return pipeline_step(Zeroing(), *args)


def step_never_sends_gradients(stage, inputs, targets, loss_fn, n_micro, schedule):
    """Stage r > 0 never sends the input's gradient back: stage r - 1 waits forever."""
    r, P = rank(), world_size()
    outputs = []
    for x, y in zip(inputs.tensor_split(n_micro), targets.tensor_split(n_micro), strict=True):
        x = x if r == 0 else recv_tensor(r - 1).requires_grad_()
        out = stage(x)
        if r < P - 1:
            send_tensor(out, r + 1).wait()
        outputs.append(out if r < P - 1 else loss_fn(out, y) / n_micro)
    for out in outputs:
        out.backward(None if r == P - 1 else recv_tensor(r + 1))
    return sum(o.item() for o in outputs) if r == P - 1 else None


def step_broadcasts(stage, inputs, targets, loss_fn, n_micro, schedule):
    """Right numbers, but a collective (a barrier) on every rank."""
    dist.barrier()
    return pipeline_step(stage, inputs, targets, loss_fn, n_micro, schedule)


def step_as_1f1b(stage, inputs, targets, loss_fn, n_micro, schedule):
    """Right 1F1B, whatever schedule is asked for."""
    return pipeline_step(stage, inputs, targets, loss_fn, n_micro, "1f1b")


def not_implemented(*args, **kwargs):
    raise NotImplementedError()


def test_send_tensor_carries_shape_and_dtype():
    def exchange():
        if rank() == 0:
            sends = [
                send_tensor(torch.arange(6.0, dtype=torch.float64).view(2, 3), 1),
                send_tensor(torch.tensor(7), 1),
            ]
            for send in sends:
                send.wait()
            return None
        return [recv_tensor(0), recv_tensor(0)]

    received = launch(exchange, world_size=2, timeout=20)[1]
    assert torch.equal(received[0], torch.arange(6.0, dtype=torch.float64).view(2, 3))
    assert received[1].dtype == torch.int64 and received[1].shape == () and received[1] == 7


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_trainer_accepts_a_right_implementation(schedule, capsys):
    sizes, gpt_stages = ((1, 3, 4), 4) if schedule == "gpipe" else ((2, 3, 4), 2)
    check_pipeline_trainer(pipeline_step, schedule, world_sizes=sizes)
    check_pipeline_trainer(
        pipeline_step, schedule, world_sizes=(gpt_stages,), models=("gpt",), seed=3
    )
    out = capsys.readouterr().out
    assert out.startswith("check_pipeline_trainer: passed. Verified 9 run(s) of 2 steps (mlp;")
    assert f"stages), {schedule}: every stage's gradients and the loss" in out


def test_the_reversed_gpipe_cheat_is_right_but_for_its_order():
    # The cheat's text: the gradients and the loss are right, only GPipe's order is not.
    step = planted("pipeline", "pipeline_step", GPIPE_BACKWARDS_REVERSED).pipeline_step
    check_pipeline_trainer(step, "1f1b", world_sizes=(2, 4))
    with pytest.raises(CheckFailed) as info:
        check_pipeline_trainer(step, "gpipe", world_sizes=(2,), n_micro=(4,))
    assert "the stage ran F0 F1 F2 F3 B3 B2 B1 B0; the gpipe schedule runs" in str(info.value)
    assert "differs" not in str(info.value)


def test_pipeline_trainer_accepts_a_different_right_implementation():
    # An explicit list of operations, torch.autograd.backward, the loss summed as a tensor
    # and returned with float() (the cheats' alternative text).
    step = planted("pipeline", "pipeline_step", PIPELINE_BY_OP_LIST).pipeline_step
    for schedule in ("gpipe", "1f1b"):
        check_pipeline_trainer(step, schedule, world_sizes=(1, 3, 4), n_micro=(2, 16))


def test_schedule_orders_keep_the_documented_number_in_flight():
    for P, m in [(4, 8), (4, 2), (2, 5), (1, 3)]:
        for r in range(P):
            for schedule, bound in (("gpipe", m), ("1f1b", min(m, P - r))):
                order = schedule_order(schedule, P, m, r)
                kinds = [kind for kind, _ in order]
                live = [kinds[: k + 1].count("F") - kinds[: k + 1].count("B") for k in range(2 * m)]
                assert max(live) == bound and live[-1] == 0, (schedule, P, m, r)
                for kind in "FB":  # each kind takes the micro-batches in order
                    assert [i for k, i in order if k == kind] == list(range(m))


@pytest.mark.parametrize(
    "fn, schedule, message",
    [
        (step_unscaled, "gpipe", "it is n_micro = 4 times the full-batch gradient"),
        (step_1f1b_keeps_everything, "1f1b", "held the activations of 4 micro-batches at once"),
        (step_1f1b_one_too_many, "1f1b", "held the activations of 3 micro-batches"),
        (step_zeroes_between_micro_batches, "1f1b", "do not zero gradients"),
        (step_never_sends_gradients, "gpipe", "did not finish within 5 s"),
        (step_broadcasts, "gpipe", "used ['barrier']"),
        (step_as_1f1b, "gpipe", "the gpipe schedule runs F0 F1 F2 F3 B0 B1 B2 B3 on stage 0 of 2"),
        (
            step_backwards_reversed,
            "gpipe",
            "the stage ran F0 F1 F2 F3 B3 B2 B1 B0; the gpipe schedule runs F0 F1 F2 F3 B0 B1 "
            "B2 B3 on stage 0 of 2",
        ),
        (
            step_backwards_reversed,
            "1f1b",
            "the stage ran F0 F1 F2 F3 B0 B3 B2 B1; the 1f1b schedule runs F0 F1 F2 F3 B0 B1 "
            "B2 B3 on stage 0 of 4",
        ),
        (step_micro_batches_reversed, "gpipe", "the stage ran F3 F2 F1 F0 B3 B2 B1 B0;"),
        (step_zeroes_first, "gpipe", "it is the full-batch gradient alone: what .grad held"),
        (step_returns_a_tensor, "gpipe", "the last stage returned a Tensor; return the whole"),
        (step_returns_everywhere, "1f1b", "the stage returned a float; only the last stage"),
        (step_never_waits, "gpipe", "send(s) that send_tensor started were never .wait()-ed"),
        (
            step_shifted_activation,
            "gpipe",
            "forward number 1 of the stage got an input that is no micro-batch's activation "
            "from stage 0",
        ),
        (step_rebuilds_the_model, "gpipe", "sent stage 1 0 bytes, fewer than the"),
        (step_rebuilds_the_model, "1f1b", "sent stage 1 0 bytes, fewer than the"),
        (not_implemented, "gpipe", "raised NotImplementedError"),
    ],
)
def test_pipeline_trainer_rejects_wrong_implementations(fn, schedule, message):
    # A deadlock is cut after its timeout (5 s); the others finish, given time on a machine
    # that other jobs load (5 s was too short with 13 processes on 2 cores).
    deadlock = "did not finish" in message
    start = time.monotonic()
    with pytest.raises(CheckFailed) as info:
        check_pipeline_trainer(fn, schedule, timeout=5 if deadlock else 30)
    assert str(info.value).startswith("check_pipeline_trainer: ")
    assert message in str(info.value)
    assert not deadlock or time.monotonic() - start < 30


def test_pipeline_failure_names_stage_step_and_tolerance():
    with pytest.raises(CheckFailed) as info:
        check_pipeline_trainer(step_unscaled, "1f1b", world_sizes=(2,), n_micro=(2,))
    text = str(info.value)
    assert "stage 0, step 0 (mlp model, batch of 16 in 2 micro-batches, 2 stages" in text
    assert "(allowed atol=1e-10 + rtol=1e-10 * |expected|)" in text


def test_one_micro_batch_cannot_tell_the_loss_scaling():
    # With n_micro = 1 the scaling is 1: the bug shows only from 2 micro-batches on.
    check_pipeline_trainer(step_unscaled, "gpipe", world_sizes=(2,), n_micro=(1,))


def test_bad_pipeline_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown schedule 'interleaved'"):
        check_pipeline_trainer(pipeline_step, "interleaved")
    with pytest.raises(ValueError, match="n_micro=3 does not divide the batch of 16"):
        check_pipeline_trainer(pipeline_step, "gpipe", n_micro=(3,))


def step_from_the_lecture(stage, inputs, targets, loss_fn, n_micro, schedule):
    from course_lib.measure import pipeline

    return pipeline.torch_pipeline_step(stage, inputs, targets, loss_fn, n_micro, schedule).loss


def test_the_lectures_trainer_is_refused():
    """Lecture 8's trainer is torch's schedule, timed (`torch_pipeline_step`)."""
    with pytest.raises(
        CheckFailed, match="runs course_lib.measure.pipeline.torch_pipeline_step[ ,]"
    ):
        check_pipeline_trainer(step_from_the_lecture, "gpipe", world_sizes=(2,), n_micro=(2,))
