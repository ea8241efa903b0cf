"""`make lab` serves JupyterLab with the course kernel; the install is idempotent."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request

from tests.conftest import ROOT, wait_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_make_lab_serves_jupyterlab_with_the_course_kernel():
    port, token = free_port(), "course-test-token"
    args = f"--no-browser --port={port} --ServerApp.ip=127.0.0.1 --IdentityProvider.token={token}"
    lab = subprocess.Popen(
        ["make", "lab", f"LAB_ARGS={args}"],
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"

    def get(path: str) -> bytes:
        with urllib.request.urlopen(f"{base}{path}?token={token}", timeout=5) as response:
            return response.read()

    def serving() -> bool:
        try:
            return bool(get("/api/status"))
        except OSError:
            return False

    try:
        assert wait_until(serving, timeout=90, every=0.5), "JupyterLab did not start"
        assert b"JupyterLab" in get("/lab")
        kernels = json.loads(get("/api/kernelspecs"))["kernelspecs"]
        assert "distcourse" in kernels
        assert kernels["distcourse"]["spec"]["display_name"].startswith("Python 3 (distributed")
        assert b"formgrader" in get("/formgrader").lower()  # nbgrader, for instructors
    finally:
        os.killpg(lab.pid, signal.SIGTERM)
        lab.wait(timeout=30)
    time.sleep(0.1)


def test_install_is_up_to_date_so_a_second_run_installs_nothing():
    """`make test` has just installed: make must now consider the install done."""
    result = subprocess.run(["make", "-q", "install"], cwd=ROOT)
    assert result.returncode == 0, "make install would run again"
