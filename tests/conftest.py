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
from collections.abc import Callable, Iterator
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


@pytest.fixture(scope="module")
def pool4() -> Iterator:
    """Four warm gloo workers, shared by one test module's tests (a module that defines its
    own `pool4` uses that)."""
    from course_lib import WorkerPool

    with WorkerPool(4) as pool:
        yield pool


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
    """Pids of this process's descendants, except the background builds' (the graded course
    and the site run alongside the tests and start processes of their own)."""
    children = psutil.Process().children(recursive=True)
    parent = {}
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            parent[child.pid] = child.ppid()
    builders = {build.process.pid for build in _builds.values()}

    def in_build(pid: int | None) -> bool:
        while pid in parent:
            if pid in builders:
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


# --- built in processes of their own, alongside the other tests -------------------------------


class Background:
    """A command run in a session of its own (one killpg stops it and everything it started),
    its output kept, while the tests run. Grading a class (~50 notebooks) and running every
    lecture are most of a test run, and both leave the CPU idle part of the time (kernels
    starting, ranks meeting, emulated networks sleeping): they start as soon as the tests are
    collected, and the tests that read what they built run last."""

    def __init__(self, *argv: str | Path, folder: Path | None = None) -> None:
        self.argv, self.folder = [str(a) for a in argv], folder  # folder: where it builds
        self.log = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(
            self.argv, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def result(self, timeout: float) -> tuple[int | str, str]:
        """(exit code, or why it has none; its output), once it has ended."""
        try:
            code: int | str = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            code = f"killed: it ran out of time ({timeout:g} s)"
        self.log.seek(0)
        return code, self.log.read()

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


# What is built in the background, each for the fixture of its name; the tests using one run
# last (`pytest_collection_modifyitems`):
# - graded_course: a course folder released, with every test submission autograded through
#   `make autograde` (tests/grading_course.py); its tests are e2e.
# - released_course: a course folder with the solutions released (`make release`), as CI's.
# - built_site: every lecture run into build/site (tools/build_site.py), which `make test` asks
#   for with COURSE_REQUIRE_SITE=1.
# With COURSE_CLASS_LAST=1 (`make test-all`) the class is graded only when its first test asks,
# after every other test has run: on 2 cores, grading it beside the other tests made both
# several times slower (CI took 80 minutes against about 45 for the parts one after the other)
# and put the checks' time limits under a load no class sees.
BUILDS = ("released_course", "built_site", "graded_course")  # the order their tests run in
SITE = ROOT / "build" / "site"
_builds: dict[str, Background] = {}


def _uses(item: pytest.Item, fixture: str) -> bool:
    return fixture in getattr(item, "fixturenames", ())


def _start(name: str) -> Background:
    if name not in _builds:
        folder = SITE if name == "built_site" else Path(tempfile.mkdtemp(prefix=f"{name}-"))
        argv = {
            "graded_course": ["-m", "tests.grading_course", folder],
            "released_course": ["-m", "tests.grading_course", folder, "--release-only"],
            "built_site": ["tools/build_site.py", "--out", folder],
        }[name]
        _builds[name] = Background(sys.executable, *argv, folder=folder)
    return _builds[name]


def _finished(name: str, timeout: float) -> tuple[Path, str]:
    """The folder of build `name` and its log, once it has ended with exit code 0: else the
    test using it fails with its log."""
    build = _start(name)  # started at collection, or now (COURSE_CLASS_LAST=1)
    code, log = build.result(timeout)
    if code != 0:
        pytest.fail(f"building {name} failed ({code}):\n{log[-6000:]}")
    return build.folder, log


def site_required() -> bool:
    return os.environ.get("COURSE_REQUIRE_SITE") == "1"


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that read the graded course are end to end (marked `e2e`: `make test-e2e`
    runs them, `make test` does not). Those reading a build run last, in the order of BUILDS.
    The grading tests' functions and the cheats travel to the ranks by value."""
    for item in items:
        if _uses(item, "graded_course"):
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
    items.sort(key=lambda item: [_uses(item, name) for name in reversed(BUILDS)])


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    wanted = [item for item in session.items if item.get_closest_marker("skip") is None]
    class_last = os.environ.get("COURSE_CLASS_LAST") == "1"
    for name in BUILDS:
        if name == "graded_course" and class_last:
            continue  # started by its fixture, once every other test has run
        if any(_uses(item, name) for item in wanted) and (name != "built_site" or site_required()):
            _start(name)


def pytest_terminal_summary(terminalreporter) -> None:
    """How long each lecture ran in the site's build: each should take about 2 minutes or less."""
    if "built_site" in _builds and _builds["built_site"].process.poll() is not None:
        _, log = _builds["built_site"].result(timeout=0)
        lines = [
            line for line in log.splitlines() if re.match(r"(\S+\.ipynb: ran in|FAILED )", line)
        ]
        terminalreporter.write_sep("=", "lectures run by the site's build")
        for line in lines:
            terminalreporter.write_line(line)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for build in list(_builds.values()):
        build.stop()
    for name in ("graded_course", "released_course"):
        if name in _builds:
            folder = _builds[name].folder
            if exitstatus == 0:
                shutil.rmtree(folder, ignore_errors=True)
            else:
                print(f"\nThe {name} folder is kept for a look: {folder}")


@pytest.fixture(scope="session")
def built_site() -> str:
    """The output of building the site in the background (`make test`), once it has ended;
    without COURSE_REQUIRE_SITE=1, the site a `make site` left in build/site, if any."""
    if not site_required():
        if not (SITE / "index.html").exists():
            pytest.skip("no site: run `make site` (make test builds it)")
        return ""
    code, log = _start("built_site").result(timeout=1800)
    if code != 0 and "FAILED " not in log:  # a lecture that fails is named by its page's test
        pytest.fail(f"building the site failed ({code}):\n{log[-6000:]}")
    return log


@pytest.fixture(scope="session")
def released_course() -> Path:
    """A course folder released from the solutions (see tests/grading_course.py)."""
    return _finished("released_course", timeout=1200)[0]


@pytest.fixture(scope="session")
def graded_course() -> tuple[Path, float]:
    """The graded course folder (see tests/grading_course.py) and how long `make autograde`
    took."""
    folder, log = _finished("graded_course", timeout=3000)
    return folder, float(re.search(r"autograde took ([\d.]+) s", log).group(1))


@pytest.fixture(scope="session")
def slurm() -> Iterator[dict[str, str]]:
    """A real one-node Slurm cluster, started by tools/slurm.sh (the environment its commands
    need). On a machine without Slurm the tests that use it are skipped, visibly; CI sets
    COURSE_REQUIRE_SLURM=1, and there the script installs and starts it. A cluster this
    session started is stopped at its end."""
    required = os.environ.get("COURSE_REQUIRE_SLURM") == "1"
    if not required and not (shutil.which("slurmctld") and os.geteuid() == 0):
        pytest.skip("no Slurm here: bash tools/slurm.sh start (as root) starts one")
    script = str(ROOT / "tools" / "slurm.sh")
    conf = subprocess.run(["bash", script, "env"], capture_output=True, text=True, check=True)
    env = {**os.environ, "SLURM_CONF": conf.stdout.strip().removeprefix("export SLURM_CONF=")}
    was_up = (
        bool(shutil.which("sinfo"))
        and subprocess.run(["sinfo"], env=env, capture_output=True).returncode == 0
    )
    start = subprocess.run(["bash", script, "start"], capture_output=True, text=True, timeout=600)
    assert start.returncode == 0, f"tools/slurm.sh start failed:\n{start.stdout}{start.stderr}"
    yield env
    if not was_up:
        subprocess.run(["bash", script, "stop"], check=False)
