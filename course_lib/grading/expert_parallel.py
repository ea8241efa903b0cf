"""Checks for Assignment 12, expert parallelism: a mixture of experts whose experts live on
different ranks.

    check_moe_forward(expert_parallel_moe)                    equal to the layer on one process
    check_moe_backward(expert_parallel_moe, sync_router_grads)  and so are its gradients
    check_moe_traffic(expert_parallel_moe, sync_router_grads)   tokens only where they must go
    check_moe_dedup(dedup_moe)                                the layer, each token sent once
                                                              to each rank (Part 4, open)

Each rank holds chunk r of `torch.tensor_split` of a seeded float64 batch x [T, d_model], the
router (nn.Linear(d_model, E, bias=False), the same on every rank) and experts r E/P to
(r+1) E/P - 1 (`models.MLPBlock`). The layer: softmax router probabilities, each token's k
most probable experts, each expert taking at most C = `costs.expert_capacity`(T, E, k,
capacity_factor) choices, the first C by token position in the whole batch (whichever of a
token's k choices it is), a token's output the sum over its kept choices of probability times
the expert's output (zero if all were dropped). The reference (`reference`) is that, written
out on one process in the checking process: never the lecture's code.

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

import torch
import torch.nn.functional as F

from course_lib import compare
from course_lib.costs import expert_capacity
from course_lib.grading._harness import RESULT, CheckFailed, Verdict, fail, run_on_ranks
from course_lib.grading.expert_parallel_dedup import (
    DEDUP_FRACTION,
    dedup_cases,
    judge_dedup,
    rank_rows,
    row_bytes,
)
from course_lib.grading.expert_parallel_ranks import (
    Case,
    expert_ids,
    inputs,
    judge_calls,
    layer,
    lengths,
    run_cases,
)

# float64: the experts add the same products in another order on another rank (~1e-16); a
# token at the wrong expert, a wrong drop or a missing gate weight moves it by 1e-2 or more.
RTOL, ATOL = 1e-9, 1e-12
TRAFFIC_WEIGHTS = {RESULT: 0.0, "dispatch": 1.0}  # right first; the traffic is what scores
DEDUP_WEIGHTS = {RESULT: 0.0, "bytes": 1.0}
HOP_BYTES = 64
ITEMSIZE = 8  # float64


def routing(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole batch's routing on one process: each token's k experts [T, k], their
    probabilities [T, k], and whether each choice is within its expert's capacity [T, k]."""
    router, _ = layer(case)
    x, _ = inputs(case)
    probs = torch.softmax(x @ router.weight.detach().T, dim=-1)
    gates, chosen = probs.topk(case.k, dim=-1)
    capacity = expert_capacity(case.tokens, case.n_experts, case.k, case.capacity_factor)
    queue = [0] * case.n_experts
    kept = torch.zeros_like(chosen, dtype=torch.bool)
    for t in range(case.tokens):  # token order, whichever of its choices it is
        for j in range(case.k):
            e = int(chosen[t, j])
            kept[t, j] = queue[e] < capacity
            queue[e] += 1
    return chosen, gates, kept


def reference(case: Case) -> dict:
    """The layer on one process over the whole batch, float64: its output, and the gradients
    of sum(out * g) for x, the router's weight and every expert's parameters."""
    router, experts = layer(case)
    x, g = inputs(case)
    x = x.clone().requires_grad_(True)
    chosen, _, kept = routing(case)
    probs = torch.softmax(F.linear(x, router.weight), dim=-1)
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        token, slot = torch.nonzero((chosen == e) & kept, as_tuple=True)
        gate = probs[token, e].unsqueeze(1)
        out = out.index_add(0, token, gate * expert(x[token]))
    out.backward(g)
    return {
        "out": out.detach(),
        "x_grad": x.grad,
        "router_grad": router.weight.grad,
        "expert_grads": [[p.grad for p in expert.parameters()] for expert in experts],
    }


def dropped(case: Case) -> int:
    """Choices over capacity in the case's batch."""
    return int((~routing(case)[2]).sum())


def kept_rows(case: Case) -> torch.Tensor:
    """[P, P]: kept choices of rank i's tokens that go to rank j's experts."""
    chosen, _, kept = routing(case)
    P, per = case.world_size, case.n_experts // case.world_size
    owner = torch.arange(case.tokens).tensor_split(P)
    rows = torch.zeros(P, P, dtype=torch.long)
    for i, tokens in enumerate(owner):
        for e in chosen[tokens][kept[tokens]].tolist():
            rows[i, e // per] += 1
    return rows


def traffic_budget(case: Case, rows: torch.Tensor | None = None) -> list[int]:
    """Bytes each rank may send in one forward and backward: its kept choices for other
    ranks' experts (dispatch) and the outputs of other ranks' choices (combine), a token row
    each, twice (backward sends the same rows' gradients the other way), plus `HOP_BYTES`
    per peer for each of the four all-to-alls and 16 E bytes per peer (counts per expert).
    With every rank sending N bytes of routed tokens spread evenly, the rows are
    2 * costs.ep_bytes(N, P)."""
    P = case.world_size
    rows = kept_rows(case) if rows is None else rows
    row = case.d_model * ITEMSIZE
    off = rows - torch.diag(rows.diagonal())
    slack = (P - 1) * (4 * HOP_BYTES + 16 * case.n_experts)
    return [int(2 * row * (off[r].sum() + off[:, r].sum())) + slack for r in range(P)]


def _run(check: str, fn, sync, cases: list[Case], P: int, timeout: float, name: str) -> list:
    """Every case on P ranks; each case's records, one per rank."""
    __tracebackhide__ = True
    for answer in (fn, sync) if sync is not None else (fn,):
        if not callable(answer):
            fail(check, f"expected your function, got {type(answer).__name__} {answer!r:.60}")
    found = run_on_ranks(
        check,
        run_cases,
        fn,
        sync,
        cases,
        world_size=P,
        timeout=timeout,
        what=f"your {name} (world size {P}, {len(cases)} cases)",
    )
    if found[0]["copied"]:
        fail(check, found[0]["copied"])
    return [[per_rank["cases"][i] for per_rank in found] for i in range(len(cases))]


def _span(case: Case, r: int) -> str:
    n = lengths(case)
    start = sum(n[:r])
    return f"tokens {start}..{start + n[r] - 1}, experts {expert_ids(case, r)}"


def judge_forward(check: str, name: str, case: Case, records: list[dict], want: dict) -> None:
    """Every rank's output equals its rows of the single-process layer."""
    __tracebackhide__ = True
    for r, record in enumerate(records):
        at = f"{case}: rank {r} ({_span(case, r)})"
        if record["raised"] is not None:
            fail(check, f"{at}: your {name} raised ValueError({record['raised']!r})")
        expected = want["out"].tensor_split(case.world_size)[r]
        if not isinstance(record["out"], torch.Tensor) or record["out"].shape != expected.shape:
            got = record["returned"]
            if isinstance(record["out"], torch.Tensor):
                got = f"a tensor of shape {tuple(record['out'].shape)}"
            fail(
                check,
                f"{at}: your {name} returned {got}; return this rank's [n_local, "
                "d_model] output tensor",
            )
        problem = compare.find_mismatch(
            {"output": record["out"]}, {"output": expected}, rtol=RTOL, atol=ATOL
        )
        if problem:
            fail(check, f"{at}: {problem}.\n{_hint(case, record, r)}")


def _hint(case: Case, record: dict, r: int) -> str:
    """What to try, from the shape of the mistake."""
    out = record["out"]
    zero_rows = int((out.abs().sum(1) == 0).sum())
    chosen, _, kept = routing(case)
    mine = torch.arange(case.tokens).tensor_split(case.world_size)[r]
    all_dropped = int((~kept[mine]).all(1).sum())
    if zero_rows < all_dropped:
        return (
            f"Hint: {all_dropped} of this rank's tokens have every choice over capacity, so "
            f"their output is zero, but only {zero_rows} rows of yours are. Is the capacity "
            "applied, over the whole batch, in token order?"
        )
    return (
        "Hint: check, in this order: the experts a token goes to (top-k of the softmax), the "
        "capacity (the first C choices of an expert in token order over the whole batch: "
        "tokens on lower ranks come first), which rank holds which expert, and that each kept "
        "output is multiplied by its router probability."
    )


def judge_backward(check: str, name: str, case: Case, records: list[dict], want: dict) -> None:
    """x's, the router's (after sync) and every expert's gradients equal the reference's."""
    __tracebackhide__ = True
    P = case.world_size
    for r, record in enumerate(records):
        at = f"{case}: rank {r} ({_span(case, r)})"
        if record["x_grad"] is None:
            fail(
                check,
                f"{at}: x.grad is None after backward: does the output depend on x "
                "through autograd (an all-to-all that autograd can go back through)?",
            )
        router_grad = record["router_grad"]
        if router_grad is None:  # no gradient reached the router: compared as zeros
            router_grad = torch.zeros_like(want["router_grad"])
        got = {"x.grad": record["x_grad"], "router.weight.grad": router_grad}
        expected = {
            "x.grad": want["x_grad"].tensor_split(P)[r],
            "router.weight.grad": want["router_grad"],
        }
        for i, e in enumerate(expert_ids(case, r)):
            reference_grads = want["expert_grads"][e]
            for j, (mine, ref) in enumerate(
                zip(record["expert_grads"][i], reference_grads, strict=True)
            ):
                got[f"expert {e} parameter {j} grad"] = (
                    torch.zeros_like(ref) if mine is None else mine
                )
                expected[f"expert {e} parameter {j} grad"] = ref
        problem = compare.find_mismatch(got, expected, rtol=RTOL, atol=ATOL)
        if problem:
            hint = ""
            if "router" in problem:
                hint = (
                    "\nHint: each rank's router saw only its own tokens: sync_router_grads "
                    "must sum its gradient over the ranks."
                )
            fail(check, f"{at}: {problem}.{hint}")


def judge_traffic(check: str, case: Case, records: list[dict]) -> None:
    """The "dispatch" property: tokens by all-to-all or point-to-point only, small collectives
    only, at most `traffic_budget` bytes per rank."""
    __tracebackhide__ = True
    judge_calls(check, case, records, "dispatch")
    budget = traffic_budget(case)
    for r, record in enumerate(records):
        if record["sent"] > budget[r]:
            fail(
                check,
                f"{case}: rank {r} sent {record['sent']} bytes; its kept tokens for other "
                f"ranks' experts and the outputs it owes them, forward and backward, come to "
                f"at most {budget[r]}. Does every token go only to its experts' ranks, and "
                "are the choices over capacity left at home?",
                prop="dispatch",
            )
    if case.world_size > 1 and not any(record["sent"] for record in records):
        fail(check, f"{case}: no rank sent anything", prop="dispatch")


def judge_refusal(check: str, name: str, case: Case, records: list[dict]) -> None:
    """Experts not divisible by the world size: every rank raises a ValueError."""
    __tracebackhide__ = True
    for r, record in enumerate(records):
        if record["raised"] is None:
            fail(
                check,
                f"{case}: rank {r}: your {name} returned {record['returned']} instead of "
                f"raising a ValueError: {case.n_experts} experts cannot be split evenly over "
                f"{case.world_size} ranks. Check it first and raise ValueError saying so.",
            )


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
        for case, records in zip(todo, _run(check, fn, sync, todo, P, timeout, name), strict=True):
            count += 1
            want = reference(case)
            with verdict.case():
                judge_forward(check, name, case, records, want)
                if sync is not None:
                    judge_backward(check, name, case, records, want)
            if weights is not None and P > 1:
                with verdict.case():
                    judge_traffic(check, case, records)
                for record, budget in zip(records, traffic_budget(case), strict=True):
                    closest = max(closest, [record["sent"] / budget, record["sent"], budget])
        if P > 1 and sync is None:  # experts that do not split: apart, as it may crash
            refused = Case(P, 2 * P, P + 1, 1, 1.0, min(seeds, default=0))
            count += 1
            with verdict.case():
                try:
                    records = _run(check, fn, None, [refused], P, timeout, name)[0]
                except CheckFailed as error:
                    if error.tampering:
                        raise
                    said = str(error).removeprefix(f"{check}: ")
                    fail(check, f"{refused}: expected a ValueError on every rank, but {said}")
                judge_refusal(check, name, refused, records)
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
    """After backward of sum(out * g) and `sync_router_grads(router)`, x's, the router's and
    this rank's experts' gradients equal the single-process layer's (rtol 1e-9, atol 1e-12)."""
    __tracebackhide__ = True
    check = "check_moe_backward"
    verdict, count, sizes, _ = _check(
        check, expert_parallel_moe, sync_router_grads, world_sizes, seeds, timeout
    )
    verdict.conclude(
        f"{count} case(s) on {', '.join(map(str, sizes))} rank(s), with and without dropped "
        "choices: the output and the gradients of x, the router (after sync_router_grads) and "
        f"every expert equal the layer's on one process (rtol {RTOL:g}, atol {ATOL:g})"
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
        for case, records in zip(
            todo, _run(check, dedup_moe, None, todo, P, timeout, name), strict=True
        ):
            with verdict.case():
                judge_forward(check, name, case, records, reference(case))
            with verdict.case():
                shares.append(judge_dedup(check, case, records, kept_rows(case)))
    verdict.conclude(
        f"{len(shares)} case(s) on {', '.join(map(str, world_sizes))} ranks, k = 2, 4 experts "
        "a rank, with and without dropped choices: every rank's output equals the layer on one "
        f"process (rtol {RTOL:g}, atol {ATOL:g}), and the ranks sent at most "
        f"{max(shares, default=0):.0%} of the bytes of one token row per (token, expert) "
        f"(allowed {DEDUP_FRACTION:.0%})"
    )


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
