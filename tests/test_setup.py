"""`make lab` serves JupyterLab with the course kernel; the install is idempotent; the lab's and
the hub's kernels talk over socket files where their paths fit."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from traitlets.config import Config
from traitlets.config.loader import PyFileConfigLoader

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


@pytest.mark.parametrize("deep", [False, True])
def test_make_labs_kernels_use_socket_files_where_they_fit(tmp_path, monkeypatch, deep):
    """A socket's path has 107 bytes on Linux: in a runtime folder too deep for a kernel's
    socket files, JupyterLab keeps TCP rather than start kernels that die binding them."""
    runtime = tmp_path / ("d" * 60) if deep else "/tmp/r"  # only its name is read
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))
    config = PyFileConfigLoader("jupyter_lab_config.py", str(ROOT / "jupyter")).load_config()
    assert config.KernelManager.get("transport", "tcp") == ("tcp" if deep else "ipc")


class Spawned:
    """What the hub's environment callables read of a spawner: its user's name."""

    class user:  # noqa: N801 (an attribute, as JupyterHub's spawner has it)
        name = "alice"


def test_hub_users_get_a_runtime_folder_their_sockets_fit_in(tmp_path, monkeypatch):
    """The hub's homes are in its state folder, too deep for socket files (the course's
    .hub/home/<user>/.local/share/jupyter/runtime is 50 characters before the folder's own
    path): each user's runtime folder is in a private folder in /tmp instead."""
    import sys

    sys.path.insert(0, str(ROOT / "jupyter"))
    from kernel_sockets import ipc_fits

    monkeypatch.setenv("COURSE_HUB_DIR", str(tmp_path / "hub"))
    monkeypatch.setenv("COURSE_HUB_PASSWORD", "not-used-here")
    hub = PyFileConfigLoader("jupyterhub_config.py", str(ROOT / "jupyter" / "hub")).load_config()
    folder = hub.Spawner.environment["JUPYTER_RUNTIME_DIR"](Spawned())
    assert folder.endswith("/alice") and ipc_fits(folder)
    assert os.stat(Path(folder).parent).st_mode & 0o077 == 0  # nobody else's to read


def test_validates_kernel_talks_over_socket_files(tmp_path, monkeypatch):
    """Validate's kernel (course_validate.py) talks over socket files in the runtime folder:
    it runs in the notebook's folder, the client elsewhere, and both find the sockets."""
    import sys

    import nbformat
    from nbgrader.validator import Validator

    sys.path.insert(0, str(ROOT / "jupyter"))
    from kernel_sockets import over_socket_files

    runtime = Path(tempfile.mkdtemp())  # /tmp/tmpXXXXXXXX: short enough for socket paths
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))
    config = over_socket_files(Config())
    assert config.KernelManager.transport == "ipc"
    assert Path(config.KernelManager.connection_file).parent == runtime
    graded = {"grade": True, "grade_id": "t", "points": 1, "solution": False, "locked": True}
    cell = nbformat.v4.new_code_cell("import os\nassert os.getcwd().endswith('work')")
    cell.metadata["nbgrader"] = {**graded, "schema_version": 3}
    (tmp_path / "work").mkdir()
    path = tmp_path / "work" / "n.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), path)
    try:
        assert Validator(config=config).validate(str(path)) == {}  # the test cell passed
        assert not list(runtime.iterdir())  # the kernel's files went with it
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
