"""Grading a class in parallel gives the same gradebook as grading it serially.

Three a01 submissions (solution, blank, planted bug) are graded by `make autograde` (one at
a time), by `make autograde JOBS=2` (scratch courses, then a merge) and, for two students,
by the Slurm recipe run locally (examples/grade_class.sh: one task per student, then the
merge). Every score, cell by cell, must be the serial run's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbgrader.api import Gradebook

from course_lib.grading.batch import LOG, SCRATCH, STATUS, merge, scratch_course
from tests.conftest import ROOT, require_sandbox
from tests.grading_class import ASSIGNMENT, build, gradebook_scores, students
from tests.grading_course import make

NAMES = students(3)
# Whole classes graded three ways: end to end, in `make test-e2e`.
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def serial(tmp_path_factory) -> dict:
    """The class graded one submission at a time, as `make autograde` always did."""
    course = tmp_path_factory.mktemp("serial")
    build(course, NAMES)
    make(course, "autograde")
    return gradebook_scores(course)


@require_sandbox
@pytest.mark.timeout(900)
def test_the_serial_run_grades_what_it_should(serial):
    """The reference itself: full marks on the autograded cells, zero, and the planted bug's
    part lost."""
    solved, blank, buggy = (serial[name] for name in NAMES)
    assert set(solved) == set(blank) == set(buggy) and solved
    # The written answer waits for a grader (needs_manual_grade); every autograded cell is full.
    assert [cell for cell, (*_, manual) in solved.items() if manual], solved
    assert all(score == top for score, top, manual in solved.values() if not manual), solved
    assert all(score == 0 for score, _, _ in blank.values()), blank
    assert 0 < sum(s for s, _, _ in buggy.values()) < sum(s for s, _, _ in solved.values())


def graded_notebook(course: Path, student: str) -> Path:
    return course / "autograded" / student / ASSIGNMENT / f"{ASSIGNMENT}.ipynb"


@require_sandbox
@pytest.mark.timeout(900)
def test_jobs_2_scores_every_cell_as_the_serial_run(serial, tmp_path):
    build(tmp_path, NAMES)
    make(tmp_path, "autograde", "JOBS=2")
    assert gradebook_scores(tmp_path) == serial
    for student in NAMES:  # the feedback's source is merged too, with the judge's verdicts
        cells = nbformat.read(graded_notebook(tmp_path, student), 4).cells
        assert any("course_lib" in cell.metadata for cell in cells), student
    assert not (tmp_path / SCRATCH).exists(), "merged scratch courses are removed"
    grades = (tmp_path / "grades.csv").read_text()
    assert all(student in grades for student in NAMES)


@require_sandbox
@pytest.mark.timeout(900)
def test_the_slurm_recipe_run_locally_grades_each_student_then_merges(serial, tmp_path):
    names = NAMES[:2]
    build(tmp_path, names)
    env = {**os.environ, "VENV": str(Path(sys.executable).parent.parent)}
    env.pop("SLURM_ARRAY_TASK_ID", None)
    script = str(ROOT / "examples" / "grade_class.sh")
    for task in ("0", "1"):  # what the array's two tasks run, one after the other here
        run = subprocess.run(
            ["bash", script],
            cwd=tmp_path,
            env={**env, "SLURM_ARRAY_TASK_ID": task},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert not (tmp_path / "autograded").exists(), "a task writes only its scratch course"
    assert gradebook_scores(tmp_path) == {}, "a task leaves the course's gradebook alone"
    merged = subprocess.run(
        ["bash", script, "merge"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert merged.returncode == 0, merged.stdout[-3000:] + merged.stderr[-3000:]
    assert gradebook_scores(tmp_path) == {name: serial[name] for name in names}
    assert all(graded_notebook(tmp_path, name).exists() for name in names)
    assert "grades.csv" in {p.name for p in tmp_path.iterdir()}


def test_merge_takes_the_graded_and_names_the_failed_keeping_their_logs(tmp_path, monkeypatch):
    """Without nbgrader runs: a scratch gradebook that holds a score, one whose grading
    failed before recording anything, and one whose grading never finished."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    monkeypatch.setenv("PATH", path)  # a new gradebook runs `alembic`
    with Gradebook(f"sqlite:///{tmp_path / 'gradebook.db'}") as gradebook:
        gradebook.add_assignment("a")
        gradebook.add_notebook("n", "a")
        gradebook.add_grade_cell("test_x", "n", "a", max_score=3, cell_type="code")
    for student in ("ok", "failed", "unfinished"):
        scratch = scratch_course(tmp_path, student, "a")
        scratch.mkdir(parents=True)
        (scratch / "gradebook.db").write_bytes((tmp_path / "gradebook.db").read_bytes())
        (scratch / LOG).write_text(f"log of {student}")
        graded = scratch / "autograded" / student / "a"
        graded.mkdir(parents=True)
        (graded / "n.ipynb").write_text("{}")
    with Gradebook(f"sqlite:///{scratch_course(tmp_path, 'ok', 'a') / 'gradebook.db'}") as gb:
        gb.add_student("ok", first_name="Ada")
        gb.add_submission("a", "ok")
        gb.find_grade("test_x", "n", "a", "ok").auto_score = 2
        gb.db.commit()
    (scratch_course(tmp_path, "ok", "a") / STATUS).write_text('{"exit_code": 0}')
    (scratch_course(tmp_path, "failed", "a") / STATUS).write_text('{"exit_code": 1}')

    failed = merge(tmp_path)

    assert [f.split(" ")[0] for f in failed] == ["failed/a", "unfinished/a"]
    assert gradebook_scores(tmp_path) == {"ok": {"n/test_x": (2, 3, True)}}
    assert (tmp_path / "autograded" / "ok" / "a" / "n.ipynb").exists()
    assert not (tmp_path / "autograded" / "failed").exists()
    assert not scratch_course(tmp_path, "ok", "a").exists()
    assert (scratch_course(tmp_path, "failed", "a") / LOG).read_text() == "log of failed"
