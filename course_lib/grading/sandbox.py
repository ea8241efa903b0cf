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
`describe_exit` say why a sandboxed process ended, as far as is known (`Limits`, `Guard` and
`describe_exit` are in limits.py).

bubblewrap (`bwrap`) is a Debian/Ubuntu/Fedora package (`apt install bubblewrap`); it needs
unprivileged user namespaces, which current distributions enable. `available()` says whether
it works here and why not.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from course_lib.grading.limits import GIB, Guard, Limits, describe_exit  # noqa: F401 (sandbox.X)


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
