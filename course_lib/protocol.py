"""The messages between the launcher, the fork server and the ranks.

Two conversations, each over a connection of its own:

    launcher -> fork server   Fork (the rank's connection and output pipes travel with it)
    fork server -> launcher   Forked (a rank started), Exited (a rank ended and was reaped)

    launcher -> rank          Call, one per launched call
    rank -> launcher          Ready once it has joined the process group, then Result or Raised
                              for every call (Progress while rank 0 runs a long loop; Tally
                              for every call an untrusted rank's process group makes)

A rank may run code that must not reach the launcher (a submission being graded), so a message
travels as plain data: a tuple of its type's name and its fields, read back by an unpickler
that refuses anything naming a class or a function (which is how a pickle runs code).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Fork:
    """Start a rank running `_worker.serve(spec, ...)`."""

    request: int  # echoed by Forked, so that a reply never answers the wrong request
    spec: dict  # rank, world size, backend, rendezvous address, environment...


@dataclass(frozen=True)
class Forked:
    request: int
    pid: int


@dataclass(frozen=True)
class Exited:
    """A rank has ended and the fork server has reaped it: from now on its pid number may
    belong to another process, so nobody may signal it."""

    pid: int
    code: int  # negative: killed by that signal


@dataclass(frozen=True)
class Call:
    """Run a function, in the launcher's environment, directory and sys.path."""

    id: int
    payload: bytes  # (fn, args, kwargs), cloudpickled by value
    env: dict[str, str]
    cwd: str
    sys_path: list[str]
    linecache: dict  # source of notebook cells, so that tracebacks on the rank can quote them


@dataclass(frozen=True)
class Ready:
    """The rank has joined the process group and waits for calls."""

    pid: int
    main_thread: int  # its main thread's ident, to find that thread in a stack dump


@dataclass(frozen=True)
class Result:
    call_id: int
    data: bytes  # the return value, pickled (in torch.save's format from an untrusted rank)
    broken: bool  # the call destroyed the default process group


@dataclass(frozen=True)
class Raised:
    call_id: int
    exc_type: str
    message: str
    traceback: str
    # the exception's own public attributes that are plain data (HungRank's `ranks`)
    attributes: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Progress:
    """How far a loop of the call has got (`course_lib.progress`), for the launcher's bar."""

    call_id: int
    desc: str
    done: int
    total: int | None
    finished: bool


@dataclass(frozen=True)
class Tally:
    """One call the rank's counted process group is about to make, or a mark between the
    parts of a call (`course_lib.counted_group`), sent as it happens: what the launcher has
    received, code on the rank can no longer take back."""

    call_id: int
    entry: tuple  # ("call", op, peer, sent, received, group, dtypes) or ("mark", label)


Message = Fork | Forked | Exited | Call | Ready | Result | Raised | Progress | Tally
_TYPES = {
    cls.__name__: cls
    for cls in (Fork, Forked, Exited, Call, Ready, Result, Raised, Progress, Tally)
}


def encode(message: Message) -> bytes:
    fields = (getattr(message, field.name) for field in dataclasses.fields(message))
    return pickle.dumps((type(message).__name__, *fields), protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Message:
    """The message in `data`; pickle.UnpicklingError if it is not one."""
    try:
        loaded = _DataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 (a malformed pickle raises all sorts of errors)
        raise pickle.UnpicklingError(f"not a message: {exc}") from None
    known = isinstance(loaded, tuple) and loaded and isinstance(loaded[0], str)
    if not (known and loaded[0] in _TYPES):
        raise pickle.UnpicklingError(f"not a message: {loaded!r:.80}")
    name, *fields = loaded
    try:
        return _TYPES[name](*fields)
    except TypeError as exc:
        raise pickle.UnpicklingError(f"a malformed {name} message: {exc}") from None


class _DataUnpickler(pickle.Unpickler):
    """Numbers, strings, bytes and containers only."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"a message names {module}.{name}: refused")
