"""Grading a class in parallel or by the Slurm recipe scores every cell as it should.

Three submissions of a short a01 (its first two parts and its written question: solution,
blank, planted bug) are graded by `make autograde JOBS=2` (scratch courses, then a merge) and,
for two students, by the Slurm recipe (examples/grade_class.sh: one task per student, then the
merge), run locally and submitted to a real one-node cluster (tools/slurm.sh). Every score,
cell by cell, must be what the released source says each submission earns
(`grading_class.expected_scores`); one submission at a time, `make autograde`'s default,
grades every class of tests/test_autograde.py. When the grader itself cannot run, both ways
fail loudly and leave every submission without a grade, for a rerun. The class is released
once; each test grades a copy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbgrader.api import Gradebook

from course_lib.grading.batch import (
    LOG,
    NOT_GRADED,
    SCRATCH,
    STATUS,
    main,
    merge,
    not_graded,
    scratch_course,
)
from tests.conftest import ROOT, require_sandbox
from tests.grading_class import (
    ASSIGNMENT,
    SHORT,
    build,
    expected_scores,
    gradebook_scores,
    students,
)
from tests.grading_course import make, run_make

NAMES = students(3)
# Whole classes graded three ways: end to end, in `make test-e2e`.
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """The class's course folder: the short a01 released, every submission in place."""
    course = tmp_path_factory.mktemp("released")
    build(course, NAMES, SHORT)
    return course


def copy_class(released: Path, course: Path, names: list[str] = NAMES) -> Path:
    """`course`, made a copy of the released class with the submissions of `names` only."""
    shutil.copytree(released, course, dirs_exist_ok=True)  # copy2: mtimes kept, no reinstall
    for student in set(NAMES) - set(names):
        shutil.rmtree(course / "submitted" / student)
    return course


def test_the_expected_scores_say_what_each_kind_of_submission_earns(released):
    """The reference itself: full marks on the autograded cells, zero, and the planted bug's
    part lost; a written answer waits for a grader unless left blank."""
    solved, blank, buggy = (expected_scores(released, NAMES)[name] for name in NAMES)
    assert set(solved) == set(blank) == set(buggy) and solved
    assert [cell for cell, (*_, manual) in solved.items() if manual], solved
    assert all(score == top for score, top, manual in solved.values() if not manual), solved
    assert all(score == 0 and not manual for score, _, manual in blank.values()), blank
    assert 0 < sum(s for s, _, _ in buggy.values()) < sum(s for s, _, _ in solved.values())


def graded_notebook(course: Path, student: str) -> Path:
    return course / "autograded" / student / ASSIGNMENT / f"{ASSIGNMENT}.ipynb"


@require_sandbox
@pytest.mark.timeout(900)
def test_jobs_2_scores_every_cell_as_it_should(released, tmp_path):
    copy_class(released, tmp_path)
    make(tmp_path, "autograde", "JOBS=2")
    assert gradebook_scores(tmp_path) == expected_scores(released, NAMES)
    for student in NAMES:  # the feedback's source is merged too, with the judge's verdicts
        cells = nbformat.read(graded_notebook(tmp_path, student), 4).cells
        assert any("course_lib" in cell.metadata for cell in cells), student
    assert not (tmp_path / SCRATCH).exists(), "merged scratch courses are removed"
    grades = (tmp_path / "grades.csv").read_text()
    assert all(student in grades for student in NAMES)


@require_sandbox
@pytest.mark.timeout(900)
def test_the_slurm_recipe_run_locally_grades_each_student_then_merges(released, tmp_path):
    names = NAMES[:2]
    copy_class(released, tmp_path, names)
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
    assert gradebook_scores(tmp_path) == expected_scores(released, names)
    assert all(graded_notebook(tmp_path, name).exists() for name in names)
    assert "grades.csv" in {p.name for p in tmp_path.iterdir()}


def wait_for_jobs(env: dict[str, str], timeout: float) -> None:
    """Until the cluster's queue is empty (tools/slurm.sh's cluster runs only this test's
    jobs); fails at once if a job waits on one that failed (the merge's afterok), naming the
    reason and the jobs' output, instead of waiting forever."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        queue = subprocess.run(
            ["squeue", "-h", "-o", "%i %j %T %r"], env=env, capture_output=True, text=True
        )
        assert queue.returncode == 0, queue.stderr
        if not queue.stdout.strip():
            return
        assert "DependencyNeverSatisfied" not in queue.stdout, queue.stdout
        time.sleep(1)
    pytest.fail(f"Slurm jobs still queued after {timeout} s")


@require_sandbox
@pytest.mark.timeout(900)
def test_the_slurm_recipe_on_a_real_slurmd_grades_each_student_then_merges(
    released, tmp_path, slurm
):
    """`bash examples/grade_class.sh submit`, as an instructor runs it: an array of one task
    per student, then the merge once every task succeeded, scheduled by a real slurmctld and
    run by a real slurmd (tools/slurm.sh)."""
    names = NAMES[:2]
    copy_class(released, tmp_path, names)
    env = {**slurm, "VENV": str(Path(sys.executable).parent.parent)}
    submitted = subprocess.run(
        ["bash", str(ROOT / "examples" / "grade_class.sh"), "submit"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert "submitted: 2 grading tasks" in submitted.stdout
    wait_for_jobs(env, timeout=800)
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("slurm-*.out")))
    assert len(list(tmp_path.glob("slurm-*.out"))) == 3, logs  # 2 tasks and the merge
    assert gradebook_scores(tmp_path) == expected_scores(released, names), logs
    assert all(graded_notebook(tmp_path, name).exists() for name in names)
    assert "grades.csv" in {p.name for p in tmp_path.iterdir()}


def test_merge_takes_the_graded_and_leaves_the_rest_ungraded_keeping_their_logs(
    tmp_path, monkeypatch
):
    """Without nbgrader runs: scratch gradebooks of a submission graded ("ok"), one nbgrader
    reported an error for but recorded ("rejected": it scores as recorded), one the grader
    failed on ("broken", recorded in its NOT_GRADED; the course's gradebook held an older
    grade of it), one whose grading stopped before nbgrader recorded it ("failed") and one
    that never finished ("unfinished"). The last three are left without a grade."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    monkeypatch.setenv("PATH", path)  # a new gradebook runs `alembic`
    with Gradebook(f"sqlite:///{tmp_path / 'gradebook.db'}") as gradebook:
        gradebook.add_assignment("a")
        gradebook.add_notebook("n", "a")
        gradebook.add_grade_cell("test_x", "n", "a", max_score=3, cell_type="code")
    students = ("ok", "rejected", "broken", "failed", "unfinished")
    for student in students:
        (tmp_path / "submitted" / student / "a").mkdir(parents=True)
        scratch = scratch_course(tmp_path, student, "a")
        scratch.mkdir(parents=True)
        (scratch / "gradebook.db").write_bytes((tmp_path / "gradebook.db").read_bytes())
        (scratch / LOG).write_text(f"log of {student}")
        graded = scratch / "autograded" / student / "a"
        graded.mkdir(parents=True)
        (graded / "n.ipynb").write_text("{}")
    for student, score, db in (
        ("ok", 2, scratch_course(tmp_path, "ok", "a") / "gradebook.db"),
        ("rejected", 0, scratch_course(tmp_path, "rejected", "a") / "gradebook.db"),
        ("broken", 3, tmp_path / "gradebook.db"),  # an older grade, in the course's gradebook
    ):
        with Gradebook(f"sqlite:///{db}") as gb:
            gb.add_student(student, first_name="Ada")
            gb.add_submission("a", student)
            gb.find_grade("test_x", "n", "a", student).auto_score = score
            gb.db.commit()
    for student, code in (("ok", 0), ("rejected", 1), ("broken", 1), ("failed", 1)):
        (scratch_course(tmp_path, student, "a") / STATUS).write_text(f'{{"exit_code": {code}}}')
    cause = {"student": "broken", "assignment": "a", "notebook": "n", "cause": "no judge\nmore"}
    (scratch_course(tmp_path, "broken", "a") / NOT_GRADED).write_text(json.dumps(cause) + "\n")

    rejected = merge(tmp_path)

    assert [r.split(" ")[0] for r in rejected] == ["rejected/a"]
    assert gradebook_scores(tmp_path) == {
        "ok": {"n/test_x": (2, 3, True)},
        "rejected": {"n/test_x": (0, 3, True)},
    }
    missing = not_graded(tmp_path)
    assert [line.split(":")[0] for line in missing] == ["broken/a", "failed/a", "unfinished/a"]
    assert "no judge (see" in missing[0] and "more" not in missing[0]
    assert "did not record it" in missing[1] and "never finished" in missing[2]
    assert (tmp_path / "autograded" / "ok" / "a" / "n.ipynb").exists()
    assert not (tmp_path / "autograded" / "failed").exists()
    assert not scratch_course(tmp_path, "ok", "a").exists()
    for student in ("broken", "failed", "unfinished"):
        assert (scratch_course(tmp_path, student, "a") / LOG).read_text() == f"log of {student}"
    assert main(["merge", "--course", str(tmp_path)]) == 1  # says so, and make stops


# --- when the grader itself fails ------------------------------------------------------------


def broken_course(released: Path, course: Path, names: list[str]) -> dict[str, str]:
    """A class whose grader cannot run: the course folder holds a copy of course_lib, which
    nbgrader imports (it puts the course folder on sys.path; PYTHONPATH points there too, for
    the scratch courses of JOBS=N), while the venv belongs to another checkout: the sandbox
    shows the copy, its Python looks for the other, and the judge cannot import course_lib.
    Returns the environment that does this."""
    copy_class(released, course, names)
    shutil.copytree(ROOT / "course_lib", course / "course_lib")
    return {"PYTHONPATH": str(course)}


def assert_not_graded(course: Path, names: list[str], code: int, out: str) -> None:
    """make failed, naming every submission and the cause; none has a grade, not even 0."""
    assert code != 0, out[-3000:]
    assert "NOT graded, because the grader itself failed" in out, out[-3000:]
    for name in names:
        assert f"{name}/{ASSIGNMENT}: " in out, out[-3000:]
    assert "No module named 'course_lib'" in out.split("NOT graded", 1)[1], out[-3000:]
    assert gradebook_scores(course) == {}
    assert not (course / "grades.csv").exists()


@require_sandbox
@pytest.mark.timeout(900)
def test_a_grader_that_cannot_run_grades_nobody_loudly_and_a_rerun_grades_them(released, tmp_path):
    names = NAMES[:2]
    env = broken_course(released, tmp_path, names)
    code, out, err = run_make(tmp_path, "autograde", env=env)
    assert_not_graded(tmp_path, names, code, out + err)
    shutil.rmtree(tmp_path / "course_lib")  # the machinery mended
    code, out, err = run_make(tmp_path, "autograde")
    assert code == 0, (out + err)[-3000:]
    assert gradebook_scores(tmp_path) == expected_scores(released, names)


@require_sandbox
@pytest.mark.timeout(900)
def test_with_jobs_2_a_grader_that_cannot_run_grades_nobody_loudly(released, tmp_path):
    names = NAMES[:2]
    env = broken_course(released, tmp_path, names)
    code, out, err = run_make(tmp_path, "autograde", "JOBS=2", env=env)
    assert_not_graded(tmp_path, names, code, out + err)
    for name in names:  # each log stays, for a look
        assert (
            "No module named 'course_lib'"
            in (scratch_course(tmp_path, name, ASSIGNMENT) / LOG).read_text()
        )
