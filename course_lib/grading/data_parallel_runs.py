"""The training runs of Assignment 3's checks, as the ranks and the reference both see them.

`DDPRun` says which model, optimizer, precision and batches (`RankRun`: what a rank is told of
it); `build_model` builds its model (`ProbeModel` is the check's own); `shard_sizes` splits
each global batch into the ranks' uneven shards, `draw_shard` draws a shard's samples (in the
checking process, from a secret seed), and `rank_loss` is the loss a rank backpropagates in
part 1 ("sync") or part 2 ("ddp").
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from course_lib import data
from course_lib.grading.training import snapshot
from course_lib.models import MLP, TinyGPT

MB = 2**20  # bytes in one "MB" of bucket_cap_mb, as in torch's DDP
# (rtol, atol) per dtype; fp32 rounding between split and whole batches is ~1e-7 (measured on
# the course's models), fp64 ~1e-14.
TOLERANCE = {torch.float32: (1e-5, 1e-6), torch.float64: (1e-10, 1e-10)}
# Default caps, in elements: below the largest parameter. ProbeModel's 60 makes the rule's
# layout differ from forward order, from 1 MB = 10^6 bytes and from closing a bucket when
# it reaches the cap (one of its buckets fills the cap exactly).
BUCKET_ELEMENTS = {"probe": 60, "mlp": 300, "gpt": 2048}


# What a student receives that would answer these parts: the lecture's data-parallel
# helpers, this module's bucket rule (it ships with course_lib), and torch's DDP. (Not the
# lecture's `_unflatten_into`: its five lines are what anyone writes to copy slices back.)
LECTURE_DP = tuple(
    f"course_lib.data_parallel.{name}"
    for name in (
        "allreduce_gradients",
        "flat_gradients",
        "gradients",
        "train_data_parallel",
        "host_step",
    )
)
# The notebook bans the three in every part.
_BANNED = (
    *LECTURE_DP,
    "course_lib.grading.data_parallel.buckets",
    "course_lib.grading.data_parallel.bucket_layout",
    "torch.nn.parallel.DistributedDataParallel",
)
FORBIDDEN = {"sync": _BANNED, "ddp": _BANNED}

# --- the check's own model ----------------------------------------------------------------


class ProbeModel(nn.Module):
    """8 -> 24 -> 12 -> 4 with uneven parameter sizes, a frozen gain, a buffer, and a layer
    (`unused`) whose weight never gets a gradient and shares a bucket with `inp.bias`."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.gain = nn.Parameter(torch.rand(24, dtype=dtype) + 0.5, requires_grad=False)
            self.inp = nn.Linear(8, 24, dtype=dtype)
            self.unused = nn.Linear(6, 6, bias=False, dtype=dtype)  # never called
            self.mid = nn.Linear(24, 12, dtype=dtype)
            self.out = nn.Linear(12, 4, dtype=dtype)
            self.register_buffer("shift", 0.1 * torch.randn(24, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x) + self.shift) * self.gain
        return self.out(torch.relu(self.mid(h)))


# --- models, data and losses shared by the ranks and the reference ------------------------


@dataclass(frozen=True)
class DDPRun:
    """One training run: which model, optimizer, precision and batches."""

    model: str = "mlp"  # "mlp", "probe" or "gpt"
    optimizer: str = "sgd"  # "sgd" or "adamw"
    seed: int = 0
    dtype: torch.dtype = torch.float32
    steps: int = 3
    batch_size: int = 16
    bucket_cap_mb: float | None = None

    def batch(self, step: int, ranks: int) -> int:
        """Samples in the global batch of `step`: batch_size, but a quarter fewer at the last
        step (as the last batch of an epoch often is), and never fewer than the ranks."""
        if step < self.steps - 1:
            return self.batch_size
        return max(ranks, 3 * self.batch_size // 4)

    def describe(self, ranks: int) -> str:
        name = {"sgd": "SGD", "adamw": "AdamW"}[self.optimizer]
        dtype = str(self.dtype).removeprefix("torch.")
        last = self.batch(self.steps - 1, ranks)
        batches = f"batches of {self.batch_size}" + (
            f" (the last {last})" if last != self.batch_size else ""
        )
        return (
            f"{self.model} model, {name}, {dtype}, seed {self.seed}, {batches} on {ranks} "
            f"rank{'s' if ranks > 1 else ''}"
        )

    def cap_mb(self) -> float:
        """bucket_cap_mb, or by default a cap smaller than the model's largest parameter."""
        if self.bucket_cap_mb is not None:
            return self.bucket_cap_mb
        element_size = torch.empty(0, dtype=self.dtype).element_size()
        return BUCKET_ELEMENTS[self.model] * element_size / MB


@dataclass(frozen=True)
class RankRun:
    """What a rank is told of a run: the model to build (its weights come apart), the
    optimizer, the precision, the bucket cap and how many of the model's parameters get a
    gradient in each backward. Not the seed: the samples and weights are drawn from a secret
    in the checking process."""

    model: str
    optimizer: str
    dtype: torch.dtype
    cap_mb: float
    gradients: int


def build_model(run: DDPRun | RankRun, seed: int) -> nn.Module:
    if run.model == "mlp":
        return MLP((8, 32, 32, 4), seed=seed, dtype=run.dtype)
    if run.model == "probe":
        return ProbeModel(seed=seed, dtype=run.dtype)
    if run.model == "gpt":
        return TinyGPT(seed=seed, dtype=run.dtype)
    raise ValueError(f"unknown model {run.model!r}: use 'mlp', 'probe' or 'gpt'")


def shard_sizes(run: DDPRun, ranks: int, step: int) -> list[int]:
    """How many of the `run.batch(step, ranks)` samples each rank holds at `step`: a random
    split (the same on every rank and in the reference), every rank at least one, usually
    uneven."""
    total = run.batch(step, ranks)
    g = torch.Generator().manual_seed(1_000_003 * run.seed + 1009 * step + ranks)
    cuts = (torch.randperm(total - 1, generator=g)[: ranks - 1] + 1).sort().values
    edges = [0, *cuts.tolist(), total]
    return [b - a for a, b in itertools.pairwise(edges)]


def draw_shard(run: DDPRun, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` samples of `run`'s kind, from `seed` (drawn from a secret by the checking process)."""
    if run.model == "gpt":
        return data.tokens(n, seed=seed)
    return data.regression(n, seed=seed, dtype=run.dtype)


def per_sample_loss(
    run: DDPRun | RankRun, output: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """One loss per sample: mean squared error, or mean next-token cross-entropy."""
    if run.model == "gpt":
        tokens = F.cross_entropy(output.flatten(0, 1), target.flatten(), reduction="none")
        return tokens.view(target.shape).mean(dim=1)
    return (output - target).pow(2).mean(dim=1)


def loss_scale(sizes: list[int]) -> float:
    """Part 2's weight of a shard's summed loss when the ranks hold `sizes` samples: world
    size / batch size."""
    return len(sizes) / sum(sizes)


def rank_loss(kind: str, run: DDPRun | RankRun, output, target, scale: float) -> torch.Tensor:
    """This rank's loss. Part 1 ("sync"): the mean over its shard (sync_gradients weights
    it). Part 2 ("ddp"): the shard's sum * `scale` (`loss_scale`), whose plain average over
    the ranks is the full-batch mean for any split."""
    losses = per_sample_loss(run, output, target)
    if kind == "sync":
        return losses.mean()
    return losses.sum() * scale


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return snapshot((name, p.grad) for name, p in model.named_parameters())
