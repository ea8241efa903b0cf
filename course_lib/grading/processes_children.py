"""Part of Assignment 1's checks (grading/processes.py): running a function in a child
process of a launched worker, and saying what became of it.

    Child(fn, *args, close=[...])    fn(*args) in a forked child; .outcome(timeout)
    describe(outcome, who, wait)     a sentence about an outcome that is not ("ok", ...)

The pipe parts play the student's ping, pong or relays against the check's own partners, each
in a child of its own: a partner's state is out of the student's code's reach, and a student
function that hangs or dies is seen as such, not as a hung check.
"""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Callable
from typing import Any

from course_lib.grading.messages import student_frames


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
        return f"{who} raised an exception:\n\n{student_frames(detail)}"
    if kind == "timeout":
        return (
            f"{who} was still running after {wait:g} s: it is probably waiting in recv() "
            "for a message that never comes"
        )
    return f"{who} ended without returning (exit code {detail})"
