"""What every check shares: running student code on ranks, and failing with a useful message.

A check never hangs and never shows a bare launcher error: a deadlock, a crash or an exception
in the student's code becomes a `CheckFailed` (an AssertionError) that names the check and
says what happened, where, and what to try.
"""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from course_lib.launch import LaunchTimeout, RankError, WorkerDied, launch


class CheckFailed(AssertionError):
    """A grading check found a problem in the student's code."""


def fail(check: str, message: str) -> NoReturn:
    __tracebackhide__ = True
    raise CheckFailed(f"{check}: {message}")


# The lectures' own implementations live in these course_lib modules. Several would answer an
# assignment as they are (the lecture's ring all-reduce, push-sum step, tensor-parallel layers),
# so a check refuses an answer that is one of them: the assignments ask for your own code.
LECTURE_MODULES = frozenset(
    f"course_lib.{name}"
    for name in (
        "collectives",
        "compression",
        "data_parallel",
        "gossip",
        "pipeline",
        "planner",
        "sharding",
        "tensor_parallel",
    )
)


def reject_lecture_code(check: str, *answers: Any) -> None:
    """Fail if an answer handed to a check is a function or class from a lecture module."""
    __tracebackhide__ = True
    for answer in answers:
        module = getattr(answer, "__module__", None)
        if callable(answer) and module in LECTURE_MODULES:
            name = getattr(answer, "__qualname__", repr(answer))
            fail(
                check,
                f"you handed in {module}.{name}, the lecture's own implementation; the "
                "assignment asks you to write it yourself in the notebook",
            )


def run_on_ranks(
    check: str, fn: Callable, *args: Any, world_size: int, timeout: float, what: str
) -> list:
    """`launch(fn, *args)` on `world_size` ranks; any failure becomes a CheckFailed that
    names `what` (e.g. "your dist_ping_pong"). An answer among `args` that is the lectures'
    own code fails at once."""
    __tracebackhide__ = True
    reject_lecture_code(check, *args)
    try:
        return launch(fn, *args, world_size=world_size, timeout=timeout)
    except RankError as error:
        fail(
            check,
            f"{what} raised {error.exc_type} on rank {error.rank}:\n\n{error.remote_traceback}",
        )
    except LaunchTimeout as error:
        fail(
            check,
            f"{what} did not finish within {timeout:g} s; is a rank waiting for a "
            f"message that never comes?\n\n{error}",
        )
    except WorkerDied as error:
        fail(check, f"{what} killed its process: {error}")


# --- running functions in child processes (inside a launched worker) ----------------------


class Child:
    """A function running in a forked child process, with its outcome reported back.

    Used inside a launched worker, never in the notebook kernel: the worker is a fresh,
    single-purpose process, so forking it is safe, and whatever the child leaves running is
    killed when the launched call ends.
    """

    def __init__(self, fn: Callable, *args: Any, close: list | None = None) -> None:
        """Start `fn(*args)` in a child that first closes the connections in `close`."""
        ctx = multiprocessing.get_context("fork")
        self._outcome, sender = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=_report, args=(sender, fn, args, close or []), daemon=True
        )
        self.process.start()
        sender.close()

    def outcome(self, timeout: float) -> tuple[str, Any]:
        """("ok", value), ("error", traceback text), ("timeout", None) or ("died", code)."""
        if self._outcome.poll(timeout):
            try:
                outcome = self._outcome.recv()
                self.process.join(timeout)
                return outcome
            except EOFError:
                pass
        self.process.join(0.1)
        if self.process.is_alive():
            return ("timeout", None)
        return ("died", self.process.exitcode)


def _report(sender, fn: Callable, args: tuple, close: list) -> None:
    for connection in close:
        connection.close()
    try:
        result = fn(*args)
    except BaseException:  # noqa: BLE001 (reported to the check)
        sender.send(("error", traceback.format_exc()))
    else:
        sender.send(("ok", result))


def describe(outcome: tuple[str, Any], who: str, wait: float) -> str:
    """A sentence about an outcome that is not ("ok", ...)."""
    kind, detail = outcome
    if kind == "error":
        return f"{who} raised an exception:\n\n{detail}"
    if kind == "timeout":
        return (
            f"{who} was still running after {wait:g} s: it is probably waiting in recv() "
            "for a message that never comes"
        )
    return f"{who} ended without returning (exit code {detail})"
