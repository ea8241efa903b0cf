"""nbgrader's exchange cycle end to end on one machine: an instructor and two students.

The instructor releases a01_processes (its first two parts and its written question:
tests/grading_class.SHORT) through a local exchange (COURSE_EXCHANGE, as on
JupyterHub); alice and bob fetch it, each solves a different part (copied from solutions/),
bob submits on time and alice after the due date; the instructor collects, autogrades
(`make autograde`), writes feedback and releases it; the students fetch it. A third rostered
student, carol, never submits. nbgrader's exchange names a student after the OS user (or
JUPYTERHUB_USER when that user is `jovyan`); here all three are root, so each student command
names its student with --CourseDirectory.student_id, as the OS user would.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import nbformat
import pytest
from nbgrader.api import Gradebook

from tests.conftest import ROOT, require_sandbox
from tests.grading_class import SHORT, keep_only
from tests.grading_course import COURSE_FILES, VENV, make

# About 2 minutes on an idle 2-core machine (two sandboxed submissions, ~20 s each); several
# times that under load, hence the generous timeout. A class's whole cycle, like the classes of
# test_autograde.py: end to end (`make test-all`, CI), not in `make test`.
pytestmark = [pytest.mark.timeout(1800), pytest.mark.e2e, require_sandbox]

A = "a01_processes"
SOLVES = {"alice": ("ping_pong", "test_ping_pong"), "bob": ("chain", "test_chain")}
ZONE = "Europe/Paris"  # the schedule's time zone: the due date is converted to UTC
PER_DAY, MOST = 1.5, 5  # late rule: 1.5 points per started day; alice is late by seconds


def max_score(assignment: str, kept: tuple[str, ...]) -> str:
    """The maximum of the assignment cut to the cells `kept`, as grades.csv and the feedback
    print it: every graded cell's points, written answers included."""
    nb = nbformat.read(ROOT / "solutions" / assignment / f"{assignment}.ipynb", as_version=4)
    cells = [c.metadata.get("nbgrader", {}) for c in nb.cells if c.id in kept]
    return f"{float(sum(c.get('points', 0) for c in cells if c.get('grade'))):.1f}"


MAX = max_score(A, SHORT)


def run(cwd: Path, *args: str, env: dict[str, str]) -> str:
    result = subprocess.run(
        [str(VENV / "bin" / "nbgrader"), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, f"nbgrader {' '.join(args)}:\n{result.stderr[-3000:]}"
    return result.stdout + result.stderr


def write_schedule(course: Path, due: datetime) -> None:
    local = due.astimezone(ZoneInfo(ZONE)).strftime("%Y-%m-%d %H:%M:%S")
    (course / "schedule.csv").write_text(
        f"assignment,due,late_points_per_day,late_points_max\n{A},{local} {ZONE},{PER_DAY},{MOST}\n"
    )


def solve(path: Path, solution: Path, cell_id: str) -> None:
    """Fill one answer cell of the student's notebook with the solution's code."""
    nb = nbformat.read(path, as_version=4)
    answer = next(c for c in nbformat.read(solution, as_version=4).cells if c.id == cell_id)
    lines = [line for line in answer.source.splitlines() if "### " not in line]
    next(c for c in nb.cells if c.id == cell_id).source = "\n".join(lines)
    nbformat.write(nb, path)


@pytest.fixture(scope="module")
def cycle(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("exchange-cycle")
    course, exchange = tmp / "course", tmp / "exchange"
    course.mkdir()
    for name in COURSE_FILES:
        shutil.copy2(ROOT / name, course / name)  # copy2 keeps mtimes: no reinstall
    shutil.copytree(ROOT / "solutions" / A, course / "solutions" / A)
    keep_only(course / "solutions" / A / f"{A}.ipynb", SHORT)  # the parts the students solve
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env.update(COURSE_EXCHANGE=str(exchange), PATH=f"{VENV / 'bin'}:{env['PATH']}")
    before = os.environ.get("COURSE_EXCHANGE")
    os.environ["COURSE_EXCHANGE"] = str(exchange)  # `make` (tests.grading_course) passes it on
    try:
        (course / "students.csv").write_text(
            "id,first_name,last_name,email\n"
            "alice,Alice,Doe,alice@example.org\nbob,Bob,Roe,\ncarol,Carol,Poe,\n"
        )
        make(course, "roster", "FILE=students.csv")
        write_schedule(course, datetime.now(timezone.utc) + timedelta(days=30))
        make(course, "release")
        run(course, "release_assignment", A, env=env)

        for student, (cell, _) in SOLVES.items():
            home = tmp / student
            home.mkdir()
            (home / "nbgrader_config.py").write_text(
                "c = get_config()  # noqa: F821\n"
                "c.CourseDirectory.course_id = 'distributed-training'\n"
                f"c.Exchange.root = {str(exchange)!r}\n"
                f"c.Exchange.cache = {str(home / 'cache')!r}\n"
            )
            run(home, "fetch_assignment", A, env=env)
            solve(home / A / f"{A}.ipynb", course / "solutions" / A / f"{A}.ipynb", cell)

        me = "--CourseDirectory.student_id={}"
        run(tmp / "bob", "submit", A, me.format("bob"), env=env)
        # Due between bob's submission and alice's: her timestamp is seconds past it.
        due = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(seconds=1)
        write_schedule(course, due)
        time.sleep(max(0.0, (due - datetime.now(timezone.utc)).total_seconds()) + 0.2)
        run(tmp / "alice", "submit", A, me.format("alice"), env=env)

        run(course, "collect", A, env=env)
        make(course, "autograde")
        make(course, "feedback")
        run(course, "release_feedback", A, env=env)
        for student in SOLVES:
            run(tmp / student, "fetch_feedback", A, me.format(student), env=env)
    finally:
        if before is None:
            del os.environ["COURSE_EXCHANGE"]
        else:
            os.environ["COURSE_EXCHANGE"] = before
    return tmp


def scores(cycle: Path, student: str) -> dict[str, float]:
    """grade id -> score of the student's submission, from the gradebook."""
    with Gradebook(f"sqlite:///{cycle / 'course' / 'gradebook.db'}") as gradebook:
        submission = gradebook.find_submission_notebook(A, A, student)
        return {grade.name: (grade.score, grade.max_score) for grade in submission.grades}


def test_each_student_scores_the_part_they_solved(cycle):
    for student, (_, test) in SOLVES.items():
        got = scores(cycle, student)
        assert got[test] == (3, 3), (student, got)
        assert sum(score for score, _ in got.values()) == 3, (student, got)


def grades(cycle: Path) -> dict[tuple[str, str], dict[str, str]]:
    with open(cycle / "course" / "grades.csv", newline="") as f:
        return {(row["student_id"], row["assignment"]): row for row in csv.DictReader(f)}


def test_grades_csv_lists_the_late_the_on_time_and_the_missing(cycle):
    rows = grades(cycle)
    assert set(rows) == {(s, a) for s in ("alice", "bob", "carol") for a in (A, "TOTAL")}
    numbers = ("status", "raw_score", "late_penalty", "score", "max_score")
    got = {s: tuple(rows[s, A][k] for k in numbers) for s in ("alice", "bob", "carol")}
    assert got == {
        "alice": ("late", "3.0", str(PER_DAY), str(3 - PER_DAY), MAX),
        "bob": ("graded", "3.0", "0.0", "3.0", MAX),
        "carol": ("missing", "0.0", "0.0", "0.0", MAX),
    }
    for student in ("alice", "bob", "carol"):
        total = rows[student, "TOTAL"]
        assert (total["score"], total["max_score"]) == (rows[student, A]["score"], MAX)
    assert rows["alice", A]["email"] == "alice@example.org"  # from the roster
    assert rows["carol", A]["submitted"] == ""
    due = datetime.fromisoformat(rows["bob", A]["due"])
    assert datetime.fromisoformat(rows["bob", A]["submitted"]) < due
    assert datetime.fromisoformat(rows["alice", A]["submitted"]) > due


def test_students_fetch_their_feedback_with_the_late_penalty(cycle):
    pages = {}
    for student in SOLVES:
        found = list((cycle / student / A / "feedback").glob(f"*/{A}.html"))
        assert len(found) == 1, f"{student} fetched {found}"
        pages[student] = found[0].read_text()
    # nbgrader's feedback page: the total after the penalty, then the penalty itself.
    assert f"Score: {3 - PER_DAY} / {MAX}" in pages["alice"]
    assert f"Late submission penalty (Score: -{PER_DAY})" in pages["alice"]
    assert f"Score: 3.0 / {MAX}" in pages["bob"]
    assert "Late submission penalty" not in pages["bob"]


def test_everything_passed_through_the_exchange_course_exchange_names(cycle):
    inbound = sorted(p.name.split("+")[0] for p in cycle.glob("exchange/*/inbound/*"))
    assert inbound == ["alice", "bob"]
    assert not (cycle / "course" / "exchange").exists()
