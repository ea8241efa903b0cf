"""The launcher's handle on one rank's process: start it, hear what it says, stop it.

A rank starts forked from the fork server (`_zygote.py`: milliseconds) or, where forking is
not an option, as a fresh interpreter (`python -m course_lib._worker`: seconds). Either way it
gets three channels to the launcher: a connection for calls and replies, and pipes for its
stdout and stderr. A thread per channel turns what arrives into events on the pool's queue:

    Reply(rank, message)          a message from the rank (`protocol`: Ready, Result, Raised,
                                  Progress)
    Disconnected(rank)            its connection has ended: the process is gone
    Output(rank, stream, text)    a line it printed (stream 1: stdout, 2: stderr)
    EndMark(rank, stream, call)   that stream has shown everything call `call` printed
    StreamClosed(rank, stream)    that pipe has ended
"""

from __future__ import annotations

import json
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection

from course_lib import protocol
from course_lib._worker import END_MARK
from course_lib._zygote import ForkServer


@dataclass(frozen=True)
class Reply:
    rank: int
    message: protocol.Message


@dataclass(frozen=True)
class Disconnected:
    rank: int


@dataclass(frozen=True)
class Output:
    rank: int
    stream: int
    text: str


@dataclass(frozen=True)
class EndMark:
    rank: int
    stream: int
    call_id: int


@dataclass(frozen=True)
class StreamClosed:
    rank: int
    stream: int


Event = Reply | Disconnected | Output | EndMark | StreamClosed


class RankProcess:
    """One rank's process, its connection and its output pipes."""

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
        self._events = events
        self.conn, child_conn = Pipe()
        # The reply thread reads a connection of its own, which only it closes. Were the pool
        # to close the one the thread reads, the thread could go on reading whatever the OS
        # opens next under that number: the connection of a rank of the next pool, say.
        replies = Connection(os.dup(self.conn.fileno()))
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            child_fds = [child_conn.fileno(), out_w, err_w]
            if server is not None:
                self.pid = server.fork(spec, child_fds)
            else:
                self._process = _spawn_subprocess(spec, child_fds)
                self.pid = self._process.pid
        except BaseException:  # Ctrl-C, say: leave no process and no pipe behind
            self.kill()
            for fd in (out_r, err_r):
                os.close(fd)
            replies.close()
            self.conn.close()
            raise
        finally:
            child_conn.close()
            os.close(out_w)
            os.close(err_w)
        for fd, stream in ((out_r, 1), (err_r, 2)):
            threading.Thread(target=self._read_output, args=(fd, stream), daemon=True).start()
        threading.Thread(target=self._read_replies, args=(replies,), daemon=True).start()

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

    def _read_replies(self, replies: Connection) -> None:
        with replies:
            while True:
                try:
                    message = protocol.decode(replies.recv_bytes())
                except (EOFError, OSError, pickle.UnpicklingError):
                    self.alive = False
                    self._events.put(Disconnected(self.rank))
                    return
                self._events.put(Reply(self.rank, message))

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
        self._events.put(StreamClosed(self.rank, stream))

    def _emit(self, line: bytes, stream: int) -> None:
        at = line.find(END_MARK)
        if at < 0:
            self._events.put(Output(self.rank, stream, line.decode("utf-8", "replace")))
            return
        if at > 0:  # the call printed a last line without a newline
            self._events.put(Output(self.rank, stream, line[:at].decode("utf-8", "replace")))
        call_id = int(line[at + len(END_MARK) :].strip(b"\x00\n"))
        self._events.put(EndMark(self.rank, stream, call_id))


# --- start methods ------------------------------------------------------------------------


def default_start_method() -> str:
    method = os.environ.get("COURSE_LIB_START_METHOD")
    if method:
        return method
    return "fork-server" if sys.platform.startswith("linux") else "subprocess"


_server: ForkServer | None = None
_server_lock = threading.Lock()


_preload_always: tuple[str, ...] = ()


def preload_in_fork_server(names: tuple[str, ...]) -> None:
    """Have the fork server, whenever this process starts it, import the modules `names` once
    for every worker it forks: a layer above calls this when imported, for the pools it will
    start (grading's ranks load the checks), so that a server another pool starts first (the
    student's `launch`, say) has them too."""
    global _preload_always
    _preload_always = tuple(dict.fromkeys((*_preload_always, *names)))


def fork_server() -> ForkServer:
    """This process's fork server, started the first time it is needed (or again if it died),
    importing the modules `preload_in_fork_server` named once for every worker it forks. One
    already running without a module named later stays: its workers import it themselves
    (`WorkerPool(preload=...)`), a little slower."""
    global _server
    with _server_lock:
        if _server is None or not _server.alive():
            _server = ForkServer(_worker_env(), _preload_always)
        return _server


def close_fork_server() -> None:
    if _server is not None:
        _server.close()


def _spawn_subprocess(spec: dict, fds: list[int]) -> subprocess.Popen:
    """Fallback start method: a fresh interpreter per rank (slower: each imports torch)."""
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


def _worker_env() -> dict[str, str]:
    """The environment for worker processes: this one, plus course_lib importable and one
    OpenMP thread per rank (many ranks share few cores)."""
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env
