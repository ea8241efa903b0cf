"""Shared helpers for the tests: waiting for processes to go, and running helper scripts."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import cloudpickle
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
    """Pids of this process's descendants, except the graded course's build (which runs
    alongside the tests and starts processes of its own)."""
    children = psutil.Process().children(recursive=True)
    parent = {}
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            parent[child.pid] = child.ppid()
    builder = _course_build.process.pid if _course_build is not None else None

    def in_build(pid: int | None) -> bool:
        while pid in parent:
            if pid == builder:
                return True
            pid = parent[pid]
        return False

    return {pid for pid in parent if not in_build(pid)}


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


# --- the graded course: built in a process of its own, alongside the other tests ------------


class _CourseBuild:
    """`python -m tests.grading_course FOLDER`: a course folder released, with every test
    submission autograded through `make autograde`. Grading ~50 notebooks is most of a test
    run and leaves the CPU idle part of the time (kernels starting, ranks meeting), so it
    starts as soon as the tests are collected and runs while the others do."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="graded-course-"))
        self.log = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.grading_course", str(self.folder)],
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # one killpg stops it and everything it started
        )

    def result(self, timeout: float) -> tuple[Path, float]:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            code = "killed: it ran out of time"
        self.log.seek(0)
        text = self.log.read()
        assert code == 0, f"building the graded course failed ({code}):\n{text[-6000:]}"
        return self.folder, float(re.search(r"autograde took ([\d.]+) s", text).group(1))

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


_course_build: _CourseBuild | None = None


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that read the graded course are end to end (marked `e2e`: `make test-e2e`
    runs them, `make test` does not) and run last, while its build has been running. The
    grading tests' functions and the cheats travel to the ranks by value."""
    for item in items:
        if "graded_course" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.e2e)
        module = getattr(item, "module", None)
        if module is not None and module.__name__.startswith("tests.test_grading_"):
            # The checks run these modules' functions on the ranks as student code: ship them
            # by value, as a notebook's are. Pickled by reference, every fresh rank would
            # import the test module, and with it nbformat (3 s of CPU each, jsonschema's IRI
            # grammar), after every restart of the grading pool.
            cloudpickle.register_pickle_by_value(module)
    if "tests.cheats" in sys.modules:  # the cheats and alternatives these modules run, too
        cloudpickle.register_pickle_by_value(sys.modules["tests.cheats"])
    items.sort(key=lambda item: "graded_course" in getattr(item, "fixturenames", ()))


def pytest_collection_finish(session: pytest.Session) -> None:
    global _course_build
    wanted = any(
        "graded_course" in getattr(item, "fixturenames", ())
        and item.get_closest_marker("skip") is None
        for item in session.items
    )
    if wanted and not session.config.option.collectonly:
        _course_build = _CourseBuild()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _course_build is not None:
        _course_build.stop()
        if exitstatus == 0:
            shutil.rmtree(_course_build.folder, ignore_errors=True)
        else:
            print(f"\nThe graded course folder is kept for a look: {_course_build.folder}")


@pytest.fixture(scope="session")
def graded_course() -> tuple[Path, float]:
    """The graded course folder (see tests/grading_course.py) and how long `make autograde`
    took."""
    global _course_build
    if _course_build is None:  # not started at collection (a test selected some other way)
        _course_build = _CourseBuild()
    return _course_build.result(timeout=3000)
