"""The sandbox autograding runs submissions in: what it hides, what it refuses, its limits.

Each test runs a small Python program inside `course_lib.grading.sandbox` and looks at what
it could do. The course folder's secrets are stood in for by files in a temporary folder.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from course_lib.grading import limits as guarding  # the module; `limits` are Limits below
from course_lib.grading import sandbox
from course_lib.grading.autograde import NO_SANDBOX, GradeInSandbox
from course_lib.grading.verdicts import GraderFailed
from tests.conftest import ROOT, require_sandbox

pytestmark = require_sandbox
LIMITS = sandbox.Limits(seconds=60)


def run_inside(
    code: str, limits: sandbox.Limits = LIMITS, folder: sandbox.SharedFolder | None = None
) -> tuple[int, str, str, str | None]:
    argv = [sys.executable, "-c", textwrap.dedent(code)]
    return sandbox.run(argv, input="", limits=limits, folder=folder)


@pytest.fixture(params=["cgroup", "pss"])
def measured(request, monkeypatch) -> str:
    """How the guard measures memory: a cgroup's count, where one can be made (as root), or
    the sum of the processes' PSS, which is what a user who cannot make one gets."""
    if request.param == "pss":
        monkeypatch.setattr(guarding, "_make_cgroups", lambda limits: [])
    else:
        guard = sandbox.Guard(LIMITS)
        guard.close()
        if not guard.cgroups:
            pytest.skip("this process may not make a cgroup: the guard measures PSS")
    return request.param


def test_a_sandboxed_process_sees_no_secret_and_writes_nowhere_but_its_tmp(tmp_path):
    secrets = {
        "solution": tmp_path / "solutions" / "a1" / "a1.ipynb",
        "gradebook": tmp_path / "gradebook.db",
        "other submission": tmp_path / "submitted" / "someone" / "a1" / "a1.ipynb",
    }
    for path in secrets.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("secret")
    paths = {name: str(p) for name, p in secrets.items()}
    paths["course folder's solutions"] = str(ROOT / "solutions")
    paths["course gradebook"] = str(ROOT / "gradebook.db")
    code, out, err, _ = run_inside(
        f"""
        import json, os, pathlib
        seen = {{name: os.path.exists(p) for name, p in {paths!r}.items()}}
        writes = {{}}
        for target in ({str(tmp_path / "planted")!r}, {str(ROOT / "course_lib" / "x.py")!r},
                       {sys.prefix!r} + "/x", "/tmp/scratch.txt"):
            try:
                pathlib.Path(target).write_text("x")
                writes[target] = "written"
            except OSError as e:
                writes[target] = type(e).__name__
        print(json.dumps({{"seen": seen, "writes": writes, "uid": os.getuid()}}))
        """
    )
    assert code == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert not any(report["seen"].values()), report["seen"]
    writes = report["writes"]
    assert writes.pop("/tmp/scratch.txt") == "written"
    assert all(result != "written" for result in writes.values()), writes
    assert not (tmp_path / "planted").exists() and not (ROOT / "course_lib" / "x.py").exists()
    assert report["uid"] != 0


def test_the_network_is_loopback_of_its_own(tmp_path):
    """Ranks meet on 127.0.0.1 inside; nothing listening outside can be reached."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    threading.Thread(target=lambda: server.accept(), daemon=True).start()
    code, out, err, _ = run_inside(
        f"""
        import socket
        inner = socket.create_server(("127.0.0.1", 0))
        socket.create_connection(inner.getsockname(), timeout=2).close()
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=2)
            print("outside reached")
        except OSError:
            print("outside unreachable")
        """
    )
    server.close()
    assert code == 0, err
    assert out.strip().endswith("outside unreachable")


def test_process_limit_stops_a_fork_bomb():
    limits = sandbox.Limits(processes=64, seconds=60)
    start = time.monotonic()
    code, out, err, killed = run_inside(
        """
        import os, time
        started = 0
        try:
            for _ in range(400):
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                started += 1
        except OSError:
            pass
        print("started", started, flush=True)
        """,
        limits,
    )
    assert time.monotonic() - start < 45
    started = [int(line.split()[1]) for line in out.splitlines() if line.startswith("started")]
    assert killed or (started and started[0] < 64), (code, out, err, killed)


def test_memory_limit_stops_a_runaway_allocation(measured):
    limits = sandbox.Limits(memory_bytes=512 << 20, seconds=60)
    code, out, err, killed = run_inside(
        """
        chunks = []
        for _ in range(64):
            chunks.append(bytearray(64 << 20))  # 4 GiB in all, touched
        print("allocated everything")
        """,
        limits,
    )
    assert "allocated everything" not in out
    assert code != 0 and killed and "memory" in killed, (code, killed)


# A process that writes 300 MiB, then forks children that keep it without writing to it: the
# pages stay shared (copy-on-write), yet each child's RSS counts all of them.
FORKS = """
    import os, time
    shared = b"x" * (300 << 20)
    children = []
    for _ in range(6):
        pid = os.fork()
        if pid == 0:
            rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            print("rss", rss, flush=True)
            time.sleep(3)  # while the guard looks
            os._exit(0)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)
    print("all", len(children), "children ended")
"""


def test_memory_shared_copy_on_write_by_forks_is_billed_once(measured):
    """Seven processes share 300 MiB: the guard bills 300 MiB, under the 1 GiB limit, not
    the 2.1 GiB their RSS add up to (which is what the memory guard once measured)."""
    limits = sandbox.Limits(memory_bytes=1 << 30, seconds=60)
    code, out, err, killed = run_inside(FORKS, limits)
    assert code == 0 and killed is None, (code, killed, err[-2000:])
    assert "all 6 children ended" in out
    rss = [int(line.split()[1]) for line in out.splitlines() if line.startswith("rss")]
    assert sum(rss) > limits.memory_bytes, "the children's RSS alone would pass the limit"


# Writes 8 MiB files in its folder, slowly enough for the guard to look, until a write fails.
WRITER = """
    import errno, time
    written = 0
    try:
        for i in range(40):
            with open(f"part{i}", "wb") as f:
                f.write(b"x" * (8 << 20))
            written += 8 << 20
            time.sleep(0.1)
        print("wrote everything")
    except OSError as error:
        print("write failed", errno.errorcode[error.errno], written >> 20, flush=True)
"""


@pytest.mark.parametrize("tmpfs", [True, False], ids=["tmpfs", "checked"])
def test_a_shared_folder_cannot_grow_past_its_size(tmpfs):
    """As root the folder is a tmpfs of the limit's size: the write past it fails (ENOSPC)
    and the process goes on. Where it cannot be, the guard stops the sandbox past it."""
    limits = sandbox.Limits(folder_bytes=64 << 20, seconds=60)
    with sandbox.SharedFolder(limits.folder_bytes, tmpfs=tmpfs) as folder:
        if tmpfs and not folder.mounted:
            pytest.skip("this process may not mount a tmpfs: the guard checks the folder")
        code, out, err, killed = run_inside(WRITER, limits, folder)
    assert "wrote everything" not in out, out
    if tmpfs:
        assert code == 0 and killed is None, (code, killed, err[-2000:])
        failed = next(line.split() for line in out.splitlines() if line.startswith("write"))
        assert failed[2] == "ENOSPC" and int(failed[3]) <= 64, failed
    else:
        assert code != 0 and killed and "folder" in killed, (code, killed)


def test_a_shared_folder_goes_when_closed():
    folder = sandbox.SharedFolder(1 << 20)
    (Path(folder.path) / "x").write_text("x")
    folder.close()
    assert not Path(folder.path).exists()
    assert folder.path not in Path("/proc/self/mounts").read_text()


def test_a_folder_left_mounted_by_a_killed_grader_goes_with_the_next():
    code = "from course_lib.grading import sandbox\n"
    code += "f = sandbox.SharedFolder(1 << 20)\nprint(f.path, f.mounted, flush=True)\n"
    code += "import time\ntime.sleep(120)\n"
    grader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    path, mounted = grader.stdout.readline().split()
    grader.kill()  # no time to unmount
    grader.wait()
    if mounted != "True":
        pytest.skip("this process may not mount a tmpfs: nothing is left mounted")
    assert path in Path("/proc/self/mounts").read_text()
    sandbox.SharedFolder(1 << 20).close()
    assert path not in Path("/proc/self/mounts").read_text() and not Path(path).exists()


def test_an_exit_code_says_how_a_sandboxed_process_ended():
    """bwrap exits with 128 + N when its command was killed by signal N."""
    assert sandbox.describe_exit(3) == "it exited with code 3"
    assert "SIGSEGV (a segmentation fault)" in sandbox.describe_exit(128 + 11)
    assert "SIGKILL" in sandbox.describe_exit(128 + 9) == sandbox.describe_exit(-9)


def test_time_limit_stops_a_process_that_never_ends():
    start = time.monotonic()
    code, out, err, killed = run_inside("import time\ntime.sleep(600)", sandbox.Limits(seconds=3))
    assert time.monotonic() - start < 40
    assert code != 0 and killed and "longer than" in killed


def test_grading_refuses_to_run_unsandboxed_unless_told(monkeypatch):
    monkeypatch.setattr(sandbox, "available", lambda: (False, "bwrap is not installed"))
    with pytest.raises(GraderFailed) as error:
        GradeInSandbox().preprocess(None, {})
    assert str(error.value) == NO_SANDBOX.format(why="bwrap is not installed")
    assert "SANDBOX=off" in str(error.value)
