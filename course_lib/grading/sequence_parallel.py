"""Checks for Assignment 11, sequence parallelism: the backward pass of attention over tokens
split across ranks.

    check_ring_backward(ring_attention_backward, causal=False)   dq, dk, dv; the ring's rules
    check_ring_memory(ring_attention_backward)                   what a rank holds at its peak
    check_ulysses_backward(ulysses_attention_backward)           dq, dk, dv by all-to-alls
    check_balanced_backward(layout, balanced_attention_backward) causal, your layout, balanced

Each rank is called with its own rows of grad_out, q, k, v (heads, n_local, head_dim), of the
forward's out and of its row log-sum-exp lse (heads, n_local), float64; it returns its rows
of (dq, dk, dv), the gradient of sum(out * grad_out) over the whole sequence. Everything is
drawn (from a secret seed, new for each call of a check) and solved in the checking process
(`sequence_parallel_cases`): torch's autograd on one process is the reference, and each rank
receives only its own rows. Which calls each rank made, to whom and how many bytes come
from the launcher's tallies (`run_on_ranks(..., traffic=True)`), never from the rank; the
work and memory of Parts 3 and 5 from `course_lib.meters.Meter` on the rank.

Ring rules (Parts 1, 2 and 5, `judge_ring`): only dist.send/recv/isend/irecv, only with
the two neighbours r - 1, r + 1 mod P, at most `ring_budget` bytes sent. Memory (Parts 3 and
5, `judge_memory`): what the busiest rank's call holds at its peak does not grow with P (the
same shard size on more ranks: at most `GROWTH_BLOCKS` block more than on the fewest).
Ulysses (`judge_ulysses`): all-to-alls (dist.all_to_all, dist.all_to_all_single, or sends and
receives), at most `ulysses_budget`. Balance (Part 5, `sequence_parallel_balance`): the
busiest rank within `BALANCE` of the mean, the total within `WORK` of the causal minimum.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from course_lib.calls import PerRank
from course_lib.grading._harness import (
    CheckFailed,
    Verdict,
    calls_by_case,
    fail,
    judge_unreported,
    measured,
    new_secret,
    run_on_ranks,
)
from course_lib.grading.sequence_parallel_balance import (
    BALANCE,
    WORK,
    balance_cases,
    balance_tokens,
    causal_backward_flops,
    judge_balance,
    judge_work,
    layout_problem,
    work_ratios,
)
from course_lib.grading.sequence_parallel_cases import (
    GROWTH_BLOCKS,
    MEMORY_BASELINE,
    Case,
    draw,
    given,
    ring_budget,
    solve,
    ulysses_budget,
)
from course_lib.grading.sequence_parallel_judge import (
    ATOL,
    RTOL,
    busiest,
    communication,
    judge_memory,
    judge_refusal,
    judge_result,
    judge_ring,
    judge_ulysses,
)
from course_lib.grading.sequence_parallel_ranks import run_cases, run_layout


def _name(fn: Callable, default: str) -> str:
    return getattr(fn, "__name__", default)


def _run(check: str, fn: Callable, cases: list[Case], timeout: float, measure: bool) -> list:
    """Every case on P ranks, each rank given its own rows: per case (case, solved, the
    ranks' records, the ranks' communication as the launcher saw it)."""
    __tracebackhide__ = True
    P = cases[0].world_size
    secret = new_secret()
    solved = [solve(case, draw(case, secret)) for case in cases]
    pairs = list(zip(cases, solved, strict=True))
    inputs = PerRank([[given(case, s, r) for case, s in pairs] for r in range(P)])
    results, traffic = run_on_ranks(
        check,
        run_cases,
        fn,
        cases,
        inputs,
        measure,
        world_size=P,
        timeout=timeout,
        what=f"your {_name(fn, 'function')} (world size {P}, {len(cases)} cases)",
        traffic=True,
    )
    for found in results:
        if found["copied"]:
            fail(check, found["copied"])
    calls = calls_by_case(check, traffic.tallies, len(cases))
    judge_unreported(check, traffic)
    return [
        (
            case,
            solved[i],
            [results[r]["cases"][i] for r in range(P)],
            [communication(calls[r][i]) for r in range(P)],
        )
        for i, case in enumerate(cases)
    ]


def _callable(check: str, *fns: Callable) -> None:
    __tracebackhide__ = True
    for fn in fns:
        if not callable(fn):
            fail(check, f"expected your function, got {type(fn).__name__} {fn!r:.60}")


def ring_cases(P: int, causal: bool) -> list[Case]:
    """Parts 1 and 2: one length P divides and one it does not (for P > 1), a few tokens per
    rank, 2 heads of 4."""
    sizes = sorted({3 * P, 3 * P + (P - 1 if P > 1 else 2)})
    return [Case(P, 2, n, 4, causal, seed=i) for i, n in enumerate(sizes)]


MEMORY_TOKENS = (4, 5)  # Part 3: tokens per rank, the same on every world size


def memory_cases(P: int) -> list[Case]:
    """Part 3: 4 and 5 tokens on each rank, 2 heads of 16, causal and not."""
    return [
        Case(P, 2, n * P, 16, causal, seed=n) for causal in (False, True) for n in MEMORY_TOKENS
    ]


class Growth:
    """The memory rule across world sizes: the busiest rank's peak per kind of case (shard
    size, mask) on `MEMORY_BASELINE` ranks, and on more ranks at most `GROWTH_BLOCKS` above
    it. Fewer ranks are not compared: on 2 ranks a ring has no rank between the two ends, and
    a rank that skips a block (causal) then holds less than it does from 3 ranks on."""

    def __init__(self, world_sizes: list[int], required: bool) -> None:
        self.judged = MEMORY_BASELINE in world_sizes and max(world_sizes) > MEMORY_BASELINE
        if required and not self.judged:
            raise ValueError(
                f"the memory rule compares {MEMORY_BASELINE} ranks with more: world sizes "
                f"{world_sizes} do not hold both"
            )
        self.base: dict = {}
        self.most = 0

    def judge(self, verdict: Verdict, check: str, case: Case, records: list[dict]) -> None:
        if not self.judged or case.world_size < MEMORY_BASELINE:
            return
        key = (case.tokens // case.world_size, case.causal)
        if case.world_size == MEMORY_BASELINE:
            self.base[key] = busiest(records)[1]
            return
        with verdict.case():
            judge_memory(check, case, records, (MEMORY_BASELINE, self.base[key]))
        self.most = max(self.most, busiest(records)[1] - self.base[key])

    def summary(self) -> str:
        if not self.judged:
            return f"(the memory rule compares {MEMORY_BASELINE} ranks with more: not run)"
        return (
            f"what the busiest rank held at its peak grew by at most {self.most:,} bytes from "
            f"{MEMORY_BASELINE} ranks (allowed: {GROWTH_BLOCKS} block)"
        )


def ulysses_cases(P: int) -> list[Case]:
    """Part 4: 3 P tokens (even shards), 12 and 2 P heads of 4, causal and not."""
    heads = sorted({12, 2 * P})
    return [Case(P, h, 3 * P, 4, causal, seed=h) for h in heads for causal in (False, True)]


def check_ring_backward(
    ring_attention_backward: Callable,
    causal: bool = False,
    *,
    world_sizes: Iterable[int] = (1, 2, 3, 4),
    timeout: float = 30.0,
) -> None:
    """Parts 1 and 2: `ring_attention_backward(grad_out, q, k, v, out, lse, causal=...)` on
    contiguous shards returns each rank's (dq, dk, dv) (rtol 1e-9, atol 1e-12, float64), and
    passes its messages around the ring (`judge_ring`)."""
    __tracebackhide__ = True
    check = "check_ring_backward" + ("(causal=True)" if causal else "")
    _callable(check, ring_attention_backward)
    name = _name(ring_attention_backward, "ring_attention_backward")
    verdict, count, closest = Verdict(check), 0, (0.0, 0, 0)
    world_sizes = sorted(set(world_sizes))
    for P in world_sizes:
        for case, solved, records, comms in _run(
            check, ring_attention_backward, ring_cases(P, causal), timeout, measure=False
        ):
            count += 1
            with verdict.case():
                judge_result(check, name, case, records, solved)
            with verdict.case():
                judge_ring(check, case, comms)
            if P > 1:
                sent = max(seen["sent"] for seen in comms)
                closest = max(closest, (sent / ring_budget(case), sent, ring_budget(case)))
    verdict.conclude(
        f"{count} case(s) on {', '.join(map(str, world_sizes))} rank(s), "
        f"{'causal' if causal else 'not causal'}, lengths P divides and does not: every rank's "
        f"dq, dk and dv equal torch's autograd on one process (rtol {RTOL:g}, atol {ATOL:g}); "
        "every rank sent only with send/recv/isend/irecv, only to its two neighbours, within "
        f"4(P-1) + 2 blocks (closest: {closest[1]:,} of {closest[2]:,} bytes)"
    )


def check_ring_memory(
    ring_attention_backward: Callable,
    *,
    world_sizes: Iterable[int] = (3, 4),
    timeout: float = 30.0,
) -> None:
    """Part 3: the same function, causal and not, right, and what the busiest rank's call
    holds at its peak (`course_lib.meters.Meter`) not growing with the world size: on more
    ranks with the same shard size, at most `GROWTH_BLOCKS` block more than on
    `MEMORY_BASELINE` ranks."""
    __tracebackhide__ = True
    check = "check_ring_memory"
    _callable(check, ring_attention_backward)
    name = _name(ring_attention_backward, "ring_attention_backward")
    verdict, count = Verdict(check), 0
    world_sizes = sorted(set(world_sizes))
    growth = Growth(world_sizes, required=True)
    for P in world_sizes:
        for case, solved, records, _ in _run(
            check, ring_attention_backward, memory_cases(P), timeout, measure=True
        ):
            count += 1
            with verdict.case():
                judge_result(check, name, case, records, solved)
            growth.judge(verdict, check, case, records)
    verdict.conclude(
        f"{count} case(s) on {', '.join(map(str, world_sizes))} rank(s), causal and not, "
        f"{' and '.join(map(str, MEMORY_TOKENS))} tokens a rank: right, and {growth.summary()}"
    )


def check_ulysses_backward(
    ulysses_attention_backward: Callable,
    *,
    world_sizes: Iterable[int] = (1, 2, 3, 4),
    timeout: float = 30.0,
) -> None:
    """Part 4: `ulysses_attention_backward(grad_out, q, k, v, out, lse, causal=...)` on even
    contiguous shards returns each rank's (dq, dk, dv); with heads not divisible by P it
    raises a ValueError before any message; it communicates by all-to-alls within
    `ulysses_budget`."""
    __tracebackhide__ = True
    check = "check_ulysses_backward"
    _callable(check, ulysses_attention_backward)
    name = _name(ulysses_attention_backward, "ulysses_attention_backward")
    verdict, count = Verdict(check), 0
    world_sizes = sorted(set(world_sizes))
    for P in world_sizes:
        for case, solved, records, comms in _run(
            check, ulysses_attention_backward, ulysses_cases(P), timeout, measure=False
        ):
            count += 1
            with verdict.case():
                judge_result(check, name, case, records, solved)
            with verdict.case():
                judge_ulysses(check, case, comms)
        if P > 1:  # heads that do not split: apart, since a wrong answer may crash on them
            refused = Case(P, P + 1, 2 * P, 4, False)
            count += 1
            with verdict.case():
                try:
                    _, _, records, comms = _run(
                        check, ulysses_attention_backward, [refused], timeout, measure=False
                    )[0]
                except CheckFailed as error:
                    if error.tampering:
                        raise
                    said = str(error).removeprefix(f"{check}: ")
                    fail(check, f"{refused}: expected a ValueError on every rank, but {said}")
                judge_refusal(check, name, refused, records, comms)
    verdict.conclude(
        f"{count} case(s) on {', '.join(map(str, world_sizes))} rank(s): every rank's dq, dk "
        f"and dv equal torch's autograd on one process (rtol {RTOL:g}, atol {ATOL:g}), causal "
        "and not, by all-to-alls within seven of the rank's block; heads not divisible by P "
        "raise ValueError before any message"
    )


def check_balanced_backward(
    layout: Callable,
    balanced_attention_backward: Callable,
    *,
    world_sizes: Iterable[int] = (2, 3, 4),
    timeout: float = 30.0,
) -> None:
    """Part 5: `layout(N, P)` gives each rank N/P positions (a partition of 0..N-1);
    `balanced_attention_backward(grad_out, q, k, v, out, lse)` on those rows returns each
    rank's (dq, dk, dv) of causal attention, by the ring's rules and Part 3's memory rule, while
    the busiest rank's measured work stays within `BALANCE` of the mean and the total within
    `WORK` times the causal minimum. All or nothing."""
    __tracebackhide__ = True
    check = "check_balanced_backward"
    _callable(check, layout, balanced_attention_backward)
    name = _name(balanced_attention_backward, "balanced_attention_backward")
    verdict, count, worst = Verdict(check), 0, (0.0, 0.0)
    world_sizes = sorted(set(world_sizes))
    growth = Growth(world_sizes, required=False)
    for P in world_sizes:
        tokens = balance_tokens(P)
        found = run_on_ranks(
            check,
            run_layout,
            layout,
            tokens,
            world_size=P,
            timeout=timeout,
            what=f"your layout (world size {P})",
        )
        for result in found:
            if result["copied"]:
                fail(check, result["copied"])
        for i, n in enumerate(tokens):
            problem = layout_problem([f["layouts"][i] for f in found], n, P)
            if problem:
                fail(check, f"world size {P}: {problem}")
        layouts = {n: found[0]["layouts"][i] for i, n in enumerate(tokens)}
        for case, solved, records, comms in _run(
            check, balanced_attention_backward, balance_cases(P, layouts), timeout, measure=True
        ):
            count += 1
            with verdict.case():
                judge_result(check, name, case, records, solved)
            with verdict.case():
                judge_ring(check, case, comms)
            growth.judge(verdict, check, case, records)
            for judge in (judge_work, judge_balance):
                with verdict.case():
                    judge(check, case, records)
            worst = tuple(map(max, worst, work_ratios(case, records)))
    verdict.conclude(
        f"{count} causal case(s) on {', '.join(map(str, world_sizes))} rank(s): every rank's "
        f"dq, dk and dv equal torch's autograd (rtol {RTOL:g}, atol {ATOL:g}), by the ring's "
        f"rules; {growth.summary()}; the busiest rank did at most {worst[0]:.2f} x the "
        f"ranks' mean work (allowed {BALANCE:g}) and the ranks {worst[1]:.2f} x the causal "
        f"minimum in all (allowed {WORK:g})"
    )
    what = "the busiest rank's work over the ranks' mean, worst case"
    measured(check, what, worst[0], "x the mean", combine="worst")


__all__ = [
    "BALANCE",
    "WORK",
    "Case",
    "GROWTH_BLOCKS",
    "causal_backward_flops",
    "check_balanced_backward",
    "check_ring_backward",
    "check_ring_memory",
    "check_ulysses_backward",
    "ring_budget",
    "ulysses_budget",
]
