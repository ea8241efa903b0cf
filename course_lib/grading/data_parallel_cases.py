"""Assignment 3's training runs, drawn in the checking process: every rank's samples and
initial weights, what each rank is given, and the cases its calls are told apart by.

A rank receives only its own shards and its own initial weights (`PerRank`), never the others'
nor the seed they come from: with nothing on a rank to copy, the full-batch gradient must come
from the messages, and (Part 2) rank 0's weights from a broadcast. The secret is new for each
call of a check.

    draw(runs, ranks)                    every run's samples and weights, for every rank
    given(kind, runs, drawn)             what each rank receives (a PerRank value per rank)
    cases(kind, runs, drawn)             the labels of the cases the ranks mark, in order
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from course_lib.grading._harness import new_secret
from course_lib.grading.data_parallel_runs import (
    DDPRun,
    RankRun,
    build_model,
    draw_shard,
    loss_scale,
    per_sample_loss,
    shard_sizes,
)


@dataclass(frozen=True)
class Drawn:
    """One run as the checking process drew it: `seeds[r]`, rank r's initial weights in Part
    2 (rank 0's are everyone's in Part 1 and the reference's); `shards[s][r]`, rank r's (x, y)
    at step s; `gradients`, how many parameters get a gradient in each backward."""

    seeds: list[int]
    shards: list[list[tuple[torch.Tensor, torch.Tensor]]]
    gradients: int


def _gradients(run: DDPRun, seed: int, shards: list[tuple]) -> int:
    """The trainable parameters that get a gradient in a backward of `run`'s model."""
    model = build_model(run, seed)
    x, y = (torch.cat(parts) for parts in zip(*shards, strict=True))
    per_sample_loss(run, model(x), y).mean().backward()
    return sum(p.grad is not None for p in model.parameters() if p.requires_grad)


def draw(runs: list[DDPRun], ranks: int) -> list[Drawn]:
    """Every run's weights and samples, from a secret no rank ever sees."""
    g = torch.Generator().manual_seed(new_secret())

    def seed() -> int:
        return int(torch.randint(2**62, (), generator=g))

    out = []
    for run in runs:
        seeds = [seed() for _ in range(ranks)]
        shards = [
            [draw_shard(run, n, seed()) for n in shard_sizes(run, ranks, s)]
            for s in range(run.steps)
        ]
        out.append(Drawn(seeds, shards, _gradients(run, seeds[0], shards[0])))
    return out


def rank_run(run: DDPRun, drawn: Drawn) -> RankRun:
    return RankRun(run.model, run.optimizer, run.dtype, run.cap_mb(), drawn.gradients)


def given(kind: str, runs: list[DDPRun], drawn: list[Drawn], ranks: int) -> list[list[dict]]:
    """Per rank, per run, what it receives: the seed of its initial weights (rank 0's in Part
    1, its own in Part 2) and, per step, its shard and Part 2's loss scale."""
    out = []
    for r in range(ranks):
        mine = []
        for run, d in zip(runs, drawn, strict=True):
            steps = []
            for s, shards in enumerate(d.shards):
                x, y = shards[r]
                steps.append({"x": x, "y": y, "scale": loss_scale(shard_sizes(run, ranks, s))})
            mine.append({"seed": d.seeds[r] if kind == "ddp" else d.seeds[0], "steps": steps})
        out.append(mine)
    return out


def cases(kind: str, runs: list[DDPRun], drawn: list[Drawn]) -> list[tuple]:
    """The cases, in the order the ranks mark them (`data_parallel_rank`). Part 1: each step.
    Part 2, per run: the construction, then per step its forward (with zero_grad), backward
    until its first gradient, after each of its `gradients` gradients (the check's own hook,
    which runs before any other, marks it), and the synchronization."""
    out: list[tuple] = []
    for i, (run, d) in enumerate(zip(runs, drawn, strict=True)):
        if kind == "ddp":
            out.append(("construction", i, None, None))
        for s in range(run.steps):
            if kind != "ddp":
                out.append(("step", i, s, None))
                continue
            out.append(("forward", i, s, None))
            out += [("backward", i, s, k) for k in range(d.gradients + 1)]
            out.append(("sync", i, s, None))
    return out
