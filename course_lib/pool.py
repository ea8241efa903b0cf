"""`WorkerPool`: warm ranks with a live process group, reused call after call.

A call: the pool pickles the function by value (`calls`), sends it to every rank
(`protocol.Call`), then handles what its ranks' processes report (`rank_process`) until every
rank has answered and shown all it printed. If a rank raises or dies, all ranks are stopped
and the error names the first (`errors`); if ranks hang, or on Ctrl-C, each running rank is
asked where it is (a stack dump on SIGUSR1) before all are stopped.
"""

from __future__ import annotations

import atexit
import itertools
import linecache
import os
import queue
import signal
import socket
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from course_lib import _stacks, sockets
from course_lib._zygote import ForkServer
from course_lib.backends import resolve_backend
from course_lib.calls import CallState, Died, per_rank_calls, pickle_call
from course_lib.errors import (
    NO_STACK,
    LaunchError,
    WorkerDied,
    interrupted,
    launch_timeout,
    rank_error,
    worker_died,
)
from course_lib.progress import RemoteBars
from course_lib.protocol import Call, Progress, Raised, Ready, Result, Tally, encode
from course_lib.rank_env import rank_spec
from course_lib.rank_process import (
    Disconnected,
    EndMark,
    Output,
    RankProcess,
    Reply,
    StreamClosed,
    close_fork_server,
    default_start_method,
    fork_server,
)

DEFAULT_TIMEOUT = 120.0  # seconds a call may run before it counts as hung
STARTUP_TIMEOUT = 180.0  # seconds for workers to start (a cold disk makes `import torch` slow)
STACK_WAIT_S = 1.0  # how long a hung rank gets to write its stack


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
        preload: tuple[str, ...] = (),
    ) -> None:
        self.backend = resolve_backend(backend, world_size)
        self.world_size = world_size
        # Untrusted: the calls run code that must not reach this process (a submission being
        # graded). Results come back as data only (never unpickled as objects), the ranks'
        # default group counts every call whatever route it took (`counted_group`), and a
        # rank that changes the libraries the checks use fails the call (`_integrity`).
        self.untrusted = untrusted
        # Modules every rank imports before its first call: an untrusted pool's checks, say,
        # before any student code runs. (The fork server imports once, for every rank it
        # forks, what `rank_process.preload_in_fork_server` named: grading names its checks.)
        self.preload = tuple(preload)
        self.start_method = start_method or default_start_method()
        if self.start_method not in ("fork-server", "subprocess"):
            raise ValueError(
                f"start_method must be 'fork-server' or 'subprocess', not {start_method!r}"
            )
        self._workers: list[RankProcess] = []
        self._busy = threading.Lock()
        self._calls = itertools.count(1)
        # A call is open from when it is sent until every rank has finished it. One still
        # open when the next starts was cut short while its ranks were being stopped (a
        # second Ctrl-C, say), so some of them may still be running it: start afresh.
        self._call_open = False
        self._sent_sources: set[str] = set()
        self._store: dist.TCPStore | None = None
        self._server: ForkServer | None = None
        self._tmpdir: tempfile.TemporaryDirectory | None = None
        self._events: queue.Queue = queue.Queue()
        self._stopped = 0  # workers stopped by the last _kill, whose output may still come
        # Untrusted pools: per rank, what its counted process group reported during the last
        # call, as it happened (`counted_group`): ("call", op, peer, sent, received, group, dtypes)
        # and ("mark", label) entries, in order.
        self.tallies: list[list[tuple]] = []
        # Untrusted pools on Linux: per rank, the bytes it wrote to each other rank's sockets
        # during the last call, as the kernel counted them (None where they cannot be read).
        self.wire: list[dict[int, int]] | None = None
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
        # One payload for all ranks, or one per rank when an argument is a PerRank.
        payload = per_rank_calls(fn, args, kwargs, self.world_size) or pickle_call(fn, args, kwargs)
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
        if self._call_open:
            return False
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
        self._server = fork_server() if self.start_method == "fork-server" else None
        try:
            # One at a time into self._workers, so that if a start is cut short (Ctrl-C, a
            # rank that dies), _kill stops every rank started so far.
            for rank in range(self.world_size):
                spec = rank_spec(
                    rank, self.world_size, self.backend, port,
                    stack_file=os.path.join(self._tmpdir.name, f"stack-{rank}.txt"),
                    untrusted=self.untrusted, preload=self.preload,
                )  # fmt: skip
                self._workers.append(RankProcess(rank, spec, self._events, self._server))
            self._wait_until_ready()
        except BaseException:
            self._kill()
            raise

    def _wait_until_ready(self) -> None:
        __tracebackhide__ = True
        waiting = set(range(self.world_size))
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while waiting:
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"workers {sorted(waiting)} did not start within {STARTUP_TIMEOUT:g} s"
                    + self._startup_log()
                )
            try:
                event = self._events.get(timeout=0.1)
            except queue.Empty:
                continue
            match event:
                case Output():
                    _print_output(event, self.world_size)
                case Reply(rank, Ready(main_thread=main_thread)):
                    self._workers[rank].ready(main_thread)
                    waiting.discard(rank)
                case Disconnected(rank):
                    time.sleep(0.2)  # let its last words reach us
                    self._flush_output()
                    raise WorkerDied(f"rank {rank} died while starting" + self._startup_log())

    def _startup_log(self) -> str:
        if self._server is not None and self._server.log().strip():
            return "\nfork server log:\n" + self._server.log()
        return ""

    # --- one call ---

    def _call(self, payload: bytes | list[bytes], timeout: float | None) -> list[Any]:
        __tracebackhide__ = True
        call = CallState(next(self._calls), self.world_size, timeout, self.untrusted)
        payloads = payload if isinstance(payload, list) else [payload] * self.world_size
        messages = [encode(self._call_message(call.id, p)) for p in payloads]
        bars = RemoteBars(shown=not self.untrusted)  # rank 0's long loops, drawn here
        self.tallies, self.wire = call.tallies, None
        pids = self.pids
        # What each rank sends the others, counted by the kernel: only where it matters.
        before = sockets.sent_between(pids) if self.untrusted and sockets.available() else None
        try:
            self._call_open = True
            self._send_to_all(messages)
            while not call.finished():
                if call.failed():
                    raise self._rank_failure(call)
                if call.past_deadline():
                    raise self._hang_failure(call)
                self._handle_next_event(call, bars)
            self._call_open = False
            if before is not None and self.pids == pids:  # not restarted on the way
                self.wire = sockets.sent_since(before, pids)
        except KeyboardInterrupt:
            self._interrupt(call)
            raise
        except BaseException:
            self._kill()  # never leave ranks running after an unexpected failure
            raise
        finally:
            bars.close()
        if call.broken:
            self.close()  # the function destroyed the process group: start afresh next time
        return call.results

    def _call_message(self, call_id: int, payload: bytes) -> Call:
        """The call, to run where it is launched from: this process's environment, directory
        and sys.path, plus the source of notebook cells so tracebacks on the ranks can quote
        them."""
        sources = {}
        for name, entry in list(linecache.cache.items()):
            if name not in self._sent_sources and len(entry) == 4 and entry[1] is None:
                sources[name] = entry
        self._sent_sources.update(sources)
        # A message carries plain data only; imports ignore entries that are not strings.
        sys_path = [entry for entry in sys.path if isinstance(entry, (str, bytes))]
        return Call(call_id, payload, dict(os.environ), os.getcwd(), sys_path, sources)

    def _send_to_all(self, messages: list[bytes]) -> None:
        """Send each rank its call; if a worker died while idle, restart and resend."""
        try:
            for worker, message in zip(self._workers, messages, strict=True):
                worker.send(message)
        except OSError:
            self._start()
            for worker, message in zip(self._workers, messages, strict=True):
                worker.send(message)

    def _handle_next_event(self, call: CallState, bars: RemoteBars) -> None:
        try:
            event = self._events.get(timeout=call.wait_s())
        except queue.Empty:
            sys.stdout.flush()
            return
        match event:
            case Output():
                _print_output(event, self.world_size)
            case EndMark(rank, stream, call_id):
                call.marked(rank, stream, call_id)
            case Reply(rank, Result() | Raised() as answer):
                call.answered(rank, answer)
            case Reply(rank, Tally(call_id, entry)) if call_id == call.id:
                call.tallies[rank].append(entry)
            case Reply(0, Progress(call_id, desc, done, total, finished)) if call_id == call.id:
                bars.update(desc, done, total, finished)
            case Disconnected(rank):
                call.died(rank, self._workers[rank].exit_code())

    # --- failures ---

    def _rank_failure(self, call: CallState) -> LaunchError:
        self._kill()
        self._flush_output()
        rank = min(call.failures)
        others = sorted(set(call.failures) - {rank})
        failure = call.failures[rank]
        if isinstance(failure, Died):
            return worker_died(rank, self.world_size, failure.exit_code, others)
        return rank_error(
            rank,
            self.world_size,
            failure.exc_type,
            failure.message,
            failure.traceback,
            others,
            failure.attributes if isinstance(failure.attributes, dict) else {},
        )

    def _hang_failure(self, call: CallState) -> LaunchError:
        running = sorted(call.waiting)
        stacks = self._stacks_of(running)
        self._kill()
        self._flush_output()
        return launch_timeout(call.timeout, self.world_size, running, stacks)

    def _interrupt(self, call: CallState) -> None:
        try:
            stacks = self._stacks_of(sorted(call.waiting))
        finally:
            self._kill()
        self._flush_output()
        print(interrupted(self.world_size, stacks), file=sys.stderr, flush=True)

    def _stacks_of(self, ranks: list[int]) -> dict[int, str]:
        before = {rank: self._workers[rank].stack_size() for rank in ranks}
        for rank in ranks:
            self._workers[rank].signal(signal.SIGUSR1)
        deadline = time.monotonic() + STACK_WAIT_S
        stacks = {}
        for rank in ranks:
            dump = self._workers[rank].wait_for_stack(before[rank], deadline)
            frames = _stacks.main_thread_frames(dump, self._workers[rank].main_thread)
            stacks[rank] = _stacks.format_frames(frames) if dump else NO_STACK
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
                event = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            match event:
                case Output():
                    _print_output(event, self.world_size)
                case StreamClosed():
                    open_streams -= 1
        sys.stdout.flush()
        sys.stderr.flush()


def _print_output(line: Output, world_size: int) -> None:
    width = len(str(world_size - 1))
    out = sys.stdout if line.stream == 1 else sys.stderr
    text = line.text
    out.write(f"[rank {line.rank:>{width}}] {text}" + ("" if text.endswith("\n") else "\n"))


_all_pools: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


def _close_everything() -> None:
    """At exit: stop every pool and the fork server (the workers would notice anyway)."""
    for pool in list(_all_pools):
        pool.close()
    close_fork_server()


atexit.register(_close_everything)
