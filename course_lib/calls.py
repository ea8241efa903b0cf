"""One launched call: how the function and its arguments travel to the ranks, and how the
pool keeps track of the ranks' answers until every rank has answered and shown all it printed.
"""

from __future__ import annotations

import importlib
import io
import pickle
import sys
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cloudpickle
import torch

from course_lib import runtime
from course_lib.protocol import Raised, Result

ERROR_GRACE_S = 0.25  # after a first error, wait this long for other ranks' errors
MARKS_WAIT_S = 2.0  # after the last reply, wait at most this long for the ranks' last output


class PerRank:
    """An argument that differs from rank to rank: rank r receives `values[r]`, and only it.

        launch(step, PerRank([shard0, shard1, shard2, shard3]), world_size=4)

    The other ranks' values never reach a rank's process: each rank's call is pickled apart.
    Grading relies on it, since a rank that runs a student's code must hold only what that
    rank would hold (its own inputs), never the others'."""

    def __init__(self, values: Sequence[Any]) -> None:
        self.values = list(values)

    def __repr__(self) -> str:
        return f"PerRank({len(self.values)} values)"


def per_rank_calls(fn: Callable, args: tuple, kwargs: dict, world_size: int) -> list[bytes] | None:
    """One pickled call per rank when an argument is a `PerRank`, else None (one for all)."""
    __tracebackhide__ = True
    given = [*args, *kwargs.values()]
    if not any(isinstance(a, PerRank) for a in given):
        return None
    for value in given:
        if isinstance(value, PerRank) and len(value.values) != world_size:
            raise ValueError(
                f"a PerRank argument holds {len(value.values)} values for {world_size} ranks: "
                "give exactly one value per rank"
            )

    def mine(value: Any, rank: int) -> Any:
        return value.values[rank] if isinstance(value, PerRank) else value

    return [
        pickle_call(
            fn,
            tuple(mine(a, r) for a in args),
            {k: mine(v, r) for k, v in kwargs.items()},
        )
        for r in range(world_size)
    ]


def pickle_call(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    """Pickle the call by value, or say exactly which piece cannot be sent to the ranks."""
    __tracebackhide__ = True
    if not callable(fn):
        raise TypeError(
            f"launch() runs a function on every rank; its first argument must be callable, "
            f"got {type(fn).__name__} {fn!r:.60}"
        )
    try:
        buffer = io.BytesIO()
        _CallPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump((fn, args, kwargs))
        return buffer.getvalue()
    except Exception as exc:  # noqa: BLE001
        raise TypeError(_unpicklable_message(fn, args, kwargs, exc)) from None


def _on_gpu(obj: object) -> bool:
    return type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.is_cuda


class _CallPickler(cloudpickle.Pickler):
    """Pickles a call by value. A GPU tensor travels as a CPU copy that each rank puts on its
    own device (`runtime.on_this_device`): pickled as it is, it would land on the launching
    process's GPU, cuda:0, on every rank."""

    def reducer_override(self, obj: object) -> Any:
        if _on_gpu(obj):
            is_parameter = isinstance(obj, torch.nn.Parameter)
            return runtime.on_this_device, (obj.detach().cpu(), is_parameter, obj.requires_grad)
        if _imported_module_like(obj):
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)


def _imported_module_like(obj: object) -> bool:
    """A module object of a subclass of its own that sits in sys.modules, like `torch.ops`:
    cloudpickle would try to pickle it by value (and fail); the rank imports it by name."""
    return (
        isinstance(obj, types.ModuleType)
        and type(obj) is not types.ModuleType
        and sys.modules.get(obj.__name__) is obj
    )


def _unpicklable_message(fn: Callable, args: tuple, kwargs: dict, exc: Exception) -> str:
    pieces = [(f"the function {getattr(fn, '__name__', fn)!r}", fn)]
    pieces += [(f"positional argument {i}", value) for i, value in enumerate(args)]
    pieces += [(f"keyword argument {name!r}", value) for name, value in kwargs.items()]
    for what, value in pieces:
        try:
            cloudpickle.dumps(value)
        except Exception as piece_exc:  # noqa: BLE001
            return (
                f"{what} ({type(value).__name__}) cannot be sent to the ranks: {piece_exc}. "
                "Each rank is a separate process that receives a pickled copy; create things "
                "like locks, open files, generators or process groups inside the function."
            )
    return f"the call cannot be sent to the ranks: {exc}"


@dataclass(frozen=True)
class Died:
    """A rank's process ended during the call, without answering."""

    exit_code: int | None


class CallState:
    """Book-keeping for one call: who has answered, who has finished printing."""

    def __init__(
        self, call_id: int, world_size: int, timeout: float | None, untrusted: bool = False
    ) -> None:
        self.id = call_id
        self.untrusted = untrusted
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.waiting = set(range(world_size))
        # Each rank writes an end mark on stdout and stderr after the call: until both have
        # come, some of what it printed may still be on its way.
        self.unmarked = {(rank, stream) for rank in range(world_size) for stream in (1, 2)}
        self.results: list[Any] = [None] * world_size
        self.failures: dict[int, Raised | Died] = {}
        # What each rank's counted process group reported while the call ran (`Tally`).
        self.tallies: list[list[tuple]] = [[] for _ in range(world_size)]
        self.failures_deadline = 0.0
        self.marks_deadline: float | None = None
        self.broken = False

    def finished(self) -> bool:
        if self.waiting or self.failures:
            return False
        if self.marks_deadline is None:
            self.marks_deadline = time.monotonic() + MARKS_WAIT_S
        return not self.unmarked or time.monotonic() > self.marks_deadline

    def failed(self) -> bool:
        """Has a rank failed, and have the others had their moment to fail too?"""
        return bool(self.failures) and time.monotonic() >= self.failures_deadline

    def past_deadline(self) -> bool:
        if self.deadline is None or not self.waiting:
            return False
        return time.monotonic() >= self.deadline

    def wait_s(self) -> float:
        """How long the pool may wait for the next event before checking the clocks again."""
        limit = 0.1
        if self.deadline is not None:
            limit = min(limit, max(0.0, self.deadline - time.monotonic()))
        if self.failures:
            limit = min(limit, max(0.0, self.failures_deadline - time.monotonic()))
        return limit

    def marked(self, rank: int, stream: int, call_id: int) -> None:
        if call_id == self.id:
            self.unmarked.discard((rank, stream))

    def answered(self, rank: int, answer: Result | Raised) -> None:
        if answer.call_id != self.id:
            return
        self.waiting.discard(rank)
        if isinstance(answer, Raised):
            self._fail(rank, answer)
            return
        try:
            self.results[rank] = (_load_data if self.untrusted else pickle.loads)(answer.data)
        except Exception as exc:  # noqa: BLE001
            note = "its return value cannot be unpickled in the launching process"
            if self.untrusted:
                note = (
                    "an untrusted rank may return only tensors, numbers, strings, None and "
                    "lists, tuples and dicts of them"
                )
            text = f"{note}: {exc}"
            self._fail(rank, Raised(self.id, type(exc).__name__, text, f"{text}\n"))
        self.broken = self.broken or answer.broken

    def died(self, rank: int, exit_code: int | None) -> None:
        if rank in self.waiting:
            self.waiting.discard(rank)
            self._fail(rank, Died(exit_code))

    def _fail(self, rank: int, failure: Raised | Died) -> None:
        if not self.failures:
            self.failures_deadline = time.monotonic() + ERROR_GRACE_S
        self.failures[rank] = failure


def _load_data(data: bytes) -> Any:
    """A return value from an untrusted rank: tensors, numbers, strings and containers."""
    return torch.load(io.BytesIO(data), weights_only=True)
