"""A small class of a01_processes submissions, for grading serially and in parallel.

Shared by tests/test_batch.py and bench/autograde_parallel.py. a01 is the
fastest assignment to grade (about 20 s a submission in the sandbox). The submissions are
built as tests/grading_course.py builds its own: the solution, the blank release and the
solution with a planted bug, taken in turn; `expected_scores` says what each must score,
worked out from the released source rather than from a grading run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nbformat
from nbgrader.api import Gradebook

from tests.conftest import ROOT
from tests.grading_course import BUG, COURSE_FILES, edit, make, notebooks, solved, submit

ASSIGNMENT = "a01_processes"
KINDS = ("solved", "blank", "buggy")


def submission(kind: str, release: Path, solution: Path) -> nbformat.NotebookNode:
    if kind == "blank":
        return nbformat.read(release, as_version=4)
    nb = solved(release, solution)
    if kind == "buggy":
        edit(nb, *BUG[ASSIGNMENT][:3])
    return nb


def students(count: int) -> list[str]:
    """`count` student names, each saying which kind of submission it handed in (`kind_of`)."""
    return [f"s{i:02d}-{KINDS[i % len(KINDS)]}" for i in range(count)]


def kind_of(student: str) -> str:
    """The kind of submission a student of `students` handed in: "s03-buggy" -> "buggy"."""
    return student.split("-")[-1]


# a01 cut to its first two parts and its written question, for the tests that grade a class
# (tests/test_batch.py) or run the exchange cycle (tests/test_exchange.py): what they test is
# how submissions travel and are graded (one at a time, in parallel, by Slurm tasks, merged,
# late), which two graded parts and a written answer show as well as five; the later parts
# cost most of a submission's time (Part 4 launches ranks for each message size up to 16 MB).
# tests/test_autograde.py grades the whole of a01.
SHORT = (
    "title", "setup", "part1", "ping_pong", "try_ping_pong_md", "try_ping_pong",
    "test_ping_pong", "part2", "chain", "try_chain_md", "try_chain", "test_chain",
    "message_cost_md", "message_cost",
)  # fmt: skip


def keep_only(notebook: Path, cells: tuple[str, ...]) -> None:
    """Rewrite `notebook` with only the cells of those ids (each must be there)."""
    nb = nbformat.read(notebook, as_version=4)
    missing = set(cells) - {c.id for c in nb.cells}
    assert not missing, f"{notebook.name} has no cells {sorted(missing)}"
    nb.cells = [c for c in nb.cells if c.id in cells]
    nbformat.write(nb, notebook)


def build(course: Path, names: list[str], cells: tuple[str, ...] | None = None) -> None:
    """A course folder with a01 released and one submission per student in `names`; with
    `cells`, a01 keeps only the cells of those ids (`SHORT`)."""
    course.mkdir(parents=True, exist_ok=True)
    for name in COURSE_FILES:
        shutil.copy2(ROOT / name, course / name)  # copy2 keeps mtimes: no reinstall
    shutil.copytree(ROOT / "solutions" / ASSIGNMENT, course / "solutions" / ASSIGNMENT)
    if cells is not None:
        keep_only(course / "solutions" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb", cells)
    make(course, "release")
    for release in notebooks(course / "assignments" / ASSIGNMENT):
        solution = course / "solutions" / ASSIGNMENT / release.name
        for student in names:
            nb = submission(kind_of(student), release, solution)
            submit(course, student, ASSIGNMENT, nb, release.name)


def expected_scores(course: Path, names: list[str]) -> dict[str, dict[str, tuple]]:
    """What `gradebook_scores` must hold once the submissions of `names` are graded, from the
    course's source notebook: a test cell scores its points unless the submission is blank or
    carries the planted bug in a part it fails (then 0); a written answer waits for a grader
    (no score yet: 0, needs a manual grade) unless it was left as released (0 at once)."""
    source = nbformat.read(course / "solutions" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb", 4)
    graded = [c for c in source.cells if c.metadata.get("nbgrader", {}).get("grade")]
    out: dict[str, dict[str, tuple]] = {}
    for student in names:
        kind = kind_of(student)
        cells = out.setdefault(student, {})
        for cell in graded:
            grade_id, points = cell.metadata.nbgrader["grade_id"], cell.metadata.nbgrader["points"]
            if cell.cell_type == "markdown":  # a written answer
                cells[f"{ASSIGNMENT}/{grade_id}"] = (0, points, kind != "blank")
            else:
                lost = kind == "blank" or (kind == "buggy" and grade_id in BUG[ASSIGNMENT][3])
                cells[f"{ASSIGNMENT}/{grade_id}"] = (0 if lost else points, points, False)
    return out


def gradebook_scores(course: Path) -> dict[str, dict[str, tuple]]:
    """student -> {notebook/grade id: (score, max score, needs manual grade)}, from the
    course's gradebook: every submission of every student it holds."""
    out: dict[str, dict[str, tuple]] = {}
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        for student in gradebook.students:
            for submitted in student.submissions:
                for notebook in submitted.notebooks:
                    out.setdefault(student.id, {}).update(
                        {
                            f"{notebook.name}/{g.name}": (
                                g.score,
                                g.max_score,
                                g.needs_manual_grade,
                            )
                            for g in notebook.grades
                        }
                    )
    return out
