"""Benchmark: a class autograded serially against `make autograde JOBS=N`.

    python bench/autograde_parallel.py [K]

K submissions of a01_processes (solution, blank and planted bug in turn; default 4) are
graded in a fresh course folder by `make autograde` (one at a time, the reference) and by
`make autograde JOBS=2` (and JOBS=<cores> when there are more than 2), each in a course
folder of its own. Prints the seconds of each, the speed-up over the serial run measured
here, and whether every score, cell by cell, is the serial run's. One submission keeps
about two cores busy (its kernel and the judge's ranks run side by side) and each scratch
course starts an nbgrader of its own, so the speed-up needs free cores beyond two: on a
2-core machine JOBS=2 measured slower than the serial run.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ builds the class
from tests.grading_class import build, gradebook_scores, students  # noqa: E402
from tests.grading_course import make  # noqa: E402


def graded(jobs: int, names: list[str]) -> tuple[float, dict]:
    """Seconds `make autograde JOBS=jobs` took on a fresh class, and its gradebook's scores."""
    with tempfile.TemporaryDirectory() as tmp:
        course = Path(tmp)
        build(course, names)
        start = time.perf_counter()
        make(course, "autograde", f"JOBS={jobs}", timeout=3600)
        return time.perf_counter() - start, gradebook_scores(course)


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    names = students(count)
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0]  # others' work on the machine: the speed-up depends on it
    print(f"{count} submissions of a01_processes, {cores} cores, load {load:.1f}")
    reference_s, reference = graded(1, names)
    print(f"{'JOBS':>5}{'seconds':>10}{'speed-up':>10}  identical scores")
    print(f"{1:>5}{reference_s:>10.1f}{1.0:>10.2f}  (the reference)")
    for jobs in sorted({2, cores} - {1}):
        seconds, scores = graded(jobs, names)
        same = "yes" if scores == reference else "NO"
        print(f"{jobs:>5}{seconds:>10.1f}{reference_s / seconds:>10.2f}  {same}")


if __name__ == "__main__":
    main()
