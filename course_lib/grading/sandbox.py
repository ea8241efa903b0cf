"""Run a submission's code where it can do no harm: Linux namespaces via bubblewrap, plus limits.

Inside the sandbox a process sees the system read-only (`/usr`, `/etc`, Python, the course's
virtual environment and `course_lib`), a private `/tmp` of limited size and nothing else: not
the course folder (solutions, hidden tests, other students' submissions, the gradebook), not
the instructor's home. It has its own process and network namespaces (loopback only, so the
ranks' rendezvous stays inside) and no capabilities. Limits (`Limits`): processes, memory, file
size, scratch space and time, enforced by a cgroup where one can be made (as root, or with a
delegated cgroup v2 subtree), else by rlimits and a watchdog that kills the whole sandbox.

Memory is measured as the kernel accounts it, so that pages shared by several processes (a
fork's copy-on-write memory, torch's libraries) are billed once: the cgroup's own count where
there is a cgroup, else the sum of the processes' PSS (`/proc/PID/smaps_rollup`, which splits a
shared page among its users). A folder the sandbox shares with the grader (`SharedFolder`, a
kernel's working folder) has a total size limit: a tmpfs of that size where this process may
mount one (as root), so that a write past it fails with "No space left on device"; else the
watchdog checks its size and stops the sandbox past the limit. `Guard.reason` and
`describe_exit` say why a sandboxed process ended, as far as is known.

bubblewrap (`bwrap`) is a Debian/Ubuntu/Fedora package (`apt install bubblewrap`); it needs
unprivileged user namespaces, which current distributions enable. `available()` says whether
it works here and why not.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
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


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


_checked: tuple[bool, str] | None = None


def available() -> tuple[bool, str]:
    """(True, "") if a sandbox can be made here, else (False, why not)."""
    global _checked
    if _checked is None:
        bwrap = bwrap_path()
        if bwrap is None:
            _checked = (False, "bubblewrap (bwrap) is not installed: apt install bubblewrap")
        else:
            probe = subprocess.run(
                [bwrap, *_base_args(None), "--", "/bin/true"], capture_output=True, text=True
            )
            ok = probe.returncode == 0
            _checked = (ok, "" if ok else f"bwrap does not work here: {probe.stderr.strip()}")
    return _checked


SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc")


def _readable() -> list[str]:
    """bwrap arguments that show, read-only, what a sandboxed Python needs: the system, the
    interpreter, the venv and the course_lib package (which an editable install keeps in the
    course folder). Top-level links (/bin -> usr/bin on merged-/usr systems) stay links."""
    import course_lib

    args = []
    for path in SYSTEM:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.exists(path):
            args += ["--ro-bind", path, path]
    tree = [sys.base_prefix, sys.prefix, str(Path(course_lib.__file__).resolve().parent)]
    for path in dict.fromkeys(tree):
        for shown in dict.fromkeys((path, os.path.realpath(path))):
            if os.path.exists(shown) and not shown.startswith(SYSTEM):
                args += ["--ro-bind", shown, shown]
    return args


def _base_args(limits: Limits | None, network: bool = False) -> list[str]:
    args = ["--die-with-parent", "--new-session", "--unshare-all", "--cap-drop", "ALL"]
    if os.geteuid() == 0:
        # As root, a user namespace is what takes the capabilities away for good.
        args += ["--unshare-user", "--uid", "65534", "--gid", "65534"]
    if network:
        args.append("--share-net")
    # The scratch /tmp first: a venv or course that lives under /tmp is then shown on top of
    # it (mounted after it), not hidden beneath it.
    size = str((limits or Limits()).scratch_bytes)
    args += ["--size", size, "--tmpfs", "/tmp", "--dev", "/dev", "--proc", "/proc"]
    return args + _readable()


def command(
    argv: list[str],
    *,
    limits: Limits,
    shared: list[str] = (),
    chdir: str = "/tmp",
    env: dict[str, str] | None = None,
) -> list[str]:
    """`argv` wrapped in bwrap. `shared` directories are visible read-write at the same path
    (a kernel's connection files, say); `env` is the whole environment inside."""
    args = [bwrap_path(), *_base_args(limits)]
    for path in shared:
        args += ["--bind", path, path]
    args += ["--chdir", chdir, "--clearenv"]
    for key, value in (env or {}).items():
        args += ["--setenv", key, value]
    return [*args, "--", *argv]


def environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A small environment for sandboxed Python: no secrets from the instructor's shell."""
    env = {
        "PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin",
        "HOME": "/tmp/home",
        "MPLCONFIGDIR": "/tmp/matplotlib",
        "IPYTHONDIR": "/tmp/ipython",
        "JUPYTER_CONFIG_DIR": "/tmp/jupyter",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONDONTWRITEBYTECODE": "1",
        "LANG": "C.UTF-8",
        # c10d warns on every rank that a sandbox's loopback has no host name: harmless.
        "TORCH_CPP_LOG_LEVEL": "ERROR",
    }
    if os.environ.get(PROFILE_ENV):
        env[PROFILE_ENV] = "1"  # the judge inside says when each phase ends (`phase`)
    return {**env, **(extra or {})}


# --- profiling ------------------------------------------------------------------------------

# With COURSE_GRADE_PROFILE=1, the grader and the judge write a line to stderr as each phase of
# grading a submission ends (bench/autograde_cost.py reads them to say where the time goes).
# The sandbox passes the variable in, and `run` echoes the judge's lines, which it would
# otherwise keep to itself, to the grader's stderr. Wall-clock times: comparable across
# processes, since the sandbox shares the host's clock.
PROFILE_ENV = "COURSE_GRADE_PROFILE"
PROFILE_PREFIX = "course-grade-profile"


def phase(what: str, at: float | None = None) -> None:
    """When profiling, say on stderr that `what` happened at `at` (default: now)."""
    if os.environ.get(PROFILE_ENV):
        when = time.time() if at is None else at
        print(f"{PROFILE_PREFIX} {when:.3f} {os.getpid()} {what}", file=sys.stderr, flush=True)


def _echo_profile(err: str) -> None:
    """Pass a sandboxed process's profiling lines on to this process's stderr."""
    if os.environ.get(PROFILE_ENV):
        for line in err.splitlines():
            if line.startswith(PROFILE_PREFIX):
                print(line, file=sys.stderr, flush=True)


# --- limits ---------------------------------------------------------------------------------


class Guard:
    """Enforces `Limits` on a sandboxed process and everything it starts: a cgroup if one can
    be made, else rlimits (set in the child before it execs) and a watchdog thread. `folders`
    are shared folders whose size the watchdog checks (those that are not a tmpfs of their
    own: see `SharedFolder`)."""

    def __init__(self, limits: Limits, folders: Sequence[SharedFolder] = ()) -> None:
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


# --- a folder shared with the grader ---------------------------------------------------------

MS_NOSUID, MS_NODEV, MNT_DETACH = 2, 4, 2
FOLDER_PREFIX = "course_lib-grade-"  # then the grader's pid


class SharedFolder:
    """A new folder that a sandbox may write to and the grader reads (a kernel's connection
    files and working folder), of at most `size` bytes in all. Where this process may mount
    (as root), it is a tmpfs of that size: a write past it fails with ENOSPC. Elsewhere it is
    a plain folder, and `Guard` stops the sandbox once its files pass the size (`tmpfs=False`
    makes one anyway, as a user who may not mount gets). `close` removes it; a grader killed
    before it could leaves its tmpfs mounted, and the next one to make a folder removes it."""

    def __init__(self, size: int, tmpfs: bool = True) -> None:
        _sweep()
        self.path = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-")
        self.size = size
        self.mounted = tmpfs and _mount_tmpfs(self.path, size)

    def close(self) -> None:
        if self.mounted:
            ctypes.CDLL(None, use_errno=True).umount2(self.path.encode(), MNT_DETACH)
            self.mounted = False
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> SharedFolder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _sweep() -> None:
    """Unmount and remove the tmpfs folders of graders that were killed before they could
    (their folder names hold their pids)."""
    with contextlib.suppress(OSError):
        mounts = Path("/proc/self/mounts").read_text().splitlines()
        prefix = os.path.join(tempfile.gettempdir(), FOLDER_PREFIX)
        for line in mounts:
            source, path, kind = line.split()[:3]
            pid = path[len(prefix) :].split("-")[0]
            if source == "course_lib" and kind == "tmpfs" and path.startswith(prefix):
                if pid.isdigit() and not psutil.pid_exists(int(pid)):
                    ctypes.CDLL(None, use_errno=True).umount2(path.encode(), MNT_DETACH)
                    shutil.rmtree(path, ignore_errors=True)


def _mount_tmpfs(path: str, size: int) -> bool:
    options = f"size={size},mode=0700".encode()
    libc = ctypes.CDLL(None, use_errno=True)
    flags = MS_NOSUID | MS_NODEV
    return libc.mount(b"course_lib", path.encode(), b"tmpfs", flags, options) == 0


def run(
    argv: list[str],
    *,
    input: str,
    limits: Limits,
    env: dict[str, str] | None = None,
    folder: SharedFolder | None = None,
) -> tuple[int, str, str, str | None]:
    """Run `argv` in a sandbox with `input` on stdin, in `folder` if given (else in its /tmp);
    (exit code, stdout, stderr, why a limit stopped it or None: `Guard.reason`)."""
    guard = Guard(limits, [folder] if folder else [])
    shared, chdir = ([folder.path], folder.path) if folder else ([], "/tmp")
    phase("sandbox-start")
    try:
        process = subprocess.Popen(
            command(argv, limits=limits, env=environment(env), shared=shared, chdir=chdir),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=guard.preexec,
        )
        guard.watch(process.pid)
        try:
            out, err = process.communicate(input, timeout=limits.seconds + 30)
        except subprocess.TimeoutExpired:
            guard.kill(f"ran longer than {limits.seconds:g} s")
            out, err = process.communicate()
        _echo_profile(err)
        return process.returncode, out, err, guard.reason()
    finally:
        guard.close()
