"""Checks for Assignment 12, expert parallelism: a mixture of experts whose experts live on
different ranks.

    check_moe_forward(expert_parallel_moe)                    equal to the layer on one process
    check_moe_backward(expert_parallel_moe, sync_router_grads)  and so are its gradients
    check_moe_traffic(expert_parallel_moe, sync_router_grads)   tokens only where they must go
    check_moe_dedup(dedup_moe)                                the layer, each token sent once
                                                              to each rank (Part 4, open)

Each rank is called with chunk r of `torch.tensor_split` of a float64 batch x [T, d_model],
the router (nn.Linear(d_model, E, bias=False), the same on every rank) and experts r E/P to
(r+1) E/P - 1 (`models.MLPBlock`). The layer: softmax router probabilities, each token's k
most probable experts, each expert taking at most C = `costs.expert_capacity`(T, E, k,
capacity_factor) choices, the first C by token position in the whole batch (whichever of a
token's k choices it is), a token's output the sum over its kept choices of probability times
the expert's output (zero if all were dropped).

Everything is drawn (from a secret seed, new for each call of a check) and solved in the
checking process (`expert_parallel_cases`): the layer written out on one process, never the
lecture's code, is the reference, and each rank receives only its own tokens and experts.
Which calls each rank made and how many bytes they sent come from the launcher's tallies
(`run_on_ranks(..., traffic=True)`), never from the rank (`expert_parallel_judge`).

Traffic rules (`check_moe_traffic`): tokens travel only by all-to-alls (all_to_all_single,
counted by its split sizes, or all_to_all) or send/recv/isend/irecv; other collectives
(all_gather, all_reduce, ...) carry at most 2 E numbers a call (counts per expert). Per
forward and backward, a rank sends at most the bytes of its kept choices that go to other
ranks' experts and of the outputs it sends back, twice (backward mirrors forward,
`traffic_budget`), plus `HOP_BYTES` per peer for each of four all-to-alls and 16 E bytes per
peer. Part 4's cases, budget and bytes are `expert_parallel_dedup`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from course_lib.calls import PerRank
from course_lib.grading._harness import (
    RESULT,
    CheckFailed,
    Verdict,
    calls_by_case,
    fail,
    judge_unreported,
    measured,
    new_secret,
    run_on_ranks,
)
from course_lib.grading.expert_parallel_cases import (
    Case,
    draw,
    dropped,
    given,
    inputs,
    kept_rows,
    layer,
    reference,
    routing,
    solve,
)
from course_lib.grading.expert_parallel_dedup import (
    DEDUP_FRACTION,
    dedup_cases,
    judge_dedup,
    rank_rows,
    row_bytes,
    typical,
)
from course_lib.grading.expert_parallel_judge import (
    ATOL,
    RTOL,
    communication,
    judge_backward,
    judge_forward,
    judge_refusal,
    judge_traffic,
    traffic_budget,
)
from course_lib.grading.expert_parallel_ranks import run_cases, sync_cases

TRAFFIC_WEIGHTS = {RESULT: 0.0, "dispatch": 1.0}  # right first; the traffic is what scores
DEDUP_WEIGHTS = {RESULT: 0.0, "bytes": 1.0}
REDRAWS = 20  # draws of a case that its `accept` may refuse (Part 4's: about none)


def _drawn(case: Case, accept: Callable | None) -> tuple[dict, dict | None]:
    """A case's layer and batch from a secret seed, and the layer on one process (None when
    the experts do not split); drawn again, from another secret, until `accept(case,
    solved)` holds."""
    for _ in range(REDRAWS):
        drawn = draw(case, new_secret())
        if case.n_experts % case.world_size:
            return drawn, None
        solved = solve(case, drawn)
        if accept is None or accept(case, solved):
            break
    return drawn, solved


def _run(
    check: str,
    fn: Callable,
    sync: Callable | None,
    cases: list[Case],
    timeout: float,
    name: str,
    accept: Callable | None = None,
) -> list:
    """Every case on P ranks, each rank given its own tokens and experts: per case (case,
    the layer on one process, the ranks' records, the ranks' calls of the layer as the
    launcher saw them). A case whose experts do not split is not solved (None)."""
    __tracebackhide__ = True
    P = cases[0].world_size
    for answer in (fn, sync) if sync is not None else (fn,):
        if not callable(answer):
            fail(check, f"expected your function, got {type(answer).__name__} {answer!r:.60}")
    drawn, solved = zip(*(_drawn(case, accept) for case in cases), strict=True)
    shares = PerRank(
        [[given(c, d, r) for c, d in zip(cases, drawn, strict=True)] for r in range(P)]
    )
    key = f"{check}-{new_secret()}"
    results, traffic = run_on_ranks(
        check,
        run_cases,
        fn,
        sync is not None,
        cases,
        shares,
        key,
        world_size=P,
        timeout=timeout,
        what=f"your {name} (world size {P}, {len(cases)} cases)",
        traffic=True,
    )
    calls = calls_by_case(check, traffic.tallies, len(cases))
    judge_unreported(check, traffic)
    if sync is not None:
        # In a call of its own: the layer's gradients are here before sync_router_grads runs.
        synced = run_on_ranks(
            check,
            sync_cases,
            sync,
            key,
            world_size=P,
            timeout=timeout,
            what=f"your {getattr(sync, '__name__', 'sync_router_grads')} (world size {P})",
        )
        for found, router_grads in zip(results, synced, strict=True):
            found["copied"] = found["copied"] or router_grads["copied"]
            for record, grad in zip(found["cases"], router_grads["router_grads"], strict=True):
                record["router_grad"] = grad
    for found in results:
        if found["copied"]:
            fail(check, found["copied"])
    return [
        (
            case,
            solved[i],
            [results[r]["cases"][i] for r in range(P)],
            [communication(calls[r][i]) for r in range(P)],
        )
        for i, case in enumerate(cases)
    ]


def cases(P: int, seeds: Iterable[int]) -> list[Case]:
    """k = 1 and k = 2 with a capacity factor that drops choices (0.75), k = 2 with one that
    cannot (E / k: C >= T), batches P does not divide (for P > 1); E = 4, or 2 a rank on 4."""
    E = 4 if P < 4 else 2 * P
    tokens = 4 * P + 1 if P > 1 else 9
    return [
        Case(P, tokens + s, E, k, factor, s)
        for s in seeds
        for k, factor in ((1, 0.75), (2, 0.75), (2, E / 2))
    ]


def _check(
    check: str,
    fn: Callable,
    sync: Callable | None,
    world_sizes: Iterable[int],
    seeds: Iterable[int],
    timeout: float,
    weights: dict | None = None,
) -> tuple[Verdict, int, list[int], list]:
    __tracebackhide__ = True
    name = getattr(fn, "__name__", "expert_parallel_moe")
    verdict, count, seeds = Verdict(check, weights), 0, tuple(seeds)
    world_sizes = sorted(set(world_sizes))
    closest = [0.0, 0, 0]
    for P in world_sizes:
        todo = cases(P, seeds)
        for case, want, records, comms in _run(check, fn, sync, todo, timeout, name):
            count += 1
            with verdict.case():
                judge_forward(check, name, case, records, want)
                if sync is not None:
                    judge_backward(check, name, case, records, want)
            if weights is not None and P > 1:
                budget = traffic_budget(case, want["kept_rows"])
                with verdict.case():
                    judge_traffic(check, case, comms, budget)
                for seen, allowed in zip(comms, budget, strict=True):
                    closest = max(closest, [seen["sent"] / allowed, seen["sent"], allowed])
        if P > 1 and sync is None:  # experts that do not split: apart, as it may crash
            refused = Case(P, 2 * P, P + 1, 1, 1.0, min(seeds, default=0))
            count += 1
            with verdict.case():
                try:
                    _, _, records, comms = _run(check, fn, None, [refused], timeout, name)[0]
                except CheckFailed as error:
                    if error.tampering:
                        raise
                    said = str(error).removeprefix(f"{check}: ")
                    fail(check, f"{refused}: expected a ValueError on every rank, but {said}")
                judge_refusal(check, name, refused, records, comms)
    return verdict, count, world_sizes, closest


def check_moe_forward(
    expert_parallel_moe: Callable,
    *,
    world_sizes: Iterable[int] = (1, 2, 4),
    seeds: Iterable[int] = (0,),
    timeout: float = 30.0,
) -> None:
    """`expert_parallel_moe(x, router, experts, k, capacity_factor)` on each rank's tokens
    and experts returns that rank's rows of the single-process layer (rtol 1e-9, atol 1e-12,
    float64), dropped choices included; a number of experts P does not divide raises."""
    __tracebackhide__ = True
    check = "check_moe_forward"
    verdict, count, sizes, _ = _check(check, expert_parallel_moe, None, world_sizes, seeds, timeout)
    verdict.conclude(
        f"{count} case(s) on {', '.join(map(str, sizes))} rank(s), k = 1 and 2, with and "
        f"without dropped choices, uneven token counts: every rank's output equals the layer "
        f"on one process (rtol {RTOL:g}, atol {ATOL:g}); experts not divisible by P raise "
        "ValueError"
    )


def check_moe_backward(
    expert_parallel_moe: Callable,
    sync_router_grads: Callable,
    *,
    world_sizes: Iterable[int] = (1, 2, 4),
    seeds: Iterable[int] = (0,),
    timeout: float = 30.0,
) -> None:
    """After backward of sum(out * g), x's and this rank's experts' gradients, and after
    `sync_router_grads(router)` the router's, equal the single-process layer's (rtol 1e-9,
    atol 1e-12)."""
    __tracebackhide__ = True
    check = "check_moe_backward"
    verdict, count, sizes, _ = _check(
        check, expert_parallel_moe, sync_router_grads, world_sizes, seeds, timeout
    )
    verdict.conclude(
        f"{count} case(s) on {', '.join(map(str, sizes))} rank(s), with and without dropped "
        "choices: the output, the gradients of x and of every expert after backward, and the "
        "router's after sync_router_grads equal the layer's on one process "
        f"(rtol {RTOL:g}, atol {ATOL:g})"
    )


def check_moe_traffic(
    expert_parallel_moe: Callable,
    sync_router_grads: Callable,
    *,
    world_sizes: Iterable[int] = (2, 4),
    seeds: Iterable[int] = (0,),
    timeout: float = 30.0,
) -> None:
    """The layer must be right (forward and backward), and its tokens travel by all-to-all
    or point-to-point, at most `traffic_budget` bytes per rank; other collectives carry
    per-expert numbers only. `sync_router_grads` is not counted."""
    __tracebackhide__ = True
    check = "check_moe_traffic"
    verdict, _, sizes, closest = _check(
        check,
        expert_parallel_moe,
        sync_router_grads,
        world_sizes,
        seeds,
        timeout,
        TRAFFIC_WEIGHTS,
    )
    verdict.conclude(
        f"on {', '.join(map(str, sizes))} rank(s), the layer is right, forward and backward, "
        "its tokens travel only by all-to-all or point-to-point, other collectives carry "
        "per-expert numbers only, and every rank sent at most its kept tokens' bytes "
        f"(closest: {closest[1]} of {closest[2]})"
    )


def check_moe_dedup(
    dedup_moe: Callable,
    *,
    world_sizes: Iterable[int] = (2, 4),
    seeds: Iterable[int] = (0,),
    timeout: float = 30.0,
) -> None:
    """Part 4 (open): `dedup_moe`, with Part 1's interface, returns this rank's rows of the
    single-process layer (rtol 1e-9, atol 1e-12), and in the forward all ranks together send
    at most DEDUP_FRACTION of the bytes of Part 1's token rows (`expert_parallel_dedup`)."""
    __tracebackhide__ = True
    check = "check_moe_dedup"
    name = getattr(dedup_moe, "__name__", "dedup_moe")
    verdict, shares = Verdict(check, DEDUP_WEIGHTS), []
    world_sizes = sorted(set(world_sizes))
    for P in world_sizes:
        todo = dedup_cases(P, seeds)
        for case, want, records, comms in _run(
            check, dedup_moe, None, todo, timeout, name, typical
        ):
            with verdict.case():
                judge_forward(check, name, case, records, want)
            with verdict.case():
                shares.append(judge_dedup(check, case, comms, want["kept_rows"]))
    verdict.conclude(
        f"{len(shares)} case(s) on {', '.join(map(str, world_sizes))} ranks, k = 2, 4 experts "
        "a rank, with and without dropped choices: every rank's output equals the layer on one "
        f"process (rtol {RTOL:g}, atol {ATOL:g}), and the ranks sent at most "
        f"{max(shares, default=0):.0%} of the bytes of one token row per (token, expert) "
        f"(allowed {DEDUP_FRACTION:.0%})"
    )
    what = "bytes sent, as a share of one token row per (token, expert), worst case"
    measured(check, what, 100 * max(shares, default=0), "%", combine="worst")


__all__ = [
    "Case",
    "DEDUP_FRACTION",
    "cases",
    "check_moe_backward",
    "check_moe_dedup",
    "check_moe_forward",
    "check_moe_traffic",
    "dedup_cases",
    "dropped",
    "inputs",
    "kept_rows",
    "layer",
    "rank_rows",
    "reference",
    "routing",
    "row_bytes",
    "traffic_budget",
]
