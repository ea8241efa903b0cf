"""How `nbgrader autograde` runs a submission here: sandboxed, and judged by a clean process.

`nbgrader_config.py` puts `GradeInSandbox` in place of nbgrader's `Execute`. For each
submitted notebook it

1. runs the student's cells (all but the test cells) in a kernel inside the sandbox
   (`course_lib.grading.sandbox`), so the feedback shows their outputs: the kernel cannot read
   the course folder, other submissions, the solutions or the gradebook, and has limits on
   processes, memory, file size and time;
2. grades the test cells in a separate sandboxed process, `course_lib.grading.judge`, which
   imports the checks and never runs student code: the student's answer cells are executed
   only on the grading ranks. Its verdict becomes each test cell's outputs, from which
   nbgrader reads the score as usual (an error: 0; a number: partial credit).

Without a working sandbox, grading stops with an error that says why; `make autograde
SANDBOX=off` (`GradeInSandbox.sandbox = False`) grades anyway, unsandboxed, with a warning on
every notebook. Tampering found by the judge is logged and written to the cell's metadata
(`course_lib.tampering`), which `python -m course_lib.grading.report` lists.

Extra credit: a test cell whose instructor source has nbgrader `points: 0` and
`"course_lib": {"extra_credit": N}` in its metadata is judged out of N points, and what it earns
is written to its grade's `extra_credit` in the gradebook, so it adds to a student's score but
not to the assignment's maximum (nbgrader's `Grade.score` is the auto or manual score plus the
extra credit). Written answers (markdown answer cells with points) are left to the formgrader.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading

import nbformat
from jupyter_client.manager import AsyncKernelManager
from nbgrader.api import Gradebook
from nbgrader.coursedir import CourseDirectory
from nbgrader.preprocessors import Execute
from nbgrader.utils import is_grade, is_locked, is_solution
from traitlets import Bool, Float, Unicode

from course_lib.grading import sandbox

NO_SANDBOX = (
    "cannot grade in a sandbox: {why}. Student code would run with your rights (it could read "
    "the solutions and other submissions and write the gradebook). Install bubblewrap, or "
    "grade anyway with `make autograde SANDBOX=off` (GradeInSandbox.sandbox = False)."
)


def role(cell: nbformat.NotebookNode) -> str | None:
    """ "setup", "answer" or "test" for the code cells the judge needs, else None."""
    if cell.cell_type != "code":
        return None
    if is_grade(cell) and not is_solution(cell):
        return "test"
    if is_solution(cell):
        return "answer"
    if is_locked(cell):
        return "setup"
    return None


class SandboxedKernelManager(AsyncKernelManager):
    """A kernel started inside the sandbox, talking to nbgrader over Unix sockets in a
    scratch folder (the sandbox has no network but loopback of its own)."""

    scratch = Unicode()

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.transport = "ipc"
        self.connection_file = os.path.join(self.scratch, "kernel.json")
        self.ip = os.path.join(self.scratch, "kernel-ipc")
        self.limits = sandbox.Limits()
        self.guard: sandbox.Guard | None = None

    def format_kernel_cmd(self, extra_arguments=None) -> list[str]:
        argv = super().format_kernel_cmd(extra_arguments)
        # A signal would reach bwrap, not the kernel: interrupt with a message instead.
        self.kernel_spec.interrupt_mode = "message"
        work = os.path.join(self.scratch, "work")
        return sandbox.command(
            argv, limits=self.limits, shared=[self.scratch], chdir=work, env=sandbox.environment()
        )

    async def _async_launch_kernel(self, kernel_cmd, **kw) -> None:
        self.guard = sandbox.Guard(self.limits)
        kw["preexec_fn"] = self.guard.preexec
        await super()._async_launch_kernel(kernel_cmd, **kw)
        self.guard.watch(self.provisioner.process.pid)

    async def _async_shutdown_kernel(self, *args, **kwargs) -> None:
        try:
            await super()._async_shutdown_kernel(*args, **kwargs)
        finally:
            if self.guard is not None:
                self.guard.close()


class GradeInSandbox(Execute):
    """nbgrader's Execute, with the student's code sandboxed and the tests judged apart."""

    sandbox = Bool(True, help="Run submissions in the sandbox (False: unsandboxed).").tag(
        config=True
    )
    judge_timeout = Float(1800.0, help="Seconds the judge may take for one notebook.").tag(
        config=True
    )

    def preprocess(self, nb, resources):
        ok, why = sandbox.available()
        if not ok and self.sandbox:
            raise RuntimeError(NO_SANDBOX.format(why=why))
        self._sandboxed = ok and self.sandbox
        if not self._sandboxed:
            self.log.warning("GRADING WITHOUT A SANDBOX: %s", why or "switched off")
        # The judge needs only the cells' sources: it runs while the kernel runs the notebook.
        judged: dict = {}
        bonus = self._extra_credit(resources)
        cells = judge_cells(nb, resources, bonus)
        judge = threading.Thread(target=lambda: judged.update(self._run_judge(cells)), daemon=True)
        judge.start()
        scratch = tempfile.mkdtemp(prefix="course_lib-grade-")
        try:
            if self._sandboxed:
                self._prepare_scratch(scratch, resources)
                self.kernel_manager_class = type(
                    "ScratchKernelManager", (SandboxedKernelManager,), {"scratch": Unicode(scratch)}
                )
            nb, resources = super().preprocess(nb, resources)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            judge.join()
        apply_verdicts(nb, judged, self.log)
        save_extra_credit(nb, resources, bonus)
        return nb, resources

    def _extra_credit(self, resources) -> dict[str, float]:
        """The extra-credit test cells of the instructor's source notebook (never the
        submission's metadata, which the student could edit)."""
        info = resources.get("nbgrader", {})
        if "db_url" not in info:
            return {}
        converter = getattr(self.parent, "parent", None)
        coursedir = getattr(converter, "coursedir", None) or CourseDirectory(config=self.config)
        folder = coursedir.format_path(coursedir.source_directory, ".", info["assignment"])
        path = os.path.join(folder, f"{info['notebook']}.ipynb")
        if not os.path.exists(path):
            self.log.warning("no source notebook %s: no extra credit is awarded", path)
            return {}
        return extra_credit(nbformat.read(path, as_version=4))

    def _prepare_scratch(self, scratch: str, resources) -> None:
        """The kernel's working folder: a copy of the submission's other files. (The sandbox's
        user is this user outside, so it may write here; nobody else may.)"""
        work = os.path.join(scratch, "work")
        source = resources.get("metadata", {}).get("path") or "."
        shutil.copytree(source, work, ignore=shutil.ignore_patterns("*.ipynb"))

    def preprocess_cell(self, cell, resources, index):
        if role(cell) == "test":
            return cell, self.resources  # judged apart, in a clean process
        return super().preprocess_cell(cell, resources, index)

    # --- the judge ---

    def _run_judge(self, cells: list[dict]) -> dict:
        return run_judge(cells, sandboxed=self._sandboxed, timeout=self.judge_timeout)


def apply_verdicts(nb, verdicts: dict, log) -> None:
    """The judge's verdicts become the test cells' outputs, from which nbgrader scores."""
    for cell in nb.cells:
        if role(cell) != "test":
            continue
        cell_id = cell.metadata.get("nbgrader", {}).get("grade_id", cell.id)
        verdict = verdicts.get(cell_id)
        if verdict is None:
            why = verdicts.get(None, "the grader did not run")
            log.error("test cell %s was not graded: %s", cell_id, why)
            verdict = _not_graded(cell_id, why)
        cell.outputs = [nbformat.from_dict(o) for o in verdict["outputs"]]
        cell.execution_count = None
        cell.metadata["course_lib"] = {
            "score": verdict.get("score", 0),
            "tampering": verdict.get("tampering", []),
            "seconds": verdict.get("seconds"),
        }
        for what in verdict.get("tampering", []):
            log.warning("TAMPERING in test cell %s: %s", cell_id, what)


def run_judge(cells: list[dict], *, sandboxed: bool, timeout: float) -> dict:
    """Run the judge on the cells (`judge_cells`), in the sandbox unless `sandboxed` is
    False; its verdicts by cell id, plus why it stopped under the key None if it did not
    grade every test cell."""
    if not any(cell["role"] == "test" for cell in cells):
        return {}
    token = secrets.token_hex(16)
    request = json.dumps({"token": token, "cells": cells})
    argv = [sys.executable, "-m", "course_lib.grading.judge"]
    if sandboxed:
        code, out, err, killed = sandbox.run(
            argv, input=request, limits=sandbox.Limits(seconds=timeout)
        )
    else:
        code, out, err, killed = _run_plain(argv, request, timeout)
    verdicts: dict = {None: killed or f"the grader stopped (exit code {code}): {err[-800:]}"}
    for line in out.splitlines():
        if line.startswith(token):
            verdict = json.loads(line[len(token) :])
            verdicts[verdict["id"]] = verdict
    return verdicts


def extra_credit(nb) -> dict[str, float]:
    """grade id -> extra-credit points of the notebook's test cells worth 0 points that say
    `"course_lib": {"extra_credit": N}`."""
    out = {}
    for cell in nb.cells:
        bonus = cell.metadata.get("course_lib", {}).get("extra_credit")
        if role(cell) == "test" and bonus is not None:
            if _points(cell):
                grade_id = cell.metadata["nbgrader"]["grade_id"]
                raise ValueError(f"test cell {grade_id} has points and extra credit: keep one")
            out[cell.metadata["nbgrader"]["grade_id"]] = float(bonus)
    return out


def save_extra_credit(nb, resources, bonus: dict[str, float]) -> None:
    """Write what each extra-credit test cell earned (`apply_verdicts`' score) to its grade.
    Its partial-credit output goes (nbgrader refuses a number above the cell's 0 points)."""
    for cell in nb.cells:
        if role(cell) == "test" and cell.metadata.get("nbgrader", {}).get("grade_id") in bonus:
            cell.outputs = [o for o in cell.outputs if o.output_type != "execute_result"]
    info = resources.get("nbgrader", {})
    if not bonus or "db_url" not in info:
        return
    with Gradebook(info["db_url"]) as gradebook:
        for cell in nb.cells:
            grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
            if role(cell) == "test" and grade_id in bonus:
                grade = gradebook.find_grade(
                    grade_id, info["notebook"], info["assignment"], info["student"]
                )
                grade.extra_credit = cell.metadata["course_lib"]["score"]
        gradebook.db.commit()


def judge_cells(nb, resources, bonus: dict[str, float] | None = None) -> list[dict]:
    """What the judge gets: the set-up, answer and test cells, in the notebook's order.

    The judge runs set-up and test cells itself, so their code comes from the gradebook (the
    instructor's source, hidden tests included), never from the submission: a cell the
    student added or relabelled as locked is not run there. Answer cells are the student's
    (the judge only ships them to the ranks). `bonus` (`extra_credit`) gives the points of
    extra-credit test cells, whose nbgrader points are 0."""
    info = resources.get("nbgrader", {})
    if "db_url" not in info:  # outside `nbgrader autograde`: trust the notebook's own cells
        bonus = extra_credit(nb)
        return [
            _cell(cell.id, role(cell), cell.source, bonus.get(cell.id) or _points(cell))
            for cell in nb.cells
            if role(cell)
        ]
    with Gradebook(info["db_url"]) as gradebook:
        source = gradebook.find_notebook(info["notebook"], info["assignment"])
        originals = {c.name: c for c in source.source_cells}
        points = {c.name: c.max_score for c in source.grade_cells}
        points.update((bonus or {}).items())
        answers = {c.name for c in source.solution_cells}
        cells = []
        for cell in nb.cells:
            grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
            original = originals.get(grade_id)
            if original is None or original.cell_type != "code":
                continue
            if grade_id in answers:
                cells.append(_cell(grade_id, "answer", cell.source, 0))
            elif grade_id in points:
                cells.append(_cell(grade_id, "test", original.source, points[grade_id]))
            elif original.locked:
                cells.append(_cell(grade_id, "setup", original.source, 0))
    return cells


def _cell(cell_id: str, cell_role: str, source: str, points: float) -> dict:
    return {"id": cell_id, "role": cell_role, "source": source, "points": points}


def _points(cell) -> float:
    return cell.metadata.get("nbgrader", {}).get("points", 0)


def _not_graded(cell_id: str, why: str) -> dict:
    return {
        "id": cell_id,
        "score": 0,
        "tampering": [],
        "outputs": [
            {
                "output_type": "error",
                "ename": "NotGraded",
                "evalue": why,
                "traceback": [f"NotGraded: {why}"],
            }
        ],
    }


def _run_plain(argv: list[str], request: str, timeout: float) -> tuple[int, str, str, None]:
    try:
        result = subprocess.run(
            argv, input=request, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as error:
        return -9, error.stdout or "", f"ran longer than {timeout:g} s", None
    return result.returncode, result.stdout, result.stderr, None
