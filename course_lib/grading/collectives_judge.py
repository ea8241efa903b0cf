"""Assignment 2's checks, judging in the calling process: what the ranks reported for one
case, against torch's result, the rules of the assignment (send/recv only, every request
waited for, inputs left unchanged), for the ring its neighbours and its bytes, and for the
fast all-reduce (Part 7) its messages and its bytes.

    Spec                    what differs between the collectives when judging them
    judge_case              the result and the calls of one case, every rank
    judge_neighbours, judge_bytes   the ring's two properties
    judge_messages, judge_bytes     the fast all-reduce's two bounds
    fast_messages(P)        its message bound: the latencies of halving-doubling, 2 log2 P
    _hint                   what to try, from the shape of a wrong result
    Tally                   what a passing check verified, for its summary
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from course_lib.comm import POINT_TO_POINT
from course_lib.costs import all_reduce_bytes, all_reduce_seconds
from course_lib.grading._harness import fail
from course_lib.grading.collectives_ranks import Case

EXACT = (0, 0)  # broadcast and all-gather only move data: every bit must arrive


@dataclass
class Spec:
    """What differs between the collectives when judging them."""

    kind: str
    check: str
    tolerance: dict | None  # None: exact for every dtype
    root: str | None = None  # "src" or "dst"
    bandwidth_optimal: bool = False  # Part 6: neighbours only, the ring's bytes
    fewest_messages: bool = False  # Part 7: the ring's bytes in 2 log2 P messages

    @property
    def counts_bytes(self) -> bool:
        return self.bandwidth_optimal or self.fewest_messages


class Tally:
    """What a passing check verified: how many cases, and the bytes they sent."""

    def __init__(self) -> None:
        self.cases, self.world_sizes, self.sent = 0, set(), 0
        self.busiest = (0.0, 0, 0)  # (share of the budget, bytes, budget) of the busiest rank
        self.chattiest = (0.0, 0, 0)  # the same for messages

    def add(self, spec: Spec, case: Case, records: list[dict]) -> None:
        self.cases += 1
        self.world_sizes.add(case.world_size)
        self.sent += sum(record["sent"] for record in records)
        if spec.counts_bytes:
            most = max(record["sent"] for record in records)
            share = most / max(_ring_budget(case), 1)
            self.busiest = max(self.busiest, (share, most, _ring_budget(case)))
        if spec.fewest_messages:
            most, allowed = max(map(_messages, records)), fast_messages(case.world_size)
            self.chattiest = max(self.chattiest, (most / allowed, most, allowed))

    def summary(self, spec: Spec, point_to_point_only: bool) -> str:
        sizes = ", ".join(str(p) for p in sorted(self.world_sizes))
        how = "exactly" if spec.tolerance is None else "within TOLERANCE for float sums"
        text = (
            f"{self.cases} case(s) on {sizes} rank(s): every rank's result matches "
            f"torch.distributed.{spec.kind} ({how})"
        )
        if point_to_point_only:
            text += ", built from send/recv/isend/irecv only, every request waited for"
        text += f"; {self.sent} bytes sent in all"
        if spec.bandwidth_optimal:
            _, most, budget = self.busiest
            text += (
                "; every rank talked only to its ring neighbours and sent at most 2(P-1) "
                f"chunks of ceil(N/P) elements (closest to the limit: {most} of {budget} bytes)"
            )
        if spec.fewest_messages:
            _, most, budget = self.busiest
            _, chattiest, allowed = self.chattiest
            text += (
                f"; every rank sent at most 2 log2 P messages (closest to the limit: {chattiest} "
                f"of {allowed}) and at most 2(P-1) chunks of ceil(N/P) elements (closest to the "
                f"limit: {most} of {budget} bytes)"
            )
        return text


def judge_case(spec: Spec, name: str, case: Case, records: list[dict], p2p_only: bool) -> None:
    """Fail on the first problem with one case's result, looking at every rank's record."""
    __tracebackhide__ = True
    where = str(case)
    for r, record in enumerate(records):
        others = sorted(set(record["calls"]) - set(POINT_TO_POINT))
        if p2p_only and others:
            fail(
                spec.check,
                f"{where}: rank {r} called {', '.join(f'dist.{op}' for op in others)}; use "
                "send/recv only (dist.send, dist.recv, dist.isend, dist.irecv): this "
                "assignment builds the collectives out of them",
            )
    sent = sum(record["sent"] for record in records)
    received = sum(record["received"] for record in records)
    if case.world_size > 1 and 0 not in case.shape and sent == received == 0:
        fail(
            spec.check,
            f"{where}: no send or recv was seen on any rank, yet the result needs data from "
            "other ranks. Build it from dist.send, dist.recv, dist.isend and dist.irecv.",
        )
    if sent != received:
        fail(
            spec.check,
            f"{where}: the ranks sent {sent} bytes in all but received {received}; every "
            "message sent must be received by the rank it was sent to, with the same size.",
        )
    for r, record in enumerate(records):
        if record["unwaited"]:
            op, peer = record["unwaited"][0]
            fail(
                spec.check,
                f"{where}: rank {r} never called wait() on the request of its "
                f"dist.{op}(..., {peer}) ({len(record['unwaited'])} request(s) not waited "
                "for). Until wait() returns, an irecv's tensor may not hold the message yet "
                "and an isend's tensor must not change: wait() for every request.",
            )
    for r, record in enumerate(records):
        for what in record.get("rebound", []):
            fail(
                spec.check,
                f"{where}: on rank {r}, {what} was replaced by another tensor; fill the "
                f"tensors the caller gave you ({what}.copy_(...)): the caller keeps "
                "references to them, not to your list",
            )
        _judge_values(spec, name, case, r, records)
        for what in record.get("changed", []):
            fail(
                spec.check,
                f"{where}: your {name} changed its input {what} on rank {r}; "
                f"torch.distributed leaves it unchanged. Accumulate into a buffer of your own "
                "(e.g. a clone) or into the output.",
            )


def judge_neighbours(spec: Spec, case: Case, records: list[dict]) -> None:
    """The "ring" property: each rank sends to and receives from its neighbours only."""
    __tracebackhide__ = True
    p = case.world_size
    for r, record in enumerate(records):
        neighbours = {(r - 1) % p, (r + 1) % p}
        for op, peer in record["peers"]:
            if peer not in neighbours:
                other = "any rank (no src given)" if peer is None else f"rank {peer}"
                fail(
                    spec.check,
                    f"{case}: rank {r} called dist.{op} with {other}; in a ring each rank "
                    f"talks only to its neighbours, here ranks {sorted(neighbours)}: send to "
                    "rank + 1 and receive from rank - 1 (modulo the world size)",
                    prop="ring",
                )


def _ring_budget(case: Case) -> int:
    """Bytes a rank may send in a ring all-reduce: 2(P-1) steps of one chunk each, a chunk
    padded up to ceil(N/P) elements at most."""
    p, itemsize = case.world_size, torch.empty((), dtype=case.dtype).element_size()
    return all_reduce_bytes(p * -(-_numel(case.shape) // p) * itemsize, p)


def judge_bytes(spec: Spec, case: Case, records: list[dict]) -> None:
    """The "bytes" property: no rank sends more than `_ring_budget`."""
    __tracebackhide__ = True
    p, numel = case.world_size, _numel(case.shape)
    itemsize = torch.empty((), dtype=case.dtype).element_size()
    allowed = _ring_budget(case)
    what, hint = (
        "a ring all-reduce",
        ("Does each step send one chunk of about N/P elements, not the whole tensor?"),
    )
    if spec.fewest_messages:
        what, hint = (
            "this all-reduce",
            (
                "Does every rank send each piece of the tensor once on the way in (summing) and "
                "once on the way out, halving what it sends as the rounds go, not whole tensors?"
            ),
        )
    for r, record in enumerate(records):
        if record["sent"] > allowed:
            fail(
                spec.check,
                f"{case}: rank {r} sent {record['sent']} bytes; {what} of "
                f"N = {numel} elements ({numel * itemsize} bytes) sends at most "
                f"2(P-1)/P * N = {all_reduce_bytes(float(numel * itemsize), p):g} bytes per rank, "
                f"and at most 2(P-1) chunks of ceil(N/P) elements, {allowed} bytes, when chunks "
                f"are padded. {hint}",
                prop="bytes",
            )


def fast_messages(world_size: int) -> int:
    """Messages a rank may send in Part 7: the latencies lecture 2's alpha-beta model charges
    halving-doubling (`costs.all_reduce_seconds` with alpha = 1, beta = 0), 2 log2 P."""
    return round(all_reduce_seconds("halving_doubling", 0, world_size, alpha=1.0, beta=0.0))


def _messages(record: dict) -> int:
    """Sends (send and isend, whatever way they were reached) in one rank's record."""
    return sum(op in ("send", "isend") for op, _ in record["peers"])


def judge_messages(spec: Spec, case: Case, records: list[dict]) -> None:
    """The "messages" property: no rank sends more than `fast_messages(P)` messages."""
    __tracebackhide__ = True
    p, allowed = case.world_size, fast_messages(case.world_size)
    for r, record in enumerate(records):
        if (sent := _messages(record)) > allowed:
            fail(
                spec.check,
                f"{case}: rank {r} sent {sent} messages (sends and isends, empty ones "
                f"included); at most 2 log2 P = {allowed} are allowed on {p} ranks. A ring "
                f"sends 2(P-1) = {2 * (p - 1)}: exchange with fewer partners, sending each a "
                "larger piece.",
                prop="messages",
            )


def _judge_values(spec: Spec, name: str, case: Case, r: int, records: list[dict]) -> None:
    __tracebackhide__ = True
    record = records[r]
    rtol, atol = (spec.tolerance or {}).get(case.dtype, EXACT)
    for what, want in record["expected"].items():
        got = record["got"][what]
        bad = _mismatch(got, want, rtol, atol)
        if bad is None:
            continue
        flat_bad = bad.nonzero().flatten()
        error = (got.double() - want.double()).abs().flatten()[flat_bad]
        scale = want.double().abs().flatten()[flat_bad].clamp_min(1e-300)
        shown = ", ".join(str(i) for i in flat_bad[:6].tolist())
        more = ", ..." if len(flat_bad) > 6 else ""
        allowed = "exactly" if (rtol, atol) == EXACT else f"within atol {atol:g} + rtol {rtol:g}"
        fail(
            spec.check,
            f"{case}: on rank {r}, {what} differs from torch.distributed.{spec.kind} at "
            f"{len(flat_bad)} of {want.numel()} elements (flat indices {shown}{more}); max abs "
            f"error {error.max().item():.3g}, max rel error {(error / scale).max().item():.3g}; "
            f"{'it must match ' + allowed}.\n"
            + _hint(spec, name, case, r, records, what, flat_bad),
        )


def _mismatch(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float):
    """None if equal within the tolerance, else a boolean mask of the wrong elements."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return torch.ones(want.shape, dtype=torch.bool)
    if not got.dtype.is_floating_point:
        bad = got != want
    else:
        bad = ~torch.isclose(got, want, rtol=rtol, atol=atol)
    return bad if bad.any() else None


def _hint(
    spec: Spec, name: str, case: Case, r: int, records: list[dict], what: str, bad: torch.Tensor
) -> str:
    """What to try, from the shape of the mistake."""
    record = records[r]
    got, want = record["got"][what], record["expected"][what]
    if (
        spec.kind == "broadcast"
        and case.root != 0
        and torch.equal(got, records[0]["inputs"]["tensor"])
    ):
        return f"Every rank got rank 0's tensor, but src was {case.root}: use the src argument."
    if spec.kind == "all_gather" and what == f"tensor_list[{r}]":
        return f"Did rank {r} also copy its own tensor into tensor_list[{r}]?"
    before = record.get("initial", record["inputs"]).get(what)
    if before is not None and torch.equal(got, before) and not torch.equal(want, before):
        returned = record["returned"] is not None
        text = (
            f"Your {name} did not change {what} on rank {r}: it must write the result into the "
            f"tensor it was given (e.g. {what}.copy_(...) or +=), in place, as torch does"
        )
        if returned:
            text += "; it returned a new tensor instead, but the return value is not used"
        text += "."
        if spec.kind == "all_reduce" and not returned:
            text += " torch's all_reduce leaves the sum on EVERY rank: did only rank 0 get it?"
        return text
    own = record["inputs"].get("tensor")
    if spec.kind in ("reduce", "all_reduce") and _close(got, want - own, spec, case):
        return f"The result is the sum over the other ranks only: did rank {r} also add its own?"
    return _general_hints(spec, case, bad)


def _general_hints(spec: Spec, case: Case, bad: torch.Tensor) -> str:
    """What to try when no single mistake explains the result: uneven chunks, int64 through
    floating point, broadcast's src, else the order of the steps."""
    numel = _numel(case.shape)
    hints = []
    tail = torch.arange(numel - len(bad), numel)
    if numel % case.world_size and len(bad) < numel and torch.equal(bad, tail):
        hints.append(
            f"Only the last {len(bad)} element(s) are wrong: with N = {numel} not divisible by "
            f"P = {case.world_size}, do your chunks cover every element "
            "(torch.tensor_split(flat, P) gives P chunks of nearly equal size)?"
        )
    if case.dtype == torch.int64:
        hints.append(
            "int64 sums must be exact: did the values pass through floating point (a true "
            "division `/`, or a float buffer)?"
        )
    if spec.kind == "broadcast":
        hints.append(f"Does every rank other than src receive from src = {case.root}?")
    if not hints:
        hints.append(
            "Check the order of your sends and receives, which chunk each step sends and "
            "receives, and that every rank adds exactly once each contribution."
        )
    return " ".join(hints)


def _close(got: torch.Tensor, want: torch.Tensor, spec: Spec, case: Case) -> bool:
    rtol, atol = (spec.tolerance or {}).get(case.dtype, EXACT)
    return _mismatch(got, want, rtol, atol) is None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
