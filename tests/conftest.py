"""Shared helpers for the tests: waiting for processes to go, and running helper scripts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _sandbox_marker() -> pytest.MarkDecorator:
    """Autograding runs submissions in a bubblewrap sandbox. Without one (a laptop without
    bubblewrap) its tests are skipped, visibly; CI sets COURSE_REQUIRE_SANDBOX=1, and there
    they must run."""
    from course_lib.grading import sandbox

    ok, why = sandbox.available()
    if ok or os.environ.get("COURSE_REQUIRE_SANDBOX") == "1":
        return pytest.mark.skipif(False, reason="the sandbox works here")
    return pytest.mark.skip(reason=f"no sandbox for autograding: {why}")


require_sandbox = _sandbox_marker()


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, every: float = 0.05) -> bool:
    """Poll `predicate` until it is true or `timeout` seconds pass; return its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return predicate()


def alive(pid: int) -> bool:
    """True if process `pid` exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def all_gone(pids: list[int], timeout: float = 10.0) -> bool:
    return wait_until(lambda: not any(alive(pid) for pid in pids), timeout)


def descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture
def run_script(tmp_path: Path) -> Callable[..., subprocess.Popen]:
    """Write `source` to a script in tmp_path and start it with this interpreter."""

    def start(source: str, name: str = "script.py", **popen_kwargs) -> subprocess.Popen:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        return subprocess.Popen(
            [sys.executable, str(path)],
            cwd=tmp_path,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            **popen_kwargs,
        )

    return start


@pytest.fixture(scope="session")
def graded_course(tmp_path_factory) -> tuple[Path, float]:
    """One course folder, released, with every test submission autograded through `make
    autograde` (see tests/grading_course.py); and how long grading took."""
    from tests import grading_course

    course = tmp_path_factory.mktemp("course")
    return course, grading_course.build(course)
