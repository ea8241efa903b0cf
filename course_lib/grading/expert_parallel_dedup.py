"""Part of Assignment 12's checks (grading/expert_parallel.py): Part 4, each token sent once
to each rank.

Part 1's layer sends a token's row once for every kept choice whose expert lives on another
rank, and gets one output back for each. With k = 2, a token whose two kept experts live on
the same rank needs to cross to that rank only once: that rank can apply both experts and
send back one vector (their gate-weighted sum), or send back both outputs. Which is the
student's design; the check measures the bytes.

    dedup_cases(P, seeds)           4 experts a rank, k = 2, d_model 64, a paired router
    rank_rows(case, chosen, kept)   [P, P]: distinct (token, rank) pairs between ranks
    row_bytes(case, rows)           what Part 1's layer sends in token rows, all ranks
    typical(case, solved)           a draw as the notebook describes the cases
    judge_dedup(check, case, comms, rows)   every byte sent, against DEDUP_FRACTION of it

The cases' router is `paired` (`expert_parallel_cases.layer`): experts 2i and 2i + 1 have
nearly the same router row, so a token's two most probable experts are mostly such a pair,
and a pair lives on one rank (E/P = 4). On one process the layer is the same as Part 1's;
only where the chosen experts sit changes, and with it what deduplication saves.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from course_lib.grading._harness import fail
from course_lib.grading.expert_parallel_cases import Case, lengths
from course_lib.grading.expert_parallel_judge import ITEMSIZE, judge_calls

# Sending each (token, rank) once saves about half of Part 1's dispatch on these cases, and
# combining on the experts' rank half of its combine: 0.52-0.56 of Part 1's token rows with
# one row back per (token, rank), 0.77-0.81 with one per (token, expert), counts and gates
# included (measured on the notebook's draws of seeds 0-2; on the checks' secret draws, which
# `typical` keeps, up to 0.63 and 0.84: tests/test_grading_expert_parallel_dedup.py). Part 1's
# layer sends 1.0 and a little more; every token to every rank over 0.9 on 2 ranks, 2.0 on 4.
DEDUP_FRACTION = 0.85


def dedup_cases(P: int, seeds: Iterable[int]) -> list[Case]:
    """k = 2 on 4 experts a rank, rows of 64 numbers, a paired router; a capacity factor
    that drops nothing (E / k: C = T) and one that drops choices (1.0); T not divisible by
    P."""
    E = 4 * P
    return [
        Case(P, 16 * P + 1 + s, E, 2, factor, s, d_model=64, paired=True)
        for s in seeds
        for factor in (E / 2, 1.0)
    ]


def rank_rows(case: Case, chosen: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """[P, P]: tokens of rank i with at least one kept choice among rank j's experts, each
    counted once, the fewest token rows rank i must send rank j."""
    P, per = case.world_size, case.n_experts // case.world_size
    rows = torch.zeros(P, P, dtype=torch.long)
    start = 0
    for i, n in enumerate(lengths(case)):
        for t in range(start, start + n):
            for j in {int(e) // per for e in chosen[t][kept[t]]}:
                rows[i, j] += 1
        start += n
    return rows


# What a draw of the cases must show (`typical`): the pairs make at most this share of the
# kept choices between ranks distinct (token, rank) rows. Over 1,440 random draws it was
# 0.50-0.52 typically, 0.56 at the 99th percentile and 0.59 at most; a rarer draw is drawn
# again, so that one (token, rank) row per pair with every expert's output back, about
# 0.5 + 0.53 of this share plus the counts (0.03 at most), stays under DEDUP_FRACTION.
DISTINCT_SHARE = 0.58


def typical(case: Case, solved: dict) -> bool:
    """Does a draw of a case (`expert_parallel_cases.solve`) look as the notebook says: the
    factor 1.0 drops choices and E / k none, and at most DISTINCT_SHARE of the kept choices
    between ranks are distinct (token, rank) rows?"""
    chosen, kept = solved["chosen"], solved["kept"]
    between = solved["kept_rows"].sum() - solved["kept_rows"].diagonal().sum()
    distinct = rank_rows(case, chosen, kept)
    distinct = distinct.sum() - distinct.diagonal().sum()
    drops = bool((~kept).any())
    return drops == (case.capacity_factor == 1.0) and distinct <= DISTINCT_SHARE * between


def row_bytes(case: Case, rows: torch.Tensor) -> int:
    """Bytes of token rows that go between ranks in one forward, all ranks together, for
    `rows[i, j]` rows from rank i to rank j each way (dispatch there, combine back)."""
    between = int(rows.sum() - rows.diagonal().sum())
    return 2 * between * case.d_model * ITEMSIZE


def judge_dedup(check: str, case: Case, comms: list[dict], rows: torch.Tensor) -> float:
    """The "bytes" property: Part 3's message rules, and every byte all ranks send in the
    forward (the launcher's tallies, `expert_parallel_judge.communication`) at most
    DEDUP_FRACTION of what Part 1's layer sends in token rows (`rows`: its kept choices per
    pair of ranks, `kept_rows`). Returns the share measured."""
    __tracebackhide__ = True
    judge_calls(check, case, comms, "bytes")
    part1 = row_bytes(case, rows)
    sent = sum(seen["sent"] for seen in comms)
    allowed = int(DEDUP_FRACTION * part1)
    if sent > allowed:
        fail(
            check,
            f"{case}: the ranks sent {sent:,} bytes together in the forward; at most "
            f"{allowed:,} allowed ({DEDUP_FRACTION:.0%} of the {part1:,} bytes of token rows "
            "that one row per (token, expert) sends, dispatch and combine). Does a token "
            "whose kept experts share a rank cross to that rank only once?",
            prop="bytes",
        )
    return sent / part1
