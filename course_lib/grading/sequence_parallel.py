"""Checks for Assignment 11, sequence parallelism: attention over tokens split across ranks.

    check_ring_attention(ring_attention, causal=False)   equal to attention on one process
    check_ring_traffic(ring_attention)                   K/V pass between ring neighbours only
    check_ulysses_attention(ulysses_attention)           two all-to-alls; ValueError if H % P
    check_balanced_attention(layout, attention)          causal, every rank's work measured

Each rank holds chunk r of `torch.tensor_split` of the tokens of q, k, v, shaped (heads,
tokens, head_dim), float64 (the shards differ by a token when P does not divide the length;
every shard holds at least one). The student's function returns this rank's (heads, n_local,
head_dim) rows of softmax(q k^T / sqrt(head_dim)) v, a query at position i seeing keys at
positions <= i when causal. The reference is that formula on the whole sequence, in float64,
in the checking process (`reference`): never the lecture's code.

Ring rules (`check_ring_traffic`): only dist.send/recv/isend/irecv, each rank talking to its
two neighbours (r - 1, r + 1 mod P) only, and sending at most the K and V of P - 1 blocks
(`costs.ring_attention_bytes` for even shards; all blocks but the smallest for uneven ones)
plus, per hop, 8 bytes per token of the block and 64 bytes (lengths, positions); no tensor on
a rank larger than a block of scores or one K/V message (`largest_tensor`). Ulysses rules:
all-to-alls (dist.all_to_all, dist.all_to_all_single, or sends and receives), at most
`costs.ulysses_bytes` (four all-to-alls of this rank's q-sized tensor) plus 64 bytes a peer.
Balance rules (`check_balanced_attention`, in `sequence_parallel_balance`): the student's
layout, each rank's floating-point work measured, within `BALANCE` of the mean and `WORK`
times the causal minimum.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from course_lib import compare
from course_lib.costs import ring_attention_bytes, ulysses_bytes
from course_lib.grading._harness import RESULT, CheckFailed, Verdict, fail, run_on_ranks
from course_lib.grading.sequence_parallel_balance import (
    BALANCE,
    WORK,
    WorkMeter,
    balance_cases,
    causal_attention_flops,
    judge_balance,
    judge_balanced_result,
    judge_work,
    layout_problem,
    run_balanced,
    run_layout,
    work_ratios,
)
from course_lib.grading.sequence_parallel_ranks import (
    ATOL,
    POINT_TO_POINT,
    RTOL,
    Case,
    inputs,
    run_cases,
    shard,
)

# The ring's points: the result must be right (it gates), the traffic is what scores.
RING_WEIGHTS = {RESULT: 0.0, "ring": 1.0}
# Ulysses: half for the result (and the ValueError), half for communicating by all-to-all.
ULYSSES_WEIGHTS = {RESULT: 0.5, "all-to-all": 0.5}
ULYSSES_CALLS = (*POINT_TO_POINT, "all_to_all", "all_to_all_single")
HOP_BYTES = 64  # per hop (ring) or per peer (Ulysses): lengths and the like
ITEMSIZE = 8  # float64


def reference(case: Case) -> torch.Tensor:
    """Attention on one process over the whole sequence, float64: (heads, tokens, head_dim)."""
    q, k, v = inputs(case)
    scores = q @ k.transpose(-2, -1) / math.sqrt(case.head_dim)
    if case.causal:
        future = torch.ones(case.tokens, case.tokens, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def lengths(case: Case) -> list[int]:
    """Tokens on each rank: torch.tensor_split's chunks."""
    return [len(c) for c in torch.arange(case.tokens).tensor_split(case.world_size)]


def ring_budget(case: Case) -> int:
    """Bytes a rank may send in ring attention: the K and V of every block but the smallest
    (exactly `ring_attention_bytes` of the whole K and V when the shards are even), plus per
    hop 8 bytes per token of the largest block and `HOP_BYTES`."""
    P, n = case.world_size, lengths(case)
    block = 2 * case.heads * case.head_dim * ITEMSIZE  # K and V of one token
    if len(set(n)) == 1:
        kv = int(ring_attention_bytes(block * case.tokens, P))
    else:
        kv = block * (case.tokens - min(n))
    return kv + (P - 1) * (ITEMSIZE * max(n) + HOP_BYTES)


def largest_tensor(case: Case, r: int) -> int:
    """Elements the largest tensor on rank r may hold in ring attention: a block of scores
    (heads x n_r x the longest shard) or one K/V message (2 x heads x the longest shard x
    head_dim, plus a position per token and 8 numbers), whichever is larger."""
    n, heads, d = lengths(case), case.heads, case.head_dim
    return max(heads * n[r] * max(n), 2 * heads * max(n) * d + max(n) + 8)


def ulysses_budget(case: Case) -> int:
    """Bytes a rank may send in Ulysses: four all-to-alls of its (heads, n_local, head_dim)
    tensor, `costs.ulysses_bytes`, plus `HOP_BYTES` per peer."""
    local = case.heads * max(lengths(case)) * case.head_dim * ITEMSIZE
    return int(ulysses_bytes(local, case.world_size)) + HOP_BYTES * (case.world_size - 1)


def _run(check: str, fn: Callable, cases: list[Case], P: int, timeout: float, name: str) -> list:
    """Every case on P ranks; each case's records, one per rank."""
    __tracebackhide__ = True
    if not callable(fn):
        fail(check, f"expected your function, got {type(fn).__name__} {fn!r:.60}")
    found = run_on_ranks(
        check,
        run_cases,
        fn,
        cases,
        world_size=P,
        timeout=timeout,
        what=f"your {name} (world size {P}, {len(cases)} cases)",
    )
    if found[0]["copied"]:
        fail(check, found[0]["copied"])
    return [[per_rank["cases"][i] for per_rank in found] for i in range(len(cases))]


def judge_result(check: str, name: str, case: Case, records: list[dict]) -> None:
    """Every rank's output equals its rows of the single-process attention."""
    __tracebackhide__ = True
    want = reference(case)
    for r, record in enumerate(records):
        at = f"{case}: rank {r}"
        if record["raised"] is not None:
            fail(check, f"{at}: your {name} raised ValueError({record['raised']!r})")
        if record["out"] is None:
            fail(
                check,
                f"{at}: your {name} returned {record['returned']}; return this rank's "
                "(heads, n_local, head_dim) output tensor",
            )
        expected = shard(want, r, case.world_size)
        problem = compare.find_mismatch(
            {"output": record["out"]}, {"output": expected}, rtol=RTOL, atol=ATOL
        )
        if problem:
            fail(check, f"{at} (tokens {_span(case, r)}): {problem}.\n{_hint(case, record, r)}")


def _span(case: Case, r: int) -> str:
    n = lengths(case)
    start = sum(n[:r])
    return f"{start}..{start + n[r] - 1}"


def _hint(case: Case, record: dict, r: int) -> str:
    """What to try, from the shape of the mistake."""
    out = record["out"]
    q, k, v = (shard(x, r, case.world_size) for x in inputs(case))
    local = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(case.head_dim), dim=-1) @ v
    same = out.shape == local.shape and out.dtype == local.dtype
    if same and not case.causal and torch.allclose(out, local):
        return "Hint: this is attention over this rank's own tokens only: did K/V go around?"
    if case.causal:
        return (
            "Hint: the causal mask is by global positions: a block from an earlier rank is "
            "wholly visible, a later rank's wholly hidden, and only the diagonal block (this "
            "rank's own K/V) needs the triangle. Which rank's block does each step hold?"
        )
    return (
        "Hint: when a block raises a row's maximum, rescale the running sum and output by "
        "exp(old max - new max) before adding the block's; and every block must be seen once."
    )


def judge_ring(check: str, case: Case, records: list[dict]) -> None:
    """The "ring" property: point-to-point only, neighbours only, at most `ring_budget`."""
    __tracebackhide__ = True
    P, budget = case.world_size, ring_budget(case)
    for r, record in enumerate(records):
        others = sorted({op for op, _, _ in record["messages"]} - set(POINT_TO_POINT))
        if others:
            fail(
                check,
                f"{case}: rank {r} called {', '.join(f'dist.{op}' for op in others)}; ring "
                "attention passes K and V with dist.send/recv/isend/irecv only",
                prop="ring",
            )
        neighbours = {(r - 1) % P, (r + 1) % P}
        for op, peer, _ in record["messages"]:
            if peer not in neighbours:
                who = "any rank (no src given)" if peer is None else f"rank {peer}"
                fail(
                    check,
                    f"{case}: rank {r} called dist.{op} with {who}; in a ring each rank talks "
                    f"only to its neighbours, here ranks {sorted(neighbours)}",
                    prop="ring",
                )
        if record["sent"] > budget:
            fail(
                check,
                f"{case}: rank {r} sent {record['sent']} bytes; passing K and V around the "
                f"ring sends at most {budget} (the K and V of P - 1 blocks, plus 8 bytes a "
                f"token and {HOP_BYTES} bytes per hop). Does each hop send one block, once?",
                prop="ring",
            )
    for r, record in enumerate(records):
        if record["largest"] > largest_tensor(case, r):
            fail(
                check,
                f"{case}: rank {r} made a tensor of {record['largest']} elements; ring "
                f"attention never needs more than {largest_tensor(case, r)} here (a block of "
                "scores, or one K/V block in flight). Keep one K/V block at a time and fold "
                "it in; do not collect the whole sequence's K/V or scores on a rank.",
                prop="ring",
            )
    if P > 1 and not any(record["sent"] for record in records):
        fail(check, f"{case}: no rank sent anything", prop="ring")


def judge_ulysses(check: str, case: Case, records: list[dict]) -> None:
    """The "all-to-all" property: all-to-alls or sends/receives only, at most the budget."""
    __tracebackhide__ = True
    budget = ulysses_budget(case)
    for r, record in enumerate(records):
        others = sorted({op for op, _, _ in record["messages"]} - set(ULYSSES_CALLS))
        if others:
            fail(
                check,
                f"{case}: rank {r} called {', '.join(f'dist.{op}' for op in others)}; Ulysses "
                "swaps shards with all-to-alls only (dist.all_to_all, dist.all_to_all_single, "
                "or dist.send/recv/isend/irecv)",
                prop="all-to-all",
            )
        if record["sent"] > budget:
            fail(
                check,
                f"{case}: rank {r} sent {record['sent']} bytes; four all-to-alls of this "
                f"rank's q-sized tensor send at most {budget}. Does every piece go only to "
                "the rank that needs it?",
                prop="all-to-all",
            )


def judge_refusal(check: str, name: str, case: Case, records: list[dict]) -> None:
    """Heads not divisible by the world size: every rank raises a ValueError."""
    __tracebackhide__ = True
    for r, record in enumerate(records):
        if record["raised"] is None:
            fail(
                check,
                f"{case}: rank {r}: your {name} returned {record['returned']} instead of "
                f"raising a ValueError: {case.heads} heads cannot be split over "
                f"{case.world_size} ranks. Check `heads % world_size()` first and raise "
                "ValueError with a message that says so.",
            )


def _ring_cases(P: int, causal: bool, seeds: Iterable[int]) -> list[Case]:
    # One length P divides and one it does not (for P > 1), a few tokens per rank.
    sizes = sorted({3 * P, 3 * P + (P - 1 if P > 1 else 2)})
    return [Case(P, 2, n, 4, causal, s) for s in seeds for n in sizes]


def check_ring_attention(
    ring_attention: Callable,
    causal: bool = False,
    *,
    world_sizes: Iterable[int] = (1, 2, 3, 4),
    seeds: Iterable[int] = (0,),
    timeout: float = 30.0,
) -> None:
    """`ring_attention(q, k, v, causal=...)` on each rank's contiguous shard returns that
    rank's rows of attention over the whole sequence (rtol 1e-9, atol 1e-12, float64)."""
    __tracebackhide__ = True
    check = "check_ring_attention" + ("(causal=True)" if causal else "")
    name = getattr(ring_attention, "__name__", "ring_attention")
    verdict, count = Verdict(check), 0
    world_sizes = sorted(set(world_sizes))
    for P in world_sizes:
        cases = _ring_cases(P, causal, seeds)
        for case, records in zip(
            cases, _run(check, ring_attention, cases, P, timeout, name), strict=True
        ):
            count += 1
            with verdict.case():
                judge_result(check, name, case, records)
    verdict.conclude(
        f"{count} case(s) on {', '.join(map(str, world_sizes))} rank(s), "
        f"{'causal' if causal else 'not causal'}, lengths P divides and does not: every "
        f"rank's output equals single-process attention (rtol {RTOL:g}, atol {ATOL:g})"
    )


def check_ring_traffic(
    ring_attention: Callable,
    *,
    world_sizes: Iterable[int] = (3, 4),
    seeds: Iterable[int] = (0,),
    timeout: float = 30.0,
) -> None:
    """Ring attention, causal and not, must be right, and pass K and V only between ring
    neighbours with send/recv/isend/irecv, at most `ring_budget` bytes per rank."""
    __tracebackhide__ = True
    check = "check_ring_traffic"
    name = getattr(ring_attention, "__name__", "ring_attention")
    verdict, most = Verdict(check, RING_WEIGHTS), (0.0, 0, 0)
    world_sizes = sorted(set(world_sizes))
    for P in world_sizes:
        cases = [c for causal in (False, True) for c in _ring_cases(P, causal, seeds)]
        for case, records in zip(
            cases, _run(check, ring_attention, cases, P, timeout, name), strict=True
        ):
            with verdict.case():
                judge_result(check, name, case, records)
            with verdict.case():
                judge_ring(check, case, records)
            sent = max(record["sent"] for record in records)
            most = max(most, (sent / ring_budget(case), sent, ring_budget(case)))
    verdict.conclude(
        f"ring attention on {', '.join(map(str, world_sizes))} rank(s), causal and not, is "
        "right, and every rank sent only with send/recv/isend/irecv, only to its two "
        f"neighbours, within the bytes of P - 1 K/V blocks (closest: {most[1]} of {most[2]}), "
        "and made no tensor larger than a block of scores or one K/V message"
    )


def check_ulysses_attention(
    ulysses_attention: Callable,
    *,
    world_sizes: Iterable[int] = (1, 2, 4),
    seeds: Iterable[int] = (0,),
    timeout: float = 30.0,
) -> None:
    """`ulysses_attention(q, k, v, causal=...)` on even contiguous shards returns this rank's
    rows of attention over the whole sequence; with heads not divisible by P it raises a
    ValueError; it communicates by all-to-alls within `ulysses_budget`."""
    __tracebackhide__ = True
    check = "check_ulysses_attention"
    name = getattr(ulysses_attention, "__name__", "ulysses_attention")
    verdict, count = Verdict(check, ULYSSES_WEIGHTS), 0
    world_sizes = sorted(set(world_sizes))
    for P in world_sizes:
        heads = 12 if 12 % P == 0 else 2 * P
        cases = [Case(P, heads, 3 * P, 4, causal, s) for s in seeds for causal in (False, True)]
        for case, records in zip(
            cases, _run(check, ulysses_attention, cases, P, timeout, name), strict=True
        ):
            count += 1
            with verdict.case():
                judge_result(check, name, case, records)
            with verdict.case():
                judge_ulysses(check, case, records)
        if P > 1:  # heads that do not split: apart, since a wrong answer may crash on them
            refused = Case(P, P + 1, 2 * P, 4, False, min(seeds, default=0))
            count += 1
            with verdict.case():
                try:
                    records = _run(check, ulysses_attention, [refused], P, timeout, name)[0]
                except CheckFailed as error:
                    if error.tampering:
                        raise
                    said = str(error).removeprefix(f"{check}: ")
                    fail(check, f"{refused}: expected a ValueError on every rank, but {said}")
                judge_refusal(check, name, refused, records)
    verdict.conclude(
        f"{count} case(s) on {', '.join(map(str, world_sizes))} rank(s): every rank's output "
        f"equals single-process attention (rtol {RTOL:g}, atol {ATOL:g}), causal and not, by "
        "all-to-alls within costs.ulysses_bytes; heads not divisible by P raise ValueError"
    )


def check_balanced_attention(
    layout: Callable,
    balanced_causal_attention: Callable,
    *,
    world_sizes: Iterable[int] = (2, 3, 4),
    seeds: Iterable[int] = (0,),
    timeout: float = 30.0,
) -> None:
    """Part 5: `layout(N, P)` gives each rank N/P positions (a partition of 0..N-1);
    `balanced_causal_attention(q, k, v)` on those shards returns each rank's rows of causal
    attention, while the busiest rank's measured work stays within `BALANCE` of the
    mean and the total within `WORK` times the causal minimum."""
    __tracebackhide__ = True
    check = "check_balanced_attention"
    for fn in (layout, balanced_causal_attention):
        if not callable(fn):
            fail(check, f"expected your functions, got {type(fn).__name__} {fn!r:.60}")
    verdict, count, worst = Verdict(check), 0, (0.0, 0.0)
    world_sizes = sorted(set(world_sizes))
    for P in world_sizes:
        cases = balance_cases(P, seeds)
        tokens = sorted({case.tokens for case in cases})
        what = f"(world size {P}, {len(cases)} cases)"
        found = run_on_ranks(
            check,
            run_layout,
            layout,
            tokens,
            world_size=P,
            timeout=timeout,
            what=f"your layout {what}",
        )
        if found[0]["copied"]:
            fail(check, found[0]["copied"])
        for i, n in enumerate(tokens):
            problem = layout_problem([f["layouts"][i] for f in found], n, P)
            if problem:
                fail(check, f"world size {P}: {problem}")
        found = run_on_ranks(
            check,
            run_balanced,
            layout,
            balanced_causal_attention,
            cases,
            world_size=P,
            timeout=timeout,
            what=f"your balanced_causal_attention {what}",
        )
        if found[0]["copied"]:
            fail(check, found[0]["copied"])
        for i, case in enumerate(cases):
            records, count = [f["cases"][i] for f in found], count + 1
            with verdict.case():
                judge_balanced_result(check, case, records)
            with verdict.case():
                judge_work(check, case, records)
            with verdict.case():
                judge_balance(check, case, records)
            worst = tuple(map(max, worst, work_ratios(case, records)))
    verdict.conclude(
        f"{count} causal case(s) on {', '.join(map(str, world_sizes))} rank(s): every rank's "
        f"rows equal torch's causal attention (rtol {RTOL:g}, atol {ATOL:g}); the busiest "
        f"rank did at most {worst[0]:.2f} x the ranks' mean work (allowed {BALANCE:g}) "
        f"and the ranks {worst[1]:.2f} x the causal minimum in all (allowed {WORK:g})"
    )


__all__ = [
    "BALANCE",
    "WORK",
    "Case",
    "WorkMeter",
    "causal_attention_flops",
    "check_balanced_attention",
    "check_ring_attention",
    "check_ring_traffic",
    "check_ulysses_attention",
    "largest_tensor",
    "lengths",
    "reference",
    "ring_budget",
    "ulysses_budget",
]
