"""Checks for Assignment 4, decentralized communication: push-sum gossip (SGP).

    check_push_sum(push_sum_step)
        push_sum_step(x, w, out_neighbors, in_neighbors) -> (x_new, w_new): one round of
        Stochastic Gradient Push's gossip. Each rank keeps the share 1 / (d + 1) of its x and
        w (d = len(out_neighbors)), sends one share of each to every out-neighbour, and adds
        what its in-neighbours sent. The totals of x and w over the ranks never change, and
        z = x / w converges to the average of the starting x on every rank.

Each round is compared with `push_sum_reference` (float64, from all ranks' inputs) on three
graphs: the directed exponential graph (rank i sends to i + 1, i + 2, i + 4, ...), its
one-peer version that changes every round (as SGP runs it), and an irregular graph where rank
0 sends to everyone, on which the weights w stop being 1 and really matter.

What the check trusts is computed or kept outside the ranks: every rank's starting x is drawn
here from a secret seed new for each call and each rank receives only its own
(`gossip_cases`); the reference is computed here from all of them (`gossip_judge`); the
messages are the calls each rank's process group reported to the launcher, round by round
(`_harness.calls_by_case`), and the bytes the kernel saw on its sockets must all be accounted
for by them (`_harness.judge_unreported`). What runs on a rank is in `gossip_ranks`.

Part 2's check, `check_one_peer_schedule(peer, push_sum_step)` (a schedule of one peer per
rank and round, graded by push-sum's consensus error), is in grading/gossip_schedule.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from course_lib import PerRank
from course_lib.grading._harness import (
    Verdict,
    calls_by_case,
    fail,
    judge_unreported,
    new_secret,
    run_on_ranks,
)
from course_lib.grading.gossip_cases import draw, push_sum_reference
from course_lib.grading.gossip_graphs import GRAPHS, in_neighbors, out_neighbors
from course_lib.grading.gossip_judge import TOLERANCE, judge_case
from course_lib.grading.gossip_ranks import Case, run_rounds
from course_lib.grading.gossip_schedule import check_one_peer_schedule

DEFAULT_WORLD_SIZES = (1, 2, 3, 4)


def check_push_sum(
    push_sum_step: Callable,
    *,
    world_sizes: Iterable[int] = DEFAULT_WORLD_SIZES,
    graphs: Iterable[str] = GRAPHS,
    rounds: int = 20,
    seeds: Iterable[int] = (0,),
    dtype: torch.dtype = torch.float64,
    timeout: float = 30.0,
) -> None:
    """`push_sum_step(x, w, out_neighbors, in_neighbors) -> (x_new, w_new)`, run for
    `rounds` rounds on each graph: each round equal to `push_sum_reference`, totals of x and
    w conserved, and every rank's z = x / w at the average of the starting x at the end."""
    __tracebackhide__ = True
    check = "check_push_sum"
    if not callable(push_sum_step):
        fail(check, f"expected your function, got {type(push_sum_step).__name__}")
    if dtype not in TOLERANCE:
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    graphs = list(graphs)
    for graph in graphs:
        if graph not in GRAPHS:
            raise ValueError(f"unknown graph {graph!r}: use one of {GRAPHS}")
    name = getattr(push_sum_step, "__name__", "push_sum_step")
    verdict, count = Verdict(check), 0
    secret = new_secret()
    for p in sorted(set(world_sizes)):
        cases = [Case(p, graph, rounds, seed, dtype) for seed in seeds for graph in graphs]
        starts = [draw(case, secret) for case in cases]  # [case][rank], never sent whole
        results, traffic = run_on_ranks(
            check,
            run_rounds,
            push_sum_step,
            cases,
            PerRank([[given[r] for given in starts] for r in range(p)]),
            world_size=p,
            timeout=timeout,
            what=f"your {name} (world size {p}, {len(cases)} cases)",
            traffic=True,
        )
        for found in results:
            if found["copied"]:
                fail(check, found["copied"])
        # One mark per round of every case, in order: calls[r][i * rounds + t].
        calls = calls_by_case(check, traffic.tallies, len(cases) * rounds)
        judge_unreported(check, traffic)
        for i, case in enumerate(cases):
            records = [results[r]["records"][i] for r in range(p)]
            in_case = [calls[r][i * rounds : (i + 1) * rounds] for r in range(p)]
            with verdict.case():
                judge_case(check, name, case, starts[i], records, in_case)
        count += len(cases)
    sizes = ", ".join(str(p) for p in sorted(set(world_sizes)))
    verdict.conclude(
        f"{count} case(s) on {sizes} rank(s) (graphs {', '.join(graphs)}; {rounds} rounds, "
        f"{str(dtype).removeprefix('torch.')}): every round equals push-sum on every rank, "
        "sends only to the round's out-neighbours and receives only from its in-neighbours, "
        "conserves the totals of x and w, and z = x / w ends at the average"
    )


__all__ = [
    "GRAPHS",
    "check_one_peer_schedule",
    "check_push_sum",
    "in_neighbors",
    "out_neighbors",
    "push_sum_reference",
]
