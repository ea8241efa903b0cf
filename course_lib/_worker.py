"""One launched rank: joins the process group, then runs the calls the launcher sends it.

A worker is started by the fork server (`_zygote.py`) or, as a fallback, as
`python -m course_lib._worker SPEC FD`. It talks to the launcher over one connection (calls
in, replies out: `protocol` has the messages). Its stdout and stderr are pipes that the
launcher reads and prints with a rank prefix; after each call the worker writes an end mark
on both, so the launcher knows it has shown every line of that call before it returns.

Between calls a warm worker puts back what a call may have changed (random states, default
dtype, global module hooks, imported user modules, environment, child processes), so a call
never sees what an earlier one left behind.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import io
import json
import linecache
import multiprocessing
import os
import pickle
import random
import signal
import sys
import sysconfig
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection

import cloudpickle
import numpy as np
import psutil
import torch
import torch.distributed as dist

from course_lib import _integrity, counted_group, runtime
from course_lib.protocol import Call, Progress, Raised, Ready, Result, Tally, decode, encode

END_MARK = b"\x00course_lib:end:"
PARENT_POLL_S = 0.2
# Rewrites of a call's (args, kwargs) once unpickled, before the call, in order: the layers
# above add theirs (course_lib.grading.answers, when imported, turns a student's answer
# shipped as source into what its cells define). The launcher itself knows none of them. A
# tuple, rebound to add one: on an untrusted rank, a rebinding after the ranks' preload is
# tampering (`_integrity`), as a change to a list would not be.
ARGUMENT_HOOKS: tuple[Callable[[tuple, dict], tuple[tuple, dict]], ...] = ()
_real_freeze = gc.freeze
_frozen_by_a_call = False


def _freeze() -> None:
    """gc.freeze on a worker: freezes, and remembers that a call did."""
    global _frozen_by_a_call
    _frozen_by_a_call = True
    _real_freeze()


# The fork server froze (gc.freeze) what it imported before forking this worker, so that
# collections skip it, which keeps the memory scans of the ZeRO checks fast; code run on a
# worker that freezes more (to hide a tensor from such a scan) is noticed, and the scans
# unfreeze everything first. The sentinel, made when the worker starts, before any call: the
# collector tracks it until something freezes (gc.freeze takes every tracked object), so it
# is missing from gc.get_objects() exactly when code froze objects, by whatever way it
# reached the real gc.freeze. (gc.get_freeze_count() says the same by walking the 290,000
# frozen objects: 27 ms, asked at every gradient of a ZeRO-2 check, was 40% of its ranks' CPU;
# gc.get_objects() walks only what the worker made.) Rebinding it is tampering (`_integrity`).
FREEZE_SENTINEL: list = []


def frozen_by_a_call() -> bool:
    """Has code run on this worker frozen objects (beyond what the fork server froze)?"""
    return _frozen_by_a_call or not any(o is FREEZE_SENTINEL for o in gc.get_objects())


_stack_file = None  # kept open for faulthandler for the life of the worker
_SIGNAL_HANDLERS = {s: signal.getsignal(s) for s in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM)}
_streams: tuple = ()  # this worker's own stdout and stderr, put back after every call


def end_mark(call_id: int) -> bytes:
    """The bytes a worker writes to stdout and stderr when call `call_id` is over."""
    return END_MARK + str(call_id).encode() + b"\x00\n"


_conn: Connection | None = None  # to the launcher, while a call runs (for report_progress)
_call_id = -1
_send_lock = threading.Lock()  # a call's own threads may report progress too


def _send(conn: Connection, message: Result | Raised | Ready | Progress | Tally) -> None:
    with _send_lock:
        conn.send_bytes(encode(message))


def report_progress(desc: str, done: int, total: int | None, finished: bool = False) -> None:
    """Tell the launcher how far a loop of the running call has got (`course_lib.progress`)."""
    if _conn is not None:
        _send(_conn, Progress(_call_id, str(desc), int(done), total, finished))


def _report_tally(entry: tuple) -> None:
    """What the counted process group of an untrusted rank reports, sent as it happens: the
    launcher keeps it (`WorkerPool.tallies`), where the code being graded cannot change it."""
    if _conn is not None:
        _send(_conn, Tally(_call_id, entry))


def serve(spec: dict, conn: Connection) -> None:
    """Set this process up as rank `spec['rank']` and answer calls until the launcher leaves."""
    global _conn, _call_id
    _become_worker(spec)
    _join_process_group(spec)
    baseline = _Baseline()
    # Untrusted code (a submission being graded) may run here: take the fingerprint of the
    # libraries before any of it has run, and check it after every call.
    fingerprint = _integrity.Fingerprint() if spec.get("untrusted") else None
    _send(conn, Ready(os.getpid(), threading.main_thread().ident))
    while True:
        try:
            call = decode(conn.recv_bytes())
        except EOFError:
            return  # the launcher closed the pool
        _conn, _call_id = conn, call.id
        reply = _run_call(call, spec)
        _conn = None
        _end_call(call.id)
        changed = fingerprint.changes() if fingerprint is not None else []
        if changed:
            reply = _tampering_reply(call.id, changed)
        _send(conn, reply)
        if changed:
            os._exit(3)  # a process whose libraries were changed is not used again
        baseline.restore()


# --- set-up -------------------------------------------------------------------------------


def _become_worker(spec: dict) -> None:
    global _stack_file, _streams, FREEZE_SENTINEL
    os.environ.update(spec["env"])
    # Line-buffered text streams on the pipes, so prints reach the notebook as they happen.
    _streams = (_line_stream(1), _line_stream(2))
    sys.stdout, sys.stderr = _streams
    # The launcher sends SIGUSR1 to a rank that hangs, to show the student where it blocks.
    _stack_file = open(spec["stack_file"], "w")  # noqa: SIM115 (lives as long as the process)
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)
    threading.Thread(target=_die_with_parent, args=(os.getppid(),), daemon=True).start()
    torch.set_num_threads(1)
    gc.freeze = _freeze
    FREEZE_SENTINEL = []  # this worker's own: the fork server froze the one it imported


def _line_stream(fd: int) -> io.TextIOWrapper:
    raw = open(fd, "wb", buffering=0, closefd=False)  # noqa: SIM115
    return io.TextIOWrapper(
        raw, encoding="utf-8", errors="backslashreplace", line_buffering=True, write_through=True
    )


def _die_with_parent(parent_pid: int) -> None:
    """Kill this worker and everything it started as soon as its parent is gone.

    The worker leads its own process group, so one killpg also takes down DataLoader
    workers and other children, even after a SIGKILL of the notebook kernel.
    """
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os.killpg(0, signal.SIGKILL)


def _join_process_group(spec: dict) -> None:
    # What the pool asks for (for grading ranks, everything the checks use) is imported before
    # any call, hence before any student code can run.
    for name in spec.get("preload", ()):
        importlib.import_module(name)
    if spec.get("untrusted"):
        # The default group is one that reports every call, whatever route the call took.
        counted_group.register()
        counted_group.set_reporter(_report_tally)
    store = dist.TCPStore(
        spec["store_host"], spec["store_port"], is_master=False, timeout=timedelta(seconds=120)
    )
    timeout = timedelta(seconds=spec["pg_timeout_s"])
    rank, world_size = spec["rank"], spec["world_size"]
    if spec["backend"] == "nccl":
        # One GPU per rank; CPU tensors still work through gloo.
        torch.cuda.set_device(rank)
        dist.init_process_group(
            "cpu:gloo,cuda:nccl",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=torch.device("cuda", rank),
        )
    else:
        backend = counted_group.BACKEND if spec.get("untrusted") else "gloo"
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )


# --- one call -----------------------------------------------------------------------------


def _run_call(call: Call, spec: dict) -> Result | Raised:
    _apply_context(call, spec)
    try:
        fn, args, kwargs = cloudpickle.loads(call.payload)
        for rewrite in ARGUMENT_HOOKS:
            args, kwargs = rewrite(args, kwargs)
        value = fn(*args, **kwargs)
        # CUDA work (NCCL collectives included) runs after the Python call returns: wait for
        # it here, so that a call whose collective cannot complete hangs (and is reported)
        # as itself, not as whichever call comes next.
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
    except BaseException as exc:  # noqa: BLE001 (SystemExit from student code is an error too)
        return _raised(call.id, exc)
    try:
        data = _dumps_safe(value) if spec.get("untrusted") else _dumps_result(value)
    except Exception as exc:  # noqa: BLE001
        return _raised(call.id, exc, "the function's return value cannot be sent back")
    return Result(call.id, data, broken=not dist.is_initialized())


def _apply_context(call: Call, spec: dict) -> None:
    """Run the call where the launcher is: its environment, working directory and sys.path."""
    os.environ.clear()
    os.environ.update(call.env)
    os.environ.update(spec["env"])
    os.chdir(call.cwd)
    sys.path[:] = call.sys_path
    # Source of notebook cells, so that tracebacks on this rank can quote their lines.
    linecache.cache.update(call.linecache)


def _raised(call_id: int, exc: BaseException, note: str | None = None) -> Raised:
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next  # hide this module's frames: the student's code comes first
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    message = str(exc) if note is None else f"{note}: {exc}"
    return Raised(call_id, type(exc).__name__, message, text, _plain_attributes(exc))


def _plain_attributes(exc: BaseException) -> dict:
    """The exception's public attributes that are numbers, strings or lists of them: what the
    launcher's `RankError.attributes` can carry (the launcher reads plain data only)."""

    def plain(value: object, depth: int = 0) -> bool:
        if type(value) in (list, tuple):
            return depth < 4 and len(value) <= 1000 and all(plain(v, depth + 1) for v in value)
        return value is None or type(value) in (bool, int, float, str)

    try:  # whatever the exception's class does, the error is still reported
        found = dict(vars(exc))
        return {k: v for k, v in found.items() if isinstance(k, str) and k[:1] != "_" and plain(v)}
    except Exception:  # noqa: BLE001
        return {}


class _ResultPickler(cloudpickle.Pickler):
    """Pickles a rank's return value, moving GPU tensors to the CPU on the way."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
            return obj.detach().cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return super().reducer_override(obj)


def _dumps_result(value: object) -> bytes:
    buffer = io.BytesIO()
    _ResultPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def _dumps_safe(value: object) -> bytes:
    """The return value in torch.save's format, which the launcher reads back with
    `torch.load(weights_only=True)`: tensors, numbers, strings and containers only, so a
    rank running untrusted code cannot make the launcher run code of its choosing."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _tampering_reply(call_id: int, changed: list[str]) -> Raised:
    shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
    message = (
        f"code run on this rank changed {shown}. The checks measure with these, so changing "
        "them is tampering with the grading: this part scores 0."
    )
    return Raised(call_id, "TamperingDetected", message, message + "\n")


def _end_call(call_id: int) -> None:
    """Stop what the call started, then mark the end of its output on both streams."""
    # A DataLoader installs a SIGCHLD handler that raises when its workers die: put the
    # signal handlers back first, then kill whatever the call started.
    for signum, handler in _SIGNAL_HANDLERS.items():
        signal.signal(signum, handler)
    _kill_children()
    runtime.run_call_end_callbacks()
    for stream in (sys.stdout, sys.stderr, *_streams):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass  # the call may have replaced or closed them
    sys.stdout, sys.stderr = _streams
    mark = end_mark(call_id)
    os.write(1, mark)
    os.write(2, mark)


def _kill_children() -> None:
    """No process a call started (DataLoader workers, say) outlives the call."""
    children = _child_pids()
    if not children:
        return
    victims = []
    for pid in children:
        try:
            process = psutil.Process(pid)
            victims += [process, *process.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for process in victims:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=2)


def _child_pids() -> list[int]:
    try:  # Linux: one small file per thread, much cheaper than scanning every process
        pids = []
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                pids += [int(pid) for pid in f.read().split()]
        return pids
    except OSError:
        return [p.pid for p in psutil.Process().children()]


# --- putting the process back as it was ---------------------------------------------------

_LIBRARY_DIRS = tuple(
    {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    | {os.path.dirname(os.path.abspath(runtime.__file__))}
)


def _process_groups() -> list:
    """Every process group this process belongs to, the default one included."""
    return list(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else []


class _Baseline:
    """What a fresh worker looks like, taken once and restored after every call."""

    def __init__(self) -> None:
        self.modules = set(sys.modules)
        self.torch_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.python_rng = random.getstate()
        self.numpy_rng = np.random.get_state()
        self.warning_filters = list(warnings.filters)
        self.num_threads = torch.get_num_threads()
        self.groups = set(_process_groups())

    def restore(self) -> None:
        # Groups a call made (dist.new_group) would pile up call after call in a warm worker,
        # each holding connections and threads (under NCCL, a communicator and GPU memory).
        for group in _process_groups():
            if group not in self.groups:
                dist.destroy_process_group(group)
        torch.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.python_rng)
        np.random.set_state(self.numpy_rng)
        torch.set_default_dtype(torch.float32)
        torch.set_default_device(None)
        torch.set_grad_enabled(True)
        torch.autograd.set_detect_anomaly(False)
        if torch.are_deterministic_algorithms_enabled():  # switching it costs 1.5 s
            torch.use_deterministic_algorithms(False)
        torch.set_num_threads(self.num_threads)
        gc.enable()
        _clear_global_module_hooks()
        # Processes the call started were killed; multiprocessing must forget them too, or
        # active_children() in the next call would report them.
        multiprocessing.process._children.clear()
        warnings.filters[:] = self.warning_filters
        self._forget_user_modules()

    def _forget_user_modules(self) -> None:
        """Drop modules the call imported from outside the libraries (a student's .py file),
        so the next call imports them afresh, with fresh globals and any edits."""
        for name in set(sys.modules) - self.modules:
            path = getattr(sys.modules[name], "__file__", None)
            if path and not os.path.abspath(path).startswith(_LIBRARY_DIRS):
                del sys.modules[name]


def _clear_global_module_hooks() -> None:
    module = torch.nn.modules.module
    for name in dir(module):
        value = getattr(module, name)
        if name.startswith("_global_") and "hooks" in name and isinstance(value, dict):
            value.clear()


def main() -> None:
    """Entry point of the fallback start method: `python -m course_lib._worker SPEC FD`."""
    from course_lib import _worker  # not __main__'s copy: progress reports go through it

    _worker.serve(json.loads(sys.argv[1]), Connection(int(sys.argv[2])))


if __name__ == "__main__":
    main()
