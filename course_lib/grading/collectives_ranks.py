"""Assignment 2's checks, what runs on each rank: every case runs torch.distributed's own
collective and the student's on the same inputs, in the same worker, and records what the
student's function did (its result, its calls and bytes, the peers it talked to, the
requests it never waited for).

    Case                    one run of a collective (world size, shape, dtype, seed, root)
    run_cases(kind, fn, cases)      what every rank runs: one record per case
    _PeerLog, _watched      the logging around the student's call

The judging of these records is in collectives_judge.py.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from course_lib import comm
from course_lib.comm import CommCounter
from course_lib.grading.provenance import Provenance
from course_lib.runtime import rank

POINT_TO_POINT = ("send", "recv", "isend", "irecv")
INT64_LIMIT = 2**58  # int64 inputs reach far past 2**53, where float64 stops being exact

# Lecture 2's module holds working collectives built from send and recv (naive, tree,
# butterfly and ring all-reduces): an answer that runs them, or a copy, is not the student's.
LECTURE = ("course_lib.collectives",)


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


def run_cases(kind: str, fn: Callable, cases: list[Case]) -> list[dict]:
    """On each rank: every case in turn, in the same order on every rank."""
    # An outer counter keeps torch.distributed wrapped for the whole run (installing the
    # wrappers costs about a millisecond); each case counts only the student's calls with a
    # counter of its own. What the outer one counts is not used.
    with CommCounter(), Provenance(LECTURE) as seen:
        results = [_RUNNERS[kind](fn, case) for case in cases]
    return {"cases": results, "copied": seen.complaint()}
