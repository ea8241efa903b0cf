"""Assignment 2's checks, judging in the calling process: what the ranks reported for one
case, against torch's result, the rules of the assignment (send/recv only, every request
waited for, inputs left unchanged), for the bidirectional ring (Part 6) its neighbours and
its bytes each way, and for the fast all-reduce (Part 7) its messages and its bytes.

    Spec                    what differs between the collectives when judging them
    judge_case              the result and the calls of one case, every rank
    judge_neighbours, judge_directions   the bidirectional ring's two properties
    direction_budget(case)  its bytes each way: one ring all-reduce of half the tensor
    judge_messages, judge_bytes          the fast all-reduce's two bounds
    fast_messages(P), fast_budget(case)  its bounds: halving-doubling on the largest power of
                            two of ranks, plus a fold of the others in and out
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
    bidirectional: bool = False  # Part 6: neighbours only, half the ring's bytes each way
    fewest_messages: bool = False  # Part 7: halving-doubling's messages and bytes, any P


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
        if spec.bidirectional:
            allowed = direction_budget(case)
            most = max(max(_each_way(case, r, record)) for r, record in enumerate(records))
            self.busiest = max(self.busiest, (most / max(allowed, 1), most, allowed))
        if spec.fewest_messages:
            allowed = fast_budget(case)
            most = max(record["sent"] for record in records)
            self.busiest = max(self.busiest, (most / max(allowed, 1), most, allowed))
            most, allowed = max(map(_messages, records)), fast_messages(case.world_size)
            self.chattiest = max(self.chattiest, (most / max(allowed, 1), most, allowed))

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
        if spec.bidirectional:
            _, most, budget = self.busiest
            text += (
                "; every rank talked only to its two neighbours and sent each way at most 2(P-1) "
                f"chunks of ceil(N/(2P)) elements (closest to the limit: {most} of {budget} "
                "bytes one way)"
            )
        if spec.fewest_messages:
            _, most, budget = self.busiest
            _, chattiest, allowed = self.chattiest
            text += (
                "; with Q the largest power of two <= P, every rank sent at most 2 log2 Q "
                f"messages, 2 more when P > Q (closest to the limit: {chattiest} of {allowed}), "
                "and at most 2(Q-1) chunks of ceil(N/Q) elements, N more when P > Q (closest "
                f"to the limit: {most} of {budget} bytes)"
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
    """The "neighbours" property: each rank sends to and receives from rank - 1 and rank + 1
    only (on 2 ranks both are the one other rank)."""
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
                    f"talks only to its neighbours, here ranks {sorted(neighbours)}: one ring "
                    "sends to rank + 1 and receives from rank - 1, the other the opposite way "
                    "(modulo the world size)",
                    prop="neighbours",
                )


def _itemsize(case: Case) -> int:
    return torch.empty((), dtype=case.dtype).element_size()


def direction_budget(case: Case) -> int:
    """Bytes a rank may send each way in Part 6: a ring all-reduce of half the tensor, 2(P-1)
    steps of one chunk, a chunk of at most ceil(N/(2P)) elements (= ceil(ceil(N/2)/P): the
    larger half cut in P, or 2P equal padded chunks)."""
    p = case.world_size
    chunk = -(-_numel(case.shape) // (2 * p))
    return int(all_reduce_bytes(p * chunk * _itemsize(case), p))


def _each_way(case: Case, r: int, record: dict) -> tuple[int, int]:
    """Bytes rank r sent to rank r + 1 and to rank r - 1; on 2 ranks (one neighbour, both
    rings on it) half its bytes each way, as only their sum can be judged."""
    p, to = case.world_size, record["sent_to"]
    if p == 2:
        return (record["sent"] + 1) // 2, record["sent"] // 2
    return to.get((r + 1) % p, 0), to.get((r - 1) % p, 0)


def judge_directions(spec: Spec, case: Case, records: list[dict]) -> None:
    """The "bytes" property of Part 6: each way (to rank + 1, to rank - 1) no rank sends more
    than `direction_budget`, and in all no more than twice it (on 2 ranks, where both rings
    share the one neighbour, only the sum is judged)."""
    __tracebackhide__ = True
    p, numel = case.world_size, _numel(case.shape)
    allowed = direction_budget(case)
    half = (
        f"one ring all-reduce of half the tensor (N = {numel} elements, "
        f"{numel * _itemsize(case)} bytes) sends at most 2(P-1) chunks of ceil(N/(2P)) "
        f"elements, {allowed} bytes"
    )
    for r, record in enumerate(records):
        to = record["sent_to"]
        ways = {"rank + 1": (r + 1) % p, "rank - 1": (r - 1) % p} if p > 2 else {}
        for way, peer in ways.items():
            if to.get(peer, 0) <= allowed:
                continue
            other_way, other = next((w, q) for w, q in ways.items() if q != peer)
            if not to.get(other, 0):
                fail(
                    spec.check,
                    f"{case}: rank {r} sent all its bytes one way, {to[peer]} to {way} (rank "
                    f"{peer}) and none to {other_way} (rank {other}); {half} each way. Cut the "
                    "flat tensor in two halves and send the second half around the ring the "
                    "other way, so that each of the rank's two links carries half.",
                    prop="bytes",
                )
            fail(
                spec.check,
                f"{case}: rank {r} sent {to[peer]} bytes to {way} (rank {peer}); {half} each "
                "way. Does each ring carry only its half of the tensor, one chunk of about "
                "N/(2P) elements a step?",
                prop="bytes",
            )
        if record["sent"] > 2 * allowed:
            shared = " (on 2 ranks both rings run between the same two ranks)" if p == 2 else ""
            fail(
                spec.check,
                f"{case}: rank {r} sent {record['sent']} bytes in all; {half} each way, "
                f"{2 * allowed} bytes for the two{shared}. Does each step send one chunk of "
                "about N/(2P) elements per ring, not the whole tensor?",
                prop="bytes",
            )


def _fold(world_size: int) -> tuple[int, bool]:
    """Q, the largest power of two <= P, and whether P - Q ranks must be folded in and out."""
    q = 1 << (world_size.bit_length() - 1)
    return q, q < world_size


def fast_messages(world_size: int) -> int:
    """Messages a rank may send in Part 7: the latencies lecture 2's alpha-beta model charges
    halving-doubling on Q ranks (`costs.all_reduce_seconds` with alpha = 1, beta = 0),
    2 log2 Q, and when P is not a power of two 2 more: the fold's message in and its message
    back, on the critical path of every rank."""
    q, folded = _fold(world_size)
    hd = round(all_reduce_seconds("halving_doubling", 0, q, alpha=1.0, beta=0.0))
    return hd + 2 * folded


def fast_budget(case: Case) -> int:
    """Bytes a rank may send in Part 7: halving-doubling of N elements on Q ranks, 2(Q-1)
    chunks of ceil(N/Q) elements (the ring's budget), and when P is not a power of two the
    whole tensor once more (a fold hands the result back to the rank that folded in)."""
    q, folded = _fold(case.world_size)
    nbytes = _numel(case.shape) * _itemsize(case)
    chunked = q * -(-_numel(case.shape) // q) * _itemsize(case)
    return int(all_reduce_bytes(chunked, q)) + nbytes * folded


def _fast_rule(world_size: int) -> str:
    q, folded = _fold(world_size)
    if folded:
        return f"2 floor(log2 P) + 2 = {fast_messages(world_size)} (P = {world_size}, Q = {q})"
    return f"2 log2 P = {fast_messages(world_size)}"


def judge_bytes(spec: Spec, case: Case, records: list[dict]) -> None:
    """The "bytes" property of Part 7: no rank sends more than `fast_budget`."""
    __tracebackhide__ = True
    p, numel = case.world_size, _numel(case.shape)
    nbytes = numel * _itemsize(case)
    q, folded = _fold(p)
    allowed = fast_budget(case)
    rule = (
        f"2(Q-1) chunks of ceil(N/Q) elements with Q = {q}, the largest power of two <= P, "
        f"plus N for the fold: {allowed} bytes"
        if folded
        else f"2(P-1) chunks of ceil(N/P) elements, {allowed} bytes"
    )
    for r, record in enumerate(records):
        if record["sent"] > allowed:
            fail(
                spec.check,
                f"{case}: rank {r} sent {record['sent']} bytes; this all-reduce of N = {numel} "
                f"elements ({nbytes} bytes) may send at most {rule}, per rank. Does every rank "
                "send each piece of the tensor once on the way in (summing) and once on the "
                "way out, halving what it sends as the rounds go, not whole tensors?",
                prop="bytes",
            )


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
                f"included); at most {_fast_rule(p)} are allowed on {p} ranks. A ring "
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
