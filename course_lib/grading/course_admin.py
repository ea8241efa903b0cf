"""The course around nbgrader: the schedule (due dates, late rules), late penalties, grades.csv
and LMS archives. nbgrader_config.py plugs each class into nbgrader; the Makefile runs the rest.

    python -m course_lib.grading.course_admin due-dates    (what `make release` runs last)

schedule.csv, at the course root, one row per assignment:

    assignment,due,late_points_per_day,late_points_max
    a01_processes,2027-01-15 23:59 Europe/Paris,1,5

`due` is a local date and time and its IANA time zone (empty: no due date). A submission late
by any part of a day loses `late_points_per_day` points per started day, at most
`late_points_max` (empty: no cap) and never more than it scored.
"""

from __future__ import annotations

import csv
import math
import re
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from nbgrader.api import Gradebook, MissingEntry
from nbgrader.plugins import ExportPlugin, FileNameCollectorPlugin, LateSubmissionPlugin
from traitlets import Unicode

SCHEDULE = "schedule.csv"
SCHEDULE_COLUMNS = ("assignment", "due", "late_points_per_day", "late_points_max")
GRADES_COLUMNS = (
    "student_id",
    "last_name",
    "first_name",
    "email",
    "lms_user_id",
    "assignment",
    "due",
    "submitted",
    "status",
    "raw_score",
    "late_penalty",
    "score",
    "max_score",
)
TOTAL = "TOTAL"  # the `assignment` of each student's last row, which sums the others
DAY = 86400.0


@dataclass(frozen=True)
class Deadline:
    """One row of the schedule: when an assignment is due (UTC, naive, as nbgrader stores
    times) and what lateness costs."""

    assignment: str
    due: datetime | None
    points_per_day: float
    max_points: float

    def penalty(self, seconds_late: float, score: float) -> float:
        days = math.ceil(seconds_late / DAY) if seconds_late > 0 else 0
        return min(days * self.points_per_day, self.max_points, score)


def parse_due(text: str, where: str) -> datetime | None:
    """'2027-01-15 23:59 Europe/Paris' -> the same instant in UTC, naive; '' -> None."""
    if not text.strip():
        return None
    parts = text.split()
    if len(parts) != 3:
        raise ValueError(f"{where}: due {text!r} should read 'YYYY-MM-DD HH:MM Area/City'")
    try:
        local = datetime.fromisoformat(f"{parts[0]} {parts[1]}")
        zone = ZoneInfo(parts[2])
    except (ValueError, ZoneInfoNotFoundError) as error:
        raise ValueError(f"{where}: due {text!r}: {error}") from None
    return local.replace(tzinfo=zone).astimezone(timezone.utc).replace(tzinfo=None)


def read_schedule(path: Path) -> dict[str, Deadline]:
    """assignment -> Deadline, from schedule.csv; a clear error for any malformed row."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = set(SCHEDULE_COLUMNS) - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(sorted(missing))}")
        schedule = {}
        for line, row in enumerate(reader, start=2):
            where = f"{path}, line {line}"
            try:
                per_day = float(row["late_points_per_day"] or 0)
                most = float(row["late_points_max"]) if row["late_points_max"].strip() else math.inf
            except ValueError:
                raise ValueError(f"{where}: late points must be numbers") from None
            if per_day < 0 or most < 0:
                raise ValueError(f"{where}: late points must not be negative")
            name = row["assignment"].strip()
            schedule[name] = Deadline(name, parse_due(row["due"], where), per_day, most)
    return schedule


def register_due_dates(course: Path, course_id: str) -> list[str]:
    """Store the schedule's due dates in the course's gradebook; returns what it did."""
    path = course / SCHEDULE
    if not path.exists():
        return [f"no {SCHEDULE} here: no due dates"]
    schedule = read_schedule(path)
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}", course_id) as gradebook:
        released = {a.name for a in gradebook.assignments}
        done = [
            f"{name}: in {SCHEDULE} but not released" for name in sorted(set(schedule) - released)
        ]
        for name in sorted(released):
            deadline = schedule.get(name)
            assignment = gradebook.find_assignment(name)
            assignment.duedate = deadline.due if deadline else None
            due = f"due {assignment.duedate} UTC" if assignment.duedate else "no due date"
            done.append(f"{name}: {due}")
        gradebook.db.commit()
    return done


class SchedulePenalty(LateSubmissionPlugin):
    """nbgrader's late-submission plugin, with the rule schedule.csv gives each assignment."""

    schedule = Unicode(SCHEDULE, help="Path of the course's schedule.csv").tag(config=True)

    def late_submission_penalty(self, student_id: str, score: float, total_seconds_late: float):
        assignment = self.parent.assignment_id  # AssignLatePenalties sets it before calling
        path = Path(self.schedule)
        deadline = read_schedule(path).get(assignment) if path.exists() else None
        if deadline is None:
            self.log.warning("%s: no late rule in %s, no penalty", assignment, self.schedule)
            return None
        penalty = deadline.penalty(total_seconds_late, score)
        self.log.info("%s / %s: %.0f s late, penalty %s", student_id, assignment,
                      total_seconds_late, penalty)  # fmt: skip
        return penalty


def grade_rows(gradebook: Gradebook, students=(), assignments=()) -> list[dict[str, object]]:
    """grades.csv's rows: every student of the gradebook (the roster and whoever submitted)
    for every assignment it holds, then the student's TOTAL row."""
    rows = []
    for student in sorted(gradebook.students, key=lambda s: s.id):
        if students and student.id not in students:
            continue
        person = {
            "student_id": student.id,
            "last_name": student.last_name or "",
            "first_name": student.first_name or "",
            "email": student.email or "",
            "lms_user_id": student.lms_user_id or "",
        }
        mine = []
        for assignment in sorted(gradebook.assignments, key=lambda a: a.name):
            if assignments and assignment.name not in assignments:
                continue
            row = {**person, "assignment": assignment.name, "max_score": assignment.max_score}
            row["due"] = assignment.duedate.isoformat(" ") if assignment.duedate else ""
            try:
                submission = gradebook.find_submission(assignment.name, student.id)
            except MissingEntry:
                row.update(submitted="", status="missing", raw_score=0.0, late_penalty=0.0)
            else:
                stamp = submission.timestamp
                row["submitted"] = stamp.isoformat(" ") if stamp else ""
                row["status"] = "late" if submission.total_seconds_late > 0 else "graded"
                row["raw_score"] = submission.score
                row["late_penalty"] = submission.late_submission_penalty or 0.0
            row["score"] = max(0.0, row["raw_score"] - row["late_penalty"])
            mine.append(row)
        total = {**person, "assignment": TOTAL, "due": "", "submitted": "", "status": ""}
        for key in ("raw_score", "late_penalty", "score", "max_score"):
            total[key] = sum(row[key] for row in mine)
        rows += [*mine, total]
    for row in rows:
        for key in ("raw_score", "late_penalty", "score", "max_score"):
            row[key] = round(float(row[key]), 2)
    return rows


class GradesExport(ExportPlugin):
    """`nbgrader export`: grades.csv with GRADES_COLUMNS, one row per student and assignment
    (status graded, late or missing; a missing one scores 0) and a TOTAL row per student."""

    def export(self, gradebook: Gradebook) -> None:
        dest = self.to or "grades.csv"
        rows = grade_rows(
            gradebook, [str(s) for s in self.student], [str(a) for a in self.assignment]
        )
        with open(dest, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=GRADES_COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        self.log.info("Wrote %d rows to %s", len(rows), dest)


# Canvas's "Download Submissions" archive: <lastfirst>_[LATE_]<userid>_<submissionid>_<file>,
# where a resubmitted file gets "-1", "-2"... before its extension.
CANVAS = re.compile(
    r"^(?P<name>[^_]+)_(?:(?P<late>LATE)_)?(?P<lms_user_id>\d+)_(?P<submission_id>\d+)_"
    r"(?P<file>.+?)(?:-\d+)?(?P<ext>\.[A-Za-z0-9]+)$"
)


class CanvasCollector(FileNameCollectorPlugin):
    """`nbgrader zip_collect` for a Canvas archive. The student is the roster's student whose
    lms_user_id is the Canvas user id; an unrostered one is filed under that user id."""

    def collect(self, submitted_file: str):
        name = Path(submitted_file).name
        if Path(name).suffix not in self.valid_ext:
            return None
        match = CANVAS.match(name)
        if match is None:
            self.log.warning("Not a Canvas submission file name, skipped: %s", name)
            return None
        user = match["lms_user_id"]
        student = self.roster().get(user)
        if student is None:
            self.log.warning("Canvas user %s (%s) is not in the roster", user, match["name"])
        if match["late"]:
            self.log.warning("Canvas marks %s LATE (its archive holds no submission time)", name)
        return {"student_id": student or user, "file_id": match["file"] + match["ext"]}

    def roster(self) -> dict[str, str]:
        """Canvas user id -> student id, from the gradebook's lms_user_id column."""
        if not hasattr(self, "_roster"):
            coursedir = self.parent.coursedir
            with Gradebook(coursedir.db_url, coursedir.course_id) as gradebook:
                self._roster = {s.lms_user_id: s.id for s in gradebook.students if s.lms_user_id}
        return self._roster


def course_id(course: Path) -> str:
    """The course id nbgrader_config.py sets (nbgrader keys the gradebook by it)."""
    from traitlets.config.loader import PyFileConfigLoader

    config = PyFileConfigLoader("nbgrader_config.py", path=str(course)).load_config()
    return config.CourseDirectory.course_id


def main(argv: list[str]) -> None:
    if argv != ["due-dates"]:
        sys.exit("usage: python -m course_lib.grading.course_admin due-dates")
    course = Path.cwd()
    try:
        done = register_due_dates(course, course_id(course))
    except (OSError, ValueError) as error:
        sys.exit(f"due dates not registered: {error}")
    print("Due dates:", "; ".join(done))


if __name__ == "__main__":
    main(sys.argv[1:])
