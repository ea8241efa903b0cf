"""Assignment 5's inputs, drawn in the checking process from a secret, and what the right
answer gives, computed there too.

The ranks that run the student's code receive only their own inputs (`PerRank`): a tensor per
case for the 8-bit all-reduce, a gradient per step for PowerSGD, a shard per step for the
training of Part 3. Never the other ranks' inputs, the seed they come from or the result:
with nothing on a rank to copy, a right sum must come from the messages. The secret is new
for every call of a check (`_harness.new_secret`), so a rank cannot regenerate the others' inputs
from its own either; a case's `seed` only labels it (and Part 1's seed 1 gives rank 0 zeros).

    q_inputs(cases, secret)              every rank's tensor, per 8-bit all-reduce case
    q_reference(inputs)                  the exact sum (float64) and A = sum of max|x_r|
    p_gradients(cases, secret)           every rank's gradient at every PowerSGD step
    TrainRun, Problem, draw_problem      Part 3's training run and its data
    loss_of, shards                      its model's loss; what each rank trains on
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# --- Part 1: the 8-bit all-reduce ----------------------------------------------------------


@dataclass(frozen=True)
class QCase:
    """One run of quantized_all_reduce: world size, shape, seed."""

    world_size: int
    shape: tuple[int, ...]
    seed: int

    def __str__(self) -> str:
        return f"world size {self.world_size}, shape {self.shape}, seed {self.seed}"


def q_inputs(cases: list[QCase], secret: int) -> list[list[torch.Tensor]]:
    """Per case, every rank's float32 input: normal values whose size differs per rank, with
    one outlier (so a scale taken from the wrong statistic clips it); seed 1 gives rank 0 all
    zeros (a scale of 0 must not turn into nan)."""
    g = torch.Generator().manual_seed(secret)
    out = []
    for case in cases:
        ranks = []
        for r in range(case.world_size):
            x = torch.randn(case.shape, generator=g) * (1 + r)
            if x.numel() > 1:
                x.view(-1)[int(torch.randint(x.numel(), (1,), generator=g))] = -6.0 * (1 + r)
            if case.seed == 1 and r == 0:
                x.zero_()
            ranks.append(x)
        out.append(ranks)
    return out


def q_reference(inputs: list[torch.Tensor]) -> tuple[torch.Tensor, float]:
    """The exact sum of one case's inputs (float64: exact for a few float32 values) and
    A = sum over the ranks of max|x_r|, which bounds every partial sum."""
    exact = torch.stack([x.double() for x in inputs]).sum(0)
    abs_max = sum(x.abs().max().item() if x.numel() else 0.0 for x in inputs)
    return exact, abs_max


# --- Part 2: PowerSGD ----------------------------------------------------------------------


@dataclass(frozen=True)
class PCase:
    """One run of PowerSGD: world size, matrix shape, approximation rank, seed, steps."""

    world_size: int
    shape: tuple[int, int]
    rank: int
    seed: int
    steps: int
    dtype: torch.dtype = torch.float32

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"world size {self.world_size}, {self.shape[0]}x{self.shape[1]} {dtype} matrix, "
            f"rank {self.rank}, seed {self.seed}"
        )

    @property
    def effective_rank(self) -> int:
        return min(self.rank, *self.shape)


def p_gradients(cases: list[PCase], secret: int) -> list[list[list[torch.Tensor]]]:
    """Per case, per rank, per step, the gradient: a low-rank part the ranks share (what they
    agree on) plus noise of each rank's own, so that warm start and error feedback both
    matter."""
    g = torch.Generator().manual_seed(secret)
    out = []
    for case in cases:
        (n, m), p = case.shape, case.world_size
        grads: list[list[torch.Tensor]] = [[] for _ in range(p)]
        for _ in range(case.steps):
            shared = torch.randn(n, 2, generator=g) @ torch.randn(2, m, generator=g)
            for w in range(p):
                own = 0.5 * torch.randn(n, m, generator=g)
                grads[w].append((shared + own).to(case.dtype))
        out.append(grads)
    return out


# --- Part 3: the training run --------------------------------------------------------------

FEATURES, HIDDEN, CLASSES = 32, 256, 10
SAMPLES, BATCH, LR = 2048, 256, 0.2


@dataclass(frozen=True)
class TrainRun:
    """One measured training run: world size, seed (a label: the data are drawn from the
    check's secret), steps."""

    world_size: int = 4
    seed: int = 0
    steps: int = 60

    def __str__(self) -> str:
        return f"{self.world_size} ranks, seed {self.seed}, {self.steps} steps"


@dataclass(frozen=True)
class Problem:
    """What one run trains on, as the checking process drew it: SAMPLES points `x` labelled
    `y` by a random two-layer teacher, the MLP's initial parameters `start` (every rank's),
    and the global batch of each step (BATCH sample indices)."""

    x: torch.Tensor
    y: torch.Tensor
    start: list[torch.Tensor]
    batches: list[torch.Tensor]


def draw_problem(run: TrainRun, secret: int) -> Problem:
    """A classification problem and its MLP FEATURES -> HIDDEN -> CLASSES (two weight
    matrices, two bias vectors), from a secret no rank sees: a rank that knew the data could
    compute the whole batch's gradient alone, and send nothing."""
    g = torch.Generator().manual_seed(secret)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    w1, w2 = torch.randn(FEATURES, 64, generator=g), torch.randn(64, CLASSES, generator=g)
    start = [
        torch.randn(HIDDEN, FEATURES, generator=g) / FEATURES**0.5,
        torch.zeros(HIDDEN),
        torch.randn(CLASSES, HIDDEN, generator=g) / HIDDEN**0.5,
        torch.zeros(CLASSES),
    ]
    batches = [torch.randperm(SAMPLES, generator=g)[:BATCH] for _ in range(run.steps)]
    return Problem(x, (torch.tanh(x @ w1) @ w2).argmax(dim=1), start, batches)


def loss_of(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, b2 = params
    return F.cross_entropy(F.linear(torch.relu(F.linear(x, w1, b1)), w2, b2), y)


def shards(problem: Problem, world_size: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per rank, per step, its (x, y): an equal share of the step's global batch. The mean of
    the P shards' mean gradients is then the whole batch's."""
    out: list[list[tuple]] = [[] for _ in range(world_size)]
    for batch in problem.batches:
        for r, part in enumerate(batch.chunk(world_size)):
            out[r].append((problem.x[part].clone(), problem.y[part].clone()))
    return out


__all__ = [
    "PCase",
    "Problem",
    "QCase",
    "TrainRun",
    "draw_problem",
    "loss_of",
    "p_gradients",
    "q_inputs",
    "q_reference",
    "shards",
]
