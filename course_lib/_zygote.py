"""The fork server: imports torch once, then forks ready-to-run workers in milliseconds.

Importing torch takes about 2 s; forking a process that has already imported it takes a few
milliseconds. So the launching process (a notebook kernel or a script) starts one fork server
the first time it needs workers, and every pool after that (a different world size, a
restart after a crash) starts almost at once. The server never runs user code and never
touches CUDA, which is what makes forking it safe; the notebook kernel itself is never forked.

`ForkServer` is the launcher's side; `main()` runs in the server process.
"""

from __future__ import annotations

import gc
import importlib
import itertools
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from course_lib.protocol import Exited, Fork, Forked, decode, encode

POLL_S = 0.2


class ForkServer:
    """Handle on a running fork server, owned by the launching process."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = ()) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = tempfile.TemporaryFile()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "course_lib._zygote", str(theirs.fileno()), *preload],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            start_new_session=True,  # Ctrl-C in a terminal goes to the launcher, not here
            env=env,
        )
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()
        self._exit_codes: dict[int, int] = {}
        self._exited = threading.Condition()
        self._requests = itertools.count(1)
        self._forked: queue.Queue[Forked | None] = queue.Queue()
        threading.Thread(target=self._listen, daemon=True).start()

    @property
    def pid(self) -> int:
        return self._process.pid

    def alive(self) -> bool:
        return self._process.poll() is None

    def fork(self, spec: dict, fds: list[int], timeout: float = 180.0) -> int:
        """Start one worker running `_worker.serve(spec, ...)` on fds (conn, out, err); return
        its pid. The first call waits for the server to finish importing torch."""
        with self._lock:
            request = next(self._requests)
            deadline = time.monotonic() + timeout
            try:
                socket.send_fds(self._sock, [encode(Fork(request, spec))], fds)
                reply = self._forked.get(timeout=timeout)
                # Replies to requests whose callers gave up waiting (Ctrl-C while a pool
                # started) come first: their ranks have nobody to talk to.
                while reply is not None and reply.request != request:
                    self._kill_unwanted(reply.pid)
                    reply = self._forked.get(timeout=max(0.0, deadline - time.monotonic()))
            except (OSError, queue.Empty):
                reply = None
        if reply is None:
            raise RuntimeError("the course_lib fork server failed:\n" + self.log())
        return reply.pid

    def exit_code(self, pid: int, timeout: float = 1.0) -> int | None:
        """Exit code of worker `pid` (negative: killed by that signal), if it has exited."""
        with self._exited:
            self._exited.wait_for(lambda: pid in self._exit_codes, timeout)
            return self._exit_codes.get(pid)

    def _kill_unwanted(self, pid: int) -> None:
        if self.exit_code(pid, 0) is None:  # not reaped: the number is still that rank's
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def log(self) -> str:
        """What the server wrote to stderr: why it failed to start, say."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def close(self) -> None:
        if self.alive():
            os.killpg(self._process.pid, signal.SIGKILL)
        self._process.wait()
        self._sock.close()

    def _listen(self) -> None:
        while True:
            try:
                message = self._sock.recv(4096)
            except OSError:
                message = b""
            if not message:
                self._forked.put(None)
                return
            reply = decode(message)
            if isinstance(reply, Forked):
                with self._exited:  # a reused pid: forget the exit of its earlier owner
                    self._exit_codes.pop(reply.pid, None)
                self._forked.put(reply)
            elif isinstance(reply, Exited):
                with self._exited:
                    self._exit_codes[reply.pid] = reply.code
                    self._exited.notify_all()


# --- the server process -------------------------------------------------------------------


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    parent = os.getppid()
    # The slow part, paid once here instead of in every worker: torch, numpy, cloudpickle, and
    # torch._dynamo, which building the first torch.optim optimizer imports (about 2.5 s of
    # CPU). Neither import starts a thread, so forking stays safe.
    import torch._dynamo  # noqa: F401

    # What the pool that started this server has its ranks import before their first call
    # (`WorkerPool(preload=...)`: the checks, for grading ranks), imported once here: a few
    # hundred milliseconds less for every worker.
    for name in sys.argv[2:]:
        importlib.import_module(name)
    from course_lib import _worker

    # Move everything imported so far (about 290,000 objects) out of the collector's reach:
    # a full collection in a worker then walks only what the worker made itself (a ZeRO
    # check scans every rank's memory several times a step), and these objects' pages stay
    # shared with the workers instead of being copied when a collection touches them.
    gc.freeze()

    while os.getppid() == parent:
        _report_exits(sock)
        ready, _, _ = select.select([sock], [], [], POLL_S)
        if not ready:
            continue
        message, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
        if not message:
            break  # the launcher has gone
        fork = decode(message)
        pid = os.fork()
        if pid == 0:
            _run_worker(_worker, sock, fork.spec, fds)
        for fd in fds:
            os.close(fd)
        sock.send(encode(Forked(fork.request, pid)))
    # Workers notice that their parent has gone and kill themselves.


def _run_worker(worker, sock: socket.socket, spec: dict, fds: list[int]) -> None:
    """In the forked child: become a session leader on the launcher's pipes, then serve."""
    code = 1
    try:
        sock.close()
        os.setsid()
        conn_fd, out_fd, err_fd = fds
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd in (null, out_fd, err_fd):
            os.close(fd)
        from multiprocessing.connection import Connection

        worker.serve(spec, Connection(conn_fd))
        code = 0
    except BaseException:  # noqa: BLE001 (reported on the rank's stderr)
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


def _report_exits(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        try:
            sock.send(encode(Exited(pid, os.waitstatus_to_exitcode(status))))
        except OSError:
            return


if __name__ == "__main__":
    main()
