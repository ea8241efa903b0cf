"""Assignment 11's checks, judging in the checking process: what the ranks returned for one
case against the gradients torch's autograd gives on one process, and their communication
(as the launcher's tallies saw it) and memory against the rules of each part.

    communication(calls)        what one rank's calls in one case add up to
    judge_result                dq, dk, dv of every rank, against autograd
    judge_ring                  send/recv only, ring neighbours only, at most `ring_budget`
    judge_memory                no rank holds more on P ranks than on fewer (GROWTH_BLOCKS)
    judge_ulysses               all-to-alls only, at most `ulysses_budget`
    judge_refusal               heads that do not split: a ValueError, before any message
"""

from __future__ import annotations

from collections import Counter

import torch

from course_lib import compare
from course_lib.comm import POINT_TO_POINT
from course_lib.grading._harness import fail
from course_lib.grading.sequence_parallel_cases import (
    GRADIENTS,
    GROWTH_BLOCKS,
    HOP_BYTES,
    Case,
    expected,
    ring_budget,
    ulysses_budget,
)
from course_lib.grading.traffic import Sent

# float64: the blocks add the same terms as one process in another order, which moves the
# gradients by ~1e-15; a block missed, or a gradient left on the wrong rank, by 1e-2 or more.
RTOL, ATOL = 1e-9, 1e-12
ULYSSES_CALLS = (*POINT_TO_POINT, "all_to_all", "all_to_all_single")


def communication(calls: list[Sent]) -> dict:
    """What one rank's calls in one case add up to, from the launcher's tallies."""
    return {
        "ops": Counter(call.op for call in calls),
        "sent": sum(call.sent for call in calls),
        "peers": [(call.op, call.peer) for call in calls if call.op in POINT_TO_POINT],
    }


def _span(case: Case, r: int) -> str:
    held = case.held(r)
    if case.positions is None and held:
        return f"tokens {held[0]}..{held[-1]}"
    return f"{len(held)} tokens"


def judge_result(check: str, name: str, case: Case, records: list[dict], solved: dict) -> None:
    """Every rank's dq, dk and dv equal its rows of autograd's on one process."""
    __tracebackhide__ = True
    want = [expected(case, solved, r) for r in range(case.world_size)]
    for r, record in enumerate(records):
        at = f"{case}: rank {r} ({_span(case, r)})"
        if record.get("missing"):
            fail(
                check,
                f"{at}: the meter was switched off (not on torch's dispatch stack at: "
                f"{', '.join(record['missing'])}); the measurement must see your whole call",
            )
        if record["raised"] is not None:
            fail(check, f"{at}: your {name} raised ValueError({record['raised']!r})")
        if record["grads"] is None:
            fail(
                check,
                f"{at}: your {name} returned {record['returned']}; return this rank's "
                "(dq, dk, dv), three tensors shaped like its q, k and v",
            )
        got = dict(zip(GRADIENTS, record["grads"], strict=True))
        problem = compare.find_mismatch(got, want[r], rtol=RTOL, atol=ATOL)
        if problem:
            fail(check, f"{at}: {problem}.\n{_hint(case, got, want, r)}")


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, RTOL, ATOL)


def _hint(case: Case, got: dict, want: list[dict], r: int) -> str:
    """What to try, from the shape of the mistake."""
    P = case.world_size
    wrong = [g for g in GRADIENTS if not _close(got[g], want[r][g])]
    if wrong == ["dk", "dv"] or wrong == ["dk"] or wrong == ["dv"]:
        for other in {(r - 1) % P, (r + 1) % P} - {r}:
            if all(_close(got[g], want[other][g]) for g in wrong):
                return (
                    f"Hint: rank {r} returned the {' and '.join(wrong)} of rank {other}'s "
                    f"keys. Each rank returns the gradients of its own keys and values: where "
                    "are they when every rank's queries have been through them?"
                )
        return (
            f"Hint: dq is right but {' and '.join(wrong)} not. The gradient of a rank's keys "
            "and values sums what every query that sees them contributes, on every rank."
        )
    if case.causal:
        return (
            "Hint: the causal mask is by position in the whole sequence: a query at position i "
            "sees the keys at positions <= i, whichever rank holds them."
        )
    return (
        "Hint: compare with torch.autograd on one process (the set-up cell's attention) to "
        "see which of dq, dk and dv is off, and for which keys."
    )


def judge_ring(check: str, case: Case, comms: list[dict]) -> None:
    """The "ring" property: send/recv only, ring neighbours only, at most `ring_budget`."""
    __tracebackhide__ = True
    P, budget = case.world_size, ring_budget(case)
    for r, seen in enumerate(comms):
        others = sorted(set(seen["ops"]) - set(POINT_TO_POINT))
        if others:
            fail(
                check,
                f"{case}: rank {r} called {', '.join(f'dist.{op}' for op in others)}; the ring "
                "passes its messages with dist.send/recv/isend/irecv only",
                prop="ring",
            )
        neighbours = {(r - 1) % P, (r + 1) % P}
        for op, peer in seen["peers"]:
            if peer not in neighbours:
                who = "any rank (no src given)" if peer is None else f"rank {peer}"
                fail(
                    check,
                    f"{case}: rank {r} called dist.{op} with {who}; in a ring each rank talks "
                    f"only to its neighbours, here ranks {sorted(neighbours)}",
                    prop="ring",
                )
        if seen["sent"] > budget:
            fail(
                check,
                f"{case}: rank {r} sent {seen['sent']:,} bytes; the ring's backward sends at "
                f"most {budget:,} here: 4(P-1) + 2 = {4 * P - 2} blocks of "
                f"{case.block_bytes():,} bytes, plus per round 16 bytes per token per head and "
                f"{HOP_BYTES} bytes. What does each hop need to carry, and what can stay?",
                prop="ring",
            )


def busiest(records: list[dict]) -> tuple[int, int]:
    """(the rank whose call held the most at its peak, those bytes)."""
    peaks = [record["peak"] for record in records]
    r = max(range(len(peaks)), key=peaks.__getitem__)
    return r, peaks[r]


def memory_allowed(case: Case, baseline: int) -> int:
    """The most a rank's call may hold on `case.world_size` ranks: the busiest rank's peak on
    the baseline's ranks, with the same shard size (`baseline`), and GROWTH_BLOCKS more."""
    return baseline + GROWTH_BLOCKS * case.block_bytes()


def judge_memory(check: str, case: Case, records: list[dict], baseline: tuple[int, int]) -> None:
    """The "memory" property: what the busiest rank held at its peak does not grow with the
    world size. `baseline` is (the ranks compared with, the busiest rank's peak there)."""
    __tracebackhide__ = True
    fewest, base = baseline
    r, peak = busiest(records)
    allowed = memory_allowed(case, base)
    if peak > allowed:
        fail(
            check,
            f"{case}: rank {r}'s call held {peak:,} bytes of tensors at its peak, "
            f"{peak - base:,} more than the busiest rank on {fewest} ranks with the same "
            f"shard size ({base:,}); at most {GROWTH_BLOCKS} block ({case.block_bytes():,} "
            "bytes) more: what a rank holds must not grow with the number of ranks. A rank "
            "that keeps every K/V block it receives holds 2(P-1) blocks more than one that "
            "passes them on: what must a rank keep, and for how long?",
            prop="memory",
        )


def judge_ulysses(check: str, case: Case, comms: list[dict]) -> None:
    """The "all-to-all" property: all-to-alls or sends/receives only, at most the budget."""
    __tracebackhide__ = True
    budget = ulysses_budget(case)
    for r, seen in enumerate(comms):
        others = sorted(set(seen["ops"]) - set(ULYSSES_CALLS))
        if others:
            fail(
                check,
                f"{case}: rank {r} called {', '.join(f'dist.{op}' for op in others)}; Ulysses "
                "swaps shards with all-to-alls only (dist.all_to_all, dist.all_to_all_single, "
                "or dist.send/recv/isend/irecv)",
                prop="all-to-all",
            )
        if seen["sent"] > budget:
            fail(
                check,
                f"{case}: rank {r} sent {seen['sent']:,} bytes; at most {budget:,} here: "
                "seven all-to-alls of this rank's q-sized block and one of two numbers per "
                f"row, plus {HOP_BYTES} bytes per peer. Does every piece go only to the rank "
                "that needs it, once?",
                prop="all-to-all",
            )


def judge_refusal(check: str, name: str, case: Case, records: list[dict], comms: list) -> None:
    """Heads not divisible by the world size: every rank raises a ValueError, before any
    message."""
    __tracebackhide__ = True
    for r, record in enumerate(records):
        if record["raised"] is None:
            fail(
                check,
                f"{case}: rank {r}: your {name} returned {record['returned']} instead of "
                f"raising a ValueError: {case.heads} heads cannot be split over "
                f"{case.world_size} ranks. Check the heads against world_size() first and "
                "raise ValueError with a message that says so.",
            )
        if sum(comms[r]["ops"].values()):
            calls = ", ".join(f"dist.{op}" for op in sorted(comms[r]["ops"]))
            fail(
                check,
                f"{case}: rank {r} raised the ValueError only after calling {calls}; raise it "
                "before any message, so that no rank waits for one that never comes",
            )


__all__ = [
    "ATOL",
    "RTOL",
    "communication",
    "busiest",
    "judge_memory",
    "memory_allowed",
    "judge_refusal",
    "judge_result",
    "judge_ring",
    "judge_ulysses",
]
