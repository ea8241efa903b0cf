"""Assignment 5's third part (open): fewer bytes, same loss.

    check_compressed_training(Compressor)
        `Compressor()` once on each of P ranks; at each of `steps` SGD steps of the check's
        own model, `compressor.average(grads)` (this rank's float32 gradients, one per
        parameter) returns the estimate of the mean gradient over the ranks that every
        rank applies. Scores when
        - every rank ends with the same parameters (the same update everywhere),
        - each rank sent at most 1/BYTE_RATIO of what float32 all-reduce training sends
          (2 (P-1)/P * 4N bytes a step, N parameters), as the launcher counted its calls,
        - the final loss on the whole training set is at most (1 + LOSS_TOLERANCE) times
          that of float32 all-reduce training on the same batches.

The data, the initial parameters and the batches are drawn in the checking process from a
secret new for each call (`compression_cases.draw_problem`); each rank receives only its own
shard of each step (`compression_ranks.train_on_rank`), so the mean gradient can only come
from the messages. The reference is independent of the student's code: float32 SGD on one
process, on the whole global batch of each step (the mean of the P equal shards' mean
gradients is the full batch's), and the loss is evaluated in float64. The bytes are what the
launcher was told of every call of every rank's process group during the run (no counter on
the rank decides them); nothing depends on wall-clock time.

The thresholds were set from measurements on this problem (seed 0, P = 4, 60 steps; final
loss / float32's, bytes fewer than float32): top-1% values + int32 indices with error feedback
1.042 at 25x, without it 1.45; PowerSGD rank 1 (biases in float32) 1.036 at 13.4x, rank 2 at
8.0x; sign + mean|.| scale with error feedback 0.999 at 15.9x; 8-bit all-reduce about 4x;
each rank keeping its own gradient 1.06 with ranks 0.11 apart. Seeds 1 and 2 (3 ranks) alike,
and so were ten problems drawn from secrets (top-1% with error feedback 1.030 to 1.041,
without it 1.38 to 1.44; sign with error feedback 0.995 to 1.002).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from course_lib import PerRank
from course_lib.costs import all_reduce_bytes
from course_lib.grading._harness import (
    fail,
    judge_unreported,
    measured,
    new_secret,
    passed,
    run_on_ranks,
)
from course_lib.grading.compression_cases import (
    CLASSES,
    FEATURES,
    HIDDEN,
    LR,
    Problem,
    TrainRun,
    draw_problem,
    loss_of,
    shards,
)
from course_lib.grading.compression_ranks import train_on_rank
from course_lib.grading.traffic import Sent, Traffic

BYTE_RATIO = 12  # at least this many times fewer bytes than float32 all-reduce training
LOSS_TOLERANCE = 0.10  # final loss at most 1.10 x float32 training's
SAME_ATOL = 1e-5  # ranks' final parameters may differ by rounding only


def parameter_count() -> int:
    """N, the MLP's parameters: two weight matrices and two bias vectors (11,018)."""
    return HIDDEN * FEATURES + HIDDEN + CLASSES * HIDDEN + CLASSES


def float32_bytes(run: TrainRun) -> int:
    """What float32 ring all-reduce training sends per rank over the run."""
    return run.steps * all_reduce_bytes(4 * parameter_count(), run.world_size)


def byte_budget(run: TrainRun) -> int:
    return float32_bytes(run) // BYTE_RATIO


def reference_loss(problem: Problem) -> float:
    """Float32 SGD on one process, whole global batch per step: the final loss (float64)."""
    x, y = problem.x, problem.y
    params = [p.clone().requires_grad_() for p in problem.start]
    for i in problem.batches:
        grads = torch.autograd.grad(loss_of(params, x[i], y[i]), params)
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p -= LR * g
    return final_loss([p.detach() for p in params], problem)


def final_loss(params: list[torch.Tensor], problem: Problem) -> float:
    with torch.no_grad():
        return loss_of([p.double() for p in params], problem.x.double(), problem.y).item()


def bytes_sent(traffic: Traffic) -> list[int]:
    """Per rank, the bytes of every call its process group reported during the run."""
    return [
        sum(Sent(*e[1:]).sent for e in entries if e[0] == "call") for entries in traffic.tallies
    ]


# --- judging -------------------------------------------------------------------------------


def judge_training(
    check: str, run: TrainRun, problem: Problem, results: list[dict], sent: list[int]
) -> str:
    """Fail on the first broken rule, from what the ranks returned and what the launcher
    counted they sent (`sent`, per rank); else what was measured."""
    __tracebackhide__ = True
    if results[0]["copied"]:
        fail(check, results[0]["copied"])
    for r, result in enumerate(results):
        if result["problem"]:
            fail(check, f"{run}: rank {r}'s {result['problem']}")
    first = results[0]["params"]
    for r in range(1, len(results)):
        worst = max(
            (a - b).abs().max().item() for a, b in zip(results[r]["params"], first, strict=True)
        )
        if worst > SAME_ATOL:
            fail(
                check,
                f"{run}: rank {r}'s parameters differ from rank 0's by up to {worst:.3g} "
                f"after training (allowed {SAME_ATOL:g}); every rank must apply the same "
                "update: average must return the same values on every rank",
            )
    full, budget = float32_bytes(run), byte_budget(run)
    most = max(sent)
    if most > budget:
        fail(
            check,
            f"{run}: a rank sent {most:,} bytes, {full / max(most, 1):.1f}x fewer than "
            f"float32 all-reduce training's {full:,}; at most {budget:,} allowed "
            f"(1/{BYTE_RATIO} of it)",
        )
    want, got = reference_loss(problem), final_loss(first, problem)
    if got > (1 + LOSS_TOLERANCE) * want:
        fail(
            check,
            f"{run}: final loss {got:.4f}, float32 all-reduce training reaches {want:.4f}; "
            f"at most {(1 + LOSS_TOLERANCE) * want:.4f} allowed (+{LOSS_TOLERANCE:.0%}). "
            "Is what compression leaves out kept and sent later (error feedback)?",
        )
    return (
        f"{run}: {most:,} bytes sent per rank, {full / max(most, 1):.1f}x fewer than float32 "
        f"all-reduce training (at least {BYTE_RATIO}x required); final loss "
        f"{got:.4f} against float32's {want:.4f} (at most +{LOSS_TOLERANCE:.0%}); the same "
        "parameters on every rank"
    )


def check_compressed_training(
    compressor_class: Callable,
    *,
    world_size: int = 4,
    seed: int = 0,
    steps: int = 60,
    timeout: float = 60.0,
) -> None:
    """Train the check's MLP on `world_size` ranks with `compressor_class()`; pass if the
    ranks agree, send at least BYTE_RATIO times fewer bytes than float32 training and end within
    LOSS_TOLERANCE of its loss."""
    __tracebackhide__ = True
    check = "check_compressed_training"
    if not callable(compressor_class):
        fail(check, f"expected your class, got {type(compressor_class).__name__}")
    name = getattr(compressor_class, "__name__", "Compressor")
    run = TrainRun(world_size, seed, steps)
    problem = draw_problem(run, new_secret())
    results, traffic = run_on_ranks(
        check,
        train_on_rank,
        compressor_class,
        problem.start,
        PerRank(shards(problem, world_size)),
        str(run),
        world_size=world_size,
        timeout=timeout,
        what=f"your {name} ({run})",
        traffic=True,
    )
    judge_unreported(check, traffic)
    sent = bytes_sent(traffic)
    passed(check, judge_training(check, run, problem, results, sent))
    measured(check, "bytes sent by the busiest rank", max(sent), "B")
