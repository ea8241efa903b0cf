"""What a sandboxed run may use (`Limits`) and how it is held to it (`Guard`): a cgroup where
one can be made (as root, or with a delegated cgroup v2 subtree), else rlimits set in the child
and a watchdog that kills the whole sandbox; memory as the kernel accounts it (the cgroup's
count, else the processes' PSS, so that shared pages are billed once). `describe_exit` says why
a sandboxed process ended, as far as its exit code tells. `sandbox.py` runs the sandbox.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

GIB = 1 << 30


@dataclass(frozen=True)
class Limits:
    """What one sandboxed run may use."""

    memory_bytes: int = 8 * GIB  # every process inside together, shared pages billed once
    processes: int = 512  # tasks: threads count too
    file_bytes: int = 1 * GIB  # largest file it may write
    scratch_bytes: int = 1 * GIB  # its /tmp
    folder_bytes: int = 1 * GIB  # a folder it shares with the grader: all its files together
    seconds: float = 1800.0


class Guard:
    """Enforces `Limits` on a sandboxed process and everything it starts: a cgroup if one can
    be made, else rlimits (set in the child before it execs) and a watchdog thread. `folders`
    are shared folders whose size the watchdog checks (those that are not a tmpfs of their
    own: see `SharedFolder`)."""

    def __init__(self, limits: Limits, folders: Sequence = ()) -> None:  # sandbox.SharedFolder
        self.limits = limits
        self.cgroups = _make_cgroups(limits)
        self.folders = [f.path for f in folders if not f.mounted]
        self._usage = _cgroup_file(self.cgroups, "memory.current", "memory.usage_in_bytes")
        # RLIMIT_NPROC counts all of this user's tasks; root is exempt (the cgroup covers it).
        uid = os.getuid()
        mine = sum(1 for p in psutil.process_iter(["uids"]) if p.info["uids"].real == uid)
        self.nproc = None if os.geteuid() == 0 else mine + limits.processes
        self.killed_because: str | None = None
        self._process: psutil.Process | None = None
        self._stop = threading.Event()
        self._pss = (0, 0.0)  # the last PSS measured, and when the next may be

    def preexec(self) -> None:
        """In the child, before exec: join the cgroups and set the rlimits."""
        for group in self.cgroups:
            with open(os.path.join(group, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        limit = self.limits.file_bytes
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        if os.geteuid() != 0:  # root is exempt from RLIMIT_NPROC: the cgroup covers it
            mine = sum(
                1 for p in psutil.process_iter(["uids"]) if p.info["uids"].real == os.getuid()
            )
            nproc = mine + self.limits.processes
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))

    def watch(self, pid: int) -> None:
        """Start the watchdog on process `pid` (the bwrap process)."""
        self._process = psutil.Process(pid)
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        deadline = time.monotonic() + self.limits.seconds
        next_size = time.monotonic()
        while not self._stop.wait(0.2):
            try:
                tree = [self._process, *self._process.children(recursive=True)]
                memory = self.memory(tree)
            except psutil.NoSuchProcess:
                return
            if memory > self.limits.memory_bytes:
                self.kill(f"used {memory / GIB:.1f} GiB of memory (limit {self._gib()})")
            elif len(tree) > self.limits.processes + 2:
                self.kill(f"started {len(tree)} processes (limit {self.limits.processes})")
            elif time.monotonic() > deadline:
                self.kill(f"ran longer than {self.limits.seconds:g} s")
            elif self.folders and time.monotonic() > next_size:
                next_size = time.monotonic() + 1.0
                size = sum(_folder_size(folder) for folder in self.folders)
                if size > self.limits.folder_bytes:
                    limit = self.limits.folder_bytes / GIB
                    self.kill(f"wrote {size / GIB:.1f} GiB to its folder (limit {limit:g} GiB)")

    def memory(self, tree: list[psutil.Process]) -> int:
        """Bytes of memory the processes `tree` use, as the kernel accounts them: the cgroup's
        count if there is one, else their PSS summed (a page that n processes share counts
        1/n in each). PSS is dear to measure (the kernel walks every page table: ~30 ms for a
        process that imported torch), and never more than RSS: it is measured only when the
        RSS sum is past the limit, and then at most every ten times what measuring it took."""
        if self._usage is not None:
            with contextlib.suppress(OSError, ValueError):
                return int(Path(self._usage).read_text())
        rss = sum(_rss(p) for p in tree)
        if rss <= self.limits.memory_bytes:
            return rss
        pss, next_at = self._pss
        if time.monotonic() >= next_at:
            start = time.monotonic()
            pss = sum(_pss(p) for p in tree)
            self._pss = (pss, time.monotonic() + 10 * (time.monotonic() - start))
        return pss

    def _gib(self) -> str:
        return f"{self.limits.memory_bytes / GIB:g} GiB"

    def kill(self, why: str) -> None:
        self.killed_because = self.killed_because or why
        with contextlib.suppress(psutil.NoSuchProcess):
            if self._process is not None:
                for p in [*self._process.children(recursive=True), self._process]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        p.kill()

    def reason(self) -> str | None:
        """Why the sandbox was stopped, if a limit stopped it: the watchdog's reason, or the
        kernel's out-of-memory killer in the cgroup. Call it before `close`."""
        if self.killed_because:
            return self.killed_because
        events = _cgroup_file(self.cgroups, "memory.events", "memory.oom_control")
        with contextlib.suppress(OSError, TypeError, ValueError):
            for line in Path(events).read_text().splitlines():
                name, _, count = line.partition(" ")
                if name == "oom_kill" and int(count) > 0:
                    return f"ran out of memory (limit {self._gib()})"
        return None

    def close(self) -> None:
        self._stop.set()
        for group in self.cgroups:
            with contextlib.suppress(OSError):
                for pid in Path(group, "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), 9)
            for _ in range(50):
                try:
                    os.rmdir(group)
                    break
                except OSError:
                    time.sleep(0.05)


def describe_exit(code: int | None) -> str:
    """What a sandboxed process's exit code says (bwrap exits with 128 + N when its command
    was killed by signal N; Popen gives -N for a process it started itself)."""
    if code is None:
        return "it did not end"
    number = -code if code < 0 else code - 128 if code > 128 else 0
    if number:
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        what = {
            "SIGSEGV": "a segmentation fault",
            "SIGBUS": "a bus error",
            "SIGABRT": "an abort",
            "SIGKILL": "killed: out of memory, or a kill from outside",
        }.get(name)
        return f"it was stopped by {name}" + (f" ({what})" if what else "")
    return f"it exited with code {code}"


def _rss(process: psutil.Process) -> int:
    try:
        return process.memory_info().rss
    except psutil.NoSuchProcess:
        return 0


def _pss(process: psutil.Process) -> int:
    """The process's proportional set size; its RSS if the kernel will not say (a process
    that made itself undumpable, seen by another user)."""
    try:
        with open(f"/proc/{process.pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return _rss(process)


def _folder_size(folder: str) -> int:
    """Bytes of the files under `folder` (what they take on disk: sparse files count what
    they hold)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def _cgroup_file(groups: list[str], v2: str, v1: str) -> str | None:
    """The path of a memory controller file in the cgroups made (v2's name or v1's)."""
    for group in groups:
        for name in (v2, v1):
            if os.path.exists(os.path.join(group, name)):
                return os.path.join(group, name)
    return None


def _make_cgroups(limits: Limits) -> list[str]:
    """Cgroups limiting processes and memory, if this process may make them; else []."""
    name = f"course_lib-{uuid.uuid4().hex[:12]}"
    root = Path("/sys/fs/cgroup")
    made: list[str] = []
    try:
        if (root / "cgroup.controllers").exists():  # cgroup v2
            group = root / name
            group.mkdir()
            made.append(str(group))
            (group / "pids.max").write_text(str(limits.processes))
            (group / "memory.max").write_text(str(limits.memory_bytes))
        else:  # cgroup v1: one hierarchy per controller
            for controller, file, value in (
                ("pids", "pids.max", limits.processes),
                ("memory", "memory.limit_in_bytes", limits.memory_bytes),
            ):
                group = root / controller / name
                group.mkdir()
                made.append(str(group))
                (group / file).write_text(str(value))
    except OSError:
        for group in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(group)
        return []
    return made
