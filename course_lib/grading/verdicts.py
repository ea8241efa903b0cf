"""The autograder's side of the judge (`course_lib.grading.judge`): what it is sent, how it is
run, and what its verdicts become.

    cells = judge_cells(nb, resources)          # set-up and test cells from the gradebook,
                                                # answer cells from the submission
    verdicts = run_judge(cells, sandboxed=True, timeout=1800)
    apply_verdicts(nb, verdicts, log)           # each test cell's outputs and score

`judge_outcome` decides whose fault a judge that stopped early is: a limit hit while it ran a
test cell (the student's code) scores the cells left 0; anything else is the grader's and
raises `GraderFailed`, and the submission is not graded. Extra-credit cells are read from the
instructor's source (`extra_credit`) and their scores saved to the gradebook
(`save_extra_credit`). `course_lib.grading.autograde` runs all this beside the notebook's own
sandboxed run.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import subprocess
import sys

import nbformat
from nbgrader.api import Gradebook
from nbgrader.utils import is_grade, is_locked, is_solution

from course_lib.grading import sandbox


class GraderFailed(RuntimeError):
    """The grading machinery failed, not the student's code: the submission is not graded."""


def role(cell: nbformat.NotebookNode) -> str | None:
    """ "setup", "answer" or "test" for the code cells the judge needs, else None."""
    if cell.cell_type != "code":
        return None
    if is_grade(cell) and not is_solution(cell):
        return "test"
    if is_solution(cell):
        return "answer"
    if is_locked(cell):
        return "setup"
    return None


def apply_verdicts(nb, verdicts: dict, log) -> None:
    """The judge's verdicts become the test cells' outputs, from which nbgrader scores."""
    for cell in nb.cells:
        if role(cell) != "test":
            continue
        cell_id = cell.metadata.get("nbgrader", {}).get("grade_id", cell.id)
        verdict = verdicts.get(cell_id)
        if verdict is None:  # `run_judge` raises unless a limit stopped the student's code
            why = verdicts.get(None, "the judge did not reach it")
            log.warning("test cell %s scores 0: %s", cell_id, why)
            verdict = _stopped(cell_id, why)
        cell.outputs = [nbformat.from_dict(o) for o in verdict["outputs"]]
        cell.execution_count = None
        cell.metadata["course_lib"] = {
            "score": verdict.get("score", 0),
            "tampering": verdict.get("tampering", []),
            "seconds": verdict.get("seconds"),
            # what the open part's check measured (`_harness.measured`), with the points it
            # was judged out of: `measurements.save` stores them for the leaderboard
            "points": verdict.get("points"),
            "measurements": verdict.get("measurements", []),
        }
        for what in verdict.get("tampering", []):
            log.warning("TAMPERING in test cell %s: %s", cell_id, what)


def run_judge(
    cells: list[dict], *, sandboxed: bool, timeout: float, limits: sandbox.Limits | None = None
) -> dict:
    """Run the judge on the cells (`judge_cells`), in the sandbox unless `sandboxed` is False,
    for at most `timeout` seconds (with other `limits` than the sandbox's default, if given);
    its verdicts by cell id (see `judge_outcome`)."""
    tests = [cell["id"] for cell in cells if cell["role"] == "test"]
    if not tests:
        return {}
    token = secrets.token_hex(16)
    request = json.dumps({"token": token, "cells": cells})
    argv = [sys.executable, "-m", "course_lib.grading.judge"]
    if sandboxed:
        limits = dataclasses.replace(limits or sandbox.Limits(), seconds=timeout)
        code, out, err, killed = sandbox.run(argv, input=request, limits=limits)
    else:
        code, out, err, killed = _run_plain(argv, request, timeout)
    return judge_outcome(tests, token, code, out, err, killed)


def judge_outcome(
    tests: list[str], token: str, code: int, out: str, err: str, killed: str | None
) -> dict:
    """The verdicts by cell id in what the judge wrote (`out`: its lines after `token`), its
    exit code, its stderr and why a limit stopped it (`sandbox.Guard.reason`).

    If it stopped before it judged every test cell in `tests`, whose fault that is decides:
    a limit (time, memory, processes) that stopped it while it ran a test cell, which runs
    the student's code, is the student's, and the reason is kept under the key None (the
    cells left score 0, as a part whose code ran out of time does). Any other stop is the
    grader's and raises `GraderFailed`: it could not start or import, it failed outside a
    test cell (`judge.main` reports that as "broken"), a limit stopped it outside a test
    cell, or it died with no limit to blame."""
    verdicts: dict = {}
    judging = broken = None
    for line in out.splitlines():
        if line.startswith(token):
            message = json.loads(line[len(token) :])
            if "judging" in message:
                judging = message["judging"]
            elif "broken" in message:
                broken = message["broken"]
            else:
                verdicts[message["id"]] = message
                judging = None
    if all(cell_id in verdicts for cell_id in tests):
        return verdicts
    if broken:
        raise GraderFailed(f"the judge failed: {broken}")
    if killed and judging is not None:
        verdicts[None] = f"the judge was stopped while it judged {judging}: it {killed}"
        return verdicts
    where = (
        f"while it judged {judging}"
        if judging
        else "between two test cells"
        if verdicts
        else "before it judged a test cell"
    )
    ended = f"it {killed}" if killed else sandbox.describe_exit(code)
    raise GraderFailed(f"the judge stopped {where} ({ended}): {_last_lines(err) or 'no message'}")


def _last_lines(text: str, lines: int = 3) -> str:
    """The last few lines of a process's stderr, on one line."""
    return " | ".join([line.strip() for line in text.splitlines() if line.strip()][-lines:])[-600:]


def extra_credit(nb) -> dict[str, float]:
    """grade id -> extra-credit points of the notebook's test cells worth 0 points that say
    `"course_lib": {"extra_credit": N}`."""
    out = {}
    for cell in nb.cells:
        bonus = cell.metadata.get("course_lib", {}).get("extra_credit")
        if role(cell) == "test" and bonus is not None:
            if _points(cell):
                grade_id = cell.metadata["nbgrader"]["grade_id"]
                raise ValueError(f"test cell {grade_id} has points and extra credit: keep one")
            out[cell.metadata["nbgrader"]["grade_id"]] = float(bonus)
    return out


def save_extra_credit(nb, resources, bonus: dict[str, float]) -> None:
    """Write what each extra-credit test cell earned (`apply_verdicts`' score) to its grade.
    Its partial-credit output goes (nbgrader refuses a number above the cell's 0 points)."""
    for cell in nb.cells:
        if role(cell) == "test" and cell.metadata.get("nbgrader", {}).get("grade_id") in bonus:
            cell.outputs = [o for o in cell.outputs if o.output_type != "execute_result"]
    info = resources.get("nbgrader", {})
    if not bonus or "db_url" not in info:
        return
    with Gradebook(info["db_url"]) as gradebook:
        for cell in nb.cells:
            grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
            if role(cell) == "test" and grade_id in bonus:
                grade = gradebook.find_grade(
                    grade_id, info["notebook"], info["assignment"], info["student"]
                )
                grade.extra_credit = cell.metadata["course_lib"]["score"]
        gradebook.db.commit()


def judge_cells(nb, resources, bonus: dict[str, float] | None = None) -> list[dict]:
    """What the judge gets: the set-up, answer and test cells, in the notebook's order.

    The judge runs set-up and test cells itself, so their code comes from the gradebook (the
    instructor's source, hidden tests included), never from the submission: a cell the
    student added or relabelled as locked is not run there. Answer cells are the student's
    (the judge only ships them to the ranks). `bonus` (`extra_credit`) gives the points of
    extra-credit test cells, whose nbgrader points are 0."""
    info = resources.get("nbgrader", {})
    if "db_url" not in info:  # outside `nbgrader autograde`: trust the notebook's own cells
        bonus = extra_credit(nb)
        return [
            _cell(cell.id, role(cell), cell.source, bonus.get(cell.id) or _points(cell))
            for cell in nb.cells
            if role(cell)
        ]
    with Gradebook(info["db_url"]) as gradebook:
        source = gradebook.find_notebook(info["notebook"], info["assignment"])
        originals = {c.name: c for c in source.source_cells}
        points = {c.name: c.max_score for c in source.grade_cells}
        points.update((bonus or {}).items())
        answers = {c.name for c in source.solution_cells}
        cells = []
        for cell in nb.cells:
            grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
            original = originals.get(grade_id)
            if original is None or original.cell_type != "code":
                continue
            if grade_id in answers:
                cells.append(_cell(grade_id, "answer", cell.source, 0))
            elif grade_id in points:
                cells.append(_cell(grade_id, "test", original.source, points[grade_id]))
            elif original.locked:
                cells.append(_cell(grade_id, "setup", original.source, 0))
    return cells


def _cell(cell_id: str, cell_role: str, source: str, points: float) -> dict:
    return {"id": cell_id, "role": cell_role, "source": source, "points": points}


def _points(cell) -> float:
    return cell.metadata.get("nbgrader", {}).get("points", 0)


def _stopped(cell_id: str, why: str) -> dict:
    """The verdict of a test cell the judge did not reach, having been stopped by a limit
    while it ran the student's code: 0."""
    return {
        "id": cell_id,
        "score": 0,
        "tampering": [],
        "outputs": [
            {
                "output_type": "error",
                "ename": "GradingStopped",
                "evalue": why,
                "traceback": [f"GradingStopped: {why}"],
            }
        ],
    }


def _run_plain(argv: list[str], request: str, timeout: float) -> tuple[int, str, str, str | None]:
    try:
        result = subprocess.run(
            argv, input=request, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as error:
        out = error.stdout.decode() if isinstance(error.stdout, bytes) else error.stdout or ""
        return -9, out, "", f"ran longer than {timeout:g} s"
    return result.returncode, result.stdout, result.stderr, None
