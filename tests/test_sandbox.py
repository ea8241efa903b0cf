"""The sandbox autograding runs submissions in: what it hides, what it refuses, its limits.

Each test runs a small Python program inside `course_lib.grading.sandbox` and looks at what
it could do. The course folder's secrets are stood in for by files in a temporary folder.
"""

from __future__ import annotations

import json
import socket
import sys
import textwrap
import threading
import time

import pytest

from course_lib.grading import sandbox
from course_lib.grading.autograde import NO_SANDBOX, GradeInSandbox
from tests.conftest import ROOT, require_sandbox

pytestmark = require_sandbox
LIMITS = sandbox.Limits(seconds=60)


def run_inside(code: str, limits: sandbox.Limits = LIMITS) -> tuple[int, str, str, str | None]:
    return sandbox.run([sys.executable, "-c", textwrap.dedent(code)], input="", limits=limits)


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


def test_memory_limit_stops_a_runaway_allocation():
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
    assert code != 0


def test_time_limit_stops_a_process_that_never_ends():
    start = time.monotonic()
    code, out, err, killed = run_inside("import time\ntime.sleep(600)", sandbox.Limits(seconds=3))
    assert time.monotonic() - start < 40
    assert code != 0 and killed and "longer than" in killed


def test_grading_refuses_to_run_unsandboxed_unless_told(monkeypatch):
    monkeypatch.setattr(sandbox, "available", lambda: (False, "bwrap is not installed"))
    with pytest.raises(RuntimeError) as error:
        GradeInSandbox().preprocess(None, {})
    assert str(error.value) == NO_SANDBOX.format(why="bwrap is not installed")
    assert "SANDBOX=off" in str(error.value)
