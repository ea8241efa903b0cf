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
(every function and class defined in it, or in any file of it if it is a package).

Every Provenance also refuses the grader's own code: a function of `course_lib.grading` called
by the student's code (`seen.hits` names it), except the tools an assignment gives students
(`course_lib.grading.GIVEN`). The checks call their helpers themselves; an
answer that imports one (a reference, a case generator) and runs it is not doing the work.
What counts as the student's code is any code that is not from a library: not from
`course_lib`, the standard library or an installed package. Calls that reach the grader
through the standard library (a `threading.Thread` target, a `functools.partial`) are judged
by the first caller outside it.

It uses `sys.setprofile` (and `threading.setprofile` for new threads): a call costs a dict
lookup more while it is active.
"""

from __future__ import annotations

import dis
import functools
import importlib
import inspect
import os
import pkgutil
import site
import sys
import sysconfig
import threading
import types
from collections.abc import Iterable
from pathlib import Path

_GRADER_CALL = "grader"  # a code object of the grader: a hit when the student's code calls it
# Copies of shorter functions are not told apart from anyone's own (see Provenance._add).
MIN_OPS = 20
# Instructions the compiler may pick differently for the same source (method calls, jumps).
_SAME = {"LOAD_METHOD": "LOAD_ATTR", "PRECALL": None, "JUMP_BACKWARD": "JUMP", "CACHE": None}


GRADER = "course_lib.grading"
_GRADER_DIR = str(Path(__file__).resolve().parent) + os.sep
_COURSE_DIR = str(Path(__file__).resolve().parent.parent) + os.sep
_THIS_FILE = str(Path(__file__).resolve())
_paths = sysconfig.get_paths()
_STDLIB = tuple({str(Path(_paths[k]).resolve()) + os.sep for k in ("stdlib", "platstdlib")})
_INSTALLED = tuple(
    {str(Path(p).resolve()) + os.sep for p in (_paths["purelib"], _paths["platlib"])}
    | {str(Path(p).resolve()) + os.sep for p in site.getsitepackages()}
)


# Outside the grading package, what reports to the launcher from a rank: code on the rank could
# call it to add calls or marks of its own (it cannot take back what was sent).
_REPORTING = (
    str(Path(_COURSE_DIR, "_worker.py")),
    str(Path(_COURSE_DIR, "counted_group.py")) + ":mark",
    str(Path(_COURSE_DIR, "counted_group.py")) + ":set_reporter",
    str(Path(_COURSE_DIR, "counted_group.py")) + ":_report",
)
# ...but gc.freeze on a rank is _worker's `_freeze` (it records that a call froze objects): the
# student's code may call gc.freeze.
_STUDENT_FACING = (str(Path(_COURSE_DIR, "_worker.py")) + ":_freeze",)


# A file's real path, once per file: every Provenance asks for each code it sees first.
_real_path = functools.cache(os.path.realpath)


@functools.cache
def _kind(filename: str) -> str:
    """ "grader", "library" (course_lib, an installed package), "stdlib" or "student"."""
    if filename.startswith("<frozen "):
        return "stdlib"
    if not filename.startswith(os.sep):  # <cell ...>, <string>: compiled from source
        return "student"
    path = _real_path(filename)
    if path.startswith(_GRADER_DIR) or path in _REPORTING:
        return "grader"
    if path.startswith(_STDLIB) and not path.startswith(_INSTALLED):
        return "stdlib"
    if path.startswith((_COURSE_DIR, *_INSTALLED)):
        return "library"
    return "student"


def _protected(code: types.CodeType) -> bool:
    """Code the student's code may not call: the grader's, and what reports to the launcher."""
    path = _real_path(code.co_filename)
    if f"{path}:{code.co_name}" in _STUDENT_FACING:
        return False
    if _kind(code.co_filename) == "grader":
        return path != _THIS_FILE  # leaving a Provenance is not
    return f"{path}:{code.co_name}" in _REPORTING


def _all_codes(value: object) -> set[types.CodeType]:
    """Every code object of a function (and the functions defined in it), or of every method
    of a class."""
    if isinstance(value, type):
        out: set[types.CodeType] = set()
        for member in vars(value).values():
            if isinstance(member, property):
                parts = [member.fget, member.fset, member.fdel]
            else:
                parts = [getattr(member, "__func__", member)]
            for part in parts:
                out |= _all_codes(part) if callable(part) else set()
        return out
    fn = inspect.unwrap(value) if callable(value) else None
    code = getattr(fn, "__code__", None)
    return set(_codes(code)) if code is not None else set()


def given_codes() -> frozenset[types.CodeType]:
    """The code of what the assignments give students from the grader, and of what the checks
    hand the student's code to call back (course_lib.grading's GIVEN and HANDED tables):
    their answers may call it."""
    grading = sys.modules.get(GRADER)
    out: set[types.CodeType] = set()
    for table in (getattr(grading, "GIVEN", {}), getattr(grading, "HANDED", {})):
        for module_name, names in table.items():
            module = sys.modules.get(module_name)
            for name in names if module is not None else ():
                out |= _all_codes(getattr(module, name, None))
    return frozenset(out)


def called_by_student(frame: types.FrameType) -> bool:
    """Is the function running in `frame` called by the student's code? The first caller
    outside the standard library decides; a thread started by the standard library, with
    no other caller, counts as the student's (the checks start none while one is watched)."""
    caller = frame.f_back
    while caller is not None and _kind(caller.f_code.co_filename) == "stdlib":
        caller = caller.f_back
    return caller is None or _kind(caller.f_code.co_filename) == "student"


def _grader_name(code: types.CodeType) -> str:
    path = Path(code.co_filename)
    package = GRADER if str(path.resolve().parent) + os.sep == _GRADER_DIR else "course_lib"
    return f"{package}.{path.stem}.{code.co_qualname}"


# Once per code object for the rank's life (a code object never changes): each check's
# Provenance takes the signature of every forbidden function and of every function the
# student's code runs, and disassembling them again per check was a quarter of a grading
# rank's CPU. The cache can only be cleared, not written: what it returns is what `dis` says.
@functools.cache
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


def _module_members(dotted: str, module: types.ModuleType) -> dict[str, object]:
    """Every function and class a module defines, by dotted name; for a package (a topic's code
    split into files), every one its files define, under the package's name where it gathers
    them (`course_lib.pipeline.simulate`) and under the file's otherwise (private helpers)."""
    modules = [module]
    if hasattr(module, "__path__"):
        inside = pkgutil.walk_packages(module.__path__, module.__name__ + ".")
        modules += [importlib.import_module(info.name) for info in inside]
    members: dict[str, object] = {}
    for found in modules:
        for name, value in vars(found).items():
            if _defined_in(value, found):
                public = vars(module).get(name) is value
                members[f"{dotted}.{name}" if public else f"{found.__name__}.{name}"] = value
    return members


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
        # Loading the forbidden modules (matplotlib, say) under an outer Provenance's profiler
        # would take several times as long: load them unwatched, then watch again.
        watching = sys.getprofile()
        sys.setprofile(None)
        try:
            self._load(forbidden)
        finally:
            sys.setprofile(watching)
        self.hits: list[str] = []
        self.grader_hits: list[str] = []  # the grader's own code, called by the student's
        self.switched_off = False
        self._hook = self._profile  # one bound method, to recognise it later
        self._seen: dict[types.CodeType, str | None] = {}
        self._given = given_codes()

    def _load(self, forbidden: Iterable[str]) -> None:
        for dotted in forbidden:
            target = _resolve(dotted)
            targets = {dotted: target}
            if isinstance(target, types.ModuleType):  # every function and class it defines
                targets = _module_members(dotted, target)
            for name, found in targets.items():
                self._add(name, found)

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
            name = self.codes.get(code) or self.names.get(_signature(code))
            if name is None and _protected(code) and code not in self._given:
                name = _GRADER_CALL  # decided per call, by who calls it
            self._seen[code] = name
        if name is _GRADER_CALL:
            name = _grader_name(code) if called_by_student(frame) else None
            if name is not None and name not in self.grader_hits:
                self.grader_hits.append(name)
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
            if self.grader_hits:
                used = self.grader_hits[0]
                return (
                    f"your answer runs {used}, the grader's own code; the part asks for your "
                    "code, and the grader's helpers are not yours to call"
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
