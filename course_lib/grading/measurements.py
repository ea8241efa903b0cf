"""What the open parts measured, per submission, kept in the gradebook for the leaderboard.

An open part's check records its measurement in the checking process (`_harness.measured`);
the judge carries it out of the sandbox with the test cell's verdict, and `apply_verdicts`
puts it in the cell's metadata (`course_lib.measurements`, with the cell's score and points).
At autograde time `save` writes those to two tables of the course's own in gradebook.db,
beside nbgrader's (whose schema is untouched: nbgrader ignores tables it does not know):

    course_measurement(student, assignment, notebook, part, check_name, name, value, unit,
                       better, score, points)
    course_display_name(student, assignment, display_name)

A regrade replaces a submission's rows; `batch.merge` copies a scratch course's rows into the
course's (`copy`), and a submission left without a grade loses them (`forget`). The display
name is what the student wrote in the notebook's `LEADERBOARD_NAME = "..."` cell, read from
its source (never run); empty means anonymous. This module imports nothing of course_lib, so
`batch` may use it.
"""

from __future__ import annotations

import ast
import contextlib
import sqlite3
import unicodedata
from collections.abc import Iterator
from pathlib import Path

NAME_VARIABLE = "LEADERBOARD_NAME"
MAX_NAME = 40  # characters of a display name shown
ANONYMOUS = "anonymous"  # how the leaderboard's ids for students who chose no name begin
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS course_measurement ("
    " student TEXT NOT NULL, assignment TEXT NOT NULL, notebook TEXT NOT NULL,"
    " part TEXT NOT NULL, check_name TEXT NOT NULL, name TEXT NOT NULL, value REAL NOT NULL,"
    " unit TEXT NOT NULL, better TEXT NOT NULL, score REAL NOT NULL, points REAL NOT NULL,"
    " PRIMARY KEY (student, assignment, notebook, part, name))",
    "CREATE TABLE IF NOT EXISTS course_display_name ("
    " student TEXT NOT NULL, assignment TEXT NOT NULL, display_name TEXT NOT NULL,"
    " PRIMARY KEY (student, assignment))",
)
COLUMNS = (
    "student, assignment, notebook, part, check_name, name, value, unit, better, score, points"
)


@contextlib.contextmanager
def connect(db: Path | str) -> Iterator[sqlite3.Connection]:
    """The gradebook at `db` (a path or nbgrader's `sqlite:///` URL), with the course's tables,
    in one transaction. nbgrader may hold the file open too: wait for its writes."""
    path = str(db).removeprefix("sqlite:///")
    connection = sqlite3.connect(path, timeout=60)
    try:
        with connection:
            for statement in SCHEMA:
                connection.execute(statement)
            yield connection
    finally:
        connection.close()


def display_name(nb) -> str:
    """The display name the student chose in the notebook: the string last assigned to
    `LEADERBOARD_NAME` in a code cell, read from the source without running it; "" (anonymous)
    if there is none, it is not a plain string or it looks like an anonymous id. Control
    characters go and spaces collapse, so that a name fits on one line of the page; it is cut
    at MAX_NAME characters."""
    chosen = ""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue
        for node in tree.body:
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == NAME_VARIABLE for t in node.targets)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                chosen = node.value.value
    printable = "".join(c for c in chosen if unicodedata.category(c)[0] != "C" or c == " ")
    name = " ".join(printable.split())[:MAX_NAME]
    # the leaderboard's anonymous ids start so: a chosen name may not pass for someone's
    return "" if name.lower().startswith(ANONYMOUS) else name


def measured_cells(nb) -> list[tuple[str, dict]]:
    """(grade id, measurement) of every test cell the judge's verdict gave measurements
    (`apply_verdicts` wrote them, with the cell's score and points, to its metadata)."""
    out = []
    for cell in nb.cells:
        verdict = cell.metadata.get("course_lib", {})
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id", cell.get("id"))
        for m in verdict.get("measurements") or []:
            out.append((grade_id, {**m, "score": verdict["score"], "points": verdict["points"]}))
    return out


def save(nb, resources) -> None:
    """Store what the submission's open parts measured, and its display name, in the
    gradebook of `nbgrader autograde` (`resources`), replacing an earlier grading's."""
    info = resources.get("nbgrader", {})
    if "db_url" not in info:
        return
    student, assignment, notebook = info["student"], info["assignment"], info["notebook"]
    with connect(info["db_url"]) as db:
        db.execute(
            "DELETE FROM course_measurement WHERE student = ? AND assignment = ? AND notebook = ?",
            (student, assignment, notebook),
        )
        db.executemany(
            f"INSERT OR REPLACE INTO course_measurement ({COLUMNS}) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (student, assignment, notebook, part, m["check"], m["name"], m["value"])
                + (m["unit"], m["better"], m["score"], m["points"])
                for part, m in measured_cells(nb)
            ],
        )
        db.execute(
            "INSERT OR REPLACE INTO course_display_name VALUES (?, ?, ?)",
            (student, assignment, display_name(nb)),
        )


def forget(db: Path | str, student: str, assignment: str) -> None:
    """Take a submission's measurements and display name out of the gradebook (it has no
    grade: the grader failed on it)."""
    with connect(db) as connection:
        for table in ("course_measurement", "course_display_name"):
            connection.execute(
                f"DELETE FROM {table} WHERE student = ? AND assignment = ?", (student, assignment)
            )


def copy(source: Path, target: Path, student: str, assignment: str) -> None:
    """Replace the submission's rows in gradebook `target` by those of gradebook `source` (a
    scratch course's, `batch.merge`)."""
    with connect(source) as db:
        rows = db.execute(
            f"SELECT {COLUMNS} FROM course_measurement WHERE student = ? AND assignment = ?",
            (student, assignment),
        ).fetchall()
        names = db.execute(
            "SELECT student, assignment, display_name FROM course_display_name "
            "WHERE student = ? AND assignment = ?",
            (student, assignment),
        ).fetchall()
    forget(target, student, assignment)
    with connect(target) as db:
        db.executemany(
            f"INSERT INTO course_measurement ({COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            rows,
        )
        db.executemany("INSERT INTO course_display_name VALUES (?, ?, ?)", names)


def rows(db: Path | str) -> list[dict]:
    """Every stored measurement, with the submission's display name ("" if none)."""
    with connect(db) as connection:
        connection.row_factory = sqlite3.Row
        found = connection.execute(
            "SELECT m.*, COALESCE(d.display_name, '') AS display_name FROM course_measurement m"
            " LEFT JOIN course_display_name d"
            " ON d.student = m.student AND d.assignment = m.assignment"
            " ORDER BY m.assignment, m.notebook, m.part, m.name, m.student"
        ).fetchall()
    return [dict(row) for row in found]
