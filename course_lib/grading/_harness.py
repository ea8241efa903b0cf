"""What every check shares: running student code on ranks, and failing with a useful message.

A check never hangs and never shows a bare launcher error: a deadlock, a crash or an exception
in the student's code becomes a `CheckFailed` (an AssertionError) that names the check and
says what happened, where, and what to try.
"""

from __future__ import annotations

import contextlib
import secrets
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

from course_lib.grading.messages import (
    DISPLAY_WIDTH,
    PREFIX,
    explain_placeholders,
    hint_for,
    student_frames,
    wrap,
)
from course_lib.grading.provenance import Provenance
from course_lib.grading.traffic import (
    Note,
    Sent,
    Traffic,
    split_by_marks,
    split_with_notes,
    unreported_bytes,
)
from course_lib.launch import LaunchTimeout, RankError, WorkerDied, WorkerPool
from course_lib.rank_process import preload_in_fork_server
from course_lib.topics import TOPICS

RESULT = "result"  # the property every part has: the answer is right
MAX_SHOWN = 3  # failing cases shown per property


class CheckFailed(AssertionError):
    """A grading check found a problem in the student's code.

    `failed` names the properties that failed, `weights` the share of the part's points each
    property is worth (the first, "result", gates the others: a wrong answer earns nothing
    for being cheap). `score` is the share earned. `tampering` is set when the student's code
    changed the libraries the check measures with."""

    def __init__(
        self,
        message: str,
        *,
        prop: str = RESULT,
        weights: dict[str, float] | None = None,
        failed: set[str] | None = None,
        tampering: bool = False,
    ) -> None:
        super().__init__(explain_placeholders(message))
        # Raised while handling a launcher error: the message already says what happened, so
        # the launcher's exception is not shown again below it.
        self.__suppress_context__ = True
        self.prop = prop
        self.weights = weights or {RESULT: 1.0}
        self.failed = set(failed) if failed is not None else {prop}
        self.tampering = tampering

    @property
    def score(self) -> float:
        return share(self.weights, self.failed)


def _show_check_failed(shell, etype, value, tb, tb_offset=None):
    """IPython's display of a CheckFailed: the message alone. The grader's frames would only
    hide it, and the cell it failed in is the one showing it (Validate lists that cell too)."""
    # Lines short enough for `nbgrader validate`, which cuts longer ones at 90 characters; the
    # first follows "CheckFailed: " on its line.
    shown = CheckFailed(wrap(str(value), DISPLAY_WIDTH, first=DISPLAY_WIDTH - len(PREFIX)))
    shell._showtraceback(etype, shown, shell.InteractiveTB.get_exception_only(etype, shown))


def install_ipython_display() -> None:
    """In a notebook, show a failing check as the student's line and the message only."""
    import sys

    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None:
        shell.set_custom_exc((CheckFailed,), _show_check_failed)


def new_secret() -> int:
    """A seed no rank can know, new for each call: a check draws its inputs from it in the
    checking process, so a rank cannot regenerate the other ranks' inputs from its own."""
    return secrets.randbits(62)


def share(weights: dict[str, float], failed: set[str]) -> float:
    """The share of a part's points earned when the properties in `failed` failed."""
    if not failed:
        return 1.0
    if RESULT in failed or not weights or set(failed) - set(weights):
        return 0.0
    return sum(w for prop, w in weights.items() if prop not in failed)


def passed(check: str, verified: str) -> None:
    """The one line a passing check prints: what it verified."""
    print(f"{check}: passed. Verified {verified}.")


# What the open parts measured in this process, for the judge to carry out of the sandbox
# with the verdict (`measured`, `take_measurements`): the class leaderboard ranks by them.
_measured: list[dict] = []


def measured(
    check: str, name: str, value: float, unit: str, better: str = "lower", combine: str = "sum"
) -> None:
    """Record what an open part measured, once its check passed: `value` (in `unit`; `better`
    "lower" or "higher") must be the checking process's own measurement (tallies, its own
    count), never a number the student's code reported. Where a test cell calls the check
    more than once (hidden tests), the cell's value is the calls' sum (`combine="sum"`: bytes,
    rounds) or the worst of them ("worst": a ratio, a peak). The judge stores it in the
    gradebook with the cell's score (`course_lib.grading.measurements`)."""
    if better not in ("lower", "higher") or combine not in ("sum", "worst"):
        raise ValueError(
            f"better must be 'lower' or 'higher' ({better!r}), combine 'sum' or 'worst' "
            f"({combine!r})"
        )
    _measured.append(
        {"check": check, "name": name, "value": float(value), "unit": unit, "better": better}
        | {"combine": combine}
    )


def take_measurements() -> list[dict]:
    """What `measured` recorded since the last call, one value per check and measure (the
    judge calls it after each test cell)."""
    combined: dict[tuple[str, str], dict] = {}
    for m in _measured:
        key = (m["check"], m["name"])
        if key not in combined:
            combined[key] = dict(m)
            continue
        into = combined[key]
        if m["combine"] == "sum":
            into["value"] += m["value"]
        else:
            into["value"] = (max if m["better"] == "lower" else min)(into["value"], m["value"])
    _measured.clear()
    return [{k: v for k, v in m.items() if k != "combine"} for m in combined.values()]


def fail(check: str, message: str, prop: str = RESULT) -> NoReturn:
    __tracebackhide__ = True
    raise CheckFailed(f"{check}: {message}", prop=prop)


class Verdict:
    """Collects what one call of a check finds, case after case, instead of stopping at the
    first problem; `conclude` then prints one line of what was verified, or raises one
    CheckFailed listing the first few failing cases of each failed property.

        verdict = Verdict("check_x", {"result": 0.6, "bytes": 0.4})
        for case in cases:
            with verdict.case():
                judge(case)        # fail(..., prop="bytes") books a failure to "bytes"
        verdict.conclude("4 world sizes, 12 cases each")
    """

    def __init__(self, check: str, weights: dict[str, float] | None = None) -> None:
        self.check = check
        self.weights = weights or {RESULT: 1.0}
        self.messages: dict[str, list[str]] = {}
        self.counts: Counter = Counter()

    @contextlib.contextmanager
    def case(self) -> Iterator[None]:
        try:
            yield
        except CheckFailed as error:
            if error.tampering:
                raise
            self.add(error.prop, str(error))

    def add(self, prop: str, message: str) -> None:
        self.counts[prop] += 1
        shown = self.messages.setdefault(prop, [])
        if len(shown) < MAX_SHOWN:
            shown.append(message.removeprefix(f"{self.check}: "))

    def settle(self) -> None:
        """Raise the failures so far, if any: for when what follows depends on them."""
        __tracebackhide__ = True
        if self.messages:
            self.conclude("")

    def conclude(self, verified: str) -> None:
        __tracebackhide__ = True
        if not self.messages:
            passed(self.check, verified)
            return
        failed = set(self.messages)
        lines = []
        for prop, shown in self.messages.items():
            more = self.counts[prop] - len(shown)
            lines.append(f"[{prop}] failed in {self.counts[prop]} case(s):")
            lines += [f"  - {m}" for m in shown]
            if more:
                lines.append(f"  ... and {more} more")
        if len(self.weights) > 1 and RESULT in failed:
            lines.append(f"No points for this part: its {RESULT} must be right first.")
        elif len(self.weights) > 1:
            earned = share(self.weights, failed)
            parts = ", ".join(
                f"{prop} {'failed' if prop in failed else 'passed'} ({w:.0%})"
                for prop, w in self.weights.items()
                if w  # a gate (weight 0) passed, or we would not be here
            )
            lines.append(f"Partial credit: {parts}: {earned:.0%} of this part's points.")
        raise CheckFailed(f"{self.check}: " + "\n".join(lines), weights=self.weights, failed=failed)


# The lectures' own implementations live in the topics' course_lib modules. Several would
# answer an assignment as they are (the lecture's ring all-reduce, push-sum step,
# tensor-parallel layers), so a check refuses an answer that is one of them: the assignments
# ask for your own code.
def _lecture_modules() -> frozenset[str]:
    """course_lib.<topic> of every topic with an assignment, and course_lib.measure.<topic>
    where the lecture's measurements have a module of their own."""
    measure = Path(__file__).parent.parent / "measure"
    names = [t.name for t in TOPICS if t.module_path and t.assignment]
    modules = [f"course_lib.{name}" for name in names]
    modules += [
        f"course_lib.measure.{n}"
        for n in names
        if (measure / f"{n}.py").is_file() or (measure / n / "__init__.py").is_file()
    ]
    return frozenset(modules)


def _from_lecture(module: str | None) -> bool:
    """Is `module` a lecture module, or a file of one that is a package?"""
    return module is not None and any(
        module == lecture or module.startswith(lecture + ".") for lecture in LECTURE_MODULES
    )


LECTURE_MODULES = _lecture_modules()


def reject_lecture_code(check: str, *answers: Any) -> None:
    """Fail if an answer handed to a check is a function or class from a lecture module."""
    __tracebackhide__ = True
    for answer in answers:
        module = getattr(answer, "__module__", None)
        if callable(answer) and _from_lecture(module):
            name = getattr(answer, "__qualname__", repr(answer))
            fail(
                check,
                f"you handed in {module}.{name}, the lecture's own implementation; the "
                "assignment asks you to write it yourself in the notebook",
            )


_pools: dict[int, WorkerPool] = {}
# What a grading rank imports before any call, hence before any student code runs: every
# check, and the resolving of answers (whose hook is then part of what `_integrity` watches).
# The fork server imports them once for all, whichever pool starts it (a notebook's set-up
# cell imports the checks before its first `launch`).
PRELOAD = ("course_lib.grading", "course_lib.grading.answers")
preload_in_fork_server(PRELOAD)


def grading_pool(world_size: int) -> WorkerPool:
    """The workers that run student code for the checks: gloo on the CPU, untrusted (see
    `WorkerPool`), apart from the pool `launch` uses. One warm pool per world size, since a
    check tries several one after the other."""
    if world_size not in _pools:
        _pools[world_size] = WorkerPool(world_size, "gloo", untrusted=True, preload=PRELOAD)
    return _pools[world_size]


def close_pool() -> None:
    """Stop the grading workers."""
    for pool in _pools.values():
        pool.close()
    _pools.clear()


class GraderCodeUsed(Exception):
    """Raised on a rank whose student code called the grader's own functions."""


def _guarded(fn: Callable, *args: Any) -> Any:
    """On a rank: `fn(*args)`, failing if the student's code called the grader's own code
    (`Provenance` refuses it on every check; a check's own Provenance inside does too)."""
    with Provenance(()) as seen:
        result = fn(*args)
    if seen.grader_hits:
        raise GraderCodeUsed(seen.complaint())
    return result


def run_on_ranks(
    check: str,
    fn: Callable,
    *args: Any,
    world_size: int,
    timeout: float,
    what: str,
    traffic: bool = False,
) -> Any:
    """Run `fn(*args)` on `world_size` grading ranks; any failure becomes a CheckFailed that
    names `what` (e.g. "your dist_ping_pong"). An answer among `args` that is the lectures'
    own code fails at once. An argument may be a `PerRank`: each rank gets only its own value.

    With `traffic=True`, returns (results, Traffic): every call each rank's process group
    made during the run, as the launcher received it while it happened (`WorkerPool.tallies`),
    and the bytes the kernel saw each rank write to the others (`WorkerPool.wire`): what the
    student's code cannot change afterwards. Judge communication by these, never by counts
    kept on the rank."""
    __tracebackhide__ = True
    reject_lecture_code(check, *args)
    pool = grading_pool(world_size)
    try:
        results = pool.launch(_guarded, fn, *args, timeout=timeout)
        if not traffic:
            return results
        return results, Traffic([list(t) for t in pool.tallies], pool.wire)
    except RankError as error:
        if error.exc_type == "GraderCodeUsed":
            said = error.remote_traceback.strip().splitlines()[-1]
            fail(check, f"{what}: on rank {error.rank}, {said.removeprefix('GraderCodeUsed: ')}")
        if error.exc_type == "TamperingDetected":
            raise CheckFailed(
                f"{check}: {what}: on rank {error.rank}, {error.remote_traceback.strip()}",
                tampering=True,
            ) from None
        fail(
            check,
            f"{what} raised {error.exc_type} on rank {error.rank}:\n\n"
            + student_frames(error.remote_traceback)
            + hint_for(error.remote_traceback),
        )
    except LaunchTimeout as error:
        fail(
            check,
            f"{what} did not finish within {timeout:g} s; is a rank waiting for a "
            f"message that never comes?\n\n{student_frames(str(error))}",
        )
    except WorkerDied as error:
        fail(check, f"{what} killed its process: {error}")


def judge_unreported(check: str, traffic: Traffic) -> None:
    """Fail the part as tampering if a rank wrote bytes that none of its calls account for."""
    __tracebackhide__ = True
    for r, extra in enumerate(unreported_bytes(traffic)):
        if extra is not None and extra > 0:
            raise CheckFailed(
                f"{check}: rank {r} wrote {extra} bytes to the other ranks that none of its "
                "send/recv calls account for (the kernel counted them on its sockets): its "
                "code talked around the process group the check counts (its inner gloo "
                "group, say, or with the reporting switched off). That is tampering with the "
                f"grading: this part scores 0. ({_wire_and_calls(traffic, r)})",
                tampering=True,
            )


def _wire_and_calls(traffic: Traffic, r: int) -> str:
    """What rank r wrote to each peer and the calls it reported: for whoever has to tell an
    honest rank's overhead from hidden traffic."""
    calls = [Sent(*e[1:]) for e in traffic.tallies[r] if e[0] == "call"]
    ops = {op: sum(1 for c in calls if c.op == op) for op in sorted({c.op for c in calls})}
    sent = sum(c.sent for c in calls if c.op == "send")
    wire = dict(sorted((traffic.wire or [{}] * (r + 1))[r].items()))
    return f"rank {r} wrote {wire} by peer; it reported {ops} calls, {sent} bytes sent"


def calls_by_case(check: str, tallies: list[list[tuple]], cases: int) -> list[list[list[Sent]]]:
    """Per rank, per case, the calls of a run whose rank function marked its cases
    (`traffic.split_by_marks`). Marks in any other order, or calls outside the cases, mean
    code on the rank reported marks of its own or talked when no case ran: that fails the
    part as tampering."""
    __tracebackhide__ = True
    out = []
    for r, entries in enumerate(tallies):
        per_case = split_by_marks(entries, cases)
        if per_case is None:
            marks = [e[1] for e in entries if e[0] == "mark"]
            raise CheckFailed(
                f"{check}: on rank {r}, the calls were reported out of order (marks "
                f"{marks[:8]}{'...' if len(marks) > 8 else ''}, expected 0 to {cases}, or "
                "calls made outside any case): code on the rank changed what the launcher "
                "records. That is tampering with the grading: this part scores 0.",
                tampering=True,
            )
        out.append(per_case)
    return out


def events_by_case(
    check: str, tallies: list[list[tuple]], cases: int
) -> list[list[list[Sent | Note]]]:
    """As `calls_by_case`, with the notes the check's code reported in their places among the
    calls (`traffic.split_with_notes`); a note outside the cases fails as tampering too."""
    __tracebackhide__ = True
    calls_by_case(check, tallies, cases)  # the marks are the check's own, or this fails
    out = []
    for r, entries in enumerate(tallies):
        per_case = split_with_notes(entries, cases)
        if per_case is None:
            raise CheckFailed(
                f"{check}: on rank {r}, notes were reported outside any case: code on the rank "
                "changed what the launcher records. That is tampering with the grading: this "
                "part scores 0.",
                tampering=True,
            )
        out.append(per_case)
    return out
