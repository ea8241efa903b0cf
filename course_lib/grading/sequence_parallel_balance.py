"""Part of Assignment 11's checks (grading/sequence_parallel.py): the causal backward pass,
balanced, on the student's own layout.

With a causal mask and contiguous shards, rank P-1's queries see the whole sequence and rank
0's only its own tokens: the last rank works about P times as long as the first. Part 5 lets
the student choose which tokens each rank holds (`layout(tokens, world_size)`) and how to
compute the backward pass on them; this part judges the layout and what each rank computed,
as `course_lib.meters.Meter` measured it on the rank, around the student's call only.

The minimum (`causal_backward_flops`): the five products of attention's backward (the scores
again, then dV, dP, dQ and dK) over the visible (query, key) pairs only, 5 h d N (N + 1)
FLOPs for N tokens, h heads of size d. A balanced, economical answer keeps every rank within
BALANCE of the ranks' mean and the total within WORK times the minimum (every score
computed, then half of them masked, costs about twice the minimum). Work done outside torch
is not seen: the total must reach the minimum, and calls that turn floating-point tensors
into numpy arrays or Python numbers, or that switch the meter off, are refused
(`sequence_parallel_ranks.Watch`).
"""

from __future__ import annotations

from course_lib.grading._harness import fail
from course_lib.grading.sequence_parallel_cases import Case

BALANCE = 1.1  # the busiest rank's work / the ranks' mean, at most
WORK = 1.8  # the ranks' total work / the causal minimum, at most
HEADS, HEAD_DIM = 2, 32
TOKENS_PER_RANK = (8, 16)  # N = 8 P and 16 P: multiples of 2P


def causal_backward_flops(tokens: int, heads: int, head_dim: int) -> int:
    """The causal minimum of the backward pass: FLOPs of its five products over the visible
    (query, key) pairs only. Row i sees i + 1 keys, 2 d FLOPs a pair for each product:
    5 h d N (N + 1) in all."""
    return 5 * heads * head_dim * tokens * (tokens + 1)


def balance_tokens(P: int) -> list[int]:
    """The sequence lengths of Part 5's cases on P ranks: 8 P and 16 P tokens."""
    return [n * P for n in TOKENS_PER_RANK]


def balance_cases(P: int, layouts: dict[int, list[list[int]]]) -> list[Case]:
    """Part 5's cases on P ranks, causal, on the student's layout for each length."""
    return [
        Case(P, HEADS, n, HEAD_DIM, True, seed=n, positions=tuple(map(tuple, layouts[n])))
        for n in balance_tokens(P)
    ]


def layout_problem(layouts: list, tokens: int, P: int) -> str | None:
    """What is wrong with the layouts the ranks computed for `tokens`, or None."""
    first = layouts[0]
    if any(other != first for other in layouts[1:]):
        return "the ranks computed different layouts; layout() must depend on its arguments only"
    if not isinstance(first, list) or len(first) != P:
        return f"layout({tokens}, {P}) must return a list of {P} 1-D integer tensors, got {first}"
    for r, shard in enumerate(first):
        if not isinstance(shard, list) or not all(isinstance(i, int) for i in shard):
            return f"layout({tokens}, {P})[{r}] is {shard!r:.60}, not a 1-D integer tensor"
        if len(shard) != tokens // P:
            return (
                f"layout({tokens}, {P})[{r}] holds {len(shard)} positions; every rank holds "
                f"tokens // world_size = {tokens // P}"
            )
    held = sorted(i for shard in first for i in shard)
    if held != list(range(tokens)):
        return (
            f"layout({tokens}, {P}) is not a partition of the positions 0..{tokens - 1}: "
            "every position must be held by exactly one rank"
        )
    return None


def work_ratios(case: Case, records: list[dict]) -> tuple[float, float]:
    """(the busiest rank's work / the ranks' mean, the total / the causal minimum)."""
    work = [record["work"] for record in records]
    least = causal_backward_flops(case.tokens, case.heads, case.head_dim)
    return max(work) * len(work) / max(sum(work), 1), sum(work) / least


def judge_work(check: str, case: Case, records: list[dict]) -> None:
    """The "work" property: the total is at least the causal minimum (else the meter missed
    some) and at most WORK times it."""
    __tracebackhide__ = True
    total = sum(record["work"] for record in records)
    least = causal_backward_flops(case.tokens, case.heads, case.head_dim)
    if total < least:
        fail(
            check,
            f"{case}: your ranks' torch operations add up to {total:,} FLOPs, less than the "
            f"{least:,} that the backward pass's five products need: some of the work was "
            "done where the meter cannot see it. Compute with torch operations on tensors.",
            prop="work",
        )
    if total > WORK * least:
        fail(
            check,
            f"{case}: the ranks did {total:,} FLOPs in all, {total / least:.2f} x the causal "
            f"minimum {least:,}; at most {WORK:g} x. Scores the mask hides are work too: "
            "skip them rather than compute and mask them.",
            prop="work",
        )


def judge_balance(check: str, case: Case, records: list[dict]) -> None:
    """The "balance" property: the busiest rank within BALANCE of the ranks' mean."""
    __tracebackhide__ = True
    work = [record["work"] for record in records]
    busiest, share = max(range(len(work)), key=work.__getitem__), work_ratios(case, records)[0]
    if share > BALANCE:
        fail(
            check,
            f"{case}: rank {busiest} did {work[busiest]:,} FLOPs, {share:.2f} x the ranks' "
            f"mean; at most {BALANCE:g} x (per rank: {', '.join(f'{w:,}' for w in work)}). "
            "Which queries see the most keys, and which rank holds them?",
            prop="balance",
        )


__all__ = [
    "BALANCE",
    "HEADS",
    "HEAD_DIM",
    "TOKENS_PER_RANK",
    "WORK",
    "balance_cases",
    "balance_tokens",
    "causal_backward_flops",
    "judge_balance",
    "judge_work",
    "layout_problem",
    "work_ratios",
]
