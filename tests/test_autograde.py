"""End to end, as an instructor would: release, submissions, autograde, feedback, grades.

The course folder is built and graded once per session (`tests/grading_course.py`).
"""

from __future__ import annotations

import csv
import filecmp
import json
import shutil
from pathlib import Path

import nbformat
import pytest
from nbgrader.api import Gradebook
from nbgrader.utils import determine_grade

from course_lib.grading import sandbox
from course_lib.grading.autograde import GradeInSandbox
from course_lib.grading.verdicts import (
    GraderFailed,
    extra_credit,
    judge_cells,
    judge_outcome,
    run_judge,
    save_extra_credit,
)
from tests.conftest import ROOT, require_sandbox
from tests.grading_course import (
    ASSIGNMENTS,
    BUG,
    CRASHED,
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

# Grading every submission takes minutes (about 25 on 2 cores): the session fixture does it
# once, and its set-up counts against the first test's timeout, which must outlast the
# fixture's own limit (tests/conftest.py, `graded_course`). `make autograde` grades in a sandbox.
pytestmark = [pytest.mark.timeout(3600), require_sandbox]


@pytest.fixture
def course(graded_course) -> Path:
    return graded_course[0]


def graded(planted: dict) -> list[str]:
    """The assignments of `planted` that the graded course holds (all, unless COURSE_E2E_ONLY
    names some: tests/grading_course.py)."""
    return sorted(set(planted) & set(ASSIGNMENTS))


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


@pytest.mark.parametrize("assignment", graded(BUG))
def test_planted_bug_fails_exactly_the_expected_tests(course, assignment):
    grades = scores(course, assignment, "buggy")
    failed = {name for name, (score, top) in grades.items() if score < top}
    assert failed == BUG[assignment][3], grades


@pytest.mark.parametrize("assignment", graded(DEADLOCK))
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


@pytest.mark.parametrize("assignment", graded(TAMPERED))
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


@pytest.mark.parametrize("assignment", graded(EXTRA))
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


# --- the machinery: an honest student never loses points to it -------------------------------


def cell(source: str, cell_id: str, **nbgrader) -> nbformat.NotebookNode:
    """A code cell; with `nbgrader` metadata (grade, solution, locked, points) if given."""
    out = nbformat.v4.new_code_cell(source, id=cell_id)
    if nbgrader:
        meta = {"grade": False, "solution": False, "locked": False, "schema_version": 3}
        out.metadata["nbgrader"] = {**meta, "grade_id": cell_id, **nbgrader}
    return out


def graded_cell(source: str, cell_id: str, points: float) -> nbformat.NotebookNode:
    return cell(source, cell_id, grade=True, locked=True, points=points)


def notebook(demo: str) -> nbformat.NotebookNode:
    """A notebook as a student hands it in: set-up, an answer, a cell of their own (`demo`)
    between two cells that print, and two test cells, one that passes and one that fails
    (outside a course, the judge takes the cells as they are)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "distcourse", "display_name": "", "language": "python"}
    nb.cells = [
        cell("import math", "setup", locked=True),
        cell("def answer():\n    return 42", "answer", solution=True),
        cell("print('before')", "before"),
        cell(demo, "demo"),
        cell("print('after')", "after"),
        graded_cell("assert math.pi > 3", "test_right", 2),
        graded_cell("assert math.pi > 4, 'pi is not above 4'", "test_wrong", 1),
    ]
    nb.cells[4].outputs = [nbformat.v4.new_output("stream", text="from the student's run\n")]
    return nb


@pytest.mark.parametrize(
    "demo, why",
    [
        ("import os\nos._exit(3)", "it exited with code 3"),
        ("chunks = [bytearray(64 << 20) for _ in range(64)]", "memory"),
    ],
    ids=["os._exit", "out of memory"],
)
def test_a_notebook_whose_own_run_dies_keeps_the_judges_verdicts(demo, why, tmp_path):
    """The kernel that runs the notebook for the feedback dies in the student's own cell:
    the test cells keep the judge's scores, the cell says the run died there and why, and
    the cells after it are not run."""
    grader = GradeInSandbox(kernel_name="distcourse", timeout=120)
    grader.limits = sandbox.Limits(memory_bytes=1 << 30)  # the kernel's
    nb, _ = grader.preprocess(notebook(demo), {"metadata": {"path": str(tmp_path)}})
    cells = {c.id: c for c in nb.cells}
    assert [o.text for o in cells["before"].outputs] == ["before\n"]
    errors = [o for o in cells["demo"].outputs if o.output_type == "error"]
    assert [e.ename for e in errors] == ["NotebookRunDied"], cells["demo"].outputs
    assert why in errors[0].evalue and "scores stand" in errors[0].evalue
    assert cells["after"].outputs == []  # not run, and not what the student's run showed
    assert determine_grade(cells["test_right"]) == (2, 2)
    assert determine_grade(cells["test_wrong"]) == (0, 1)


TOKEN = "0123abcd"


def said(*messages: dict) -> str:
    """What the judge writes: its messages after the token, among lines from the ranks."""
    return "".join(f"a rank prints\n{TOKEN}{json.dumps(m)}\n" for m in messages)


def verdict(cell_id: str) -> dict:
    return {"id": cell_id, "score": 1, "outputs": [], "tampering": []}


def test_a_limit_that_stops_the_student_code_scores_the_cells_left_zero():
    """Stopped by a limit while a test cell ran (the student's code, on the ranks): the
    cells judged keep their verdicts, and the reason stands for the others (they score 0)."""
    out = said(verdict("t1"), {"judging": "t2"})
    verdicts = judge_outcome(["t1", "t2", "t3"], TOKEN, -9, out, "", "ran longer than 60 s")
    assert verdicts["t1"]["score"] == 1 and "t2" not in verdicts and "t3" not in verdicts
    assert verdicts[None] == "the judge was stopped while it judged t2: it ran longer than 60 s"


KILLED = said({"judging": "t1"})


@pytest.mark.parametrize(
    "out, code, err, killed, expected",
    [
        ("", 1, "Traceback:\nModuleNotFoundError: No module named 'course_lib'", None, "before"),
        (said(verdict("t1"), {"broken": "RuntimeError: set-up"}), 3, "", None, "failed"),
        (said(verdict("t1")), -9, "", "ran longer than 60 s", "between two test cells"),
        (KILLED, 128 + 9, "", None, "while it judged t1 (it was stopped by SIGKILL"),
    ],
    ids=["cannot import", "broken outside a test cell", "limit between cells", "killed"],
)
def test_any_other_stop_of_the_judge_is_the_graders_failure(out, code, err, killed, expected):
    """The judge could not import, failed in its own code, was stopped by a limit while no
    student code ran, or died with no limit to blame: the grader failed, not the student."""
    with pytest.raises(GraderFailed, match="the judge") as failure:
        judge_outcome(["t1", "t2"], TOKEN, code, out, err, killed)
    assert expected in str(failure.value)
    assert all(line in str(failure.value) for line in err.splitlines())  # its last words


def test_a_judge_that_cannot_import_course_lib_is_the_graders_failure(monkeypatch):
    """A sandbox that does not show the course_lib the venv imports (a course copied beside
    another checkout's venv, say): the judge cannot start, and no test cell gets a 0."""
    course_lib = str(ROOT / "course_lib")
    shown = sandbox._readable

    def without_course_lib() -> list[str]:
        args = shown()
        triples = [args[i : i + 3] for i in range(0, len(args), 3)]
        return [arg for triple in triples if triple[1] != course_lib for arg in triple]

    monkeypatch.setattr(sandbox, "_readable", without_course_lib)
    with pytest.raises(GraderFailed, match="No module named 'course_lib'"):
        run_judge(judge_cells(notebook("pass"), {}), sandboxed=True, timeout=300)


def test_a_judge_whose_set_up_fails_is_the_graders_failure():
    nb = notebook("pass")
    nb.cells[0].source = "raise RuntimeError('the set-up cell broke')"
    with pytest.raises(GraderFailed, match="the judge failed: RuntimeError: the set-up cell"):
        run_judge(judge_cells(nb, {}), sandboxed=True, timeout=300)


def test_a_judge_stopped_by_a_limit_in_a_test_cell_scores_it_zero():
    """The judge's sandbox reaches its memory limit while a test cell runs: the student's
    (their code runs in a test cell), so the cell scores 0 and the cells judged before keep
    their scores. (The test cell allocates itself, standing in for a check whose ranks do.)"""
    nb = notebook("pass")
    nb.cells[-1].source = "chunks = [bytearray(64 << 20) for _ in range(96)]"  # 6 GiB
    limits = sandbox.Limits(memory_bytes=3 << 30)
    verdicts = run_judge(judge_cells(nb, {}), sandboxed=True, timeout=600, limits=limits)
    assert verdicts["test_right"]["score"] == 2 and "test_wrong" not in verdicts
    stopped = "the judge was stopped while it judged test_wrong: it "
    assert verdicts[None].startswith(stopped) and "memory" in verdicts[None], verdicts[None]


def test_a_kernel_that_dies_or_a_full_folder_costs_no_point(course):
    """The crasher's own cells write past the folder its notebook runs in, then end the
    kernel: it keeps every point, and the feedback says what happened."""
    assignment, student = CRASHED
    grades = scores(course, assignment, student)
    assert grades and all(score == top for score, top in grades.values()), grades
    graded = course / "autograded" / student / assignment / f"{assignment}.ipynb"
    cells = nbformat.read(graded, 4).cells
    index = {c.id: i for i, c in enumerate(cells)}
    errors = {
        c.id: o.evalue
        for c in cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type == "error"
    }
    with sandbox.SharedFolder(1 << 20) as probe:
        tmpfs = probe.mounted  # as when `make autograde` ran, in the same rights
    if tmpfs:  # the write failed, the run went on to the next cell and died there
        printed = "".join(o.get("text", "") for o in cells[index["overfill"]].outputs)
        assert printed.startswith("write failed: No space left on device after "), printed
        assert 512 <= int(printed.split()[-2]) <= 1024, printed  # the folder also holds files
        died = "crash"
        assert "it exited with code 3" in errors[died]
    else:  # the guard found the folder too big, and stopped the kernel
        died = "overfill"
        assert "to its folder (limit 1 GiB)" in errors[died]
    assert "died in this cell" in errors[died]
    later = [c for c in cells[index[died] + 1 :] if c.cell_type == "code" and c.id not in grades]
    assert later and all(not c.outputs for c in later), "cells after the death were not run"
