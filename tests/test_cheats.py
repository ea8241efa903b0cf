"""Cheats score 0 on what they target; right-but-different answers keep full marks.

Each assignment's cheats and alternatives (tests/cheats/<assignment>.py) are planted in
copies of its solution and graded with the session's other test submissions
(`graded_course`): a cheat that changes shared state through `make autograde`, as for a real
class; the others by the same sandboxed judge on the same cells, without the kernel that only
renders the feedback (`tests/grading_course.judge`).
"""

from __future__ import annotations

import pytest

from tests import cheats
from tests.conftest import require_sandbox
from tests.grading_course import ASSIGNMENTS, scores

pytestmark = [pytest.mark.timeout(3600), require_sandbox]  # as test_autograde.py's

CHEATERS = [(a, s) for a in ASSIGNMENTS for s in cheats.students(a) if s.startswith("cheater")]
ALTERNATIVES = [(a, s) for a in ASSIGNMENTS for s in cheats.students(a) if s.startswith("alt")]


def _ids(pairs):
    return [f"{a}-{s}" for a, s in pairs]


@pytest.mark.parametrize("assignment, student", CHEATERS, ids=_ids(CHEATERS))
def test_each_cheat_scores_zero_on_its_target_and_nothing_else_changes(
    graded_course, assignment, student
):
    """Cheats that change only their own answer cells are judged on their targets alone
    (`cheats.targets`); "nothing else changes" is asserted of the `alone` cheats' notebooks,
    graded whole through `make autograde`."""
    course, _ = graded_course
    grades = scores(course, assignment, student)
    planted = cheats.students(assignment)[student]
    targeted = set().union(*(cheat.fails for cheat in planted))
    for cheat in planted:
        passed = {t: grades[t] for t in cheat.fails if grades[t][0] > 0}
        assert not passed, f"cheat '{cheat.name}' earned points: {passed}"
    untouched = {t: g for t, g in grades.items() if t not in targeted and g[0] < g[1]}
    assert not untouched, f"parts no cheat targeted lost points: {untouched}"


@pytest.mark.parametrize("assignment, student", ALTERNATIVES, ids=_ids(ALTERNATIVES))
def test_right_but_different_answers_keep_full_marks(graded_course, assignment, student):
    course, _ = graded_course
    grades = scores(course, assignment, student)
    planted = cheats.students(assignment)[student]
    names = [a.name for a in planted]
    reworked = set().union(*(a.reworked_by for a in planted))  # later parts built on another design
    lost = {t: g for t, g in grades.items() if g[0] < g[1] and t not in reworked}
    assert not lost, f"alternatives {names} lost points: {lost}"


def test_every_assignment_has_cheats_and_alternatives():
    missing = [a for a in ASSIGNMENTS if not all(cheats.load(a))]
    assert not missing, f"no cheats or no alternatives for {missing}"


def test_tampering_is_reported_for_cheaters_only(graded_course):
    """`make autograde` ends with the tampering report: it names cheaters, never an honest
    submission."""
    from course_lib.grading.report import findings

    course, _ = graded_course
    rows = findings(course / "autograded")
    assert rows, "no tampering found, yet some cheats rebind checks or patch course_lib"
    honest = {r["student"] for r in rows if not r["student"].startswith(("cheater", "hostile"))}
    assert not honest, f"tampering reported for honest submissions: {honest}"
    assert (course / "tampering.csv").read_text().count("\n") == len(rows) + 1
