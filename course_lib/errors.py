"""What a launched call raises when it fails, and the messages that say which rank failed and
where each rank was."""

from __future__ import annotations

import signal

NO_STACK = "    (no stack: the process did not answer)\n"
_HANG_HINT = (
    "Hint: a rank that waits forever is usually in a recv (or a collective) that no other rank "
    "matches: check that every send has a recv with the same peer, size and order, and that "
    "every rank calls the same collectives in the same order."
)


class LaunchError(RuntimeError):
    """A launched call failed: a rank raised, died or hung."""


class RankError(LaunchError):
    """A rank raised an exception; `rank`, `exc_type` and `remote_traceback` say which, and
    `attributes` holds the exception's own public attributes that are plain data (numbers,
    strings, lists of them), e.g. the `ranks` of a `fault_tolerance.HungRank`."""

    def __init__(
        self,
        message: str,
        rank: int,
        exc_type: str,
        remote_traceback: str,
        attributes: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.attributes = dict(attributes or {})


class WorkerDied(LaunchError):
    """A rank's process ended without answering (os._exit, a segfault, out of memory)."""


class LaunchTimeout(LaunchError, TimeoutError):
    """Ranks were still running after the timeout; `stacks` maps rank -> where it was."""

    def __init__(self, message: str, stacks: dict[int, str]) -> None:
        super().__init__(message)
        self.stacks = stacks


def rank_error(
    rank: int,
    world_size: int,
    exc_type: str,
    message: str,
    traceback: str,
    others: list[int],
    attributes: dict | None = None,
) -> RankError:
    return RankError(
        f"rank {rank} of {world_size} raised {exc_type}: {message}{_also(others)}\n"
        f"All ranks were stopped.\n\nTraceback on rank {rank} (most recent call last):\n"
        + _strip_traceback_header(traceback),
        rank,
        exc_type,
        traceback,
        attributes,
    )


def worker_died(rank: int, world_size: int, exit_code: int | None, others: list[int]) -> WorkerDied:
    return WorkerDied(
        f"rank {rank} of {world_size} died{_also(others)}: {_describe_exit(exit_code)}. The other "
        "ranks were stopped."
    )


def launch_timeout(
    timeout: float, world_size: int, running: list[int], stacks: dict[int, str]
) -> LaunchTimeout:
    finished = sorted(set(range(world_size)) - set(running))
    lines = [
        f"the call did not finish within {timeout:g} s: {_ranks(running)} still running"
        + (f" ({_ranks(finished)} had returned)" if finished else "")
        + ". All ranks were stopped.",
        "",
        "Where each running rank was (most recent call last):",
        *_stacks(stacks),
        "",
        _HANG_HINT,
    ]
    return LaunchTimeout("\n".join(lines), stacks)


def interrupted(world_size: int, stacks: dict[int, str]) -> str:
    """What Ctrl-C prints: where the ranks that were still running were."""
    report = [f"Interrupted: stopped all {world_size} ranks. Where the running ones were:"]
    return "\n".join(report + _stacks(stacks))


def _stacks(stacks: dict[int, str]) -> list[str]:
    lines = []
    for rank, stack in sorted(stacks.items()):
        lines += [f"--- rank {rank} ---", stack.rstrip("\n")]
    return lines


def _also(others: list[int]) -> str:
    return f" ({_ranks(others)} failed too)" if others else ""


def _ranks(ranks: list[int]) -> str:
    """'rank 3' or 'ranks 0, 2'."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _strip_traceback_header(text: str) -> str:
    prefix = "Traceback (most recent call last):\n"
    return text[len(prefix) :] if text.startswith(prefix) else text


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "its process ended without a reply"
    if code < 0:
        name = signal.Signals(-code).name
        hint = " (the system may have run out of memory)" if name == "SIGKILL" else ""
        return f"killed by {name}{hint}"
    return f"its process exited with code {code} (os._exit or sys.exit outside Python?)"
