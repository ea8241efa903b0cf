"""Autograde a class in parallel: every submission in a scratch course folder of its own.

    python -m course_lib.grading.batch grade [--jobs N] [--student S ...] [--no-sandbox]
    python -m course_lib.grading.batch merge
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
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from nbgrader.api import Gradebook, MissingEntry

SCRATCH = "grading-scratch"
GRADEBOOK = "gradebook.db"
STATUS = "status.json"  # written in a scratch course once its grading is over
LOG = "nbgrader.log"
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
    scores, comments, flags, late penalty) from a scratch gradebook into the course's."""
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


def merge(course: Path) -> list[str]:
    """Merge every graded scratch course into the course (gradebook.db and autograded/),
    one after the other, and remove it; the submissions that could not be graded."""
    failed = []
    for scratch in sorted((course / SCRATCH).glob("*/*")):
        student, assignment = scratch.parent.name, scratch.name
        if not (scratch / STATUS).exists():
            failed.append(f"{student}/{assignment} (its grading never finished)")
            continue
        ok = json.loads((scratch / STATUS).read_text())["exit_code"] == 0
        if not ok:
            failed.append(f"{student}/{assignment} (see {scratch / LOG})")
        try:
            merge_gradebook(scratch / GRADEBOOK, course / GRADEBOOK, student, assignment)
        except MissingEntry:  # nbgrader stopped before it recorded the submission
            continue
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
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.grading.batch")
    parser.add_argument("command", choices=["grade", "merge", "students"])
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
    if args.command == "grade":
        pairs = submissions(course, args.student)
        if not pairs:
            raise SystemExit("Nothing to grade: put submissions in submitted/<student>/<a>/")
        if args.student is None:  # the whole class: nothing left over from an earlier run
            shutil.rmtree(course / SCRATCH, ignore_errors=True)
        grade_all(course, pairs, jobs=args.jobs, sandbox=not args.no_sandbox)
        return 0  # failures are reported by `merge`, as they would be by a serial run
    failed = merge(course)
    if failed:
        print(
            "WARNING: these submissions could not be graded (they score 0; their logs are "
            f"kept in {SCRATCH}/): {', '.join(failed)}. The others were graded."
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
