"""Benchmark: seconds to autograde one submission of each assignment.

    python bench/autograde.py

For each assignment in solutions/, a temporary course folder gets a release and one correct
submission, then `nbgrader autograde` runs once and is timed (kernel start, every test cell,
hidden tests included). Target on a 2-core CPU: under 60 s per submission.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TARGET_S = 60.0


def nbgrader(course: Path, *args: str) -> None:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(
        [str(BIN / "nbgrader"), *args], cwd=course, env=env, check=True, capture_output=True
    )


def submit_solution(course: Path, assignment: str) -> None:
    """Submit the release with the solution's answers filled in, as student 'bench' (the
    grading course's own way of building a right submission)."""
    sys.path.insert(0, str(ROOT))  # tests/ holds the one builder of submissions
    from tests.grading_course import solved, submit

    for release in (course / "assignments" / assignment).glob("*.ipynb"):
        solution = course / "solutions" / assignment / release.name
        submit(course, "bench", assignment, solved(release, solution), release.name)


def main() -> None:
    assignments = sorted(p.name for p in (ROOT / "solutions").iterdir() if p.is_dir())
    print(f"{'assignment':<24}{'autograde (s)':>14}{'target (s)':>12}{'ratio':>8}")
    for assignment in assignments:
        with tempfile.TemporaryDirectory() as tmp:
            course = Path(tmp)
            shutil.copy2(ROOT / "nbgrader_config.py", course)
            shutil.copytree(ROOT / "solutions" / assignment, course / "solutions" / assignment)
            nbgrader(course, "generate_assignment", assignment, "--force")
            submit_solution(course, assignment)
            start = time.perf_counter()
            nbgrader(course, "autograde", assignment, "--force")
            seconds = time.perf_counter() - start
        print(f"{assignment:<24}{seconds:>14.1f}{TARGET_S:>12.0f}{seconds / TARGET_S:>8.2f}")


if __name__ == "__main__":
    main()
