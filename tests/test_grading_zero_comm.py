"""Assignment 7's checks of stages 1 and 2 judge each step's communication from the launcher's
tallies (`grading/zero_comm.py`): a rank that takes the other ranks' samples, or all their
full gradients, fails; right answers that move other bytes than the solution's pass."""

from __future__ import annotations

import pytest

from course_lib.grading import CheckFailed, check_zero1, check_zero2
from course_lib.grading.traffic import Sent
from course_lib.grading.zero_comm import (
    SLACK,
    moved_inputs,
    setup_budget,
    step_budget,
)
from course_lib.grading.zero_memory import shard_bytes
from course_lib.grading.zero_ranks import ZeroRun, build_model
from tests.adapters import mutant, planted
from tests.cheats.a07_zero_comm import (
    ZERO1_ALL_REDUCE,
    ZERO1_FLAT_RING,
    ZERO1_GATHERS_FULL_GRADIENTS,
    ZERO1_GATHERS_SAMPLES,
    ZERO1_GATHERS_SAMPLES_AS_FLOATS,
    ZERO1_GATHERS_SAMPLES_UNREPORTED,
)

RUN = ZeroRun(steps=3, batch_size=12)
MODEL = build_model(RUN)
WORLD = (0, 1, 2, 3)


def zero1(source: str):
    return planted("zero", "zero1", source).ShardedOptimizer


# --- the rule, on calls made up here --------------------------------------------------------


def test_a_step_moves_at_most_an_all_reduce_per_backward_and_an_all_gather_and_receives_the_model():
    c_bytes = shard_bytes(MODEL, 4)  # c elements of every parameter, 8 bytes each
    assert step_budget(MODEL, 4, 1).least == 8 * sum(p.numel() for p in MODEL.parameters())
    assert step_budget(MODEL, 4, 1).most == 3 * 3 * c_bytes + SLACK
    assert step_budget(MODEL, 4, 2).most == 5 * 3 * c_bytes + SLACK
    assert step_budget(MODEL, 1, 1).least == 0  # one rank has no one to talk to
    assert setup_budget(MODEL, 4).most == 3 * shard_bytes(MODEL, 1) + SLACK


@pytest.mark.parametrize(
    "call, found",
    [
        (Sent("all_gather_into_tensor", None, 504, 504, WORLD, ("int64",)), "int64"),
        # a rank's share (3 rows of 7 tokens on 4 ranks) as float64, all-gathered
        (Sent("all_gather_into_tensor", None, 504, 504, WORLD, ("float64",)), "share"),
        # tokens and targets of a share, in float32, sent to one rank
        (Sent("send", 1, 168, 0, WORLD, ("float32",)), "tokens and targets"),
        # a whole batch's tokens broadcast by its root
        (Sent("broadcast", None, 3 * 84 * 8, 0, WORLD, ("float64",)), "global batch"),
    ],
)
def test_a_call_of_an_inputs_size_or_of_integers_moves_the_inputs(call, found):
    assert found in moved_inputs(call, RUN, 4)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_no_parameter_or_chunk_of_the_model_is_taken_for_the_inputs(world):
    """Every call the right answers make (a parameter's or a chunk's size, in float64) and
    a few small flags pass the rule against the inputs."""
    sizes = {p.numel() for p in MODEL.parameters()}
    sizes |= {-(-n // world) for n in sizes} | {1, 2, 8}
    ranks = tuple(range(world))
    for n in sizes:
        for op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "send"):
            sent = (world - 1) * n * 8 if op != "send" else n * 8
            if op == "all_reduce":
                sent = 2 * (world - 1) * n * 8 // world
            call = Sent(op, None, sent, sent if op != "send" else 0, ranks, ("float64",))
            assert moved_inputs(call, RUN, world) is None, (op, n)


# --- the cheats fail, the right answers pass ------------------------------------------------


@pytest.mark.parametrize(
    "source, message",
    [
        (ZERO1_GATHERS_SAMPLES, "moved int64 tensors (the token ids"),
        (ZERO1_GATHERS_SAMPLES_AS_FLOATS, "float64 values, the size of a rank's share"),
        # On the inner group the samples go unreported; the gradients it never received
        # are what shows.
        (ZERO1_GATHERS_SAMPLES_UNREPORTED, "a step needs at least the model's"),
        (ZERO1_GATHERS_FULL_GRADIENTS, "one all-reduce of the gradients"),
    ],
)
def test_check_zero1_fails_a_rank_that_takes_samples_or_full_gradients(source, message):
    with pytest.raises(CheckFailed, match="check_zero1") as failure:
        check_zero1(zero1(source), steps=2)
    assert message in str(failure.value)
    assert failure.value.score == 0


def test_check_zero1_passes_an_all_reduce_and_a_flat_bucket_moved_by_rings_of_sends():
    check_zero1(zero1(ZERO1_ALL_REDUCE), steps=2)
    check_zero1(zero1(ZERO1_FLAT_RING), world_size=3, steps=3)


def test_check_zero2_fails_a_hook_that_all_gathers_the_full_gradient():
    gathers_full = mutant(
        "zero",
        "zero2",
        (
            "        grad = reduce_scatter_mean(param.grad)\n",
            "        every = torch.empty(world_size() * param.numel(), dtype=param.dtype)\n"
            "        dist.all_gather_single(every, param.grad.reshape(-1).contiguous())\n"
            "        grad = take_shard(every.view(world_size(), -1).mean(0))\n",
        ),
    ).ShardedGradOptimizer
    with pytest.raises(CheckFailed, match="one all-reduce of the gradients"):
        check_zero2(gathers_full, steps=2)
