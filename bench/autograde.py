"""Benchmark: what autograding one submission of each assignment costs, and a class with it.

    python bench/autograde.py [ASSIGNMENT ...]      (default: every assignment in solutions/)

For each assignment a temporary course folder gets a release and one correct submission, then
`nbgrader autograde` runs once (kernel start, the notebook's own cells, the judge and every
test cell, hidden tests included). Printed per assignment: wall seconds and core-seconds, the
user + system CPU of the whole process tree of `nbgrader autograde`, sandboxes, kernels,
judges, fork servers and ranks included (`process_cost.run_costed`: the kernel's count for a
cgroup of the run where one can be made, else getrusage's), with getrusage's and a sampler's
sums as checks. Then the mean, and the projection

    wall hours of a class = S * sum over assignments of core-s / C / 3600

for S students handing in each of the A assignments measured, graded on C cores kept busy (a
lower bound: it assumes submissions packed with no idle core). Targets: at most 30 core-s per
submission on average, every assignment under 60 s wall on a 2-core machine.

Then where the time went for each assignment (`grading_phases`): a timeline of its two lanes,
the notebook's own run and the judge, and which kinds of process the CPU went to.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # process_cost, grading_phases
from grading_phases import cell_times, phases, slowest_checks  # noqa: E402
from process_cost import Cost, class_hours, run_costed  # noqa: E402

from course_lib.grading.sandbox import PROFILE_ENV  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TARGET_S = 60.0  # wall seconds per submission, every assignment
TARGET_CORE_S = 30.0  # core-seconds per submission, mean over assignments
CLASS = (500, 11)  # students, assignments: the class the projection is printed for
CORES = (32, 128)


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


def autograde(assignment: str) -> tuple[Cost, list, list]:
    """Grade one right submission of `assignment`, costed: (cost, phases, slowest checks)."""
    with tempfile.TemporaryDirectory() as tmp:
        course = Path(tmp)
        shutil.copy2(ROOT / "nbgrader_config.py", course)
        shutil.copytree(ROOT / "solutions" / assignment, course / "solutions" / assignment)
        nbgrader(course, "generate_assignment", assignment, "--force")
        submit_solution(course, assignment)
        env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", PROFILE_ENV: "1"}
        start = time.time()
        argv = [str(BIN / "nbgrader"), "autograde", assignment, "--force"]
        cost = run_costed(argv, cwd=course, env=env)
        if cost.returncode != 0:
            raise RuntimeError(f"nbgrader autograde {assignment} failed:\n{cost.stderr[-3000:]}")
        graded = course / "autograded" / "bench" / assignment / f"{assignment}.ipynb"
        cells = cell_times(graded) if graded.exists() else []
        rows = phases(start, start + cost.wall_s, cost.stderr, cells)
        return cost, rows, slowest_checks(cost.stderr)


def import_torch_cost() -> Cost:
    """One `import torch` in a fresh interpreter: what each process that imports it pays."""
    return run_costed([sys.executable, "-c", "import torch"])


def main() -> None:
    names = sys.argv[1:] or sorted(p.name for p in (ROOT / "solutions").iterdir() if p.is_dir())
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start")
    print("core-s: the kernel's count for the run's cgroup where one can be made, else rusage; "
          "rusage: getrusage's; sampled: /proc, by process (process_cost)")  # fmt: skip
    columns = ("wall s", 8), ("core-s", 8), ("rusage", 8), ("sampled", 9), ("wall/60s", 10)
    print(f"{'assignment':<24}" + "".join(f"{name:>{width}}" for name, width in columns))
    costs = {}
    for assignment in names:
        cost, rows, slowest = autograde(assignment)
        costs[assignment] = (cost, rows, slowest)
        print(
            f"{assignment:<24}{cost.wall_s:>8.1f}{cost.core_s:>8.1f}{cost.rusage_s:>8.1f}"
            f"{sum(cost.by_kind.values()):>9.1f}{cost.wall_s / TARGET_S:>10.2f}"
            + (f"  ({cost.orphans_left} processes outlived it)" if cost.orphans_left else "")
        )
    core_s = [cost.core_s for cost, _, _ in costs.values()]
    mean = sum(core_s) / len(core_s)
    slow = [a for a, (cost, _, _) in costs.items() if cost.wall_s >= TARGET_S]
    print(f"\nmean {mean:.1f} core-s per submission (target <= {TARGET_CORE_S:g}: "
          f"{'met' if mean <= TARGET_CORE_S else 'NOT met'}); "
          f"over {TARGET_S:g} s wall: {', '.join(slow) or 'none'}")  # fmt: skip
    students, count = CLASS
    # Assignments not measured count at the mean of those measured.
    per_class = core_s + [mean] * max(0, count - len(core_s))
    print("class of S students x A assignments on C cores: S * sum(core-s) / C / 3600 h")
    for cores in CORES:
        hours = class_hours(students, per_class, cores)
        print(f"  {students} x {count} on {cores} cores: {hours:.2f} h")
    torch_cost = import_torch_cost()
    print(f"\nimport torch in a fresh process: {torch_cost.wall_s:.1f} s wall, "
          f"{torch_cost.core_s:.1f} core-s (paid by nbgrader, the kernel, the judge and "
          f"each fork server)")  # fmt: skip
    for assignment, (cost, rows, slowest) in costs.items():
        print(f"\n{assignment}: where the {cost.wall_s:.1f} s wall went (lanes run side by side)")
        for lane, name, seconds in rows:
            print(f"  {lane:<9}{name:<52}{seconds:>7.1f} s")
        shown = ", ".join(f"{cell} {s:.1f} s" for s, cell in slowest)
        print(f"  slowest test cells: {shown}")
        print(f"  CPU by process (sampled, {sum(cost.by_kind.values()):.1f} of "
              f"{cost.core_s:.1f} core-s):")  # fmt: skip
        for kind, seconds in cost.by_kind.items():
            print(f"    {kind:<30}{seconds:>7.1f} core-s")
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
