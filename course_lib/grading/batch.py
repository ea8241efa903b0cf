"""Autograde a class in parallel: every submission in a scratch course folder of its own.

    python -m course_lib.grading.batch grade [--jobs N] [--student S ...] [--no-sandbox]
    python -m course_lib.grading.batch merge
    python -m course_lib.grading.batch not-graded
    python -m course_lib.grading.batch students

nbgrader's gradebook is one SQLite file, and `nbgrader autograde` is written for one writer.
So `grade` gives each submission (student, assignment) a scratch course of its own under
`grading-scratch/<student>/<assignment>/`: the course's nbgrader_config.py, a copy of its
gradebook, the assignment's source files and the submission. There an ordinary
`nbgrader autograde` grades it (sandboxed, as `make autograde` does), N of them at a time.
`merge` then copies, one submission after the other, each scratch gradebook's rows for that
submission into the course's gradebook.db and its autograded/ folder into the course's, and
removes the scratch. Each scratch starts from the course's gradebook, so a submission is
graded from the same state as in a serial run, and its scores are the same.

The scratch folders can be graded anywhere that sees the course folder: `make autograde
JOBS=N` on one machine, or one Slurm array task per student (examples/grade_class.sh).

A submission the grader itself failed on (`verdicts.GraderFailed`: no sandbox, a judge that
cannot start...) has no grade, never a 0: `GradeInSandbox` removes it from the gradebook and
records it in the course's NOT_GRADED. `merge` leaves such a submission out (and takes any
older grade of it out of the course's gradebook), as it does one whose grading never finished
or stopped before nbgrader recorded it, keeps its scratch folder and log, and exits non-zero
naming each with its cause; `not-graded` does the same after a serial `make autograde`. A
notebook nbgrader itself rejected (its cells' metadata forged, say) is merged as nbgrader
recorded it: it scores 0, with a warning.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from nbgrader.api import Gradebook, MissingEntry

from course_lib.grading import measurements

SCRATCH = "grading-scratch"
GRADEBOOK = "gradebook.db"
STATUS = "status.json"  # written in a scratch course once its grading is over
LOG = "nbgrader.log"
# In a course folder: one JSON line per submission left without a grade ({"student",
# "assignment", "notebook", "cause"}), written by autograde.GradeInSandbox and by `merge`.
NOT_GRADED = "not-graded.jsonl"
BIN = Path(sys.executable).parent  # nbgrader's, and the `alembic` its gradebook runs


def submissions(course: Path, students: list[str] | None = None) -> list[tuple[str, str]]:
    """(student, assignment) of every folder submitted/<student>/<assignment>/, sorted."""
    found = sorted(
        (path.parent.name, path.name)
        for path in (course / "submitted").glob("*/*")
        if path.is_dir() and not path.name.startswith(".") and not path.parent.name.startswith(".")
    )
    if students is not None:
        unknown = set(students) - {student for student, _ in found}
        if unknown:
            raise SystemExit(f"no submissions in submitted/ for: {', '.join(sorted(unknown))}")
        found = [(s, a) for s, a in found if s in students]
    return found


def scratch_course(course: Path, student: str, assignment: str) -> Path:
    return course / SCRATCH / student / assignment


def prepare(course: Path, student: str, assignment: str) -> Path:
    """A fresh scratch course for one submission: config, gradebook copy, source, submission."""
    scratch = scratch_course(course, student, assignment)
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    shutil.copy2(course / "nbgrader_config.py", scratch)
    if (course / "schedule.csv").exists():  # the late rules the config's penalty plugin reads
        shutil.copy2(course / "schedule.csv", scratch)
    if not (course / GRADEBOOK).exists():
        raise SystemExit(f"no {GRADEBOOK} in {course}: run `make release` first")
    shutil.copy2(course / GRADEBOOK, scratch)
    source = course / "solutions" / assignment
    if source.is_dir():  # nbgrader copies the source's other files over the submission's
        shutil.copytree(source, scratch / "solutions" / assignment)
    shutil.copytree(
        course / "submitted" / student / assignment,
        scratch / "submitted" / student / assignment,
    )
    return scratch


def grade(course: Path, student: str, assignment: str, *, sandbox: bool = True) -> int:
    """Grade one submission in its scratch course with `nbgrader autograde`; its exit code.
    The log goes to the scratch's nbgrader.log, the outcome to its status.json."""
    scratch = prepare(course, student, assignment)
    argv = [str(BIN / "nbgrader"), "autograde", assignment, "--student", student, "--force"]
    if not sandbox:
        argv.append("--GradeInSandbox.sandbox=False")
    with open(scratch / LOG, "w") as log:
        code = subprocess.run(argv, cwd=scratch, stdout=log, stderr=subprocess.STDOUT).returncode
    (scratch / STATUS).write_text(json.dumps({"exit_code": code}))
    return code


def grade_all(
    course: Path, pairs: list[tuple[str, str]], *, jobs: int, sandbox: bool = True
) -> list[tuple[str, str]]:
    """Grade the submissions `pairs`, `jobs` at a time; the ones nbgrader failed on. Each
    log is printed whole when its submission is done (never interleaved)."""
    if jobs < 1:
        raise SystemExit(f"--jobs must be at least 1, not {jobs}")
    printing = threading.Lock()

    def one(pair: tuple[str, str]) -> int:
        code = grade(course, *pair, sandbox=sandbox)
        with printing:
            print(f"=== {pair[0]} / {pair[1]}: exit code {code}", flush=True)
            sys.stdout.write((scratch_course(course, *pair) / LOG).read_text())
            sys.stdout.flush()
        return code

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        codes = list(pool.map(one, pairs))
    return [pair for pair, code in zip(pairs, codes, strict=True) if code != 0]


def merge_gradebook(scratch_db: Path, course_db: Path, student: str, assignment: str) -> None:
    """Copy what `nbgrader autograde` wrote for one submission (student, submission time,
    scores, comments, flags, late penalty; the open parts' measurements and display name,
    `measurements`) from a scratch gradebook into the course's."""
    with (
        Gradebook(f"sqlite:///{scratch_db}") as source,
        Gradebook(f"sqlite:///{course_db}") as target,
    ):
        who = source.find_student(student)
        target.update_or_create_student(
            student,
            first_name=who.first_name,
            last_name=who.last_name,
            email=who.email,
            lms_user_id=who.lms_user_id,
        )
        graded = source.find_submission(assignment, student)
        submission = target.update_or_create_submission(assignment, student)
        submission.timestamp, submission.extension = graded.timestamp, graded.extension
        for notebook in graded.notebooks:
            into = target.find_submission_notebook(notebook.name, assignment, student)
            into.flagged = notebook.flagged
            into.late_submission_penalty = notebook.late_submission_penalty
            for g in notebook.grades:
                to = target.find_grade(g.name, notebook.name, assignment, student)
                to.auto_score, to.manual_score = g.auto_score, g.manual_score
                to.extra_credit, to.needs_manual_grade = g.extra_credit, g.needs_manual_grade
            for c in notebook.comments:
                to = target.find_comment(c.name, notebook.name, assignment, student)
                to.auto_comment, to.manual_comment = c.auto_comment, c.manual_comment
        target.db.commit()
    measurements.copy(scratch_db, course_db, student, assignment)


def merge(course: Path) -> list[str]:
    """Merge every graded scratch course into the course (gradebook.db and autograded/),
    one after the other, and remove it; the submissions nbgrader reported errors for but
    recorded (they are merged). Those left without a grade are recorded in the course's
    NOT_GRADED (see `not_graded`); their scratch folders stay, for a look at their logs."""
    rejected = []
    for scratch in sorted((course / SCRATCH).glob("*/*")):
        student, assignment = scratch.parent.name, scratch.name
        cause = _why_not_graded(scratch)
        if cause is None:
            try:
                merge_gradebook(scratch / GRADEBOOK, course / GRADEBOOK, student, assignment)
            except MissingEntry:  # nbgrader stopped before it recorded the submission
                cause = f"nbgrader did not record it (see {scratch / LOG})"
        if cause is not None:
            _record_not_graded(course, student, assignment, cause)
            continue
        ok = json.loads((scratch / STATUS).read_text())["exit_code"] == 0
        if not ok:
            rejected.append(f"{student}/{assignment} (see {scratch / LOG})")
        graded = scratch / "autograded" / student / assignment
        into = course / "autograded" / student / assignment
        shutil.rmtree(into, ignore_errors=True)
        if graded.is_dir():  # nbgrader removes what it failed to grade
            shutil.copytree(graded, into)
        if ok:  # a failure's log stays for a look
            shutil.rmtree(scratch)
    for empty in [*(course / SCRATCH).glob("*"), course / SCRATCH]:
        if empty.is_dir() and not any(empty.iterdir()):
            empty.rmdir()
    return rejected


def _why_not_graded(scratch: Path) -> str | None:
    """Why a scratch course's submission has no grade, or None if it was graded."""
    if not (scratch / STATUS).exists():
        return f"its grading never finished (see {scratch / LOG})"
    records = _records(scratch)
    if records:
        return "; ".join(r["cause"].splitlines()[0] for r in records) + f" (see {scratch / LOG})"
    return None


def _record_not_graded(course: Path, student: str, assignment: str, cause: str) -> None:
    """Record that a submission has no grade, and make it so: any older grade of it goes."""
    with Gradebook(f"sqlite:///{course / GRADEBOOK}") as gradebook:
        with contextlib.suppress(MissingEntry):
            gradebook.remove_submission(assignment, student)
    measurements.forget(course / GRADEBOOK, student, assignment)
    shutil.rmtree(course / "autograded" / student / assignment, ignore_errors=True)
    with open(course / NOT_GRADED, "a") as f:
        f.write(json.dumps({"student": student, "assignment": assignment, "cause": cause}) + "\n")


def _records(course: Path) -> list[dict]:
    path = course / NOT_GRADED
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def not_graded(course: Path) -> list[str]:
    """The submissions of submitted/ the gradebook holds no grade of, each with why: the
    causes NOT_GRADED records for it (the grader failed on it), else nbgrader's log."""
    causes: dict[tuple[str, str], list[str]] = {}
    for record in _records(course):
        cause = record["cause"].splitlines()[0]
        causes.setdefault((record["student"], record["assignment"]), []).append(cause)
    if not (course / GRADEBOOK).exists():
        raise SystemExit(f"no {GRADEBOOK} in {course}: run `make release` first")
    missing = []
    with Gradebook(f"sqlite:///{course / GRADEBOOK}") as gradebook:
        for student, assignment in submissions(course):
            try:
                gradebook.find_submission(assignment, student)
            except MissingEntry:
                why = causes.get((student, assignment), ["nbgrader did not record it: see its log"])
                missing.append(f"{student}/{assignment}: {'; '.join(dict.fromkeys(why))}")
    return missing


def report_not_graded(course: Path) -> int:
    """Print the submissions left without a grade (`not_graded`); 1 if there are any."""
    missing = not_graded(course)
    if not missing:
        return 0
    print(
        f"ERROR: {len(missing)} submission(s) NOT graded, because the grader itself failed "
        "(not the students' code):",
        *(f"  {line}" for line in missing),
        f"They have no grade in {GRADEBOOK} (not a 0) and grades.csv was not written. Fix the "
        "cause, then run `make autograde` again: it grades them.",
        sep="\n",
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.grading.batch")
    parser.add_argument("command", choices=["grade", "merge", "not-graded", "students"])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--student", action="append", help="only this student (repeatable)")
    parser.add_argument("--no-sandbox", action="store_true", help="as make autograde SANDBOX=off")
    parser.add_argument("--course", type=Path, default=Path.cwd())
    args = parser.parse_args(argv)
    os.environ["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    course = args.course.resolve()
    if args.command == "students":
        print("\n".join(sorted({student for student, _ in submissions(course)})))
        return 0
    if args.command == "not-graded":
        return report_not_graded(course)
    if args.command == "grade":
        pairs = submissions(course, args.student)
        if not pairs:
            raise SystemExit("Nothing to grade: put submissions in submitted/<student>/<a>/")
        if args.student is None:  # the whole class: nothing left over from an earlier run
            shutil.rmtree(course / SCRATCH, ignore_errors=True)
            (course / NOT_GRADED).unlink(missing_ok=True)
        grade_all(course, pairs, jobs=args.jobs, sandbox=not args.no_sandbox)
        return 0  # failures are reported by `merge`, as they would be by a serial run
    rejected = merge(course)
    if rejected:
        print(
            "WARNING: nbgrader reported errors for these submissions, merged as it recorded "
            f"them (a notebook it rejects scores 0; their logs are kept in {SCRATCH}/): "
            f"{', '.join(rejected)}."
        )
    return report_not_graded(course)


if __name__ == "__main__":
    sys.exit(main())
