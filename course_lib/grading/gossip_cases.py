"""Assignment 4's cases, drawn and solved in the checking process: every rank's starting x, from
a secret seed new for every call of a check, and push-sum's rounds computed from all of them.

The ranks that run the student's code receive only their own starting x (`PerRank`), never the
others' nor the reference: a rank can neither look them up in its process nor regenerate them
from a seed, so a right round must come from the messages.

    draw(case, secret)                     every rank's starting x for one case of Part 1
    push_sum_reference(xs, ws, graph, t)   one round for every rank at once, float64
    reference_gap(case, starts)            how close push-sum itself gets to the average
"""

from __future__ import annotations

import torch

from course_lib.grading.gossip_graphs import out_neighbors
from course_lib.grading.gossip_ranks import Case


def draw(case: Case, secret: int) -> list[torch.Tensor]:
    """Every rank's starting x: random, and rank r's centred on r, so that the average is no
    rank's own."""
    g = torch.Generator().manual_seed(secret ^ (1_009 * case.seed + 3))
    return [
        (torch.randn(case.size, generator=g, dtype=torch.float64) * 3 + r).to(case.dtype)
        for r in range(case.world_size)
    ]


def push_sum_reference(
    xs: list[torch.Tensor], ws: list[torch.Tensor], graph: str, round_: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One push-sum round for all ranks at once, in float64: rank j's x and w are split into
    d_j + 1 equal shares, one kept and one sent to each out-neighbour; shares are added up."""
    p = len(xs)
    new_x = [torch.zeros_like(xs[0], dtype=torch.float64) for _ in range(p)]
    new_w = [torch.zeros((), dtype=torch.float64) for _ in range(p)]
    for j in range(p):
        targets = out_neighbors(graph, j, p, round_)
        share = 1.0 / (len(targets) + 1)
        for i in [j, *targets]:
            new_x[i] += share * xs[j].double()
            new_w[i] += share * ws[j].double()
    return new_x, new_w


def reference_gap(case: Case, starts: list[torch.Tensor]) -> float:
    """max |z - average| of the float64 reference after all the rounds."""
    average = sum(x.double() for x in starts) / len(starts)
    xs = [x.double() for x in starts]
    ws = [torch.ones((), dtype=torch.float64) for _ in starts]
    for t in range(case.rounds):
        xs, ws = push_sum_reference(xs, ws, case.graph, t)
    return max((x / w - average).abs().max().item() for x, w in zip(xs, ws, strict=True))
