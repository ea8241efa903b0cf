"""bench/autograde.py's accounting: the class projection, core-seconds of a whole process tree
(orphans included), the kinds of process CPU is booked to, and the grading phases read from
the profiling lines."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from grading_phases import marks, phases, slowest_checks  # noqa: E402
from process_cost import class_hours, kind  # noqa: E402

from course_lib.grading.sandbox import PROFILE_PREFIX  # noqa: E402

BURN_S = 0.6  # CPU seconds the orphaned grandchild burns


def test_class_hours_is_students_times_summed_core_seconds_over_cores():
    # 500 students, 11 assignments of 30 core-s each, 32 cores: 500 * 330 / 32 / 3600 h.
    assert class_hours(500, [30.0] * 11, 32) == pytest.approx(500 * 330 / 32 / 3600)
    assert class_hours(500, [10.0, 50.0], 128) == pytest.approx(500 * 60 / 128 / 3600)
    assert class_hours(1, [3600.0], 1) == pytest.approx(1.0)


# A child that starts a grandchild and exits without waiting for it: the grandchild, an
# orphan, burns BURN_S of CPU after its parent is gone. getrusage alone would lose it (init
# would reap it); run_costed adopts it as subreaper and waits for it.
TREE = textwrap.dedent(
    f"""
    import subprocess, sys
    burn = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < {BURN_S}: pass"
    subprocess.Popen([sys.executable, "-c", burn])
    """
)


def test_core_seconds_count_an_orphaned_grandchild():
    # In a process of its own: run_costed makes its caller a subreaper for good.
    probe = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {str(ROOT / "bench")!r})
        from process_cost import run_costed
        cost = run_costed([sys.executable, "-c", {TREE!r}])
        print(json.dumps({{"rusage_s": cost.rusage_s, "cgroup_s": cost.cgroup_s,
                          "orphans_left": cost.orphans_left}}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    cost = json.loads(done.stdout)
    assert cost["orphans_left"] == 0
    # The grandchild's BURN_S, plus two interpreters' start-up (well under a second each).
    assert cost["rusage_s"] >= BURN_S
    if cost["cgroup_s"] is not None:  # the kernel's count, where a cpuacct cgroup can be made
        assert cost["cgroup_s"] >= BURN_S
        assert cost["cgroup_s"] == pytest.approx(cost["rusage_s"], rel=0.1, abs=0.05)


def test_kinds_follow_the_tree():
    assert kind(["python", "-m", "ipykernel_launcher", "-f", "k.json"], "bwrap") == "kernel"
    assert kind(["python", "-m", "course_lib.grading.judge"], "bwrap") == "judge"
    zygote = ["python", "-m", "course_lib._zygote", "5", "course_lib.grading"]
    assert kind(zygote, "judge") == "fork server: judge"
    # A rank is forked from its fork server and shows the server's command line.
    assert kind(zygote, "fork server: judge") == "ranks: judge"
    assert kind(zygote, "fork server: kernel") == "ranks: kernel"
    assert kind(["/usr/bin/nbgrader", "autograde", "a01"], None) == "nbgrader"
    assert kind(["bwrap", "--die-with-parent"], "nbgrader") == "bwrap: nbgrader"
    assert kind(["sh", "-c", "true"], "kernel") == "kernel"  # booked to what started it


def test_phases_are_read_from_the_profiling_lines():
    lines = [
        (100.0, "sandbox-start"),
        (100.5, "notebook-run-start"),
        (101.0, "judge-process"),
        (104.0, "judge-imported"),
        (110.0, "judge-ranks-started"),
        (112.0, "judge-cell test_a"),
        (119.0, "judge-cell test_b"),
        (120.0, "judge-returned"),
        (125.0, "notebook-run-done"),
    ]
    stderr = "noise\n" + "".join(f"{PROFILE_PREFIX} {t} 42 {what}\n" for t, what in lines)
    assert marks(stderr) == lines
    cells = [(102.0, 103.0), (103.0, 121.0)]
    rows = {(lane, name): s for lane, name, s in phases(95.0, 130.0, stderr, cells)}
    assert rows[("nbgrader", "start, imports, gradebook (to the first phase)")] == 5.0
    assert rows[("notebook", "kernel start in the sandbox")] == 1.5
    assert rows[("notebook", "its own cells (2)")] == 19.0
    assert rows[("judge", "sandbox start (bwrap)")] == 1.0
    assert rows[("judge", "python, torch and the checks")] == 3.0
    assert rows[("judge", "grading ranks (fork server, 2 ranks)")] == 6.0
    assert rows[("judge", "the checks (2 test cells)")] == 9.0
    assert rows[("nbgrader", "after both lanes: write the notebook, gradebook, exit")] == 5.0
    assert slowest_checks(stderr) == [(7.0, "test_b"), (2.0, "test_a")]
