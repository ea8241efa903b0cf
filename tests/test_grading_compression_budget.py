"""Assignment 5's Part 3 check (fewer bytes, same loss) accepts the designs the notebook
names and rejects each broken rule; its reference is float32 all-reduce training."""

from __future__ import annotations

import pytest
import torch

from course_lib import PerRank
from course_lib.grading import CheckFailed, check_compressed_training
from course_lib.grading import compression_budget as budget
from course_lib.grading._harness import run_on_ranks
from course_lib.grading.compression_cases import shards
from course_lib.grading.compression_ranks import train_on_rank
from tests.adapters import planted, solution
from tests.cheats import a05_compression as cheats

SOLVED = solution("compression")


def expect_failure(check, args, message: str, **options) -> str:
    with pytest.raises(CheckFailed) as info:
        check(*args, **options)
    text = str(info.value)
    assert message in text, text
    return text


def compressor(source: str):
    """The Compressor class of the solution notebook with its answer cell replaced."""
    return planted("compression", "compressor", source).Compressor


def test_compressed_training_accepts_the_solution(capsys):
    check_compressed_training(SOLVED.Compressor)
    out = capsys.readouterr().out
    assert out.startswith(
        "check_compressed_training: passed. Verified 4 ranks, seed 0, 60 steps: 158,400 bytes "
        "sent per rank, 25.0x fewer than float32 all-reduce training"
    ), out


@pytest.mark.parametrize(
    "source, ratio",
    [(cheats.POWERSGD_RANK_1, "13.4x"), (cheats.SIGN_WITH_FEEDBACK, "15.9x")],
    ids=["powersgd-rank-1", "sign-with-feedback"],
)
def test_compressed_training_accepts_other_designs(source, ratio, capsys):
    check_compressed_training(compressor(source))
    out = capsys.readouterr().out
    assert out.startswith("check_compressed_training: passed.") and f"{ratio} fewer" in out, out


@pytest.mark.parametrize(
    "source, message",
    [
        # the bytes rule: no compression at all, then Part 1's 8 bits (about 4x)
        (cheats.FLOAT32_ALL_REDUCE, "1.0x fewer than float32 all-reduce training's 3,966,480"),
        (cheats.EIGHT_BIT, "4.0x fewer than float32 all-reduce training's 3,966,480"),
        # the loss rule: top-1% without error feedback ends 45% above float32's loss
        (cheats.TOP_K_NO_FEEDBACK, "Is what compression leaves out kept and sent later"),
        # the same-update rule: each rank keeps its own gradient (sends nothing, loss +6%)
        (cheats.OWN_GRADIENT, "rank 1's parameters differ from rank 0's"),
        # the lecture's code, wrapped
        (cheats.LECTURE_TOP_K, "runs course_lib.compression.TopK"),
    ],
    ids=["float32", "8-bit", "top-k-without-feedback", "own-gradient", "lecture"],
)
def test_compressed_training_rejects(source, message):
    expect_failure(check_compressed_training, (compressor(source),), message)


class TorchFp16Hook:
    """PyTorch's fp16 DDP communication hook, fed a bucket-like object."""

    def average(self, grads):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        class Bucket:
            def __init__(self, flat):
                self.flat = flat

            def buffer(self):
                return self.flat

        flat = torch.cat([g.reshape(-1) for g in grads])
        mean = default_hooks.fp16_compress_hook(None, Bucket(flat)).wait()
        parts = mean.split([g.numel() for g in grads])
        return [part.view_as(g) for part, g in zip(parts, grads, strict=True)]


def test_torchs_comm_hooks_are_refused():
    expect_failure(
        check_compressed_training,
        (TorchFp16Hook,),
        "runs torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook",
        steps=2,
    )


def test_the_reference_is_float32_all_reduce_training():
    """The check's single-process loss is what 4 ranks training with a float32 all-reduce
    reach, and the launcher's byte count is what they send."""
    run = budget.TrainRun()
    problem = budget.draw_problem(run, 12345)
    got, traffic = run_on_ranks(
        "test",
        train_on_rank,
        compressor(cheats.FLOAT32_ALL_REDUCE),
        problem.start,
        PerRank(shards(problem, 4)),
        str(run),
        world_size=4,
        timeout=60,
        what="float32 all-reduce training",
        traffic=True,
    )
    assert budget.bytes_sent(traffic) == [budget.float32_bytes(run)] * 4 == [3_966_480] * 4
    loss = budget.final_loss(got[0]["params"], problem)
    assert loss == pytest.approx(budget.reference_loss(problem), rel=1e-5, abs=0)
    assert budget.byte_budget(run) == 3_966_480 // 12 == 330_540
    assert budget.reference_loss(problem) < 0.5 * budget.final_loss(problem.start, problem)
