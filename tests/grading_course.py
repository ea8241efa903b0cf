"""One course folder graded end to end, shared by test_autograde.py and test_cheats.py.

Everything runs in a temporary course folder through the Makefile targets (`make release`,
`make autograde`, `make feedback`), as an instructor would; scores are read from the
gradebook, not from logs. Grading takes minutes, so it happens once per test session, in a
process of its own that starts as soon as the tests are collected and runs alongside the
others (`python -m tests.grading_course FOLDER`, started by conftest.py).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import nbformat
from nbgrader.api import Gradebook
from nbgrader.utils import determine_grade

from course_lib.grading.verdicts import (
    apply_verdicts,
    extra_credit,
    judge_cells,
    role,
    run_judge,
    save_extra_credit,
)
from tests import cheats
from tests.conftest import ROOT

ASSIGNMENTS = sorted(p.name for p in (ROOT / "solutions").iterdir() if p.is_dir())
# While working on some assignments, grade only those end to end, e.g.
# COURSE_E2E_ONLY=a07_zero pytest tests/test_cheats.py (the tests of test_autograde.py that
# name a01 or a02 need those two). CI grades them all.
if os.environ.get("COURSE_E2E_ONLY"):
    _only = set(os.environ["COURSE_E2E_ONLY"].split(","))
    if _only - set(ASSIGNMENTS):
        raise ValueError(f"COURSE_E2E_ONLY names no assignment: {sorted(_only - set(ASSIGNMENTS))}")
    ASSIGNMENTS = [a for a in ASSIGNMENTS if a in _only]
# What a course folder needs from the repository to run the Makefile's targets.
COURSE_FILES = ("Makefile", "pyproject.toml", "requirements.lock", "nbgrader_config.py")
VENV = Path(sys.executable).parent.parent
JUDGED = "judged.json"  # scores of the submissions graded by the judge alone (`judge`)
JUDGES_BESIDE_AUTOGRADE = 1  # judges run at a time while `make autograde` runs (`build`)


def source(assignment: str) -> nbformat.NotebookNode:
    return nbformat.read(ROOT / "solutions" / assignment / f"{assignment}.ipynb", as_version=4)


def bonus(assignment: str) -> dict[str, float]:
    """grade id -> points of the assignment's extra-credit test cells (max score 0)."""
    return extra_credit(source(assignment))


def written(assignment: str) -> dict[str, float]:
    """grade id -> points of the assignment's written answers, graded by hand."""
    return {
        c.metadata.nbgrader["grade_id"]: c.metadata.nbgrader["points"]
        for c in source(assignment).cells
        if c.cell_type == "markdown" and c.metadata.get("nbgrader", {}).get("grade")
    }


# Bugs planted in a correct submission: (cell id, text, replacement, tests expected to fail).
BUG = {
    "a01_processes": (
        "ping_pong",
        "conn.send(conn.recv() + 1)",
        "conn.send(conn.recv())",
        {"test_ping_pong"},
    ),
    "a02_collectives": (
        "bidirectional_ring_all_reduce",
        "incoming += buffer",
        "incoming.copy_(buffer)",
        {"test_bidirectional_ring_all_reduce"},
    ),
    "a03_data_parallel": (
        "sync_gradients",
        "share = num_samples / total.item()",
        "share = 1 / world_size()",
        {"test_sync_gradients"},
    ),
    "a04_gossip": (
        "push_sum_step",
        "total = message + sum(inbox)",
        "total = message",
        {"test_push_sum", "test_schedule"},  # Part 2 runs Part 1's push_sum_step
    ),
    "a05_compression": (
        "powersgd",
        "M = grad + self.error",
        "M = grad",
        {"test_powersgd"},
    ),
    "a07_zero": (
        "zero2",
        "param.grad = None  # the full gradient is gone as soon as its shard exists",
        "pass",
        {"test_zero2"},
    ),
    "a08_pipeline": (
        "pipeline_step",
        'warmup = n_micro if schedule == "gpipe" else min(P - r - 1, n_micro)',
        "warmup = n_micro",
        {"test_1f1b"},
    ),
    "a09_tensor_parallel": (
        "tp_functions",
        "return grad.chunk(world_size(), dim=-1)[rank()].contiguous()",
        "return grad.chunk(world_size(), dim=-1)[0].contiguous()",
        {"test_column_parallel"},
    ),
    "a10_parallel_3d": (
        "train_step",
        "p.grad /= dp_size",
        "p.grad /= 1",
        {"test_train_2d"},
    ),
    "a11_sequence_parallel": (
        "ring_backward",
        "source = (r - step) % P",
        "source = (r - step - 1) % P",
        {"test_ring_causal", "test_ring_memory"},
    ),
    "a12_expert_parallel": (
        "moe_layer",
        "gates[token, slot, None] * back",
        "back",
        {"test_forward", "test_backward", "test_traffic"},
    ),
}
DEADLOCK = {  # rank 1 never replies, so rank 0 waits in recv forever
    "a01_processes": (
        "dist_ping_pong",
        "dist.send(buffer + 1, dst=0)",
        "pass",
        {"test_dist_ping_pong"},
    ),
}
# (d) and (e) need one assignment only: they test nbgrader and the launcher, not the checks.
TAMPERED = {"a01_processes"}  # the planted bug, plus the failing test cell emptied
# A submission that tries to overwrite the gradebook, another student's submission and the
# solution, from its kernel and from its grading ranks (its answer cell runs in both).
HOSTILE = ("a01_processes", "ping_pong")
OVERWRITTEN = "overwritten by a hostile submission"


# A solved submission whose student chose a display name for the leaderboard, markup
# included: the page must show it as text (tests/test_leaderboard.py). "solver" chose none.
LEADERBOARD = ("a01_processes", "ada", '<script>alert("Ada")</script> & co')


def targets(course: Path) -> list[Path]:
    a = HOSTILE[0]
    return [
        course / "gradebook.db",
        course / "submitted" / "solver" / a / f"{a}.ipynb",
        course / "solutions" / a / f"{a}.ipynb",
    ]


def hostile_code(course: Path) -> str:
    paths = [str(p) for p in targets(course)]
    return (
        f"for _path in {paths!r}:\n"
        "    try:\n"
        f"        open(_path, 'w').write({OVERWRITTEN!r})\n"
        "    except OSError:\n"
        "        pass\n\n"
    )


# A wrong broadcast, plus a cell the student labelled as a locked set-up cell that makes the
# check pass: if the judge ran it, the part would score.
FORGED = ("a02_collectives", "broadcast", "test_broadcast")
FORGED_CELL = (
    "import course_lib.grading, course_lib.grading.collectives\n"
    "course_lib.grading.check_broadcast = lambda *args, **kwargs: None\n"
    "course_lib.grading.collectives.check_broadcast = lambda *args, **kwargs: None\n"
)


def forged(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(FORGED_CELL)
    cell.metadata["nbgrader"] = {
        "grade": False,
        "grade_id": "forged_setup",
        "locked": True,
        "schema_version": 3,
        "solution": False,
    }
    nb.cells.insert(0, cell)
    answer = next(c for c in nb.cells if c.id == FORGED[1])
    answer.source = "def broadcast(tensor, src):\n    pass\n"
    return nb


# A solved submission with two cells of its own after the set-up cell: one writes past the
# folder its notebook runs in (1 GiB: where that is a tmpfs, the write fails and the run goes
# on), the next ends the kernel. Neither may cost a point: the judge grades the test cells.
CRASHED = ("a01_processes", "crasher")
OVERFILL = (
    "written = 0\n"
    "try:\n"
    "    for i in range(20):\n"
    "        with open(f'big{i}.bin', 'wb') as f:\n"
    "            f.write(bytes(64 << 20))\n"
    "        written += 64\n"
    "except OSError as error:\n"
    "    print('write failed:', error.strerror, 'after', written, 'MiB')\n"
)
CRASH = "import os\nos._exit(3)"


def crashing(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """`nb` with the OVERFILL and CRASH cells (ids "overfill", "crash") after its set-up cell."""
    setup = next(i for i, c in enumerate(nb.cells) if role(c) == "setup")
    cells = [nbformat.v4.new_code_cell(OVERFILL), nbformat.v4.new_code_cell(CRASH)]
    for cell, cell_id in zip(cells, ("overfill", "crash"), strict=True):
        cell.id = cell_id
    nb.cells[setup + 1 : setup + 1] = cells
    return nb


MARKERS = (
    "### BEGIN SOLUTION",
    "### END SOLUTION",
    "### BEGIN HIDDEN TESTS",
    "### END HIDDEN TESTS",
)


def make(course: Path, *targets: str, timeout: float = 1500) -> float:
    """Run make targets in the course folder; return the seconds they took. Past `timeout`,
    make and everything it started (nbgrader, sandboxes, ranks) are killed, and the error
    says which submissions were graded by then."""
    start = time.monotonic()
    code, stdout, stderr = run_make(course, *targets, timeout=timeout)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    return time.monotonic() - start


def run_make(
    course: Path, *targets: str, timeout: float = 1500, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """`make targets` in the course folder, with `env` added to the environment; (exit code,
    stdout, stderr). Past `timeout`, as `make`."""
    environment = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    # `-o STAMP`: never install into the running venv from a course folder. Where the venv's
    # stamp is older than pyproject.toml (a checkout that changed it since `make install`),
    # make would reinstall the course from this folder, which holds no course_lib: the
    # editable install would then find no package, here and in every process after.
    stamp = VENV / ".course-installed"
    process = subprocess.Popen(
        ["make", "-s", f"VENV={VENV}", "-o", str(stamp), *targets],
        cwd=course,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**environment, **(env or {})},
        start_new_session=True,  # its own process group, to stop as a whole
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        graded = sorted(str(p.relative_to(course)) for p in course.glob("autograded/*/*"))
        raise AssertionError(
            f"make {' '.join(targets)} took over {timeout:.0f} s and was stopped; graded by "
            f"then: {', '.join(graded) or 'nothing'}"
        ) from None
    return process.returncode, stdout, stderr


def notebooks(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.ipynb"))


def cell_regions(source: str, begin: str, end: str) -> list[str]:
    """The lines between begin and end markers, skipping ones too short to tell (")")."""
    lines, inside = [], False
    for line in source.splitlines():
        if begin in line:
            inside = True
        elif end in line:
            inside = False
        elif inside and len(line.strip()) >= 8:
            lines.append(line.strip())
    return lines


def solved(release: Path, solution: Path) -> nbformat.NotebookNode:
    """The release notebook with every answer cell filled in as the solution has it."""
    nb = nbformat.read(release, as_version=4)
    answers = {c.id: c.source for c in nbformat.read(solution, as_version=4).cells}
    for cell in nb.cells:
        if cell.metadata.get("nbgrader", {}).get("solution"):
            cell.source = "\n".join(
                line
                for line in answers[cell.id].splitlines()
                if "### BEGIN SOLUTION" not in line and "### END SOLUTION" not in line
            )
    return nb


def edit(nb: nbformat.NotebookNode, cell_id: str, old: str, new: str) -> None:
    cell = next(c for c in nb.cells if c.id == cell_id)
    assert old in cell.source, f"{old!r} not in cell {cell_id}"
    cell.source = cell.source.replace(old, new)


def submit(course: Path, student: str, assignment: str, nb: nbformat.NotebookNode, name: str):
    folder = course / "submitted" / student / assignment
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(folder / name))


def judge_request(
    course: Path, assignment: str, notebook: str, nb, tests: set[str] | None = None
) -> tuple[nbformat.NotebookNode, list[dict]]:
    """What `judge` sends to the judge: the notebook (with `tests`, only those test cells)
    and the cells the judge gets from the gradebook, as `make autograde` would send them.
    Read before the class is graded, so that no judge reads the gradebook nbgrader writes."""
    if tests is not None:
        nb = copy.deepcopy(nb)
        nb.cells = [
            c for c in nb.cells if role(c) != "test" or c.metadata.nbgrader["grade_id"] in tests
        ]
    info = {"db_url": f"sqlite:///{course / 'gradebook.db'}"}
    info.update(notebook=notebook, assignment=assignment)
    return nb, judge_cells(nb, {"nbgrader": info}, bonus(assignment))


def judge_scores(assignment: str, nb, cells: list[dict]) -> dict[str, list[float]]:
    """grade id -> [score, max score] of the test cells of `nb` once the sandboxed judge has
    judged `cells` (`judge_request`): its verdicts turned into the test cells' outputs and
    nbgrader's scoring of those."""
    extra = bonus(assignment)
    verdicts = run_judge(cells, sandboxed=True, timeout=1800)
    apply_verdicts(nb, verdicts, logging.getLogger(__name__))
    save_extra_credit(nb, {}, extra)
    out = {}
    for cell in nb.cells:
        if role(cell) == "test":
            grade_id = cell.metadata.nbgrader["grade_id"]
            if grade_id in extra:  # what `make autograde` writes to the grade's extra credit
                out[grade_id] = [cell.metadata["course_lib"]["score"], extra[grade_id]]
            else:
                out[grade_id] = list(determine_grade(cell))
    return out


def judge(
    course: Path, assignment: str, notebook: str, nb, tests: set[str] | None = None
) -> dict[str, list[float]]:
    """grade id -> [score, max score] of a submission as `make autograde` scores it, from
    the judge alone: the cells it gets from the gradebook, the sandboxed judge, its verdicts
    turned into the test cells' outputs and nbgrader's scoring of those. What it skips is the
    kernel that runs the notebook for the feedback, which has no say in a score. With `tests`,
    only those test cells are judged (and scored)."""
    return judge_scores(assignment, *judge_request(course, assignment, notebook, nb, tests))


def scores(course: Path, assignment: str, student: str) -> dict[str, tuple[float, float]]:
    """grade id -> (score, max score) of the autograded cells, from the gradebook (or from
    `judge`'s record for a submission graded by the judge alone). An extra-credit cell's max
    score is the extra credit it can earn (its gradebook maximum is 0); written answers,
    graded by hand, are left out (`manual_grades`)."""
    judged = json.loads((course / JUDGED).read_text()).get(assignment, {})
    if student in judged:
        return {grade: tuple(pair) for grade, pair in judged[student].items()}
    extra, hand = bonus(assignment), written(assignment)
    return {
        g.name: (g.score, g.max_score or extra.get(g.name, 0.0))
        for g in grades(course, assignment, student)
        if g.name not in hand
    }


def grades(course: Path, assignment: str, student: str, db: Path | None = None) -> list:
    """The gradebook's Grade rows of a submission (detached: read them, do not change them)."""
    with Gradebook(f"sqlite:///{db or course / 'gradebook.db'}") as gradebook:
        out = []
        for notebook in gradebook.find_assignment(assignment).notebooks:
            submission = gradebook.find_submission_notebook(notebook.name, assignment, student)
            out += [SimpleNamespace(**g.to_dict(), score=g.score) for g in submission.grades]
        return out


def manual_grades(course: Path, assignment: str, student: str, db: Path | None = None):
    """grade id -> the gradebook's record of each written answer (auto_score, manual_score,
    extra_credit, needs_manual_grade, score, max_score)."""
    hand = written(assignment)
    return {g.name: g for g in grades(course, assignment, student, db) if g.name in hand}


def release_course(course: Path) -> None:
    """Fill `course` with the repository's solutions and release them (`make release`)."""
    for name in COURSE_FILES:
        shutil.copy2(ROOT / name, course / name)  # copy2 keeps mtimes: no reinstall
    shutil.copytree(ROOT / "solutions", course / "solutions")
    make(course, "release")


def build(course: Path) -> float:
    """A course folder with a fresh release, graded submissions (the solution, the blank
    release, planted bugs, a deadlock, a tampered test, and the cheats and alternatives of
    `tests/cheats/`) and feedback; returns how long `make autograde` took. Submissions whose
    verdicts are the judge's alone (planted bugs, cheats that change no shared state,
    alternatives) are graded by `judge`, without the kernel that renders feedback; the others
    go through `make autograde`, as a class's would (a submission whose kernel dies, too)."""
    judge_only = []
    release_course(course)
    for assignment in ASSIGNMENTS:
        for release in notebooks(course / "assignments" / assignment):
            solution = course / "solutions" / assignment / release.name
            submit(course, "solver", assignment, solved(release, solution), release.name)
            submit(course, "blank", assignment, nbformat.read(release, 4), release.name)
            if assignment in BUG:
                nb = solved(release, solution)
                edit(nb, *BUG[assignment][:3])
                judge_only.append(("buggy", assignment, release.stem, copy.deepcopy(nb)))
                if assignment in TAMPERED:
                    # The same bug, plus the student "fixing" the failing test by emptying it.
                    failing = sorted(BUG[assignment][3])[0]
                    next(c for c in nb.cells if c.id == failing).source = "pass"
                    submit(course, "tamperer", assignment, nb, release.name)
            if assignment in DEADLOCK:
                nb = solved(release, solution)
                edit(nb, *DEADLOCK[assignment][:3])
                submit(course, "deadlocked", assignment, nb, release.name)
            if assignment == HOSTILE[0]:
                nb = solved(release, solution)
                cell = next(c for c in nb.cells if c.id == HOSTILE[1])
                cell.source = hostile_code(course) + cell.source
                submit(course, "hostile", assignment, nb, release.name)
            if assignment == FORGED[0]:
                nb = forged(solved(release, solution))
                submit(course, "forger", assignment, nb, release.name)
            if assignment == CRASHED[0]:
                nb = crashing(solved(release, solution))
                submit(course, CRASHED[1], assignment, nb, release.name)
            if assignment == LEADERBOARD[0]:
                nb = solved(release, solution)
                chosen = f"LEADERBOARD_NAME = {LEADERBOARD[2]!r}"
                edit(nb, "leaderboard_name", 'LEADERBOARD_NAME = ""', chosen)
                submit(course, LEADERBOARD[1], assignment, nb, release.name)
            for student, nb, whole in cheats.submissions(release, solution, assignment):
                if whole:
                    submit(course, student, assignment, nb, release.name)
                else:
                    judge_only.append((student, assignment, release.stem, nb))
    # The submissions judged alone are judged while `make autograde` grades the others: a
    # grading waits on processes starting and on timeouts as much as it computes, so the two
    # share the CPU well (one judge at a time besides it: the checks' own time limits must
    # hold on a busy CI machine). A cheat that changes only its own answer cells is judged
    # on the parts it targets.
    requests = [
        (student, assignment, *judge_request(course, assignment, notebook, nb, targets))
        for student, assignment, notebook, nb in judge_only
        for targets in [cheats.targets(assignment, student)]
    ]
    pool = ThreadPoolExecutor(JUDGES_BESIDE_AUTOGRADE)
    try:
        scored = [pool.submit(judge_scores, a, nb, cells) for _, a, nb, cells in requests]
        seconds = make(course, "autograde", timeout=3600)
        make(course, "feedback")
        judged: dict = {}
        for (student, assignment, *_), future in zip(requests, scored, strict=True):
            judged.setdefault(assignment, {})[student] = future.result()
    finally:
        pool.shutdown(cancel_futures=True)  # a failed `make` waits for no more judges
    (course / JUDGED).write_text(json.dumps(judged, indent=1))
    return seconds


if __name__ == "__main__":  # python -m tests.grading_course FOLDER [--release-only]
    if sys.argv[2:] == ["--release-only"]:
        release_course(Path(sys.argv[1]))
    else:
        print(f"autograde took {build(Path(sys.argv[1])):.1f} s", flush=True)
