"""Checks for Assignment 2, collectives built from point-to-point messages.

    check_broadcast(broadcast)                 broadcast(tensor, src), in place
    check_reduce(reduce)                       reduce(tensor, dst): the sum lands on dst
    check_all_gather(all_gather)               all_gather(tensor_list, tensor)
    check_reduce_scatter(reduce_scatter)       reduce_scatter(output, input_list)
    check_all_reduce(all_reduce)               all_reduce(tensor): the sum on every rank
    check_all_reduce(ring_all_reduce, bandwidth_optimal=True)
                                               ... and each rank talks only to its two
                                               neighbours and sends at most 2(P-1)/P * N

Every case runs the student's function and torch.distributed's own collective on the same
inputs in the same worker; torch's result is the reference. Sums are compared exactly for
int64 and within `TOLERANCE` for floats (the order of the additions differs). The checks also
count the calls with `CommCounter`: only send/recv/isend/irecv are allowed, and every
isend/irecv must be waited for.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from course_lib import comm
from course_lib.comm import CommCounter
from course_lib.costs import all_reduce_bytes
from course_lib.grading._harness import RESULT, Verdict, fail, run_on_ranks
from course_lib.grading.provenance import Provenance
from course_lib.runtime import rank

POINT_TO_POINT = ("send", "recv", "isend", "irecv")
# (rtol, atol) for sums: |got - expected| <= atol + rtol * |expected|. A sum of P float32
# values in another order differs by a few units in the last place (~1e-7 relative).
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12), torch.int64: (0, 0)}
EXACT = (0, 0)  # broadcast and all-gather only move data: every bit must arrive
INT64_LIMIT = 2**58  # int64 inputs reach far past 2**53, where float64 stops being exact

# The ring part's points: half for talking only to the neighbours, half for the bytes, and
# neither unless the sum is right on every rank (a right sum alone is part 5's naive answer).
RING_WEIGHTS = {RESULT: 0.0, "ring": 0.5, "bytes": 0.5}

DTYPES = (torch.float32, torch.float64, torch.int64)
DEFAULT_SHAPES = ((5,), (2, 3))
DEFAULT_WORLD_SIZES = (1, 2, 3, 4)


@dataclass(frozen=True)
class Case:
    """One run of a collective: on how many ranks, with what tensor, from/to which root."""

    world_size: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    seed: int
    root: int | None = None  # src of a broadcast, dst of a reduce

    def __str__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        root = "" if self.root is None else f", root rank {self.root}"
        return f"world size {self.world_size}, {dtype}, shape {self.shape}, seed {self.seed}{root}"


# --- on each rank: run torch's collective and the student's on the same inputs -----------


def _random(case: Case, generator: torch.Generator) -> torch.Tensor:
    if case.dtype.is_floating_point:
        return torch.randn(case.shape, generator=generator, dtype=case.dtype)
    return torch.randint(
        -INT64_LIMIT, INT64_LIMIT, case.shape, generator=generator, dtype=case.dtype
    )


def _generator(case: Case) -> torch.Generator:
    """The same inputs for the same case and rank, whatever ran before."""
    return torch.Generator().manual_seed(
        1_000_003 * case.seed + 1009 * rank() + 7 * len(case.shape)
    )


class _Request:
    """An isend/irecv request that remembers whether the student waited for it."""

    def __init__(self, work: Any, op: str, peer: int | None) -> None:
        self._work, self.op, self.peer, self.waited = work, op, peer, False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self.waited = True
        return self._work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        self.waited = self.waited or done
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@functools.cache
def _signature(op: str) -> inspect.Signature:
    return inspect.signature(getattr(c10d, op))


class _PeerLog:
    """While active: which rank each send/recv talks to, and which requests were never
    waited for. Sits on top of a CommCounter's wrappers (enter it after the counter)."""

    def __enter__(self) -> _PeerLog:
        self.peers: list[tuple[str, int | None]] = []
        self.requests: list[_Request] = []
        # Peers from course_lib.comm's hook: on grading ranks it sees every route (a name
        # bound before the check, the group object); wait() only on dist's own functions.
        comm.add_around_hook(self._peer)
        self._saved = {op: getattr(dist, op) for op in POINT_TO_POINT}
        for op, inner in self._saved.items():
            wrapper = self._wrap(op, inner)
            # Both namespaces, as CommCounter does: P2POp compares against c10d's.
            setattr(dist, op, wrapper)
            setattr(c10d, op, wrapper)
        return self

    def _peer(self, op, args, sent, received, call):
        if op in POINT_TO_POINT:
            names = ("dst", "group_dst") if op in ("send", "isend") else ("src", "group_src")
            peer = next((args[n] for n in names if args.get(n) is not None), None)
            self.peers.append((op, peer))
        return call()

    def __exit__(self, exc_type: type | None, *rest: object) -> None:
        comm.remove_around_hook(self._peer)
        for op, inner in self._saved.items():
            setattr(dist, op, inner)
            setattr(c10d, op, inner)
        if exc_type is None:
            # Finish what the student left in flight, so the next case starts in step.
            for request in self.requests:
                if not request.waited:
                    request._work.wait()

    def unwaited(self) -> list[tuple[str, int | None]]:
        return [(r.op, r.peer) for r in self.requests if not r.waited]

    def _wrap(self, op: str, inner: Callable) -> Callable:
        signature = _signature(op)
        peer_names = ("dst", "group_dst") if op in ("send", "isend") else ("src", "group_src")

        def logged(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs).arguments
            peer = next((bound[n] for n in peer_names if bound.get(n) is not None), None)
            work = inner(*args, **kwargs)
            if op in ("isend", "irecv") and work is not None:
                work = _Request(work, op, peer)
                self.requests.append(work)
            return work

        return logged


def _watched(fn: Callable, case: Case, *args: Any) -> dict:
    """Run the student's fn(*args) on this rank, counting and logging its messages."""
    with CommCounter() as counter, _PeerLog() as log:
        try:
            returned = fn(*args)
        except BaseException as exc:
            if hasattr(exc, "add_note"):  # Python 3.11+: the traceback then names the case
                exc.add_note(f"(while checking: {case})")
            raise
    return {
        "returned": returned if isinstance(returned, torch.Tensor) else None,
        "calls": dict(counter.calls),
        "sent": counter.bytes_sent,
        "received": counter.bytes_received,
        "peers": log.peers,
        "unwaited": log.unwaited(),
    }


def _run_broadcast(fn: Callable, case: Case) -> dict:
    tensor = _random(case, _generator(case))
    expected = tensor.clone()
    dist.broadcast(expected, src=case.root)
    mine = tensor.clone()
    record = _watched(fn, case, mine, case.root)
    return {
        **record,
        "inputs": {"tensor": tensor},
        "got": {"tensor": mine},
        "expected": {"tensor": expected},
    }


def _run_reduce(fn: Callable, case: Case) -> dict:
    tensor = _random(case, _generator(case))
    expected = tensor.clone()
    dist.reduce(expected, dst=case.root)
    mine = tensor.clone()
    record = _watched(fn, case, mine, case.root)
    # torch leaves the other ranks' tensors unspecified: only dst's is compared.
    at_dst = rank() == case.root
    return {
        **record,
        "inputs": {"tensor": tensor},
        "got": {"tensor": mine} if at_dst else {},
        "expected": {"tensor": expected} if at_dst else {},
    }


def _run_all_reduce(fn: Callable, case: Case) -> dict:
    tensor = _random(case, _generator(case))
    expected = tensor.clone()
    dist.all_reduce(expected)
    mine = tensor.clone()
    record = _watched(fn, case, mine)
    return {
        **record,
        "inputs": {"tensor": tensor},
        "got": {"tensor": mine},
        "expected": {"tensor": expected},
    }


def _run_all_gather(fn: Callable, case: Case) -> dict:
    generator = _generator(case)
    tensor = _random(case, generator)
    garbage = [_random(case, generator) for _ in range(case.world_size)]  # torch overwrites
    expected = [g.clone() for g in garbage]
    dist.all_gather(expected, tensor.clone())
    given, mine = [g.clone() for g in garbage], tensor.clone()
    tensor_list = list(given)
    record = _watched(fn, case, tensor_list, mine)
    return {
        **record,
        "inputs": {"tensor": tensor},
        "got": {f"tensor_list[{i}]": t for i, t in enumerate(given)},
        "expected": {f"tensor_list[{i}]": t for i, t in enumerate(expected)},
        "initial": {f"tensor_list[{i}]": g for i, g in enumerate(garbage)},
        "rebound": [
            f"tensor_list[{i}]"
            for i, t in enumerate(given)
            if i >= len(tensor_list) or tensor_list[i] is not t
        ],
        "changed": ["tensor"] if not torch.equal(mine, tensor) else [],
    }


def _run_reduce_scatter(fn: Callable, case: Case) -> dict:
    generator = _generator(case)
    inputs = [_random(case, generator) for _ in range(case.world_size)]
    garbage = _random(case, generator)
    expected = garbage.clone()
    dist.reduce_scatter(expected, [t.clone() for t in inputs])
    output, input_list = garbage.clone(), [t.clone() for t in inputs]
    record = _watched(fn, case, output, input_list)
    return {
        **record,
        "inputs": {f"input_list[{i}]": t for i, t in enumerate(inputs)},
        "got": {"output": output},
        "expected": {"output": expected},
        "initial": {"output": garbage},
        "changed": [
            f"input_list[{i}]" for i, t in enumerate(inputs) if not torch.equal(input_list[i], t)
        ],
    }


_RUNNERS = {
    "broadcast": _run_broadcast,
    "reduce": _run_reduce,
    "all_reduce": _run_all_reduce,
    "all_gather": _run_all_gather,
    "reduce_scatter": _run_reduce_scatter,
}


def _run_cases(kind: str, fn: Callable, cases: list[Case]) -> list[dict]:
    """On each rank: every case in turn, in the same order on every rank."""
    # An outer counter keeps torch.distributed wrapped for the whole run (installing the
    # wrappers costs about a millisecond); each case counts only the student's calls with a
    # counter of its own. What the outer one counts is not used.
    with CommCounter(), Provenance(LECTURE) as seen:
        results = [_RUNNERS[kind](fn, case) for case in cases]
    return {"cases": results, "copied": seen.complaint()}


# Lecture 2's module holds working collectives built from send and recv (naive, tree,
# butterfly and ring all-reduces): an answer that runs them, or a copy, is not the student's.
LECTURE = ("course_lib.collectives",)


# --- in the calling process: judge what the ranks reported -------------------------------


@dataclass
class _Spec:
    """What differs between the collectives when judging them."""

    kind: str
    check: str
    tolerance: dict | None  # None: exact for every dtype
    root: str | None = None  # "src" or "dst"
    bandwidth_optimal: bool = False


def _check(
    spec: _Spec,
    fn: Callable,
    world_sizes: Iterable[int],
    shapes: Iterable,
    dtypes: Iterable[torch.dtype],
    seeds: Iterable[int],
    timeout: float,
    point_to_point_only: bool,
) -> None:
    __tracebackhide__ = True
    if not callable(fn):
        fail(spec.check, f"expected your function, got {type(fn).__name__} {fn!r:.60}")
    shapes = [tuple(s) if isinstance(s, Iterable) else (int(s),) for s in shapes]
    name = getattr(fn, "__name__", "function")
    verdict = Verdict(spec.check, RING_WEIGHTS if spec.bandwidth_optimal else None)
    tally = _Tally()
    for p in sorted(set(world_sizes)):
        roots = range(p) if spec.root else [None]
        cases = [
            Case(p, shape, dtype, seed, root)
            for shape in shapes
            for dtype in dtypes
            for seed in seeds
            for root in roots
        ]
        results = run_on_ranks(
            spec.check,
            _run_cases,
            spec.kind,
            fn,
            cases,
            world_size=p,
            timeout=timeout,
            what=f"your {name} (world size {p}, {len(cases)} cases)",
        )
        if results[0]["copied"]:
            fail(spec.check, results[0]["copied"])
        results = [found["cases"] for found in results]
        for i, case in enumerate(cases):
            records = [results[r][i] for r in range(p)]
            with verdict.case():
                _judge(spec, name, case, records, point_to_point_only)
            if spec.bandwidth_optimal:
                with verdict.case():
                    _judge_neighbours(spec, case, records)
                with verdict.case():
                    _judge_bytes(spec, case, records)
            tally.add(spec, case, records)
    verdict.conclude(tally.summary(spec, point_to_point_only))


class _Tally:
    """What a passing check verified: how many cases, and the bytes they sent."""

    def __init__(self) -> None:
        self.cases, self.world_sizes, self.sent = 0, set(), 0
        self.busiest = (0.0, 0, 0)  # (share of the budget, bytes, budget) of the busiest rank

    def add(self, spec: _Spec, case: Case, records: list[dict]) -> None:
        self.cases += 1
        self.world_sizes.add(case.world_size)
        self.sent += sum(record["sent"] for record in records)
        if spec.bandwidth_optimal:
            most = max(record["sent"] for record in records)
            share = most / max(_ring_budget(case), 1)
            self.busiest = max(self.busiest, (share, most, _ring_budget(case)))

    def summary(self, spec: _Spec, point_to_point_only: bool) -> str:
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
        return text


def _judge(spec: _Spec, name: str, case: Case, records: list[dict], p2p_only: bool) -> None:
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


def _judge_neighbours(spec: _Spec, case: Case, records: list[dict]) -> None:
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


def _judge_bytes(spec: _Spec, case: Case, records: list[dict]) -> None:
    """The "bytes" property: no rank sends more than `_ring_budget`."""
    __tracebackhide__ = True
    p, numel = case.world_size, _numel(case.shape)
    itemsize = torch.empty((), dtype=case.dtype).element_size()
    allowed = _ring_budget(case)
    for r, record in enumerate(records):
        if record["sent"] > allowed:
            fail(
                spec.check,
                f"{case}: rank {r} sent {record['sent']} bytes; a ring all-reduce of "
                f"N = {numel} elements ({numel * itemsize} bytes) sends at most "
                f"2(P-1)/P * N = {all_reduce_bytes(float(numel * itemsize), p):g} bytes per rank, "
                f"and at most 2(P-1) chunks of ceil(N/P) elements, {allowed} bytes, when chunks "
                "are padded. Does each step send one chunk of about N/P elements, not the "
                "whole tensor?",
                prop="bytes",
            )


def _judge_values(spec: _Spec, name: str, case: Case, r: int, records: list[dict]) -> None:
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
    spec: _Spec, name: str, case: Case, r: int, records: list[dict], what: str, bad: torch.Tensor
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


def _close(got: torch.Tensor, want: torch.Tensor, spec: _Spec, case: Case) -> bool:
    rtol, atol = (spec.tolerance or {}).get(case.dtype, EXACT)
    return _mismatch(got, want, rtol, atol) is None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# --- the checks ---------------------------------------------------------------------------


def check_broadcast(
    broadcast: Callable,
    *,
    world_sizes: Iterable[int] = DEFAULT_WORLD_SIZES,
    shapes: Iterable = DEFAULT_SHAPES,
    dtypes: Iterable[torch.dtype] = DTYPES,
    seeds: Iterable[int] = (0,),
    timeout: float = 20.0,
    point_to_point_only: bool = True,
) -> None:
    """`broadcast(tensor, src)`: afterwards every rank's `tensor` holds src's, bit for bit.
    Tried from every src, for each world size, shape, dtype and seed."""
    __tracebackhide__ = True
    spec = _Spec("broadcast", "check_broadcast", tolerance=None, root="src")
    _check(spec, broadcast, world_sizes, shapes, dtypes, seeds, timeout, point_to_point_only)


def check_reduce(
    reduce: Callable,
    *,
    world_sizes: Iterable[int] = DEFAULT_WORLD_SIZES,
    shapes: Iterable = DEFAULT_SHAPES,
    dtypes: Iterable[torch.dtype] = DTYPES,
    seeds: Iterable[int] = (0,),
    timeout: float = 20.0,
    point_to_point_only: bool = True,
) -> None:
    """`reduce(tensor, dst)`: afterwards dst's `tensor` holds the sum over all ranks (the
    other ranks' tensors are not checked, as in torch). Tried with every dst."""
    __tracebackhide__ = True
    spec = _Spec("reduce", "check_reduce", tolerance=TOLERANCE, root="dst")
    _check(spec, reduce, world_sizes, shapes, dtypes, seeds, timeout, point_to_point_only)


def check_all_gather(
    all_gather: Callable,
    *,
    world_sizes: Iterable[int] = DEFAULT_WORLD_SIZES,
    shapes: Iterable = DEFAULT_SHAPES,
    dtypes: Iterable[torch.dtype] = DTYPES,
    seeds: Iterable[int] = (0,),
    timeout: float = 20.0,
    point_to_point_only: bool = True,
) -> None:
    """`all_gather(tensor_list, tensor)`: on every rank, tensor_list[i] is filled (in place)
    with rank i's `tensor`; `tensor` itself is unchanged."""
    __tracebackhide__ = True
    spec = _Spec("all_gather", "check_all_gather", tolerance=None)
    _check(spec, all_gather, world_sizes, shapes, dtypes, seeds, timeout, point_to_point_only)


def check_reduce_scatter(
    reduce_scatter: Callable,
    *,
    world_sizes: Iterable[int] = DEFAULT_WORLD_SIZES,
    shapes: Iterable = DEFAULT_SHAPES,
    dtypes: Iterable[torch.dtype] = DTYPES,
    seeds: Iterable[int] = (0,),
    timeout: float = 20.0,
    point_to_point_only: bool = True,
) -> None:
    """`reduce_scatter(output, input_list)`: rank r's `output` becomes the sum over all ranks
    of their input_list[r]; `input_list` is unchanged."""
    __tracebackhide__ = True
    spec = _Spec("reduce_scatter", "check_reduce_scatter", tolerance=TOLERANCE)
    _check(spec, reduce_scatter, world_sizes, shapes, dtypes, seeds, timeout, point_to_point_only)


def check_all_reduce(
    all_reduce: Callable,
    bandwidth_optimal: bool = False,
    *,
    world_sizes: Iterable[int] = DEFAULT_WORLD_SIZES,
    shapes: Iterable = ((1,), (7,), (3, 4)),
    dtypes: Iterable[torch.dtype] = DTYPES,
    seeds: Iterable[int] = (0,),
    timeout: float = 20.0,
    point_to_point_only: bool = True,
) -> None:
    """`all_reduce(tensor)`: every rank's `tensor` becomes the sum over all ranks, in place.
    With `bandwidth_optimal=True` (a ring): each rank sends only to and receives only from
    its neighbours rank +- 1, and sends at most 2(P-1)/P * N elements (plus rounding)."""
    __tracebackhide__ = True
    check = "check_all_reduce" + ("(bandwidth_optimal=True)" if bandwidth_optimal else "")
    spec = _Spec("all_reduce", check, tolerance=TOLERANCE, bandwidth_optimal=bandwidth_optimal)
    _check(spec, all_reduce, world_sizes, shapes, dtypes, seeds, timeout, point_to_point_only)


__all__ = [
    "TOLERANCE",
    "check_all_gather",
    "check_all_reduce",
    "check_broadcast",
    "check_reduce",
    "check_reduce_scatter",
]
