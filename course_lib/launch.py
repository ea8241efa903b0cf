"""Run a function on several processes at once, straight from a notebook cell.

    from course_lib import launch, rank

    def hello():
        print("hello from rank", rank())
        return rank() ** 2

    launch(hello, world_size=4)   # prints "[rank 2] hello from rank 2", ...; returns [0, 1, 4, 9]

Each rank is its own Python process with `torch.distributed` initialised (gloo on the CPU, or
NCCL with one GPU per rank). The function and its arguments are shipped by value with
cloudpickle, so functions and classes defined in a notebook cell work; the notebook kernel is
never forked. What the launcher promises:

- every rank's prints appear as they happen, prefixed with the rank;
- if a rank raises, all ranks are stopped and one `RankError` names the rank and shows its
  traceback;
- if ranks hang (a recv without its send), `LaunchTimeout` after `timeout` seconds shows the
  line each rank was blocked on;
- Ctrl-C / interrupting the kernel stops every rank; nothing a rank started survives the call,
  the kernel's restart or its death;
- ranks meet on a free port bound to 127.0.0.1 only, so launches never collide.

Workers stay warm between calls (`WorkerPool`; `launch` keeps one default pool), so running a
cell again costs milliseconds instead of seconds of interpreter and torch start-up.

How it is built, top down: `pool` (the WorkerPool), `calls` (a call's journey and its
answers), `errors` (what a failure raises), `rank_process` (one rank's process, as the
launcher sees it), `protocol` (the messages), `_zygote` (the fork server) and `_worker` (a rank).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from course_lib.backends import resolve_backend
from course_lib.errors import LaunchError, LaunchTimeout, RankError, WorkerDied
from course_lib.pool import DEFAULT_TIMEOUT, WorkerPool

__all__ = [
    "DEFAULT_TIMEOUT",
    "LaunchError",
    "LaunchTimeout",
    "RankError",
    "WorkerDied",
    "WorkerPool",
    "default_pool",
    "launch",
    "resolve_backend",
    "shutdown",
]


def launch(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 4,
    backend: str = "auto",
    timeout: float | None = DEFAULT_TIMEOUT,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` ranks; return their results in rank order.

    Uses a default `WorkerPool` that stays warm between calls and is replaced when the world
    size or backend changes. `backend`: "auto" (NCCL if there is a GPU per rank, else gloo;
    on a machine with GPUs it says once which it chose), "gloo" or "nccl". `timeout`: seconds
    before the call counts as hung (None: never).
    """
    __tracebackhide__ = True
    global _default_pool
    backend = resolve_backend(backend, world_size)
    if _default_pool is None or _default_pool.key != (world_size, backend):
        shutdown()
        _default_pool = WorkerPool(world_size, backend)
    return _default_pool.launch(fn, *args, timeout=timeout, **kwargs)


def default_pool() -> WorkerPool | None:
    """The pool `launch` is using (None before the first call or after `shutdown`)."""
    return _default_pool


def shutdown() -> None:
    """Stop the default pool's workers (they would otherwise wait for the next call)."""
    global _default_pool
    if _default_pool is not None:
        _default_pool.close()
        _default_pool = None


_default_pool: WorkerPool | None = None
