"""A small class of a01_processes submissions, for grading serially and in parallel.

Shared by tests/test_batch.py and bench/autograde_parallel.py. a01 is the
fastest assignment to grade (about 20 s a submission in the sandbox). The submissions are
built as tests/grading_course.py builds its own: the solution, the blank release and the
solution with a planted bug, taken in turn.
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
    """`count` student names, each saying which kind of submission it handed in."""
    return [f"s{i:02d}-{KINDS[i % len(KINDS)]}" for i in range(count)]


def build(course: Path, names: list[str]) -> None:
    """A course folder with a01 released and one submission per student in `names`."""
    course.mkdir(parents=True, exist_ok=True)
    for name in COURSE_FILES:
        shutil.copy2(ROOT / name, course / name)  # copy2 keeps mtimes: no reinstall
    shutil.copytree(ROOT / "solutions" / ASSIGNMENT, course / "solutions" / ASSIGNMENT)
    make(course, "release")
    for release in notebooks(course / "assignments" / ASSIGNMENT):
        solution = course / "solutions" / ASSIGNMENT / release.name
        for student in names:
            kind = student.split("-")[-1]
            nb = submission(kind, release, solution)
            submit(course, student, ASSIGNMENT, nb, release.name)


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
