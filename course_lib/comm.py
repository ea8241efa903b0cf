"""Count the bytes a rank sends and receives through torch.distributed.

    with CommCounter() as c:
        ring_all_reduce(t)
    c.bytes_sent   # compare with 2 * (P - 1) / P * t.numel() * t.element_size()

While a counter is active, the torch.distributed calls below are wrapped. Point-to-point
calls (send, recv, isend, irecv, and batch_isend_irecv through them) are counted exactly:
the bytes of the tensor. What a built-in collective moves inside the backend cannot be seen
from Python, so it is counted with the per-rank volume of the textbook algorithm in
`COLLECTIVE_MODEL` (ring for all-reduce, all-gather and reduce-scatter; a flat tree for
broadcast, reduce, gather and scatter), the formulas of `course_lib.costs` the lectures use.
An all-to-all sends each piece straight to its owner, so it is counted exactly: its tensors'
sizes, or for `all_to_all_single` with split sizes, the rows of the splits.

Calls made through a name bound before the counter started (`from torch.distributed import
send`), through the process-group object, or from C++ (DistributedDataParallel's reducer) are
not seen by these wrappers. On grading ranks they are: there the default process group is a
`course_lib.counted_group.CountedGroup`, which reports every call to `record` below.

`WireCounter` counts instead what the process really wrote to its sockets, from the
operating system: the check on those textbook volumes.

Other modules hook the same wrapped calls with `add_around_hook` (the emulated network in
`course_lib.network` does), so the two never wrap each other.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from course_lib import runtime
from course_lib.costs import (
    COLLECTIVE_MODEL,
    all_gather_bytes,
    all_reduce_bytes,
    all_to_all_bytes,
)

POINT_TO_POINT = ("send", "recv", "isend", "irecv")


@dataclass
class CommCounter:
    """Bytes this rank sends and receives through torch.distributed while the block runs."""

    bytes_sent: int = 0
    bytes_received: int = 0
    calls: Counter = field(default_factory=Counter)
    by_op: dict[str, list[int]] = field(default_factory=dict)

    def __enter__(self) -> CommCounter:
        with _lock:
            _install()
            _active.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        with _lock:
            if self in _active:
                _active.remove(self)
            _uninstall_if_unused()

    def add(self, op: str, sent: int, received: int) -> None:
        self.bytes_sent += sent
        self.bytes_received += received
        self.calls[op] += 1
        totals = self.by_op.setdefault(op, [0, 0])
        totals[0] += sent
        totals[1] += received

    def summary(self) -> str:
        """A small table: calls, bytes sent and received per operation."""
        rows = [f"{'op':<24}{'calls':>6}{'sent':>14}{'received':>14}"]
        for op, (sent, received) in sorted(self.by_op.items()):
            rows.append(f"{op:<24}{self.calls[op]:>6}{sent:>14,}{received:>14,}")
        rows.append(
            f"{'total':<24}{sum(self.calls.values()):>6}{self.bytes_sent:>14,}"
            f"{self.bytes_received:>14,}"
        )
        return "\n".join(rows)


class WireCounter:
    """Bytes this process really wrote through the operating system while the block ran, read
    from Linux's /proc/self/io (`wchar`). On gloo the ranks talk over TCP sockets, so this is
    what crossed the loopback to the other ranks, gloo's small message headers included: a
    count that does not come from any formula, to hold `CommCounter`'s textbook volumes of
    the built-in collectives against. It counts every write of the process (keep prints out
    of the block); on NCCL, GPU-to-GPU traffic does not pass through the OS and is not seen.

        with WireCounter() as wire:
            dist.all_reduce(t)
        wire.bytes_written   # ~ 2(P-1)/P * N, plus ~50 bytes of header per message
    """

    def __init__(self) -> None:
        self.bytes_written = 0
        self._start: int | None = None

    def __enter__(self) -> WireCounter:
        self._start = written_bytes()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.bytes_written = written_bytes() - self._start


class _Request:
    """An isend/irecv request that remembers whether it was waited for."""

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


class RequestLog:
    """While active, every request `dist.isend` and `dist.irecv` return is remembered, with
    whether it was waited for: an irecv's tensor holds the message, and an isend's may be
    changed, only once wait() has returned.

        with RequestLog() as log:
            ring_all_reduce(t)
        log.unwaited()   # [("isend", 1)] for a request never waited for

    On leaving, requests left unwaited are finished (waited for), so that what runs next
    starts in step. Two at a time are not supported."""

    def __enter__(self) -> RequestLog:
        self.requests: list[_Request] = []
        self._saved = {op: getattr(dist, op) for op in ("isend", "irecv")}
        for op, inner in self._saved.items():
            wrapper = self._wrap(op, inner)
            # Both namespaces, as the counters do: P2POp compares against c10d's.
            setattr(dist, op, wrapper)
            setattr(c10d, op, wrapper)
        return self

    def __exit__(self, exc_type: type | None, *rest: object) -> None:
        for op, inner in self._saved.items():
            setattr(dist, op, inner)
            setattr(c10d, op, inner)
        if exc_type is None:
            for request in self.requests:
                if not request.waited:
                    request._work.wait()

    def unwaited(self) -> list[tuple[str, int | None]]:
        """(op, peer) of every request not waited for."""
        return [(r.op, r.peer) for r in self.requests if not r.waited]

    def _wrap(self, op: str, inner: Callable) -> Callable:
        signature = inspect.signature(getattr(c10d, op))
        peer_names = ("dst", "group_dst") if op == "isend" else ("src", "group_src")

        @functools.wraps(inner)
        def logged(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs).arguments
            peer = next((bound[n] for n in peer_names if bound.get(n) is not None), None)
            work = inner(*args, **kwargs)
            if work is not None:
                work = _Request(work, op, peer)
                self.requests.append(work)
            return work

        return logged


def written_bytes() -> int:
    """Bytes this process has written through system calls so far (/proc/self/io)."""
    try:
        with open("/proc/self/io") as io:
            for line in io:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError as error:
        raise RuntimeError(
            "WireCounter reads /proc/self/io, which only Linux provides; use CommCounter"
        ) from error
    raise RuntimeError("/proc/self/io has no wchar line")


_active: list[CommCounter] = []
# hook(op, args, sent, received, call) -> what the call returns; `call()` makes the real call
AroundHook = Callable[[str, dict, int, int, Callable[[], object]], object]
_around: list[AroundHook] = []
_lock = threading.Lock()
_originals: dict[str, Callable] = {}
_depth = threading.local()  # a wrapped call made inside another is counted once, outermost


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _group_size(group) -> int:
    return dist.get_world_size(group)


def _is_root(args: dict, root: str) -> bool:
    group = args.get("group")
    group_root = args.get(f"group_{root}")
    if group_root is not None:
        return dist.get_rank(group) == group_root
    return dist.get_rank() == args.get(root)


def _split_bytes(tensor: torch.Tensor, splits, world_size: int, me: int) -> int:
    """Bytes of `all_to_all_single`'s `tensor` that go to (or come from) the other ranks:
    with split sizes, the rows of every split but this rank's own; without, P even chunks."""
    if not splits:
        return all_to_all_bytes(_nbytes(tensor), world_size)
    row = _nbytes(tensor) // tensor.shape[0] if tensor.shape[0] else 0
    return row * (sum(splits) - splits[me])


def volume(op: str, args: dict) -> tuple[int, int]:
    """(bytes sent, bytes received) by this rank for one call, per `COLLECTIVE_MODEL`."""
    if op in ("send", "isend"):
        return _nbytes(args["tensor"]), 0
    if op in ("recv", "irecv"):
        return 0, _nbytes(args["tensor"])
    if op == "barrier":
        return 0, 0
    p = _group_size(args.get("group"))
    if op == "all_reduce":
        n = all_reduce_bytes(_nbytes(args["tensor"]), p)
        return n, n
    if op == "all_gather":
        n = all_gather_bytes(_nbytes(args["tensor"]), p)
        return n, n
    if op in ("all_gather_single", "all_gather_into_tensor"):
        n = all_gather_bytes(_nbytes(args["input_tensor"]), p)
        return n, n
    if op in ("reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor"):
        n = all_gather_bytes(_nbytes(args["output"]), p)  # the mirror image of an all-gather
        return n, n
    # A flat tree: the root sends (or receives) N to (from) each of the P-1 others.
    if op == "broadcast":
        n = _nbytes(args["tensor"])
        return (all_gather_bytes(n, p), 0) if _is_root(args, "src") else (0, n)
    if op in ("reduce", "gather"):
        n = _nbytes(args["tensor"])
        return (0, all_gather_bytes(n, p)) if _is_root(args, "dst") else (n, 0)
    if op == "scatter":
        n = _nbytes(args["tensor"])
        return (all_gather_bytes(n, p), 0) if _is_root(args, "src") else (0, n)
    if op == "all_to_all_single":
        me = dist.get_rank(args.get("group"))
        sent = _split_bytes(args["input"], args.get("input_split_sizes"), p, me)
        received = _split_bytes(args["output"], args.get("output_split_sizes"), p, me)
        return sent, received
    if op == "all_to_all":
        me = dist.get_rank(args.get("group"))
        sent = sum(_nbytes(t) for i, t in enumerate(args["input_tensor_list"]) if i != me)
        received = sum(_nbytes(t) for i, t in enumerate(args["output_tensor_list"]) if i != me)
        return sent, received
    raise KeyError(op)


def add_around_hook(hook: AroundHook) -> None:
    """Wrap `hook` around every outermost torch.distributed call above until it is removed."""
    with _lock:
        _install()
        if hook not in _around:
            _around.append(hook)


def remove_around_hook(hook: AroundHook) -> None:
    with _lock:
        if hook in _around:
            _around.remove(hook)
        _uninstall_if_unused()


def unwrapped(op: str) -> Callable:
    """torch.distributed's own `op`, unwrapped: for messages a hook sends on the side."""
    return _originals.get(op) or getattr(c10d, op)


def record(op: str, args: dict, call: Callable[[], object]) -> object:
    """Count one torch.distributed call and run it through the around hooks.

    The entry point of the torch.distributed wrappers below and of `course_lib.counted_group`,
    the process group of grading ranks, which reports every call whatever route it took. A
    call made inside another (a collective built on send/recv, or a wrapper calling the
    group) is counted once, by the outermost."""
    depth = getattr(_depth, "value", 0)
    if depth == 0 and (_active or _around) and not c10d._rank_not_in_group(args.get("group")):
        sent, received = volume(op, args)
        for counter in list(_active):
            counter.add(op, sent, received)
        for hook in reversed(list(_around)):
            call = functools.partial(hook, op, args, sent, received, call)
    _depth.value = depth + 1
    try:
        return call()
    finally:
        _depth.value = depth


def _wrap(op: str, original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def counted(*args, **kwargs):
        call = functools.partial(original, *args, **kwargs)
        if getattr(_depth, "value", 0) or not (_active or _around):
            return call()
        return record(op, signature.bind(*args, **kwargs).arguments, call)

    counted.__wrapped_by_course_lib__ = True
    return counted


def _install() -> None:
    if _originals:  # already wrapped (by a counter or a hook)
        return
    for op in (*POINT_TO_POINT, *COLLECTIVE_MODEL):
        original = getattr(c10d, op)
        _originals[op] = original
        wrapped = _wrap(op, original)
        # Both namespaces: user code calls dist.X, and torch's own helpers call c10d.X.
        setattr(c10d, op, wrapped)
        setattr(dist, op, wrapped)


def _uninstall() -> None:
    for op, original in _originals.items():
        setattr(c10d, op, original)
        setattr(dist, op, original)
    _originals.clear()


def _uninstall_if_unused() -> None:
    if not _active and not _around:
        _uninstall()


def _reset() -> None:
    """After a launched call: drop counters and hooks left active, put torch.distributed back."""
    with _lock:
        _active.clear()
        _around.clear()
        _uninstall()


runtime.at_call_end(_reset)
