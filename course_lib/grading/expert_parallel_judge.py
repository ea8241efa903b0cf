"""Assignment 12's checks, judging in the checking process: what the ranks returned for one
case against the layer on one process (`expert_parallel_cases.solve`), and their calls, as
the launcher's tallies saw them, against the message rules and the byte budget.

    communication(calls)        what one rank's calls in one case add up to
    judge_forward               every rank's output, against its rows of the reference
    judge_backward              x's, the router's and every expert's gradients
    judge_calls                 tokens by all-to-all or point-to-point; other calls small
    judge_traffic               Part 3: the calls, and at most `traffic_budget` bytes a rank
    judge_refusal               experts that do not split: a ValueError on every rank, no call
"""

from __future__ import annotations

import torch

from course_lib import compare
from course_lib.comm import POINT_TO_POINT
from course_lib.grading._harness import fail
from course_lib.grading.expert_parallel_cases import Case, expert_ids, kept_rows, lengths
from course_lib.grading.traffic import Sent

# float64: the experts add the same products in another order on another rank (~1e-16); a
# token at the wrong expert, a wrong drop or a missing gate weight moves it by 1e-2 or more.
RTOL, ATOL = 1e-9, 1e-12
HOP_BYTES = 64
ITEMSIZE = 8  # float64, and the int64 counts per expert
TOKEN_CALLS = (*POINT_TO_POINT, "all_to_all", "all_to_all_single")  # what may carry tokens
SMALL_CALLS = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast")


def carried(call: Sent) -> int:
    """Bytes of the rank's own tensor in one small collective, from what the launcher was told
    it sent and received (`comm.volume`'s models, inverted): an all-gather sends its piece to
    each of the P - 1 others, a ring all-reduce 2(P-1)/P of its tensor, a broadcast's root
    the tensor to each other rank, which receives it once."""
    others = len(call.group) - 1
    if others <= 0:
        return 0
    if call.op == "all_reduce":
        return round(max(call.sent, call.received) * (others + 1) / (2 * others))
    if call.op == "broadcast":
        return round(max(call.sent / others, call.received))
    return round(max(call.sent, call.received) / others)


def communication(calls: list[Sent]) -> dict:
    """What one rank's calls in one case add up to, from the launcher's tallies: each call
    (op, bytes sent, bytes of its own tensor for the small collectives), and the bytes sent."""
    return {
        "calls": [(c.op, c.sent, carried(c) if c.op in SMALL_CALLS else 0) for c in calls],
        "sent": int(sum(call.sent for call in calls)),
    }


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
            fail(check, f"{at}: {problem}.\n{_hint(case, record, r, want)}")


def _hint(case: Case, record: dict, r: int, want: dict) -> str:
    """What to try, from the shape of the mistake."""
    out = record["out"]
    zero_rows = int((out.abs().sum(1) == 0).sum())
    mine = torch.arange(case.tokens).tensor_split(case.world_size)[r]
    all_dropped = int((~want["kept"][mine]).all(1).sum())
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


def judge_calls(check: str, case: Case, comms: list[dict], prop: str) -> None:
    """The message rules of Parts 3 and 4: tokens travel by all-to-alls or point-to-point
    only; any other call carries at most 2 E numbers (counts per expert). The tallies give a
    call's bytes, not its numbers: 2 E numbers are 2 E of 8 bytes (int64 counts, float64)."""
    __tracebackhide__ = True
    limit = 2 * case.n_experts
    for r, seen in enumerate(comms):
        for op, _, size in seen["calls"]:
            if op in TOKEN_CALLS:
                continue
            if op not in SMALL_CALLS:
                fail(
                    check,
                    f"{case}: rank {r} called dist.{op}; tokens travel by all-to-alls "
                    "(dist.all_to_all_single, dist.all_to_all) or dist.send/recv/isend/irecv "
                    "only",
                    prop=prop,
                )
            if size > limit * ITEMSIZE:
                fail(
                    check,
                    f"{case}: rank {r} called dist.{op} on a tensor of {size} bytes "
                    f"({size / ITEMSIZE:g} numbers of 8 bytes); collectives may carry "
                    f"per-expert numbers only (at most {limit} here). Tokens go only to the "
                    "ranks of their experts, by all-to-all.",
                    prop=prop,
                )


def traffic_budget(case: Case, rows: torch.Tensor | None = None) -> list[int]:
    """Bytes each rank may send in one forward and backward: its kept choices for other
    ranks' experts (dispatch) and the outputs of other ranks' choices (combine), a token row
    each, twice (backward sends the same rows' gradients the other way), plus `HOP_BYTES`
    per peer for each of the four all-to-alls and 16 E bytes per peer (counts per expert).
    `rows`: the case's `kept_rows` (by default, with the notebook's secret). With every rank
    sending N bytes of routed tokens spread evenly, the rows are 2 * costs.ep_bytes(N, P)."""
    P = case.world_size
    rows = kept_rows(case) if rows is None else rows
    row = case.d_model * ITEMSIZE
    off = rows - torch.diag(rows.diagonal())
    slack = (P - 1) * (4 * HOP_BYTES + 16 * case.n_experts)
    return [int(2 * row * (off[r].sum() + off[:, r].sum())) + slack for r in range(P)]


def judge_traffic(check: str, case: Case, comms: list[dict], budget: list[int]) -> None:
    """The "dispatch" property: tokens by all-to-all or point-to-point only, small collectives
    only, at most `traffic_budget` bytes per rank."""
    __tracebackhide__ = True
    judge_calls(check, case, comms, "dispatch")
    for r, seen in enumerate(comms):
        if seen["sent"] > budget[r]:
            fail(
                check,
                f"{case}: rank {r} sent {seen['sent']} bytes; its kept tokens for other "
                f"ranks' experts and the outputs it owes them, forward and backward, come to "
                f"at most {budget[r]}. Does every token go only to its experts' ranks, and "
                "are the choices over capacity left at home?",
                prop="dispatch",
            )
    if case.world_size > 1 and not any(seen["sent"] for seen in comms):
        fail(check, f"{case}: no rank sent anything", prop="dispatch")


def judge_refusal(
    check: str, name: str, case: Case, records: list[dict], comms: list[dict]
) -> None:
    """Experts not divisible by the world size: every rank raises a ValueError, before any
    message (no call in the launcher's tallies)."""
    __tracebackhide__ = True
    for r, record in enumerate(records):
        if record["raised"] is None:
            fail(
                check,
                f"{case}: rank {r}: your {name} returned {record['returned']} instead of "
                f"raising a ValueError: {case.n_experts} experts cannot be split evenly over "
                f"{case.world_size} ranks. Check it first and raise ValueError saying so.",
            )
        if comms[r]["calls"]:
            made = ", ".join(op for op, _, _ in comms[r]["calls"])
            fail(
                check,
                f"{case}: rank {r}: your {name} raised the ValueError after communicating "
                f"({made}): {case.n_experts} experts cannot be split evenly over "
                f"{case.world_size} ranks, which every rank knows from its own arguments. "
                "Check it first, before any message.",
            )


__all__ = [
    "ATOL",
    "HOP_BYTES",
    "ITEMSIZE",
    "RTOL",
    "SMALL_CALLS",
    "TOKEN_CALLS",
    "carried",
    "communication",
    "judge_backward",
    "judge_calls",
    "judge_forward",
    "judge_refusal",
    "judge_traffic",
    "traffic_budget",
]
