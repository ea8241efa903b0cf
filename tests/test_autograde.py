"""End to end, as an instructor would: release, submissions, autograde, feedback, grades.

Everything runs in a temporary course folder through the Makefile targets (`make release`,
`make autograde`, `make feedback`), and scores are read from the gradebook, not from logs.
"""

from __future__ import annotations

import csv
import filecmp
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import nbformat
import pytest
from nbgrader.api import Gradebook

from tests.conftest import ROOT, require_sandbox

# Grading every assignment's submissions takes minutes: the module fixture below does it once,
# and its set-up counts against the first test's timeout. `make autograde` grades in a sandbox.
pytestmark = [pytest.mark.timeout(1800), require_sandbox]

ASSIGNMENTS = sorted(p.name for p in (ROOT / "solutions").iterdir() if p.is_dir())
VENV = Path(sys.executable).parent.parent

# Bugs planted in a correct submission: (cell id, text, replacement, tests expected to fail).
BUG = {
    "a0_processes": (
        "ping_pong",
        "conn.send(conn.recv() + 1)",
        "conn.send(conn.recv())",
        {"test_ping_pong"},
    ),
    "a1_collectives": (
        "ring_all_reduce",
        "incoming += received",
        "incoming.copy_(received)",
        {"test_ring_all_reduce"},
    ),
    "a2_data_parallel": (
        "sync_gradients",
        "p.grad /= world_size()",
        "p.grad /= 1",
        {"test_sync_gradients"},
    ),
    "a3_communication": (
        "powersgd",
        "M = grad + self.error",
        "M = grad",
        {"test_powersgd"},
    ),
    "a4_zero": (
        "zero2",
        "param.grad = None  # the full gradient is gone as soon as its shard exists",
        "pass",
        {"test_zero2"},
    ),
    "a5_model_parallel": (
        "pipeline_step",
        'warmup = n_micro if schedule == "gpipe" else min(P - r - 1, n_micro)',
        "warmup = n_micro",
        {"test_1f1b"},
    ),
    "a6_capstone": (
        "train_step",
        "p.grad /= dp_size",
        "p.grad /= 1",
        {"test_train_2d"},
    ),
}
DEADLOCK = {  # rank 1 never replies, so rank 0 waits in recv forever
    "a0_processes": (
        "dist_ping_pong",
        "dist.send(buffer + 1, dst=0)",
        "pass",
        {"test_dist_ping_pong"},
    ),
}
# (d) and (e) need one assignment only: they test nbgrader and the launcher, not the checks.
TAMPERED = {"a0_processes"}  # the planted bug, plus the failing test cell emptied
MARKERS = (
    "### BEGIN SOLUTION",
    "### END SOLUTION",
    "### BEGIN HIDDEN TESTS",
    "### END HIDDEN TESTS",
)


def make(course: Path, *targets: str, timeout: float = 1500) -> float:
    """Run make targets in the course folder; return the seconds they took."""
    start = time.monotonic()
    result = subprocess.run(
        ["make", "-s", f"VENV={VENV}", *targets],
        cwd=course,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return time.monotonic() - start


def notebooks(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.ipynb"))


def cell_regions(source: str, begin: str, end: str) -> list[str]:
    """The lines between begin and end markers, skipping ones too short to tell (")")."""
    lines, inside = [], False
    for line in source.splitlines():
        if begin in line:
            inside = True
        elif end in line:
            inside = False
        elif inside and len(line.strip()) >= 8:
            lines.append(line.strip())
    return lines


def solved(release: Path, solution: Path) -> nbformat.NotebookNode:
    """The release notebook with every answer cell filled in as the solution has it."""
    nb = nbformat.read(release, as_version=4)
    answers = {c.id: c.source for c in nbformat.read(solution, as_version=4).cells}
    for cell in nb.cells:
        if cell.metadata.get("nbgrader", {}).get("solution"):
            cell.source = "\n".join(
                line
                for line in answers[cell.id].splitlines()
                if "### BEGIN SOLUTION" not in line and "### END SOLUTION" not in line
            )
    return nb


def edit(nb: nbformat.NotebookNode, cell_id: str, old: str, new: str) -> None:
    cell = next(c for c in nb.cells if c.id == cell_id)
    assert old in cell.source, f"{old!r} not in cell {cell_id}"
    cell.source = cell.source.replace(old, new)


def submit(course: Path, student: str, assignment: str, nb: nbformat.NotebookNode, name: str):
    folder = course / "submitted" / student / assignment
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(folder / name))


def scores(course: Path, assignment: str, student: str) -> dict[str, tuple[float, float]]:
    """grade id -> (score, max score), from the gradebook."""
    out = {}
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        for notebook in gradebook.find_assignment(assignment).notebooks:
            submission = gradebook.find_submission_notebook(notebook.name, assignment, student)
            out.update({g.name: (g.score, g.max_score) for g in submission.grades})
    return out


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> tuple[Path, float]:
    """A course folder with a fresh release, graded submissions and feedback; and how long
    `make autograde` took."""
    course = tmp_path_factory.mktemp("course")
    for name in ("Makefile", "pyproject.toml", "nbgrader_config.py"):
        shutil.copy2(ROOT / name, course / name)  # copy2 keeps mtimes: no reinstall
    shutil.copytree(ROOT / "solutions", course / "solutions")
    make(course, "release")
    for assignment in ASSIGNMENTS:
        for release in notebooks(course / "assignments" / assignment):
            solution = course / "solutions" / assignment / release.name
            submit(course, "solver", assignment, solved(release, solution), release.name)
            submit(course, "blank", assignment, nbformat.read(release, 4), release.name)
            if assignment in BUG:
                nb = solved(release, solution)
                edit(nb, *BUG[assignment][:3])
                submit(course, "buggy", assignment, nb, release.name)
                if assignment in TAMPERED:
                    # The same bug, plus the student "fixing" the failing test by emptying it.
                    failing = sorted(BUG[assignment][3])[0]
                    next(c for c in nb.cells if c.id == failing).source = "pass"
                    submit(course, "tamperer", assignment, nb, release.name)
            if assignment in DEADLOCK:
                nb = solved(release, solution)
                edit(nb, *DEADLOCK[assignment][:3])
                submit(course, "deadlocked", assignment, nb, release.name)
    seconds = make(course, "autograde")
    make(course, "feedback")
    return course, seconds


@pytest.fixture
def course(graded) -> Path:
    return graded[0]


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_committed_release_is_exactly_what_make_release_generates(course, assignment):
    fresh, committed = course / "assignments" / assignment, ROOT / "assignments" / assignment
    comparison = filecmp.dircmp(fresh, committed)
    assert not comparison.left_only and not comparison.right_only, "files differ: run make release"
    for name in comparison.common_files:
        assert (fresh / name).read_bytes() == (committed / name).read_bytes(), (
            f"{assignment}/{name} is out of date: run make release"
        )


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_release_holds_no_solution_code_and_no_hidden_tests(assignment):
    for solution in notebooks(ROOT / "solutions" / assignment):
        release = nbformat.read(ROOT / "assignments" / assignment / solution.name, 4)
        released = {c.id: c.source for c in release.cells}
        assert not any(m in source for source in released.values() for m in MARKERS)
        for cell in nbformat.read(solution, 4).cells:
            secret = cell_regions(cell.source, "### BEGIN SOLUTION", "### END SOLUTION")
            secret += cell_regions(cell.source, "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS")
            leaked = [line for line in secret if line in released[cell.id]]
            assert not leaked, f"cell {cell.id} of the release shows {leaked}"


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_solution_gets_full_marks(course, assignment):
    grades = scores(course, assignment, "solver")
    assert grades and all(score == top for score, top in grades.values()), grades


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_untouched_release_gets_zero_on_every_test(course, assignment):
    grades = scores(course, assignment, "blank")
    assert grades and all(score == 0 for score, _ in grades.values()), grades


@pytest.mark.parametrize("assignment", sorted(BUG))
def test_planted_bug_fails_exactly_the_expected_tests(course, assignment):
    grades = scores(course, assignment, "buggy")
    failed = {name for name, (score, top) in grades.items() if score < top}
    assert failed == BUG[assignment][3], grades


@pytest.mark.parametrize("assignment", sorted(DEADLOCK))
def test_deadlocked_code_scores_zero_there_and_grading_finishes(course, assignment):
    grades = scores(course, assignment, "deadlocked")
    failed = {name for name, (score, top) in grades.items() if score < top}
    assert failed == DEADLOCK[assignment][3], grades
    # The check's own timeout stopped the deadlocked ranks: the test cell ended within a minute,
    # long before nbgrader's per-cell limit (Execute.timeout) would have cut it off.
    graded_nb = course / "autograded" / "deadlocked" / assignment / f"{assignment}.ipynb"
    for cell in nbformat.read(graded_nb, 4).cells:
        if cell.id in DEADLOCK[assignment][3]:
            assert cell_seconds(cell) < 60, f"{cell.id} ran {cell_seconds(cell):.0f} s"


def cell_seconds(cell: nbformat.NotebookNode) -> float:
    """How long a cell ran, from the timestamps nbclient records in its metadata."""
    stamps = cell.metadata["execution"]
    start = datetime.fromisoformat(stamps["iopub.execute_input"].replace("Z", "+00:00"))
    end = datetime.fromisoformat(stamps["shell.execute_reply"].replace("Z", "+00:00"))
    return (end - start).total_seconds()


@pytest.mark.parametrize("assignment", sorted(TAMPERED))
def test_editing_a_test_cell_does_not_help(course, assignment):
    grades = scores(course, assignment, "tamperer")
    failing = sorted(BUG[assignment][3])[0]
    assert grades[failing][0] == 0, "the emptied test cell was graded as passed"
    graded = nbformat.read(
        course / "autograded" / "tamperer" / assignment / f"{assignment}.ipynb", 4
    )
    original = nbformat.read(ROOT / "solutions" / assignment / f"{assignment}.ipynb", 4)
    restored = next(c for c in graded.cells if c.id == failing).source
    assert restored == next(c for c in original.cells if c.id == failing).source


def test_grades_csv_and_feedback_are_written(course):
    with open(course / "grades.csv") as f:
        rows = list(csv.DictReader(f))
    by_student = {(r["assignment"], r["student_id"]): float(r["score"]) for r in rows}
    for assignment in ASSIGNMENTS:
        solver = by_student[(assignment, "solver")]
        assert solver > 0 and by_student[(assignment, "blank")] == 0
        html = course / "feedback" / "solver" / assignment / f"{assignment}.html"
        assert html.exists() and f"{solver:g}" in html.read_text()
