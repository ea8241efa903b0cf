"""Assignment 4's checks, what runs on each rank: the student's push-sum step on this rank's own
starting x, round after round (Part 1 on the check's graphs, Part 2 on the student's schedule),
and Part 2's schedule as this rank's `peer` gives it.

A rank holds nothing else. The other ranks' starting x are drawn in the checking process from
a secret seed and never sent here (`PerRank`), the reference rounds are computed there
(`gossip_cases`, `gossip_schedule.mix`), and the calls each rank makes are reported to the
launcher as they happen (`course_lib.counted_group`), after a mark that names the round they
belong to: the rank does not keep the tallies the checks judge by.

    Case                                  one run of Part 1: world size, graph, rounds, ...
    run_rounds(push_sum_step, cases, starts)   Part 1: every case, every round
    schedule_table(peer, world_size)      Part 2: the whole schedule, as this rank's peer says
    run_schedule(table, push_sum_step, x)      Part 2: push-sum on that schedule
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from course_lib import counted_group
from course_lib.grading.gossip_graphs import in_neighbors, out_neighbors
from course_lib.grading.provenance import Provenance
from course_lib.runtime import rank

# Lecture 4's module has a working push-sum step, and the checks' reference computes a round
# for every rank: an answer that runs them, or a copy, is not the student's own.
FORBIDDEN = ("course_lib.gossip", "course_lib.grading.gossip.push_sum_reference")
# Part 2 asks for a schedule of the student's own: the lecture's graphs (its ExponentialGraph,
# RandomPeer) and the grader's, and the reference mixing, are not.
FORBIDDEN_SCHEDULE = (
    "course_lib.gossip",
    "course_lib.grading.gossip.out_neighbors",
    "course_lib.grading.gossip.push_sum_reference",
    "course_lib.grading.gossip_schedule.mix",
)
SCHEDULE_SIZE = 5  # elements of x in Part 2


@dataclass(frozen=True)
class Case:
    """Gossip on one graph: world size, graph, rounds, seed, dtype, vector size. The seed only
    tells cases apart: the values come from it and a secret only the checking process holds."""

    world_size: int
    graph: str
    rounds: int
    seed: int
    dtype: torch.dtype = torch.float64
    size: int = 5

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"world size {self.world_size}, {self.graph} graph, seed {self.seed}, {dtype} x "
            f"of {self.size} elements"
        )


def well_formed(got, size: int, dtype: torch.dtype) -> bool:
    """A pair (x_new, w_new): x_new a `dtype` tensor of shape (size,), w_new one element."""
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        return False
    x, w = got
    return (
        isinstance(x, torch.Tensor)
        and x.shape == (size,)
        and x.dtype == dtype
        and isinstance(w, torch.Tensor)
        and w.numel() == 1
    )


def describe(got) -> str:
    """What a push-sum step returned, in a few words (for a wrong shape or type)."""
    if isinstance(got, (tuple, list)):
        inner = ", ".join(
            f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            for x in got
        )
        return f"{type(got).__name__} of ({inner})"
    return type(got).__name__


def _step(push_sum_step: Callable, x, w, outs: list[int], ins: list[int], size, dtype, at: str):
    """One call of the student's step, and what to report of it: a copy of (x_new, w_new)
    taken as it returns (the student's code holds no handle on what the judge sees: it is
    only ever given clones), or, if it is no such pair, a description. Also the (x, w) to
    feed to the next round: the new ones, or the old ones again, so that every rank runs
    every round and the messages of the rounds after it keep matching (the judge fails the
    round)."""
    try:
        got = push_sum_step(x.clone(), w.clone(), list(outs), list(ins))
    except BaseException as exc:
        if hasattr(exc, "add_note"):  # Python 3.11+: the traceback then names the round
            exc.add_note(f"(while checking: {at})")
        raise
    if not well_formed(got, size, dtype):
        return {"got": None, "described": describe(got)}, (x, w)
    new_x, new_w = got[0].detach().clone(), got[1].detach().clone().reshape(())
    return {"got": (new_x, new_w), "described": ""}, (new_x, new_w)


def run_rounds(push_sum_step: Callable, cases: list[Case], starts: list[torch.Tensor]) -> dict:
    """On each rank: every case, `rounds` rounds each, from this rank's own starting x (one per
    case), each round's output fed back to the next. Before each round a mark goes to the
    launcher, so that the calls reported after it count for that round."""
    with Provenance(FORBIDDEN) as seen:
        me, label, records = rank(), 0, []
        for case, x in zip(cases, starts, strict=True):
            p, w, rounds = case.world_size, torch.ones((), dtype=case.dtype), []
            for t in range(case.rounds):
                counted_group.mark(label)
                label += 1
                outs, ins = out_neighbors(case.graph, me, p, t), in_neighbors(case.graph, me, p, t)
                at = f"{case}, round {t}"
                record, (x, w) = _step(push_sum_step, x, w, outs, ins, case.size, case.dtype, at)
                rounds.append(record)
            records.append(rounds)
        counted_group.mark(label)  # what comes after the last round belongs to none
    return {"records": records, "copied": seen.complaint()}


def schedule_table(peer: Callable, world_size: int, rounds: int) -> dict:
    """On each rank: the whole schedule, as this rank's `peer` gives it."""
    with Provenance(FORBIDDEN_SCHEDULE) as seen:
        table = [[peer(r, world_size, t) for r in range(world_size)] for t in range(rounds)]
    return {"table": table, "copied": seen.complaint()}


def run_schedule(table: list[list[int]], push_sum_step: Callable, x: torch.Tensor) -> dict:
    """On each rank: push-sum on the (judged) schedule from this rank's own starting x, each
    round's result, with a mark before each round as in `run_rounds`."""
    with Provenance(FORBIDDEN_SCHEDULE) as seen:
        me, w, records = rank(), torch.ones((), dtype=torch.float64), []
        for t, peers in enumerate(table):
            counted_group.mark(t)
            ins = [j for j, q in enumerate(peers) if q == me]
            at = f"world size {len(peers)}, round {t}"
            record, (x, w) = _step(
                push_sum_step, x, w, [peers[me]], ins, SCHEDULE_SIZE, torch.float64, at
            )
            records.append(record)
        counted_group.mark(len(table))
    return {"records": records, "copied": seen.complaint()}
