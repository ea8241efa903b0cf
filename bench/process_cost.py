"""What a command costs in CPU: core-seconds of its whole process tree, and by kind of process.

    from process_cost import run_costed, class_hours

`run_costed(argv)` runs a command and returns its wall seconds and its core-seconds: user +
system CPU of every process it started, down to the last grandchild. Three counts:

- the kernel's: where this process may make a cgroup in cgroup v1's `cpuacct` hierarchy (as
  root), the command runs in one, and `cpuacct.usage` is the CPU every task in it ever used,
  however it ended and whoever reaped it. (The sandbox makes its cgroups in the `pids` and
  `memory` hierarchies only, so every descendant stays in this one.) `Cost.core_s` is this
  count where there is one.
- getrusage's: `RUSAGE_CHILDREN` before and after, which counts a process once it has been
  waited for, with every descendant it waited for. This process makes itself the tree's
  subreaper (`PR_SET_CHILD_SUBREAPER`), so that orphans are reparented here rather than to
  init, and waits for them too. Measured on `nbgrader autograde`, it still came out about a
  fifth below the kernel's count: some descendants' CPU never reaches it through a wait.
- a sampler's, reading every descendant's CPU from /proc as it runs, to say which processes
  it went to (`kind`). It misses what a process uses after its last sample and processes
  that live less than one period, so its sum is a little below the true total.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field

import psutil

PR_SET_CHILD_SUBREAPER = 36
CPUACCT = "/sys/fs/cgroup/cpuacct"  # cgroup v1's CPU accounting hierarchy
SAMPLE_S = 0.2  # the sampler's period
ORPHAN_WAIT_S = 10.0  # how long orphans left running get to end on their own


def class_hours(students: int, core_seconds: list[float], cores: int) -> float:
    """Wall hours to grade a class: S * sum(core-s) / C / 3600, for S students each handing in
    one submission of every assignment whose cost is in `core_seconds`, on C cores kept busy
    (submissions packed with no idle core: a lower bound)."""
    return students * sum(core_seconds) / cores / 3600


def become_subreaper() -> bool:
    """Make orphaned descendants of this process its children (Linux); False where not."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def children_cpu() -> float:
    """User + system CPU seconds of this process's children that were waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def kind(cmdline: list[str], parent_kind: str | None) -> str:
    """What a process of the grading tree is, from its command line and its parent's kind.
    A rank is forked from its fork server without exec, so it shows the server's command."""
    line = " ".join(cmdline)
    owner = (parent_kind or "").split(": ")[-1]
    if "course_lib._zygote" in line:
        if parent_kind and parent_kind.startswith(("fork server", "ranks")):
            return f"ranks: {owner}"
        return f"fork server: {owner}"
    if "ipykernel" in line:
        return "kernel"
    if "course_lib.grading.judge" in line:
        return "judge"
    if "nbgrader" in line:
        return "nbgrader"
    if "bwrap" in line:
        return f"bwrap: {owner}" if owner else "bwrap"
    return parent_kind or "other"


@dataclass
class Sampler:
    """CPU seconds of every descendant of `root` (by default this process), read from /proc
    every `period` seconds while it runs; `by_kind()` sums the last reading of each."""

    root: int = field(default_factory=os.getpid)
    period: float = SAMPLE_S
    seen: dict[int, tuple[str, float]] = field(default_factory=dict)  # pid -> (kind, cpu s)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.period)

    def sample(self) -> None:
        try:
            tree = psutil.Process(self.root).children(recursive=True)
        except psutil.Error:
            return
        for process in tree:
            try:
                with process.oneshot():
                    times = process.cpu_times()
                    pid, ppid = process.pid, process.ppid()
                    known = self.seen.get(pid)
                    name = known[0] if known else kind(process.cmdline(), self._kind_of(ppid))
            except psutil.Error:
                continue  # gone between the listing and the reading
            self.seen[pid] = (name, max(times.user + times.system, known[1] if known else 0.0))

    def _kind_of(self, pid: int) -> str | None:
        return self.seen[pid][0] if pid in self.seen else None

    def by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, cpu in self.seen.values():
            out[name] = out.get(name, 0.0) + cpu
        return dict(sorted(out.items(), key=lambda item: -item[1]))


class CpuAccount:
    """A cgroup of its own in cgroup v1's cpuacct hierarchy, if one can be made here: the
    kernel counts the CPU of every task that ever ran in it (`seconds`)."""

    def __init__(self) -> None:
        self.path: str | None = os.path.join(CPUACCT, f"course-bench-{uuid.uuid4().hex[:12]}")
        try:
            os.mkdir(self.path)
        except OSError:
            self.path = None

    def join(self) -> None:
        """Move the calling process (a child, before it execs) into the cgroup."""
        if self.path is not None:
            with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

    def seconds(self) -> float | None:
        if self.path is None:
            return None
        with open(os.path.join(self.path, "cpuacct.usage")) as f:
            return int(f.read()) / 1e9

    def close(self) -> None:
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.rmdir(self.path)  # empty once every task in it has been reaped


@dataclass
class Cost:
    """What one command took: wall seconds, core-seconds of its tree (getrusage's count, and
    the kernel's for its cgroup where there is one), the sampler's view."""

    wall_s: float
    rusage_s: float
    cgroup_s: float | None
    by_kind: dict[str, float]
    returncode: int
    stdout: str
    stderr: str
    orphans_left: int  # descendants still running after ORPHAN_WAIT_S (not counted)

    @property
    def core_s(self) -> float:
        """The kernel's count where there is one, else getrusage's."""
        return self.rusage_s if self.cgroup_s is None else self.cgroup_s


def reap_orphans(wait_s: float = ORPHAN_WAIT_S) -> int:
    """Wait for every child of this process (orphans adopted as subreaper) to end, for at most
    `wait_s` seconds; how many are left running."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return 0  # no children left
        if pid == 0:
            if time.monotonic() > deadline:
                return len(psutil.Process().children())
            time.sleep(0.05)


def run_costed(argv: list[str], **popen: object) -> Cost:
    """Run `argv` to its end and cost it (see the module's docstring). Call it with no other
    child process of this one running: those would be waited for and counted too."""
    become_subreaper()
    account = CpuAccount()
    before = children_cpu()
    start = time.perf_counter()
    try:
        with Sampler() as sampler:
            process = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                preexec_fn=account.join,
                **popen,
            )
            out, err = process.communicate()
            wall = time.perf_counter() - start
            left = reap_orphans()
        rusage_s, cgroup_s = children_cpu() - before, account.seconds()
    finally:
        account.close()
    return Cost(wall, rusage_s, cgroup_s, sampler.by_kind(), process.returncode, out, err, left)
