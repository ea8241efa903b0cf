"""Where one submission's grading time goes: a timeline of its phases.

With COURSE_GRADE_PROFILE=1, the grader and the judge write a line to stderr as each phase
ends (`course_lib.grading.sandbox.phase`: "course-grade-profile <unix time> <pid> <what>"), and
nbclient records when each cell of the notebook's own run started and ended in the cell's
metadata (`execution`), which the autograded notebook keeps. Two lanes run side by side:
the notebook's own run (a kernel in the sandbox, for the feedback) and the judge (a second
sandboxed process that scores the test cells on its grading ranks).
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import nbformat

from course_lib.grading.sandbox import PROFILE_PREFIX


def marks(stderr: str) -> list[tuple[float, str]]:
    """(unix time, what) of every profiling line in `stderr`, in the order written."""
    out = []
    for line in stderr.splitlines():
        if line.startswith(PROFILE_PREFIX + " "):
            _, when, _pid, what = line.split(" ", 3)
            out.append((float(when), what))
    return out


def cell_times(notebook: Path) -> list[tuple[float, float]]:
    """(start, end) unix times of each code cell the notebook's own run executed."""
    out = []
    for cell in nbformat.read(notebook, as_version=4).cells:
        timing = cell.get("metadata", {}).get("execution", {})
        if "iopub.execute_input" in timing and "shell.execute_reply" in timing:
            start, end = (timing[k] for k in ("iopub.execute_input", "shell.execute_reply"))
            out.append((_unix(start), _unix(end)))
    return out


def _unix(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def phases(start: float, end: float, stderr: str, cells: list[tuple[float, float]]) -> list:
    """(lane, phase, seconds) of one `nbgrader autograde` run started at `start` and ended at
    `end` (unix times), from its profiling lines and its notebook's cell times."""
    at: dict[str, float] = {}
    judged: list[float] = []
    for when, what in marks(stderr):
        if what.startswith("judge-cell "):
            judged.append(when)
        else:
            at.setdefault(what, when)
    rows = []

    def span(lane: str, name: str, a: float | None, b: float | None) -> None:
        if a is not None and b is not None:
            rows.append((lane, name, b - a))

    first_mark = min(at.values(), default=None)
    span("nbgrader", "start, imports, gradebook (to the first phase)", start, first_mark)
    span("notebook", "kernel start in the sandbox", at.get("notebook-run-start"),
         cells[0][0] if cells else None)  # fmt: skip
    if cells:
        rows.append(("notebook", f"its own cells ({len(cells)})", sum(b - a for a, b in cells)))
    span("notebook", "kernel shutdown", cells[-1][1] if cells else None,
         at.get("notebook-run-done"))  # fmt: skip
    span("judge", "sandbox start (bwrap)", at.get("sandbox-start"), at.get("judge-process"))
    span("judge", "python, torch and the checks", at.get("judge-process"), at.get("judge-imported"))
    span("judge", "grading ranks (fork server, 2 ranks)", at.get("judge-imported"),
         at.get("judge-ranks-started"))  # fmt: skip
    previous = at.get("judge-ranks-started")
    if previous is not None and judged:
        rows.append(("judge", f"the checks ({len(judged)} test cells)", judged[-1] - previous))
        span("judge", "close, sandbox exit", judged[-1], at.get("judge-returned"))
    last = max(at.get("notebook-run-done", 0.0), at.get("judge-returned", 0.0)) or None
    span("nbgrader", "after both lanes: write the notebook, gradebook, exit", last, end)
    return rows


def slowest_checks(stderr: str, after: str = "judge-ranks-started", count: int = 3) -> list:
    """The `count` test cells the judge spent longest on: (seconds, cell id)."""
    times = marks(stderr)
    previous = next((when for when, what in times if what == after), None)
    out = []
    for when, what in times:
        if what.startswith("judge-cell ") and previous is not None:
            out.append((when - previous, what.removeprefix("judge-cell ")))
            previous = when
    return sorted(out, reverse=True)[:count]
