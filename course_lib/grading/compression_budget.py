"""Assignment 5's third part (open): fewer bytes, same loss.

    check_compressed_training(Compressor)
        `Compressor()` once on each of P ranks; at each of `steps` SGD steps of the check's
        own model, `compressor.average(grads)` (this rank's float32 gradients, one per
        parameter) returns the estimate of the mean gradient over the ranks that every
        rank applies. Scores when
        - every rank ends with the same parameters (the same update everywhere),
        - each rank sent at most 1/BYTE_RATIO of what float32 all-reduce training sends
          (2 (P-1)/P * 4N bytes a step, N parameters), counted by CommCounter,
        - the final loss on the whole training set is at most (1 + LOSS_TOLERANCE) times
          that of float32 all-reduce training on the same batches.

The reference is independent of the student's code: float32 SGD on one process, on the whole
global batch of each step (the mean of the P equal shards' mean gradients is the full
batch's), and the loss is evaluated in float64. Everything is seeded: the measurement is
deterministic (bytes and losses, no wall-clock time).

The thresholds were set from measurements on this problem (seed 0, P = 4, 60 steps; final
loss / float32's, bytes fewer than float32): top-1% values + int32 indices with error feedback
1.042 at 25x, without it 1.45; PowerSGD rank 1 (biases in float32) 1.036 at 13.4x, rank 2 at
8.0x; sign + mean|.| scale with error feedback 0.999 at 15.9x; 8-bit all-reduce about 4x;
each rank keeping its own gradient 1.06 with ranks 0.11 apart. Seeds 1 and 2 (3 ranks) alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from course_lib.comm import CommCounter
from course_lib.costs import all_reduce_bytes
from course_lib.grading._harness import fail, passed, run_on_ranks
from course_lib.grading.provenance import Provenance
from course_lib.runtime import rank, world_size

BYTE_RATIO = 12  # at least this many times fewer bytes than float32 all-reduce training
LOSS_TOLERANCE = 0.10  # final loss at most 1.10 x float32 training's
SAME_ATOL = 1e-5  # ranks' final parameters may differ by rounding only

# The lecture's compressors, and PyTorch's DDP communication hooks (PowerSGD, fp16/bf16,
# quantization): an answer that runs them, or a copy, is not the student's own.
FORBIDDEN = (
    "course_lib.compression",
    "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
    "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook",
    "torch.distributed.algorithms.ddp_comm_hooks.quantization_hooks",
)

FEATURES, HIDDEN, CLASSES = 32, 256, 10
SAMPLES, BATCH, LR = 2048, 256, 0.2


@dataclass(frozen=True)
class TrainRun:
    """One measured training run: world size, seed (data, model, batches), steps."""

    world_size: int = 4
    seed: int = 0
    steps: int = 60

    def __str__(self) -> str:
        return f"{self.world_size} ranks, seed {self.seed}, {self.steps} steps"


# --- the check's problem: data, model, batches --------------------------------------------


def dataset(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SAMPLES points in FEATURES dimensions, labelled by a random two-layer teacher."""
    g = torch.Generator().manual_seed(1_000 + seed)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    w1, w2 = torch.randn(FEATURES, 64, generator=g), torch.randn(64, CLASSES, generator=g)
    return x, (torch.tanh(x @ w1) @ w2).argmax(dim=1)


def initial_parameters(seed: int) -> list[torch.Tensor]:
    """The MLP FEATURES -> HIDDEN -> CLASSES: two weight matrices and two bias vectors."""
    g = torch.Generator().manual_seed(2_000 + seed)
    return [
        torch.randn(HIDDEN, FEATURES, generator=g) / FEATURES**0.5,
        torch.zeros(HIDDEN),
        torch.randn(CLASSES, HIDDEN, generator=g) / HIDDEN**0.5,
        torch.zeros(CLASSES),
    ]


def loss_of(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, b2 = params
    return F.cross_entropy(F.linear(torch.relu(F.linear(x, w1, b1)), w2, b2), y)


def batch_indices(run: TrainRun, step: int) -> torch.Tensor:
    """The global batch of one step (BATCH samples, the same on every rank)."""
    g = torch.Generator().manual_seed(3_000 + 7_919 * run.seed + step)
    return torch.randperm(SAMPLES, generator=g)[:BATCH]


def parameter_count() -> int:
    return sum(p.numel() for p in initial_parameters(0))


def float32_bytes(run: TrainRun) -> int:
    """What float32 ring all-reduce training sends per rank over the run."""
    return run.steps * all_reduce_bytes(4 * parameter_count(), run.world_size)


def byte_budget(run: TrainRun) -> int:
    return float32_bytes(run) // BYTE_RATIO


def reference_loss(run: TrainRun) -> float:
    """Float32 SGD on one process, whole global batch per step: the final loss (float64)."""
    x, y = dataset(run.seed)
    params = [p.requires_grad_() for p in initial_parameters(run.seed)]
    for step in range(run.steps):
        i = batch_indices(run, step)
        grads = torch.autograd.grad(loss_of(params, x[i], y[i]), params)
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p -= LR * g
    return final_loss([p.detach() for p in params], run)


def final_loss(params: list[torch.Tensor], run: TrainRun) -> float:
    x, y = dataset(run.seed)
    with torch.no_grad():
        return loss_of([p.double() for p in params], x.double(), y).item()


# --- what runs on each rank ----------------------------------------------------------------


def _shape_problem(got, params: list[torch.Tensor]) -> str | None:
    if not isinstance(got, (list, tuple)) or len(got) != len(params):
        return f"{type(got).__name__} {got!r:.60}; expected a list of {len(params)} tensors"
    for j, (g, p) in enumerate(zip(got, params, strict=True)):
        if not isinstance(g, torch.Tensor) or g.shape != p.shape or g.dtype != p.dtype:
            what = (g.dtype, tuple(g.shape)) if isinstance(g, torch.Tensor) else type(g)
            return f"{what} at position {j}; expected a float32 tensor of shape {tuple(p.shape)}"
        if not torch.isfinite(g).all():
            return f"a tensor with inf or nan at position {j}"
    return None


def train_on_rank(compressor_class: Callable, run: TrainRun) -> dict:
    """This rank's training with the student's compressor: its final parameters, the bytes it
    sent during the whole run (the check itself sends nothing here, so every byte is the
    compressor's, whenever it sends it), and what went wrong first, if anything."""
    me, ranks = rank(), world_size()
    x, y = dataset(run.seed)
    params = [p.requires_grad_() for p in initial_parameters(run.seed)]
    problem = None
    with CommCounter() as counter, Provenance(FORBIDDEN) as seen:
        compressor = compressor_class()
        for step in range(run.steps):
            i = batch_indices(run, step).chunk(ranks)[me]
            grads = torch.autograd.grad(loss_of(params, x[i], y[i]), params)
            try:
                got = compressor.average([g.detach().clone() for g in grads])
            except BaseException as exc:
                if hasattr(exc, "add_note"):
                    exc.add_note(f"(while checking: {run}, step {step})")
                raise
            problem = _shape_problem(got, params)
            if problem:
                problem = f"step {step}: average returned {problem}"
                break
            with torch.no_grad():
                for p, g in zip(params, got, strict=True):
                    p -= LR * g
    return {
        "params": [p.detach().clone() for p in params],
        "sent": counter.bytes_sent,
        "problem": problem,
        "copied": seen.complaint(),
    }


# --- judging -------------------------------------------------------------------------------


def judge_training(check: str, run: TrainRun, results: list[dict]) -> str:
    """Fail on the first broken rule; else what was measured."""
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
    most = max(result["sent"] for result in results)
    if most > budget:
        fail(
            check,
            f"{run}: a rank sent {most:,} bytes, {full / max(most, 1):.1f}x fewer than "
            f"float32 all-reduce training's {full:,}; at most {budget:,} allowed "
            f"(1/{BYTE_RATIO} of it)",
        )
    want, got = reference_loss(run), final_loss(first, run)
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
    results = run_on_ranks(
        check,
        train_on_rank,
        compressor_class,
        run,
        world_size=world_size,
        timeout=timeout,
        what=f"your {name} ({run})",
    )
    passed(check, judge_training(check, run, results))
