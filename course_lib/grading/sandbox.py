"""Run a submission's code where it can do no harm: Linux namespaces via bubblewrap, plus limits.

Inside the sandbox a process sees the system read-only (`/usr`, `/etc`, Python, the course's
virtual environment and `course_lib`), a private `/tmp` of limited size and nothing else: not
the course folder (solutions, hidden tests, other students' submissions, the gradebook), not
the instructor's home. It has its own process and network namespaces (loopback only, so the
ranks' rendezvous stays inside) and no capabilities. Limits: processes, memory, file size,
scratch space and time, enforced by a cgroup where one can be made (as root, or with a
delegated cgroup v2 subtree), else by rlimits and a watchdog that kills the whole sandbox.

bubblewrap (`bwrap`) is a Debian/Ubuntu/Fedora package (`apt install bubblewrap`); it needs
unprivileged user namespaces, which current distributions enable. `available()` says whether
it works here and why not.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

GIB = 1 << 30


@dataclass(frozen=True)
class Limits:
    """What one sandboxed run may use."""

    memory_bytes: int = 8 * GIB  # resident memory of every process inside, together
    processes: int = 512  # tasks: threads count too
    file_bytes: int = 1 * GIB  # largest file it may write
    scratch_bytes: int = 1 * GIB  # its /tmp
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
    return {**env, **(extra or {})}


# --- limits ---------------------------------------------------------------------------------


class Guard:
    """Enforces `Limits` on a sandboxed process and everything it starts: a cgroup if one can
    be made, else rlimits (set in the child before it execs) and a watchdog thread."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.cgroups = _make_cgroups(limits)
        # RLIMIT_NPROC counts all of this user's tasks; root is exempt (the cgroup covers it).
        uid = os.getuid()
        mine = sum(1 for p in psutil.process_iter(["uids"]) if p.info["uids"].real == uid)
        self.nproc = None if os.geteuid() == 0 else mine + limits.processes
        self.killed_because: str | None = None
        self._process: psutil.Process | None = None
        self._stop = threading.Event()

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
        while not self._stop.wait(0.2):
            try:
                tree = [self._process, *self._process.children(recursive=True)]
                rss = sum(_rss(p) for p in tree)
            except psutil.NoSuchProcess:
                return
            if rss > self.limits.memory_bytes:
                self.kill(f"used {rss / GIB:.1f} GiB of memory (limit {self._gib()})")
            elif len(tree) > self.limits.processes + 2:
                self.kill(f"started {len(tree)} processes (limit {self.limits.processes})")
            elif time.monotonic() > deadline:
                self.kill(f"ran longer than {self.limits.seconds:g} s")

    def _gib(self) -> str:
        return f"{self.limits.memory_bytes / GIB:g} GiB"

    def kill(self, why: str) -> None:
        self.killed_because = self.killed_because or why
        with contextlib.suppress(psutil.NoSuchProcess):
            if self._process is not None:
                for p in [*self._process.children(recursive=True), self._process]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        p.kill()

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


def _rss(process: psutil.Process) -> int:
    try:
        return process.memory_info().rss
    except psutil.NoSuchProcess:
        return 0


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


def run(
    argv: list[str], *, input: str, limits: Limits, env: dict[str, str] | None = None
) -> tuple[int, str, str, str | None]:
    """Run `argv` in a sandbox with `input` on stdin; (exit code, stdout, stderr, why the
    guard killed it or None)."""
    guard = Guard(limits)
    try:
        process = subprocess.Popen(
            command(argv, limits=limits, env=environment(env)),
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
        return process.returncode, out, err, guard.killed_because
    finally:
        guard.close()
