"""Assignment 5's checks trust nothing computed or counted on the ranks (`compression_ranks`
runs only the student's code there): each cheat below found what it needed in the rank's
process while the checks computed it there (each passed the checks of commit cbe0078), and
now scores nothing."""

from __future__ import annotations

import re

import pytest

from course_lib.grading import (
    CheckFailed,
    check_compressed_training,
    check_powersgd,
    check_quantized_all_reduce,
)
from course_lib.grading.compression_quantized import split_by_kind
from course_lib.grading.traffic import Sent
from tests.adapters import planted, solution
from tests.cheats import a05_compression as cheats

SOLVED = solution("compression")
quantize, dequantize = SOLVED.quantize, SOLVED.dequantize


def _sum(source: str):
    return planted("compression", "quantized_all_reduce", source).quantized_all_reduce


def _fails(check, args: tuple, message: str, **options) -> str:
    with pytest.raises(CheckFailed) as info:
        check(*args, **options)
    text = str(info.value)
    assert message in text, text
    return text


# --- the reference and the other ranks' inputs are not on the rank ------------------------


def test_the_exact_sum_is_not_in_the_frames_nor_on_the_heap():
    """The rank computed the exact sum (float64) beside the student's call: found, returned."""
    answer = _sum(cheats.FRAMES_EXACT_SUM)
    _fails(
        check_quantized_all_reduce,
        (quantize, dequantize, answer),
        "the result is off the exact sum",
        world_sizes=(2, 3),
        shapes=((7,), (30, 33)),
    )


def test_the_gradients_cannot_be_regenerated_from_the_seed():
    """Every rank's gradient was a function of the case and the step, both in the frames."""
    cls = planted("compression", "powersgd", cheats.SEEDED_POWERSGD).PowerSGD
    _fails(check_powersgd, (cls,), "approximation", world_sizes=(2,), ranks=(1,))


def test_the_whole_batch_is_not_in_the_frames():
    """The rank held the whole dataset and the run whose batches it could recompute."""
    cls = planted("compression", "compressor", cheats.FRAMES_WHOLE_BATCH).Compressor
    _fails(check_compressed_training, (cls,), "parameters differ from rank 0's", steps=5)


# --- the bytes are the launcher's ----------------------------------------------------------


def test_a_float32_sum_hidden_from_the_counters_is_booked_as_not_8_bit():
    answer = _sum(cheats.COUNTERS_EMPTIED_SUM)
    text = _fails(
        check_quantized_all_reduce,
        (quantize, dequantize, answer),
        "bytes in tensors that are not 8-bit (float32)",
        world_sizes=(4,),
        shapes=((1000,),),
        seeds=(0,),
    )
    # the whole float32 all-reduce: 2 (P-1)/P * 4N
    assert "rank 0 sent 6000 bytes in tensors that are not 8-bit" in text, text


def test_float32_training_hidden_from_the_counters_is_counted():
    cls = planted("compression", "compressor", cheats.COUNTERS_EMPTIED_TRAINING).Compressor
    _fails(
        check_compressed_training,
        (cls,),
        "a rank sent 330,540 bytes, 1.0x fewer than float32 all-reduce training's 330,540",
        steps=5,
    )


# A float32 sum on the counted group's inner gloo group, unseen by any counter, the launcher
# included, with one 8-bit message to the neighbour for show: the kernel counts the bytes on
# the rank's sockets, and the send and recv calls reported do not account for them.
INNER_GROUP_SUM = """
def quantized_all_reduce(tensor):
    p, me = world_size(), rank()
    if p > 1:
        request = dist.isend(torch.ones(p, dtype=torch.int8), (me + 1) % p)
        dist.recv(torch.empty(p, dtype=torch.int8), (me - 1) % p)
        request.wait()
    total = tensor.clone()
    dist.group.WORLD._inner.allreduce([total]).wait()
    return total
"""


def test_a_sum_on_the_inner_group_is_tampering():
    with pytest.raises(CheckFailed) as info:
        check_quantized_all_reduce(
            quantize, dequantize, _sum(INNER_GROUP_SUM), world_sizes=(2,), shapes=((1000,),)
        )
    assert info.value.tampering and "none of its send/recv calls account for" in str(info.value)


def test_split_by_kind_reads_each_calls_dtypes_from_the_launchers_tallies():
    codes = Sent("all_to_all_single", None, 750, 750, (0, 1, 2, 3), ("int8",))
    scales = Sent("all_gather", None, 24, 24, (0, 1, 2, 3), ("float32",))
    mixed = Sent("all_reduce", None, 6000, 6000, (0, 1, 2, 3), ("float32", "uint8"))
    assert split_by_kind([codes, scales]) == (750, 24, ["float32"])
    # a call is 8-bit only when every tensor it carries is: one float32 tensor makes it other
    assert split_by_kind([codes, mixed]) == (750, 6000, ["float32"])
    assert split_by_kind([Sent("barrier", None, 0, 0, (0, 1))]) == (0, 0, [])


# --- every call draws new inputs -----------------------------------------------------------

# Right on one rank (the sum of one tensor is itself); says what it was given.
TELLING_SUM = """
def quantized_all_reduce(tensor):
    print(f"given {tensor.sum().item():.9g}")
    return tensor.clone()
"""


def test_every_call_of_a_check_draws_new_inputs(capsys):
    seen = []
    for _ in range(2):
        answer = _sum(TELLING_SUM)
        check_quantized_all_reduce(
            quantize, dequantize, answer, world_sizes=(1,), shapes=((7,),), seeds=(0,)
        )
        seen.append(re.findall(r"given (\S+)", capsys.readouterr().out))
    assert len(seen[0]) == 1 and seen[0] != seen[1], seen


def test_every_call_of_the_training_check_draws_a_new_problem(capsys):
    losses = []
    for _ in range(2):
        check_compressed_training(SOLVED.Compressor, steps=3)
        losses += re.findall(r"against float32's (\S+)", capsys.readouterr().out)
    assert len(losses) == 2 and losses[0] != losses[1], losses
