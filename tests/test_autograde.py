"""End to end, as an instructor would: release, submissions, autograde, feedback, grades.

The course folder is built and graded once per session (`tests/grading_course.py`).
"""

from __future__ import annotations

import csv
import filecmp
import shutil
from pathlib import Path

import nbformat
import pytest
from nbgrader.api import Gradebook
from nbgrader.utils import determine_grade

from course_lib.grading.autograde import extra_credit, save_extra_credit
from tests.conftest import ROOT, require_sandbox
from tests.grading_course import (
    ASSIGNMENTS,
    BUG,
    DEADLOCK,
    FORGED,
    HOSTILE,
    MARKERS,
    OVERWRITTEN,
    TAMPERED,
    bonus,
    cell_regions,
    grades,
    manual_grades,
    notebooks,
    scores,
    source,
    targets,
    written,
)

EXTRA = {a for a in ASSIGNMENTS if bonus(a)}  # assignments worth extra credit only

# Grading every submission takes minutes: the session fixture does it once, and its set-up
# counts against the first test's timeout. `make autograde` grades in a sandbox.
pytestmark = [pytest.mark.timeout(2400), require_sandbox]


@pytest.fixture
def course(graded_course) -> Path:
    return graded_course[0]


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_committed_release_is_exactly_what_make_release_generates(released_course, assignment):
    """The release is built in the background while other tests run (tests/conftest.py);
    `make test` runs this test, the graded course is `make test-e2e`'s."""
    fresh = released_course / "assignments" / assignment
    committed = ROOT / "assignments" / assignment
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
def test_the_solved_notebook_runs_top_to_bottom_in_the_sandbox(course, assignment):
    """Every cell of the solved notebook ran without an error where autograding runs it (try
    cells and measurements included: a student runs them too)."""
    graded = course / "autograded" / "solver" / assignment / f"{assignment}.ipynb"
    errors = [
        (cell.id, out.get("ename"), out.get("evalue", "")[:200])
        for cell in nbformat.read(graded, 4).cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "error"
    ]
    assert not errors, errors


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
    # The check's own timeout stopped the deadlocked ranks: the test cell was judged within a
    # minute, long before the judge's own limit (GradeInSandbox.judge_timeout) would stop it.
    graded_nb = course / "autograded" / "deadlocked" / assignment / f"{assignment}.ipynb"
    for cell in nbformat.read(graded_nb, 4).cells:
        if cell.id in DEADLOCK[assignment][3]:
            assert cell_seconds(cell) < 60, f"{cell.id} ran {cell_seconds(cell):.0f} s"


def cell_seconds(cell: nbformat.NotebookNode) -> float:
    """How long the judge took over a test cell, as the autograder records it."""
    return cell.metadata["course_lib"]["seconds"]


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


def test_a_hostile_submission_cannot_touch_the_gradebook_or_other_files(course):
    """Its code ran in the sandboxed kernel and on the sandboxed grading ranks, and tried to
    overwrite the gradebook, another student's submission and the solution."""
    for path in targets(course):
        assert OVERWRITTEN not in path.read_bytes().decode(errors="replace"), path
    grades = scores(course, HOSTILE[0], "solver")
    assert grades and all(score == top for score, top in grades.values()), grades
    assert scores(course, HOSTILE[0], "hostile")  # and it was graded like any other


def test_a_cell_forged_as_locked_does_not_run_where_tests_are_judged(course):
    """nbgrader rejects the forged cell's metadata and that submission scores 0, while the
    rest of the class is graded; the judge would not have run the cell either (it takes
    set-up and test cells from the gradebook, not from the submission)."""
    grades = scores(course, FORGED[0], "forger")
    assert grades[FORGED[2]][0] == 0, grades


# --- written answers (graded by hand) and extra credit ---------------------------------------


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_every_assignment_asks_a_written_question_with_its_points(assignment):
    """The release shows the question, with its points, and an empty answer cell (the model
    answer and the rubric stay in the solution)."""
    hand = written(assignment)
    assert hand, f"{assignment} has no written answer graded by hand"
    extra = {
        c.id: c.metadata.get("course_lib", {}).get("extra_credit") for c in source(assignment).cells
    }
    cells = nbformat.read(ROOT / "assignments" / assignment / f"{assignment}.ipynb", 4).cells
    for i, cell in enumerate(cells):
        if cell.id in hand:
            assert cell.cell_type == "markdown" and cell.source == "YOUR ANSWER HERE"
            points = extra[cell.id] or hand[cell.id]  # the capstone's are extra credit
            assert points > 0 and f"({points:g} points" in cells[i - 1].source
            assert "graded by hand" in cells[i - 1].source


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_written_answers_wait_for_a_grader_and_blank_ones_score_zero(course, assignment):
    """The solution's autograded cells have full marks (test_solution_gets_full_marks) while
    its written answers have no score yet and are flagged for the formgrader; an answer left
    as released scores 0 at once and needs no grader (nbgrader's "No response")."""
    for name, grade in manual_grades(course, assignment, "solver").items():
        assert grade.auto_score is None and grade.needs_manual_grade, (name, grade)
        assert grade.manual_score is None and grade.score == 0
    for name, grade in manual_grades(course, assignment, "blank").items():
        assert grade.auto_score == 0 and not grade.needs_manual_grade, (name, grade)


def test_a_manual_grade_adds_to_the_autograde_score(course, tmp_path):
    """As the formgrader does (its grade API handler): set a written answer's manual score in
    the gradebook. The formgrader's submission list (`notebook_submission_dicts`) keeps the
    code (autograded) and written (manual) scores apart, the total combines them, and the
    answer is listed as needing grading before and not after. On a copy of the gradebook:
    other tests read the session's."""
    assignment = ASSIGNMENTS[0]
    db = tmp_path / "gradebook.db"
    shutil.copy(course / "gradebook.db", db)
    auto = sum(score for score, _ in scores(course, assignment, "solver").values())
    hand = written(assignment)
    assert auto > 0 and hand

    def listed() -> tuple[dict, list[str]]:
        """The solver's row in the formgrader's list, and the answers flagged for grading."""
        with Gradebook(f"sqlite:///{db}") as gradebook:
            rows = gradebook.notebook_submission_dicts(assignment, assignment)
        row = next(r for r in rows if r["student"] == "solver")
        grades = manual_grades(course, assignment, "solver", db)
        flagged = sorted(name for name, g in grades.items() if g.needs_manual_grade)
        assert row["needs_manual_grade"] == bool(flagged)
        return row, flagged

    row, flagged = listed()
    assert flagged == sorted(hand)
    assert row["code_score"] == pytest.approx(auto) and row["written_score"] == 0
    assert row["score"] == pytest.approx(auto)
    manual = {name: points - 0.5 for name, points in hand.items()}
    with Gradebook(f"sqlite:///{db}") as gradebook:
        for name, score in manual.items():
            grade = gradebook.find_grade(name, assignment, assignment, "solver")
            grade.manual_score = score  # what the formgrader's PUT /api/grade/<id> does
            grade.needs_manual_grade = grade.manual_score is None and grade.auto_score is None
        gradebook.db.commit()
    row, flagged = listed()
    assert flagged == []
    assert row["code_score"] == pytest.approx(auto)
    assert row["written_score"] == pytest.approx(sum(manual.values()))
    assert row["max_written_score"] == pytest.approx(sum(hand.values()))
    assert row["score"] == pytest.approx(auto + sum(manual.values()))
    with Gradebook(f"sqlite:///{db}") as gradebook:
        submission = gradebook.find_submission(assignment, "solver")
        assert submission.score == pytest.approx(auto + sum(manual.values()))
        assert not submission.needs_manual_grade


@pytest.mark.parametrize("assignment", sorted(EXTRA))
def test_extra_credit_adds_to_the_score_but_not_to_the_maximum(course, assignment):
    """The capstone's autograded points are extra credit: its maximum is 0, the solution
    earns every bonus point, the blank release none, and an ordinary assignment's maximum
    is its points."""
    extra = bonus(assignment)
    assert extra, f"{assignment} has no extra-credit test cell"
    solver = {g.name: g for g in grades(course, assignment, "solver")}
    for name, points in extra.items():
        assert solver[name].max_score == 0 and solver[name].auto_score == 0
        assert solver[name].extra_credit == points and solver[name].score == points
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        assert gradebook.find_assignment(assignment).max_score == 0
        assert gradebook.find_submission(assignment, "solver").score == sum(extra.values())
        assert gradebook.find_submission(assignment, "blank").score == 0
        # None when the class is the capstone alone (a run for one assignment).
        ordinary = next((a for a in ASSIGNMENTS if a not in EXTRA), None)
        if ordinary is not None:
            cells = gradebook.find_notebook(ordinary, ordinary).grade_cells
            maximum = gradebook.find_assignment(ordinary).max_score
            assert maximum == sum(c.max_score for c in cells) > 0


def test_extra_credit_comes_with_zero_points_only():
    """A test cell may not both count in the maximum and give extra credit."""
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("check()", id="t")
    cell.metadata = {
        "nbgrader": {"grade": True, "solution": False, "grade_id": "t", "points": 2},
        "course_lib": {"extra_credit": 2},
    }
    nb.cells.append(cell)
    with pytest.raises(ValueError, match="points and extra credit"):
        extra_credit(nb)
    cell.metadata.nbgrader["points"] = 0
    assert extra_credit(nb) == {"t": 2.0}


def test_partial_extra_credit_does_not_break_nbgrader_scoring():
    """A part of an extra-credit cell that earns part of its points prints the score as a
    number, which nbgrader refuses above the cell's 0 points; the number is dropped (the
    score reaches the gradebook as extra credit) and nbgrader scores the cell 0 of 0."""
    cell = nbformat.v4.new_code_cell("check()", id="t")
    cell.metadata = {
        "nbgrader": {"grade": True, "solution": False, "grade_id": "t", "points": 0},
        "course_lib": {"score": 1.5},
    }
    cell.outputs = [
        nbformat.v4.new_output("stream", name="stdout", text="1.5 of 2 points"),
        nbformat.v4.new_output("execute_result", data={"text/plain": "1.5"}, execution_count=1),
    ]
    nb = nbformat.v4.new_notebook(cells=[cell])
    with pytest.raises(ValueError, match="greater than maximum"):
        determine_grade(cell)
    save_extra_credit(nb, {}, {"t": 2.0})
    assert determine_grade(cell) == (0, 0) and cell.outputs[0].text == "1.5 of 2 points"
