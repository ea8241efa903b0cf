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
"""

from __future__ import annotations

import atexit
import io
import itertools
import linecache
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing import Pipe
from typing import Any

import cloudpickle
import psutil
import torch
import torch.distributed as dist

from course_lib import _stacks, runtime
from course_lib._worker import END_MARK
from course_lib._zygote import ForkServer

DEFAULT_TIMEOUT = 120.0  # seconds a call may run before it counts as hung
STARTUP_TIMEOUT = 180.0  # seconds for workers to start (a cold disk makes `import torch` slow)
ERROR_GRACE_S = 0.25  # after a first error, wait this long for other ranks' errors
STACK_WAIT_S = 1.0  # how long a hung rank gets to write its stack
PG_TIMEOUT_S = 3600  # torch.distributed's own timeout; the launcher's timeout comes first


class LaunchError(RuntimeError):
    """A launched call failed: a rank raised, died or hung."""


class RankError(LaunchError):
    """A rank raised an exception; `rank`, `exc_type` and `remote_traceback` say which."""

    def __init__(self, message: str, rank: int, exc_type: str, remote_traceback: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback


class WorkerDied(LaunchError):
    """A rank's process ended without answering (os._exit, a segfault, out of memory)."""


class LaunchTimeout(LaunchError, TimeoutError):
    """Ranks were still running after the timeout; `stacks` maps rank -> where it was."""

    def __init__(self, message: str, stacks: dict[int, str]) -> None:
        super().__init__(message)
        self.stacks = stacks


# --- public API ---------------------------------------------------------------------------


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


def resolve_backend(backend: str, world_size: int) -> str:
    """Check the arguments and pick "gloo" or "nccl"; raise before any process starts."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        chosen = "nccl" if gpus >= world_size else "gloo"
        if gpus:  # with GPUs the choice depends on the world size: say which and why, once
            _say_once(world_size, gpus, chosen)
        return chosen
    if backend == "gloo":
        return backend
    if backend == "nccl":
        if gpus < world_size:
            raise ValueError(
                f"backend='nccl' needs one GPU per rank: {world_size} ranks asked for, but "
                f"{gpus} GPU{'s' if gpus != 1 else ''} visible. Use backend='gloo' (CPU) or "
                f"world_size<={gpus}."
            )
        return backend
    raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")


_said: set[tuple[int, str]] = set()


def _say_once(world_size: int, gpus: int, chosen: str) -> None:
    if (world_size, chosen) in _said:
        return
    _said.add((world_size, chosen))
    if chosen == "nccl":
        why = f"one GPU for each of the {world_size} ranks ({gpus} visible)"
    else:
        why = f"{world_size} ranks but {gpus} GPU{'s' if gpus != 1 else ''}: every rank on the CPU"
    print(
        f"course_lib: backend='auto' chose {chosen}, {why}. Pass backend='gloo' or "
        "backend='nccl' to choose yourself.",
        file=sys.stderr,
    )


class WorkerPool:
    """`world_size` warm workers with a live process group, reused call after call.

        with WorkerPool(4) as pool:
            pool.launch(step, model_state)   # same arguments as `launch`

    Workers start on the first call. A call never sees what an earlier call left behind
    (random states, module globals, global hooks); a call that fails or hangs restarts the
    workers.
    """

    def __init__(
        self,
        world_size: int,
        backend: str = "auto",
        *,
        start_method: str | None = None,
        untrusted: bool = False,
    ) -> None:
        self.backend = resolve_backend(backend, world_size)
        self.world_size = world_size
        # Untrusted: the calls run code that must not reach this process (a submission being
        # graded). Results come back as data only (never unpickled as objects), the ranks'
        # default group counts every call whatever route it took (`counted_group`), and a
        # rank that changes the libraries the checks use fails the call (`_integrity`).
        self.untrusted = untrusted
        self.start_method = start_method or _default_start_method()
        if self.start_method not in ("fork-server", "subprocess"):
            raise ValueError(
                f"start_method must be 'fork-server' or 'subprocess', not {start_method!r}"
            )
        self._workers: list[_Worker] = []
        self._busy = threading.Lock()
        self._calls = itertools.count(1)
        self._sent_sources: set[str] = set()
        self._store: dist.TCPStore | None = None
        self._tmpdir: tempfile.TemporaryDirectory | None = None
        self._events: queue.Queue = queue.Queue()
        self._stopped = 0  # workers stopped by the last _kill, whose output may still come
        _all_pools.add(self)

    @property
    def key(self) -> tuple[int, str]:
        return (self.world_size, self.backend)

    @property
    def pids(self) -> list[int]:
        """Process ids of the running workers, in rank order (empty before the first call)."""
        return [w.pid for w in self._workers]

    def __del__(self) -> None:
        try:
            self._kill()
        except Exception:  # noqa: BLE001 (interpreter shutdown: the workers die with us)
            pass

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def launch(
        self,
        fn: Callable[..., Any],
        *args: Any,
        world_size: int | None = None,
        backend: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        **kwargs: Any,
    ) -> list[Any]:
        """Run `fn(*args, **kwargs)` on every worker; results in rank order. See `launch`."""
        __tracebackhide__ = True
        self._check_matches(world_size, backend)
        payload = _pickle_call(fn, args, kwargs)
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a number of seconds > 0 or None, got {timeout!r}")
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("this WorkerPool is already running a call (from another thread)")
        try:
            if not self._healthy():
                self._start()
            return self._call(payload, timeout)
        finally:
            self._busy.release()

    def close(self) -> None:
        """Stop the workers and free the port; the pool restarts if launched again."""
        self._kill()
        self._store = None
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    # --- starting ---

    def _check_matches(self, world_size: int | None, backend: str | None) -> None:
        if world_size is not None and world_size != self.world_size:
            raise ValueError(
                f"this pool has {self.world_size} workers but world_size={world_size} was asked "
                f"for; make a WorkerPool({world_size}) or use launch(..., world_size={world_size})"
            )
        if backend in (None, "auto"):
            return
        if resolve_backend(backend, self.world_size) != self.backend:
            raise ValueError(f"this pool uses backend {self.backend!r}, not {backend!r}")

    def _healthy(self) -> bool:
        return bool(self._workers) and all(w.alive for w in self._workers)

    def _start(self) -> None:
        self.close()
        self._events = queue.Queue()
        self._sent_sources = set()
        self._tmpdir = tempfile.TemporaryDirectory(prefix="course_lib-")
        # Bind the rendezvous port ourselves, on loopback only, and hand the bound socket to
        # the store: the OS picks a free port and no other launch can take it in between.
        listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        port = listener.getsockname()[1]
        self._store = dist.TCPStore(
            "127.0.0.1",
            port,
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
        )
        listener.detach()  # the store owns the socket now and closes it when it goes
        server = _fork_server() if self.start_method == "fork-server" else None
        self._workers = [
            _Worker(rank, self._spec(rank, port), self._events, server)
            for rank in range(self.world_size)
        ]
        self._wait_until_ready()

    def _spec(self, rank: int, port: int) -> dict:
        return {
            "rank": rank,
            "world_size": self.world_size,
            "backend": self.backend,
            "store_host": "127.0.0.1",
            "store_port": port,
            "stack_file": os.path.join(self._tmpdir.name, f"stack-{rank}.txt"),
            "pg_timeout_s": PG_TIMEOUT_S,
            "untrusted": self.untrusted,
            "env": self._rank_env(rank, port),
        }

    def _rank_env(self, rank: int, port: int) -> dict[str, str]:
        """What rank `rank` adds to its environment (torchrun's variables, and more)."""
        env = {
            "COURSE_LIB_WORKER": "1",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        if self.backend == "nccl":
            # NCCL collectives return before they run, so a hang would show up later, at some
            # unrelated line. Blocking wait makes a collective's wait() (which every call
            # without async_op=True makes) hold the rank until it completes, as gloo does:
            # a hung rank's stack then points at the collective itself.
            env["TORCH_NCCL_BLOCKING_WAIT"] = "1"
        loopback = _loopback_interface()
        if loopback:  # gloo and NCCL would otherwise listen on the host's public address
            env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", loopback)
            env["NCCL_SOCKET_IFNAME"] = os.environ.get("NCCL_SOCKET_IFNAME", loopback)
        return env

    def _wait_until_ready(self) -> None:
        __tracebackhide__ = True
        waiting = set(range(self.world_size))
        deadline = time.monotonic() + STARTUP_TIMEOUT
        try:
            while waiting:
                if time.monotonic() > deadline:
                    raise LaunchError(
                        f"workers {sorted(waiting)} did not start within {STARTUP_TIMEOUT:g} s"
                        + self._startup_log()
                    )
                try:
                    kind, rank, item = self._events.get(timeout=0.1)
                except queue.Empty:
                    continue
                if kind == "out":
                    _print_line(rank, item[0], item[1], self.world_size)
                elif kind == "reply" and item[0] == "ready":
                    self._workers[rank].ready(item[2])
                    waiting.discard(rank)
                elif kind == "eof":
                    time.sleep(0.2)  # let its last words reach us
                    self._flush_output()
                    raise WorkerDied(f"rank {rank} died while starting" + self._startup_log())
        except BaseException:
            self._kill()
            raise

    def _startup_log(self) -> str:
        server = _fork_server_if_running()
        if self.start_method == "fork-server" and server is not None and server.log().strip():
            return "\nfork server log:\n" + server.log()
        return ""

    # --- one call ---

    def _call(self, payload: bytes, timeout: float | None) -> list[Any]:
        __tracebackhide__ = True
        call = _Call(next(self._calls), self.world_size, timeout, self.untrusted)
        message = pickle.dumps((call.id, payload, self._context()))
        try:
            self._send_to_all(message)
            while not call.finished():
                if call.errors and time.monotonic() >= call.error_deadline:
                    raise self._rank_failure(call)
                if call.past_deadline():
                    raise self._hang_failure(call)
                self._handle_next_event(call)
        except KeyboardInterrupt:
            self._interrupt(call)
            raise
        except BaseException:
            self._kill()  # never leave ranks running after an unexpected failure
            raise
        if call.broken:
            self.close()  # the function destroyed the process group: start afresh next time
        return call.results

    def _send_to_all(self, message: bytes) -> None:
        """Send the call to every rank; if a worker died while idle, restart and resend."""
        try:
            for worker in self._workers:
                worker.send(message)
        except OSError:
            self._start()
            for worker in self._workers:
                worker.send(message)

    def _handle_next_event(self, call: _Call) -> None:
        try:
            kind, rank, item = self._events.get(timeout=call.wait_s())
        except queue.Empty:
            sys.stdout.flush()
            return
        if kind == "out":
            _print_line(rank, item[0], item[1], self.world_size)
        elif kind == "mark":
            call.marked(rank, item)
        elif kind == "reply":
            call.replied(rank, item)
        elif kind == "eof":
            call.died(rank, self._workers[rank].exit_code())

    def _context(self) -> dict:
        """Where the call should run: this process's environment, directory and sys.path,
        plus the source of notebook cells so tracebacks on the ranks can quote them."""
        sources = {}
        for name, entry in list(linecache.cache.items()):
            if name not in self._sent_sources and len(entry) == 4 and entry[1] is None:
                sources[name] = entry
        self._sent_sources.update(sources)
        return {
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "sys_path": list(sys.path),
            "linecache": sources,
        }

    # --- failures ---

    def _rank_failure(self, call: _Call) -> LaunchError:
        self._kill()
        self._flush_output()
        rank = min(call.errors)
        others = sorted(set(call.errors) - {rank})
        also = f" ({_ranks(others)} failed too)" if others else ""
        error = call.errors[rank]
        if error[0] == "died":
            return WorkerDied(
                f"rank {rank} of {self.world_size} died{also}: {error[1]}. The other ranks were "
                "stopped."
            )
        exc_type, message, remote_tb = error[1], error[2], error[3]
        return RankError(
            f"rank {rank} of {self.world_size} raised {exc_type}: {message}{also}\n"
            f"All ranks were stopped.\n\nTraceback on rank {rank} (most recent call last):\n"
            + _strip_traceback_header(remote_tb),
            rank,
            exc_type,
            remote_tb,
        )

    def _hang_failure(self, call: _Call) -> LaunchTimeout:
        running = sorted(call.waiting)
        stacks = self._stacks_of(running)
        self._kill()
        self._flush_output()
        finished = sorted(set(range(self.world_size)) - set(running))
        lines = [
            f"the call did not finish within {call.timeout:g} s: {_ranks(running)} still running"
            + (f" ({_ranks(finished)} had returned)" if finished else "")
            + ". All ranks were stopped.",
            "",
            "Where each running rank was (most recent call last):",
        ]
        for rank in running:
            lines += [f"--- rank {rank} ---", stacks[rank].rstrip("\n")]
        lines += ["", _HANG_HINT]
        return LaunchTimeout("\n".join(lines), stacks)

    def _interrupt(self, call: _Call) -> None:
        try:
            running = sorted(call.waiting)
            stacks = self._stacks_of(running)
        finally:
            self._kill()
        self._flush_output()
        report = [f"Interrupted: stopped all {self.world_size} ranks. Where the running ones were:"]
        for rank in running:
            report += [f"--- rank {rank} ---", stacks[rank].rstrip("\n")]
        print("\n".join(report), file=sys.stderr, flush=True)

    def _stacks_of(self, ranks: list[int]) -> dict[int, str]:
        before = {rank: self._workers[rank].stack_size() for rank in ranks}
        for rank in ranks:
            self._workers[rank].signal(signal.SIGUSR1)
        deadline = time.monotonic() + STACK_WAIT_S
        stacks = {}
        for rank in ranks:
            dump = self._workers[rank].wait_for_stack(before[rank], deadline)
            frames = _stacks.main_thread_frames(dump, self._workers[rank].main_thread)
            stacks[rank] = _stacks.format_frames(frames) if dump else _NO_STACK
        return stacks

    def _kill(self) -> None:
        for worker in self._workers:
            worker.kill()
        for worker in self._workers:
            worker.close()
        self._stopped = len(self._workers)
        self._workers = []

    def _flush_output(self, wait_s: float = 0.5) -> None:
        """Print what the stopped ranks wrote last (their pipes close as they die)."""
        deadline = time.monotonic() + wait_s
        open_streams = 2 * self._stopped
        while open_streams > 0 and time.monotonic() < deadline:
            try:
                kind, rank, item = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if kind == "out":
                _print_line(rank, item[0], item[1], self.world_size)
            elif kind == "closed":
                open_streams -= 1
        sys.stdout.flush()
        sys.stderr.flush()


_NO_STACK = "    (no stack: the process did not answer)\n"
_HANG_HINT = (
    "Hint: a rank that waits forever is usually in a recv (or a collective) that no other rank "
    "matches: check that every send has a recv with the same peer, size and order, and that "
    "every rank calls the same collectives in the same order."
)


class _Call:
    """Book-keeping for one call: who has answered, who has finished printing."""

    def __init__(
        self, call_id: int, world_size: int, timeout: float | None, untrusted: bool = False
    ) -> None:
        self.id = call_id
        self.untrusted = untrusted
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.waiting = set(range(world_size))
        self.unmarked = {(rank, stream) for rank in range(world_size) for stream in (1, 2)}
        self.results: list[Any] = [None] * world_size
        self.errors: dict[int, tuple] = {}
        self.error_deadline = 0.0
        self.marks_deadline: float | None = None
        self.broken = False

    def finished(self) -> bool:
        if self.waiting or self.errors:
            return False
        if self.marks_deadline is None:
            self.marks_deadline = time.monotonic() + 2.0
        return not self.unmarked or time.monotonic() > self.marks_deadline

    def past_deadline(self) -> bool:
        if self.deadline is None or not self.waiting:
            return False
        return time.monotonic() >= self.deadline

    def wait_s(self) -> float:
        limit = 0.1
        if self.deadline is not None:
            limit = min(limit, max(0.0, self.deadline - time.monotonic()))
        if self.errors:
            limit = min(limit, max(0.0, self.error_deadline - time.monotonic()))
        return limit

    def marked(self, rank: int, item: tuple[int, int]) -> None:
        stream, call_id = item
        if call_id == self.id:
            self.unmarked.discard((rank, stream))

    def replied(self, rank: int, reply: tuple) -> None:
        kind, call_id = reply[0], reply[1]
        if call_id != self.id:
            return
        self.waiting.discard(rank)
        if kind == "ok":
            try:
                self.results[rank] = (_load_data if self.untrusted else pickle.loads)(reply[2])
            except Exception as exc:  # noqa: BLE001
                note = "its return value cannot be unpickled in the launching process"
                if self.untrusted:
                    note = (
                        "an untrusted rank may return only tensors, numbers, strings, None and "
                        "lists, tuples and dicts of them"
                    )
                text = f"{note}: {exc}"
                self._failed(rank, ("raised", type(exc).__name__, text, f"{text}\n"))
            self.broken = self.broken or reply[3]
        else:
            self._failed(rank, ("raised", *reply[2:5]))

    def died(self, rank: int, exit_code: int | None) -> None:
        if rank in self.waiting:
            self.waiting.discard(rank)
            self._failed(rank, ("died", _describe_exit(exit_code)))

    def _failed(self, rank: int, error: tuple) -> None:
        if not self.errors:
            self.error_deadline = time.monotonic() + ERROR_GRACE_S
        self.errors[rank] = error


class _Worker:
    """The launcher's handle on one rank: its process, connection and output pipes."""

    def __init__(
        self, rank: int, spec: dict, events: queue.Queue, server: ForkServer | None
    ) -> None:
        self.rank = rank
        self.spec = spec
        self.pid = -1
        self.main_thread = 0
        self.alive = True
        self._process: subprocess.Popen | None = None
        self._server = server
        self.conn, child_conn = Pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        child_fds = [child_conn.fileno(), out_w, err_w]
        if server is not None:
            self.pid = server.fork(spec, child_fds)
        else:
            self._process = _spawn_subprocess(spec, child_fds)
            self.pid = self._process.pid
        child_conn.close()
        os.close(out_w)
        os.close(err_w)
        self._events = events
        for fd, stream in ((out_r, 1), (err_r, 2)):
            threading.Thread(target=self._read_output, args=(fd, stream), daemon=True).start()
        threading.Thread(target=self._read_replies, daemon=True).start()

    def ready(self, main_thread: int) -> None:
        self.main_thread = main_thread

    def send(self, message: bytes) -> None:
        self.conn.send_bytes(message)

    def signal(self, signum: int) -> None:
        if self.pid > 0 and not self._reaped():
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL the rank's whole process group: the rank and everything it started.

        Only while the rank has not been reaped. Pid numbers are reused (on a busy machine
        they wrap within minutes), so a signal sent to the number of a rank that is gone
        could kill an unrelated process: a rank of the next pool, say.
        """
        if self.pid > 0 and not self._reaped():
            for kill in (os.killpg, os.kill):
                try:
                    kill(self.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if self._process is not None:
            self._process.wait()
        self.alive = False

    def close(self) -> None:
        self.conn.close()

    def exit_code(self) -> int | None:
        if self._process is not None:
            return self._process.wait(timeout=2)
        return self._server.exit_code(self.pid) if self.pid > 0 else None

    def _reaped(self) -> bool:
        """Has the rank's pid been released, so that its number may belong to someone else?"""
        if self._process is not None:
            return self._process.returncode is not None  # only our own wait() reaps it
        # A fork server that is gone no longer reaps its ranks, which kill themselves when
        # they see their parent go (`_worker._die_with_parent`).
        return not self._server.alive() or self._server.exit_code(self.pid, 0) is not None

    def stack_size(self) -> int:
        try:
            return os.path.getsize(self.spec["stack_file"])
        except OSError:
            return 0

    def wait_for_stack(self, start: int, deadline: float) -> str:
        """The stack dump the rank writes after SIGUSR1 (empty if it never comes)."""
        size = start
        while time.monotonic() < deadline:
            time.sleep(0.02)
            new_size = self.stack_size()
            if new_size > start and new_size == size:
                break  # it grew and has stopped growing
            size = new_size
        with open(self.spec["stack_file"], errors="replace") as f:
            f.seek(start)
            return f.read()

    def _read_replies(self) -> None:
        while True:
            try:
                reply = _load_envelope(self.conn.recv_bytes())
            # TypeError: the pool closed this end of the pipe while we were reading it.
            except (EOFError, OSError, TypeError, pickle.UnpicklingError):
                self.alive = False
                self._events.put(("eof", self.rank, None))
                return
            self._events.put(("reply", self.rank, reply))

    def _read_output(self, fd: int, stream: int) -> None:
        """Split the rank's output into lines; end marks become events of their own."""
        pending = b""
        with open(fd, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self._emit(line + b"\n", stream)
        if pending:
            self._emit(pending, stream)
        self._events.put(("closed", self.rank, stream))

    def _emit(self, line: bytes, stream: int) -> None:
        at = line.find(END_MARK)
        if at < 0:
            self._events.put(("out", self.rank, (stream, line.decode("utf-8", "replace"))))
            return
        if at > 0:  # the call printed a last line without a newline
            self._events.put(("out", self.rank, (stream, line[:at].decode("utf-8", "replace"))))
        call_id = int(line[at + len(END_MARK) :].strip(b"\x00\n"))
        self._events.put(("mark", self.rank, (stream, call_id)))


# --- helpers ------------------------------------------------------------------------------


class _EnvelopeUnpickler(pickle.Unpickler):
    """Replies from ranks are tuples of numbers, strings and bytes: refuse anything that
    would name a class or function (which is how a pickle runs code)."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"a rank's reply names {module}.{name}: refused")


def _load_envelope(data: bytes) -> tuple:
    return _EnvelopeUnpickler(io.BytesIO(data)).load()


def _load_data(data: bytes) -> Any:
    """A return value from an untrusted rank: tensors, numbers, strings and containers."""
    return torch.load(io.BytesIO(data), weights_only=True)


def _pickle_call(fn: Callable, args: tuple, kwargs: dict) -> bytes:
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
        return super().reducer_override(obj)


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


def _print_line(rank: int, stream: int, text: str, world_size: int) -> None:
    width = len(str(world_size - 1))
    out = sys.stdout if stream == 1 else sys.stderr
    out.write(f"[rank {rank:>{width}}] {text}" + ("" if text.endswith("\n") else "\n"))


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


def _ranks(ranks: list[int]) -> str:
    """'rank 3' or 'ranks 0, 2'."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _loopback_interface() -> str | None:
    """Name of the network interface that carries 127.0.0.1 ('lo' on Linux, 'lo0' on macOS)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addresses):
            return name
    return None


def _default_start_method() -> str:
    method = os.environ.get("COURSE_LIB_START_METHOD")
    if method:
        return method
    return "fork-server" if sys.platform.startswith("linux") else "subprocess"


def _worker_env() -> dict[str, str]:
    """The environment for worker processes: this one, plus course_lib importable and one
    OpenMP thread per rank (many ranks share few cores)."""
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _spawn_subprocess(spec: dict, fds: list[int]) -> subprocess.Popen:
    """Fallback start method: a fresh interpreter per rank (slower: each imports torch)."""
    import json

    conn_fd, out_w, err_w = fds
    return subprocess.Popen(
        [sys.executable, "-m", "course_lib._worker", json.dumps(spec), str(conn_fd)],
        pass_fds=[conn_fd],
        stdin=subprocess.DEVNULL,
        stdout=out_w,
        stderr=err_w,
        start_new_session=True,
        env=_worker_env(),
    )


_server: ForkServer | None = None
_server_lock = threading.Lock()


def _fork_server() -> ForkServer:
    global _server
    with _server_lock:
        if _server is None or not _server.alive():
            _server = ForkServer(_worker_env())
        return _server


def _fork_server_if_running() -> ForkServer | None:
    return _server


_default_pool: WorkerPool | None = None
_all_pools: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


def _close_everything() -> None:
    """At exit: stop every pool and the fork server (the workers would notice anyway)."""
    for pool in list(_all_pools):
        pool.close()
    if _server is not None:
        _server.close()


atexit.register(_close_everything)
