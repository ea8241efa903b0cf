"""Cheats and right-but-different answers, one module per assignment (`a02_collectives.py`, ...).

`tests/test_cheats.py` plants each in a copy of the assignment's solution notebook, grades
the copies and asserts that every cheat scores 0 on the parts it targets, while the untouched
parts, the solution and every alternative keep full marks. A copy whose cheat changes shared
state (`alone=True`: rebinding a check, patching a module) is graded through `make
autograde`, sandbox, judge and tampering report, as for a real class; the others, whose
verdicts come from the judge alone, are judged exactly as `make autograde` judges (the same
cells from the gradebook, the same sandboxed judge, nbgrader's scoring of its outputs) without
the kernel that runs the notebook for the feedback's outputs (`tests/grading_course.py`).

A module defines

    CHEATS = [Cheat(...), ...]          # must score 0 on `fails`
    ALTERNATIVES = [Alternative(...)]   # right answers the notebook allows: full marks

Cheats that change only their own answer cell are graded together in one notebook when they
rewrite different cells and fail different tests (a notebook takes ~15-60 s to grade), and so
are alternatives; a cheat with `alone=True` (one that changes shared state, such as rebinding
a check or patching a module) gets a notebook of its own. A notebook of cheats that change
only their own cells is judged on the tests they target (`targets`): the other parts run the
solution's code, which the solution's own grading already scores; an `alone` cheat's notebook
is graded whole, and must lose nothing outside its targets.
"""

from __future__ import annotations

import copy
import importlib
import textwrap
from dataclasses import dataclass

import nbformat


@dataclass(frozen=True)
class Cheat:
    """A submission that wants points without the work."""

    name: str  # what the student tries, in a few words
    cell: str  # id of the answer cell it rewrites
    source: str  # the cell's new source (the whole cell)
    fails: frozenset[str]  # grade ids of the test cells that must score 0
    alone: bool = False  # changes shared state: in a notebook of its own, via make autograde


@dataclass(frozen=True)
class Alternative:
    """A right answer written differently from the solution: must keep full marks, except on
    `reworked_by`: test cells of later parts whose solution builds on the solution's design
    of this cell (its attributes, its methods), which a student who chose this design writes
    to match it. Such an answer is graded in a notebook of its own."""

    name: str
    cell: str
    source: str
    reworked_by: frozenset[str] = frozenset()


# --- turning them into submissions ----------------------------------------------------------


def load(assignment: str) -> tuple[list[Cheat], list[Alternative]]:
    """The cheats and alternatives of one assignment (none if it has no module here)."""
    try:
        module = importlib.import_module(f"tests.cheats.{assignment}")
    except ModuleNotFoundError:
        return [], []
    return list(getattr(module, "CHEATS", [])), list(getattr(module, "ALTERNATIVES", []))


def groups(items: list) -> list[list]:
    """Items in as few notebooks as possible: never two rewriting the same cell in one, never
    two cheats that fail a same test (one could hide that the other earned points), and a
    cheat marked `alone` in a notebook of its own. Cheats and alternatives are grouped apart:
    a cheat would hide whether an alternative judged by the same test keeps its points."""
    out: list[list] = []
    for item in items:
        if _alone(item):
            out.append([item])
            continue
        for group in out:
            if _alone(group[0]) or item.cell in {i.cell for i in group}:
                continue
            failing = {test for i in group for test in getattr(i, "fails", ())}
            if failing & set(getattr(item, "fails", ())):
                continue
            group.append(item)
            break
        else:
            out.append([item])
    return out


def _alone(item) -> bool:
    return bool(getattr(item, "alone", False) or getattr(item, "reworked_by", None))


def planted(nb: nbformat.NotebookNode, items: list) -> nbformat.NotebookNode:
    nb = copy.deepcopy(nb)
    for item in items:
        cell = next((c for c in nb.cells if c.id == item.cell), None)
        assert cell is not None, f"{item.name}: no cell {item.cell!r}"
        cell.source = textwrap.dedent(item.source).strip("\n")
    return nb


def targets(assignment: str, student: str) -> set[str] | None:
    """The tests a cheater's notebook targets (None for any other student): a notebook of
    cheats that change only their own answer cells is judged on those tests alone."""
    planted = students(assignment).get(student) if student.startswith("cheater") else None
    return set().union(*(cheat.fails for cheat in planted)) if planted else None


def students(assignment: str) -> dict[str, list]:
    """Student id -> the cheats (or alternatives) planted in that student's notebook."""
    cheats, alternatives = load(assignment)
    found = {f"cheater{i}": group for i, group in enumerate(groups(cheats), 1)}
    found.update({f"alternative{i}": g for i, g in enumerate(groups(alternatives), 1)})
    return found


def submissions(release, solution, assignment: str):
    """(student id, notebook, through make autograde?) for every cheat and alternative
    notebook of `assignment`: the solved release with the items planted."""
    from tests.grading_course import solved

    base = solved(release, solution)
    for student, items in students(assignment).items():
        yield student, planted(base, items), any(getattr(i, "alone", False) for i in items)
