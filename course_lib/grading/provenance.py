"""Is the answer the student's own code, or the course's implementation of the same thing?

The lectures' modules hold working code for what several parts ask (the lecture's ring
all-reduce, say), and a student could hand in a thin wrapper around it, or paste its source.
`Provenance`, active on a rank around the student's call, records every call into one of
the forbidden functions, and into any function whose bytecode is the same (a copy made from
its source with `exec`, renamed or not, or from its code object):

    with Provenance(["course_lib.collectives.ring_all_reduce"]) as seen:
        student_fn(tensor)
    seen.hits          # ["course_lib.collectives.ring_all_reduce"] if it was used
    seen.switched_off  # True if the student's code removed the profiler

A forbidden name may be a function, a class (every method it defines) or a whole module
(every function and class defined in it).

It uses `sys.setprofile` (and `threading.setprofile` for new threads): a call costs a dict
lookup more while it is active.
"""

from __future__ import annotations

import dis
import importlib
import inspect
import sys
import threading
import types
from collections.abc import Iterable

# Copies of shorter functions are not told apart from anyone's own (see Provenance._add).
MIN_OPS = 20
# Instructions the compiler may pick differently for the same source (method calls, jumps).
_SAME = {"LOAD_METHOD": "LOAD_ATTR", "PRECALL": None, "JUMP_BACKWARD": "JUMP", "CACHE": None}


def _signature(code: types.CodeType) -> tuple:
    """What stays the same when a function is copied from its source under another name: the
    sequence of operations and the names and constants they use."""
    ops = []
    for ins in dis.get_instructions(code):
        op = _SAME.get(ins.opname, ins.opname)
        if op is None:
            continue
        value = ins.argval
        if isinstance(value, types.CodeType):
            value = _signature(value)
        elif not (ins.opcode in dis.hasname or ins.opcode in dis.hasconst):
            value = None
        elif not isinstance(value, (str, int, float, bool, bytes, type(None), tuple)):
            value = repr(value)
        ops.append((op, value))
    return tuple(ops)


def _codes(code: types.CodeType) -> Iterable[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _defined_in(value: object, module: types.ModuleType) -> bool:
    return (
        isinstance(value, (type, types.FunctionType))
        and getattr(value, "__module__", None) == module.__name__
    )


def _resolve(dotted: str) -> object:
    """A dotted name: a module, a function or class in one, or a method of such a class."""
    try:
        return importlib.import_module(dotted)
    except ImportError:
        pass
    module_name, _, attr = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError):
        module_name, _, cls = module_name.rpartition(".")
        return getattr(getattr(importlib.import_module(module_name), cls), attr)


class Provenance:
    """Records calls into forbidden functions (or copies of them) while active."""

    def __init__(self, forbidden: Iterable[str]) -> None:
        self.names: dict[tuple, str] = {}  # signature of a copy -> forbidden name
        self.codes: dict[types.CodeType, str] = {}  # the forbidden code itself -> name
        for dotted in forbidden:
            target = _resolve(dotted)
            targets = {dotted: target}
            if isinstance(target, types.ModuleType):  # every function and class it defines
                targets = {
                    f"{dotted}.{name}": v
                    for name, v in vars(target).items()
                    if _defined_in(v, target)
                }
            for name, found in targets.items():
                self._add(name, found)
        self.hits: list[str] = []
        self.switched_off = False
        self._hook = self._profile  # one bound method, to recognise it later
        self._seen: dict[types.CodeType, str | None] = {}

    def _add(self, dotted: str, target: object) -> None:
        members = vars(target).values() if isinstance(target, type) else [target]
        for member in members:
            # A decorated function is known by its own code, not its decorator's (the
            # wrapper of @contextmanager is the code of every context manager).
            fn = inspect.unwrap(getattr(member, "__func__", member))
            code = getattr(fn, "__code__", None)
            for inner in _codes(code) if code is not None else ():
                # Comprehensions and lambdas are idioms anyone writes
                # (`[g.reshape(-1) for g in grads]`), not a copy of the function.
                if inner.co_name.startswith("<"):
                    continue
                self.codes[inner] = dotted  # running the function itself always counts
                signature = _signature(inner)
                # A copy counts only if the function is long enough to be someone's in
                # particular: `return self.proj(F.gelu(self.fc(x)))` is what anyone writes.
                if len(signature) >= MIN_OPS:
                    self.names[signature] = dotted

    def _profile(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        name = self._seen.get(code, False)
        if name is False:
            name = self._seen[code] = self.codes.get(code) or self.names.get(_signature(code))
        if name is not None and name not in self.hits:
            self.hits.append(name)

    def __enter__(self) -> Provenance:
        self._previous = (sys.getprofile(), threading.getprofile())
        sys.setprofile(self._hook)
        threading.setprofile(self._hook)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.switched_off = sys.getprofile() is not self._hook
        sys.setprofile(self._previous[0])
        threading.setprofile(self._previous[1])

    def complaint(self) -> str | None:
        """What to tell the student, or None if the answer is their own."""
        if self.hits:
            # The first hit is what the answer called; the rest, what that called in turn.
            first = self.hits[0] + (
                f" (and {len(self.hits) - 1} more of it)" if len(self.hits) > 1 else ""
            )
            if not any(hit.startswith("course_lib.") for hit in self.hits):
                return (
                    f"your answer runs {first}, PyTorch's own implementation; the part asks "
                    "for your code (subclassing, wrapping or pasting it does not count)"
                )
            return (
                f"your answer runs {first}, the course's own implementation; the part asks "
                "for your code (calling it, wrapping it or pasting its source does not count)"
            )
        if self.switched_off:
            return "your answer switched off the profiler the check uses (sys.setprofile)"
        return None
