"""A gloo process group that reports every call to `course_lib.comm`, whatever route it took.

`CommCounter` and the around hooks of `course_lib.comm` wrap the functions of
`torch.distributed`, so they miss a call made through a name bound before the wrapping
(`from torch.distributed import all_reduce`), through the process-group object
(`dist.group.WORLD.allreduce(...)`) or from C++ (DDP's reducer). Every one of those routes
ends in a method of the process group, so a group whose methods report to `comm.record`
sees them all.

Grading ranks (`WorkerPool(..., untrusted=True)`) use this group as their default group, and
every group they create with `dist.new_group` is one too: what the checks count is what the
student's code really called. Underneath, each call runs on an ordinary gloo group.
(`torch.ops.c10d` operators refuse a Python group outright, so that route fails loudly.)
"""

from __future__ import annotations

import types
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

from course_lib import comm

BACKEND = "course_gloo"


# Where every call is reported as it happens, besides `comm.record`: on a grading rank, a
# function that sends it to the launcher (`_worker`), out of reach of the code being graded.
_reporter: Callable[[tuple], None] | None = None


def set_reporter(reporter: Callable[[tuple], None] | None) -> None:
    """Send every call of every counted group to `reporter`, before the call is made, as
    ("call", op, peer, sent, received, group, dtypes): the peer's global rank for
    point-to-point calls (None otherwise), bytes by `comm.volume`, the group's global ranks,
    and the names of the dtypes of the call's tensors, sorted ("float32", "int8"); and, among
    them, ("mark", label) and ("note", label) as `mark` and `note` put them."""
    global _reporter
    _reporter = reporter


def mark(label: str | int, *, _kind: str = "mark") -> None:
    """Put ("mark", label) between the reported calls: what the calls after it belong to (a
    check's case, say). Code on the rank can add marks; it cannot remove what was sent."""
    if _kind not in ("mark", "note"):
        raise ValueError(f"a mark or a note, not {_kind!r}")
    if _reporter is not None:
        _reporter((_kind, label))


# A note is `mark` under another kind: the same code in a function of its own, not a wrapper
# around it. Whatever refuses the student's code calling `mark` (the grader's provenance
# names `mark`'s code) refuses a note from it too, while the check's own notes, sent from the
# check's code, pass; and being a function, its name is watched like mark's (`_integrity`).
note = types.FunctionType(mark.__code__, mark.__globals__, "note")
note.__qualname__, note.__kwdefaults__ = "note", {"_kind": "note"}
note.__doc__ = """Put ("note", label) between the reported calls, in the order things happen: an
event of the check's that is no call (a stage's forward, say), whose place among the calls
the judge reads. Unlike marks, notes do not split the calls into cases. Code on the
rank can add notes; it cannot remove what was sent."""


def _report(group: CountedGroup, op: str, args: dict) -> None:
    if _reporter is None:
        return
    peer = args.get("group_dst", args.get("group_src")) if op in ("send", "recv") else None
    ranks = tuple(dist.get_process_group_ranks(group))
    sent, received = comm.volume(op, {**args, "group": group})
    dtypes = tuple(sorted({str(t.dtype).removeprefix("torch.") for t in tensors_in(args.values())}))
    _reporter(("call", op, None if peer is None else ranks[peer], sent, received, ranks, dtypes))


def tensors_in(values) -> list[torch.Tensor]:
    """Every tensor among `values`, in lists and tuples too."""
    out = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, list | tuple):
            out += tensors_in(value)
    return out


def _counted(op: str, args: dict, call: Callable[[], object]) -> object:
    _report(args["group"], op, args)
    return comm.record(op, args, call)


def _collective(method_name: str, op: str, describe):
    """A group method that reports `op` with the arguments `describe(*args)` returns."""

    def method(self, *args, **kwargs):
        inner = getattr(self._inner, method_name)
        details = describe(self, *args)
        return _counted(op, {"group": self, **details}, lambda: inner(*args, **kwargs))

    method.__name__ = method_name
    return method


def _root(opts) -> int:
    return opts.rootRank


class CountedGroup(dist.ProcessGroup):
    """A process group whose every call passes through `course_lib.comm.record`."""

    def __init__(self, inner: dist.ProcessGroup, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._inner = inner

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND

    @property
    def name(self) -> str:
        return BACKEND

    # torch names a group once it is made (`_set_group_name`) and reads the name back to
    # destroy it. A ProcessGroup keeps its name in its backends, and this one has none of its
    # own (its gloo is `_inner`'s): without these, destroying a group a call made failed and
    # took the grading worker down with it, to be restarted for the next check.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name
        self._inner._set_group_name(name)

    @property
    def group_name(self) -> str:
        return self._group_name

    def shutdown(self) -> None:
        self._inner.shutdown()

    def send(self, tensors, dst, tag=0):
        args = {"tensor": tensors[0], "group": self, "group_dst": dst}
        return _counted("send", args, lambda: self._inner.send(tensors, dst, tag))

    def recv(self, tensors, src, tag=0):
        args = {"tensor": tensors[0], "group": self, "group_src": src}
        return _counted("recv", args, lambda: self._inner.recv(tensors, src, tag))

    def recv_anysource(self, tensors, tag=0):
        args = {"tensor": tensors[0], "group": self, "group_src": None}
        return _counted("recv", args, lambda: self._inner.recv_anysource(tensors, tag))

    allreduce = _collective("allreduce", "all_reduce", lambda g, ts, *a: {"tensor": ts[0]})
    allreduce_coalesced = _collective(
        "allreduce_coalesced", "all_reduce", lambda g, ts, *a: {"tensor": _flat(ts)}
    )
    broadcast = _collective(
        "broadcast",
        "broadcast",
        lambda g, ts, opts, *a: {"tensor": ts[0], "group_src": _root(opts)},
    )
    reduce = _collective(
        "reduce", "reduce", lambda g, ts, opts, *a: {"tensor": ts[0], "group_dst": _root(opts)}
    )
    allgather = _collective("allgather", "all_gather", lambda g, outs, ins, *a: {"tensor": ins[0]})
    allgather_coalesced = _collective(
        "allgather_coalesced", "all_gather", lambda g, outs, ins, *a: {"tensor": _flat(ins)}
    )
    _allgather_base = _collective(
        "_allgather_base", "all_gather_into_tensor", lambda g, out, inp, *a: {"input_tensor": inp}
    )
    all_gather_single = _collective(
        "all_gather_single", "all_gather_into_tensor", lambda g, out, inp, *a: {"input_tensor": inp}
    )
    all_gather_single_coalesced = _collective(
        "all_gather_single_coalesced",
        "all_gather_into_tensor",
        lambda g, outs, ins, *a: {"input_tensor": _flat(ins)},
    )
    allgather_into_tensor_coalesced = _collective(
        "allgather_into_tensor_coalesced",
        "all_gather_into_tensor",
        lambda g, outs, ins, *a: {"input_tensor": _flat(ins)},
    )
    reduce_scatter = _collective(
        "reduce_scatter", "reduce_scatter", lambda g, outs, ins, *a: {"output": outs[0]}
    )
    _reduce_scatter_base = _collective(
        "_reduce_scatter_base", "reduce_scatter_tensor", lambda g, out, inp, *a: {"output": out}
    )
    reduce_scatter_single = _collective(
        "reduce_scatter_single", "reduce_scatter_tensor", lambda g, out, inp, *a: {"output": out}
    )
    reduce_scatter_single_coalesced = _collective(
        "reduce_scatter_single_coalesced",
        "reduce_scatter_tensor",
        lambda g, outs, ins, *a: {"output": _flat(outs)},
    )
    reduce_scatter_tensor_coalesced = _collective(
        "reduce_scatter_tensor_coalesced",
        "reduce_scatter_tensor",
        lambda g, outs, ins, *a: {"output": _flat(outs)},
    )
    alltoall = _collective(
        "alltoall",
        "all_to_all",
        lambda g, outs, ins, *a: {"output_tensor_list": outs, "input_tensor_list": ins},
    )
    alltoall_base = _collective(
        "alltoall_base",
        "all_to_all_single",
        lambda g, out, inp, out_splits=None, in_splits=None, *a: {
            "output": out,
            "input": inp,
            "output_split_sizes": out_splits,
            "input_split_sizes": in_splits,
        },
    )
    all_to_all_single = _collective(
        "all_to_all_single",
        "all_to_all_single",
        lambda g, out, inp, out_splits=None, in_splits=None, *a: {
            "output": out,
            "input": inp,
            "output_split_sizes": out_splits,
            "input_split_sizes": in_splits,
        },
    )
    gather = _collective(
        "gather",
        "gather",
        lambda g, outs, ins, opts, *a: {"tensor": ins[0], "group_dst": _root(opts)},
    )
    scatter = _collective(
        "scatter",
        "scatter",
        lambda g, outs, ins, opts, *a: {"tensor": outs[0], "group_src": _root(opts)},
    )
    barrier = _collective("barrier", "barrier", lambda g, *a: {})
    monitored_barrier = _collective("monitored_barrier", "barrier", lambda g, *a: {})


def _flat(tensors) -> torch.Tensor:
    """One tensor as large as all of `tensors` together (for counting bytes only)."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    return torch.empty(total, dtype=torch.uint8, device="meta")


def _create(store, rank: int, size: int, timeout: timedelta) -> CountedGroup:
    inner = dist.ProcessGroup(store, rank, size)
    gloo = ProcessGroupGloo(store, rank, size, timeout)
    gloo_type = dist.ProcessGroup.BackendType.GLOO
    inner._register_backend(torch.device("cpu"), gloo_type, gloo)
    inner._set_default_backend(gloo_type)
    return CountedGroup(inner, rank, size)


def register() -> None:
    """Make `init_process_group("course_gloo", ...)` and `new_group` build counted groups."""
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
