"""The schedule, its late rule, and LMS archives collected by `make zip-collect`.
(grades.csv and the penalty inside nbgrader are tested end to end in test_exchange.py.)"""

from __future__ import annotations

import shutil
import zipfile
from datetime import datetime
from pathlib import Path

import pytest

from course_lib.grading.course_admin import CANVAS, Deadline, parse_due, read_schedule
from tests.conftest import ROOT
from tests.grading_course import COURSE_FILES, make

A = "a01_processes"


def test_due_dates_are_converted_from_their_time_zone_to_utc():
    assert parse_due("2027-01-15 23:59 Europe/Paris", "x") == datetime(2027, 1, 15, 22, 59)
    assert parse_due("2027-07-15 23:59 Europe/Paris", "x") == datetime(2027, 7, 15, 21, 59)
    assert parse_due("2027-07-15 08:00:30 America/New_York", "x") == datetime(
        2027, 7, 15, 12, 0, 30
    )
    assert parse_due("  ", "x") is None


@pytest.mark.parametrize(
    "due, error",
    [
        ("2027-01-15 23:59", "should read"),
        ("2027-01-15 23:59 Mars/Olympus", "Mars/Olympus"),
        ("2027-13-15 23:59 UTC", "month"),
    ],
)
def test_a_malformed_due_date_says_where_and_why(due, error):
    with pytest.raises(ValueError, match=error):
        parse_due(due, "schedule.csv, line 2")


def test_the_penalty_counts_started_days_and_stops_at_the_cap_and_the_score():
    rule = Deadline(A, datetime(2027, 1, 1), points_per_day=1.5, max_points=4)
    day = 86400
    assert rule.penalty(0, 10) == 0
    assert rule.penalty(1, 10) == 1.5  # a second late is a started day
    assert rule.penalty(day, 10) == 1.5
    assert rule.penalty(day + 1, 10) == 3
    assert rule.penalty(10 * day, 10) == 4  # the cap
    assert rule.penalty(10 * day, 2) == 2  # never more than the score


def test_the_course_schedule_covers_every_assignment_with_a_due_date():
    schedule = read_schedule(ROOT / "schedule.csv")
    assert set(schedule) == {p.name for p in (ROOT / "solutions").iterdir() if p.is_dir()}
    assert all(deadline.due is not None for deadline in schedule.values())


def test_a_schedule_with_bad_points_or_columns_is_refused(tmp_path):
    path = tmp_path / "schedule.csv"
    path.write_text("assignment,due,late_points_per_day,late_points_max\na01,,-1,2\n")
    with pytest.raises(ValueError, match="line 2: late points must not be negative"):
        read_schedule(path)
    path.write_text("assignment,due\na01,\n")
    with pytest.raises(ValueError, match="missing column"):
        read_schedule(path)


def test_canvas_names_give_the_user_id_lateness_and_the_notebook():
    match = CANVAS.match("smithjohn_LATE_23456_78901_a01_processes-1.ipynb")
    assert (match["lms_user_id"], match["late"], match["file"]) == ("23456", "LATE", A)
    match = CANVAS.match("doejane_12345_67890_a01_processes.ipynb")
    assert (match["lms_user_id"], match["late"], match["file"]) == ("12345", None, A)
    assert CANVAS.match("a01_processes.ipynb") is None


def test_zip_collect_files_a_canvas_archive_under_the_rostered_students(tmp_path: Path):
    course = tmp_path / "course"
    course.mkdir()
    for name in COURSE_FILES:
        shutil.copy2(ROOT / name, course / name)
    shutil.copytree(ROOT / "assignments" / A, course / "assignments" / A)
    (course / "students.csv").write_text(
        "id,first_name,last_name,email,lms_user_id\njdoe,Jane,Doe,,12345\njsmith,John,Smith,,23456\n"
    )
    make(course, "roster", "FILE=students.csv")
    release = (course / "assignments" / A / f"{A}.ipynb").read_text()
    files = {
        f"doejane_12345_67890_{A}.ipynb": release.replace("# YOUR CODE HERE", "# jane's"),
        f"smithjohn_LATE_23456_78901_{A}.ipynb": release.replace("# YOUR CODE HERE", "# john's"),
        f"roepat_34567_89012_{A}.ipynb": release,  # not in the roster: filed by Canvas id
        "doejane_12345_67890_notes.txt": "not a notebook",
    }
    archive = tmp_path / "submissions.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    make(course, "zip-collect", f"FILE={archive}", f"ASSIGNMENT={A}")
    submitted = sorted(
        str(p.relative_to(course / "submitted")) for p in course.glob("submitted/*/*/*")
    )
    assert submitted == [f"{s}/{A}/{A}.ipynb" for s in ("34567", "jdoe", "jsmith")]
    assert "# jane's" in (course / "submitted" / "jdoe" / A / f"{A}.ipynb").read_text()
    assert "# john's" in (course / "submitted" / "jsmith" / A / f"{A}.ipynb").read_text()
