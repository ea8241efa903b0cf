"""How `nbgrader autograde` runs a submission here: sandboxed, and judged by a clean process.

`nbgrader_config.py` puts `GradeInSandbox` in place of nbgrader's `Execute`. For each
submitted notebook it

1. runs the student's cells (all but the test cells) in a kernel inside the sandbox
   (`course_lib.grading.sandbox`), so the feedback shows their outputs: the kernel cannot read
   the course folder, other submissions, the solutions or the gradebook, and has limits on
   processes, memory, file size, time and the size of the folder it works in (a copy of the
   submission's other files, `Limits.folder_bytes`: a write past it fails);
2. grades the test cells in a separate sandboxed process, `course_lib.grading.judge`, which
   imports the checks and never runs student code: the student's answer cells are executed
   only on the grading ranks. Its verdict becomes each test cell's outputs, from which
   nbgrader reads the score as usual (an error: 0; a number: partial credit).

The two runs fail apart, and an honest student never loses points to the machinery:

- When the notebook's own run dies (a demo cell runs out of memory, segfaults or calls
  `os._exit`), the test cells keep the judge's verdicts, and the cell it died in says so in the
  feedback, with why as far as the sandbox knows (`sandbox.Guard.reason`, the exit status); the
  cells after it are not run.
- When the grader itself fails (no sandbox, a kernel that cannot start in it, a judge that
  cannot start or import, or dies outside a test cell, or for no limit's reason: see
  `run_judge`), the notebook raises `GraderFailed`: nbgrader reports it and exits non-zero, the
  submission is removed from the gradebook (no grade, rather than a 0) and recorded in the
  course's `batch.NOT_GRADED`, which `make autograde` reports before it fails
  (`python -m course_lib.grading.batch not-graded`). A rerun grades it.
- What the student's code does still scores 0 on its part, as a notebook would: it raises, it
  deadlocks past the check's timeout, or the judge is stopped by a limit (time, memory,
  processes) while it runs their code in a test cell.

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

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import subprocess
import sys
import threading

import nbformat
from jupyter_client.manager import AsyncKernelManager
from nbclient.exceptions import DeadKernelError
from nbgrader.api import Gradebook, MissingEntry
from nbgrader.coursedir import CourseDirectory
from nbgrader.preprocessors import Execute
from nbgrader.utils import is_grade, is_locked, is_solution
from traitlets import Bool, Float

from course_lib.grading import sandbox
from course_lib.grading.batch import NOT_GRADED

NO_SANDBOX = (
    "cannot grade in a sandbox: {why}. Student code would run with your rights (it could read "
    "the solutions and other submissions and write the gradebook). Install bubblewrap, or "
    "grade anyway with `make autograde SANDBOX=off` (GradeInSandbox.sandbox = False)."
)
RUN_DIED = (
    "The notebook's own run (the one that shows your outputs here) died in this cell: {why}. "
    "The cells after it were not run. Your test cells were graded apart, by the judge, and "
    "their scores stand."
)


RUN_NOT_STARTED = (
    "The notebook's own run (the one that shows your outputs here) did not start: {why}. Your "
    "test cells were graded apart, by the judge, and their scores stand."
)


class GraderFailed(RuntimeError):
    """The grading machinery failed, not the student's code: the submission is not graded."""


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
    """A kernel started inside the sandbox, talking to nbgrader over Unix sockets in a shared
    folder (`folder`, a `sandbox.SharedFolder`; the sandbox has no network but loopback of its
    own), with `limits`."""

    folder: sandbox.SharedFolder
    limits = sandbox.Limits()

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.transport = "ipc"
        self.connection_file = os.path.join(self.folder.path, "kernel.json")
        self.ip = os.path.join(self.folder.path, "kernel-ipc")
        self.guard: sandbox.Guard | None = None

    def format_kernel_cmd(self, extra_arguments=None) -> list[str]:
        argv = super().format_kernel_cmd(extra_arguments)
        # A signal would reach bwrap, not the kernel: interrupt with a message instead.
        self.kernel_spec.interrupt_mode = "message"
        work = os.path.join(self.folder.path, "work")
        return sandbox.command(
            argv,
            limits=self.limits,
            shared=[self.folder.path],
            chdir=work,
            env=sandbox.environment(),
        )

    async def _async_launch_kernel(self, kernel_cmd, **kw) -> None:
        self.guard = sandbox.Guard(self.limits, [self.folder])
        kw["preexec_fn"] = self.guard.preexec
        await super()._async_launch_kernel(kernel_cmd, **kw)
        self.guard.watch(self.provisioner.process.pid)

    def why_it_died(self) -> str:
        """Why the kernel ended, as far as is known: a limit, or its exit status."""
        reason = self.guard.reason() if self.guard is not None else None
        return f"it {reason}" if reason else why_it_ended(self)

    async def _async_shutdown_kernel(self, *args, **kwargs) -> None:
        try:
            await super()._async_shutdown_kernel(*args, **kwargs)
        finally:
            if self.guard is not None:
                self.guard.close()


def why_it_ended(kernel_manager) -> str:
    """A kernel's exit status, in words."""
    process = getattr(getattr(kernel_manager, "provisioner", None), "process", None)
    return sandbox.describe_exit(process.poll() if process is not None else None)


class GradeInSandbox(Execute):
    """nbgrader's Execute, with the student's code sandboxed and the tests judged apart."""

    limits = sandbox.Limits()  # the kernel's (before the trait `sandbox` hides the module)
    sandbox = Bool(True, help="Run submissions in the sandbox (False: unsandboxed).").tag(
        config=True
    )
    judge_timeout = Float(1800.0, help="Seconds the judge may take for one notebook.").tag(
        config=True
    )

    def preprocess(self, nb, resources):
        try:
            return self._grade(nb, resources)
        except GraderFailed as failure:
            self._leave_ungraded(resources, str(failure))
            raise

    def _grade(self, nb, resources):
        ok, why = sandbox.available()
        if not ok and self.sandbox:
            raise GraderFailed(NO_SANDBOX.format(why=why))
        self._sandboxed = ok and self.sandbox
        if not self._sandboxed:
            self.log.warning("GRADING WITHOUT A SANDBOX: %s", why or "switched off")
        self._died: str | None = None  # why the notebook's own run stopped, once it has
        self._why_not_run: str | None = None  # to show in the first cell, if it never started
        # The judge needs only the cells' sources: it runs while the kernel runs the notebook.
        judged: dict = {}
        failed: list[GraderFailed] = []
        self._judge_failed = threading.Event()  # the kernel's run is of no use then

        def judge() -> None:
            try:
                judged.update(
                    run_judge(cells, sandboxed=self._sandboxed, timeout=self.judge_timeout)
                )
            except Exception as error:  # noqa: BLE001 (the grader's failure, raised below)
                if not isinstance(error, GraderFailed):
                    error = GraderFailed(f"the judge's driver failed: {error!r}")
                failed.append(error)
                self._judge_failed.set()

        bonus = self._extra_credit(resources)
        cells = judge_cells(nb, resources, bonus)
        thread = threading.Thread(target=judge, daemon=True)
        thread.start()
        with contextlib.ExitStack() as stack:
            stack.callback(thread.join)
            if self._sandboxed:
                folder = stack.enter_context(sandbox.SharedFolder(self.limits.folder_bytes))
                self._prepare_scratch(folder.path, resources)
                self.kernel_manager_class = type(
                    "ScratchKernelManager",
                    (SandboxedKernelManager,),
                    {"folder": folder, "limits": self.limits},
                )
            try:
                nb, resources = super().preprocess(nb, resources)
            except Exception as error:
                if not self._judge_failed.is_set():
                    raise GraderFailed(
                        f"the notebook's kernel could not run{' in the sandbox' * self._sandboxed}"
                        f": {type(error).__name__}: {error}"
                    ) from error
        if failed:
            raise failed[0]
        apply_verdicts(nb, judged, self.log)
        save_extra_credit(nb, resources, bonus)
        return nb, resources

    def _leave_ungraded(self, resources, cause: str) -> None:
        """The grader failed on this submission: say so loudly, take it out of the gradebook
        (so that it has no grade, rather than a 0, until a rerun grades it) and record it in
        the course's NOT_GRADED."""
        info = resources.get("nbgrader", {})
        who = "/".join(info.get(key, "?") for key in ("student", "assignment", "notebook"))
        self.log.error("NOT GRADED: %s: the grader failed, not the student's code: %s", who, cause)
        if "db_url" not in info:
            return
        with Gradebook(info["db_url"]) as gradebook, contextlib.suppress(MissingEntry):
            gradebook.remove_submission(info["assignment"], info["student"])
        record = {key: info.get(key) for key in ("student", "assignment", "notebook")}
        with open(os.path.join(self._coursedir().root, NOT_GRADED), "a") as f:
            f.write(json.dumps({**record, "cause": cause}) + "\n")

    def _coursedir(self) -> CourseDirectory:
        converter = getattr(self.parent, "parent", None)
        return getattr(converter, "coursedir", None) or CourseDirectory(config=self.config)

    def _extra_credit(self, resources) -> dict[str, float]:
        """The extra-credit test cells of the instructor's source notebook (never the
        submission's metadata, which the student could edit)."""
        info = resources.get("nbgrader", {})
        if "db_url" not in info:
            return {}
        coursedir = self._coursedir()
        folder = coursedir.format_path(coursedir.source_directory, ".", info["assignment"])
        path = os.path.join(folder, f"{info['notebook']}.ipynb")
        if not os.path.exists(path):
            self.log.warning("no source notebook %s: no extra credit is awarded", path)
            return {}
        return extra_credit(nbformat.read(path, as_version=4))

    def _prepare_scratch(self, scratch: str, resources) -> None:
        """The kernel's working folder: a copy of the submission's other files. (The sandbox's
        user is this user outside, so it may write here; nobody else may.) If they cannot be
        copied (they do not fit in `Limits.folder_bytes`), the notebook is not run; the judge
        grades it all the same."""
        work = os.path.join(scratch, "work")
        source = resources.get("metadata", {}).get("path") or "."
        try:
            shutil.copytree(source, work, ignore=shutil.ignore_patterns("*.ipynb"))
        except OSError as error:
            size = f"{self.limits.folder_bytes / sandbox.GIB:g} GiB"
            self._died = f"the submission's files could not be copied to its {size} folder"
            self._why_not_run = RUN_NOT_STARTED.format(why=f"{self._died} ({error})"[:500])

    def preprocess_cell(self, cell, resources, index):
        if role(cell) == "test":
            return cell, self.resources  # judged apart, in a clean process
        if self._judge_failed.is_set() or (self._died and cell.cell_type == "code"):
            if cell.cell_type == "code":  # not run: no outputs of the student's own run
                cell.outputs, cell.execution_count = [], None
                if self._why_not_run:
                    _say(cell, "NotebookNotRun", self._why_not_run)
                    self._why_not_run = None
            return cell, self.resources
        try:
            return super().preprocess_cell(cell, resources, index)
        except DeadKernelError:
            sandboxed = isinstance(self.km, SandboxedKernelManager)
            self._died = self.km.why_it_died() if sandboxed else why_it_ended(self.km)
            cell_id = cell.metadata.get("nbgrader", {}).get("grade_id", cell.id)
            self.log.warning("the notebook's own run died in cell %s: %s", cell_id, self._died)
            _say(cell, "NotebookRunDied", RUN_DIED.format(why=self._died))
            return cell, self.resources


def _say(cell, name: str, message: str) -> None:
    """Add an error output that says `message` to `cell` (for the feedback)."""
    cell.outputs.append(
        nbformat.v4.new_output("error", ename=name, evalue=message, traceback=[message])
    )


def apply_verdicts(nb, verdicts: dict, log) -> None:
    """The judge's verdicts become the test cells' outputs, from which nbgrader scores."""
    for cell in nb.cells:
        if role(cell) != "test":
            continue
        cell_id = cell.metadata.get("nbgrader", {}).get("grade_id", cell.id)
        verdict = verdicts.get(cell_id)
        if verdict is None:  # `run_judge` raises unless a limit stopped the student's code
            why = verdicts.get(None, "the judge did not reach it")
            log.warning("test cell %s scores 0: %s", cell_id, why)
            verdict = _stopped(cell_id, why)
        cell.outputs = [nbformat.from_dict(o) for o in verdict["outputs"]]
        cell.execution_count = None
        cell.metadata["course_lib"] = {
            "score": verdict.get("score", 0),
            "tampering": verdict.get("tampering", []),
            "seconds": verdict.get("seconds"),
        }
        for what in verdict.get("tampering", []):
            log.warning("TAMPERING in test cell %s: %s", cell_id, what)


def run_judge(
    cells: list[dict], *, sandboxed: bool, timeout: float, limits: sandbox.Limits | None = None
) -> dict:
    """Run the judge on the cells (`judge_cells`), in the sandbox unless `sandboxed` is False,
    for at most `timeout` seconds (with other `limits` than the sandbox's default, if given);
    its verdicts by cell id (see `judge_outcome`)."""
    tests = [cell["id"] for cell in cells if cell["role"] == "test"]
    if not tests:
        return {}
    token = secrets.token_hex(16)
    request = json.dumps({"token": token, "cells": cells})
    argv = [sys.executable, "-m", "course_lib.grading.judge"]
    if sandboxed:
        limits = dataclasses.replace(limits or sandbox.Limits(), seconds=timeout)
        code, out, err, killed = sandbox.run(argv, input=request, limits=limits)
    else:
        code, out, err, killed = _run_plain(argv, request, timeout)
    return judge_outcome(tests, token, code, out, err, killed)


def judge_outcome(
    tests: list[str], token: str, code: int, out: str, err: str, killed: str | None
) -> dict:
    """The verdicts by cell id in what the judge wrote (`out`: its lines after `token`), its
    exit code, its stderr and why a limit stopped it (`sandbox.Guard.reason`).

    If it stopped before it judged every test cell in `tests`, whose fault that is decides:
    a limit (time, memory, processes) that stopped it while it ran a test cell, which runs
    the student's code, is the student's, and the reason is kept under the key None (the
    cells left score 0, as a part whose code ran out of time does). Any other stop is the
    grader's and raises `GraderFailed`: it could not start or import, it failed outside a
    test cell (`judge.main` reports that as "broken"), a limit stopped it outside a test
    cell, or it died with no limit to blame."""
    verdicts: dict = {}
    judging = broken = None
    for line in out.splitlines():
        if line.startswith(token):
            message = json.loads(line[len(token) :])
            if "judging" in message:
                judging = message["judging"]
            elif "broken" in message:
                broken = message["broken"]
            else:
                verdicts[message["id"]] = message
                judging = None
    if all(cell_id in verdicts for cell_id in tests):
        return verdicts
    if broken:
        raise GraderFailed(f"the judge failed: {broken}")
    if killed and judging is not None:
        verdicts[None] = f"the judge was stopped while it judged {judging}: it {killed}"
        return verdicts
    where = (
        f"while it judged {judging}"
        if judging
        else "between two test cells"
        if verdicts
        else "before it judged a test cell"
    )
    ended = f"it {killed}" if killed else sandbox.describe_exit(code)
    raise GraderFailed(f"the judge stopped {where} ({ended}): {_last_lines(err) or 'no message'}")


def _last_lines(text: str, lines: int = 3) -> str:
    """The last few lines of a process's stderr, on one line."""
    return " | ".join([line.strip() for line in text.splitlines() if line.strip()][-lines:])[-600:]


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


def _stopped(cell_id: str, why: str) -> dict:
    """The verdict of a test cell the judge did not reach, having been stopped by a limit
    while it ran the student's code: 0."""
    return {
        "id": cell_id,
        "score": 0,
        "tampering": [],
        "outputs": [
            {
                "output_type": "error",
                "ename": "GradingStopped",
                "evalue": why,
                "traceback": [f"GradingStopped: {why}"],
            }
        ],
    }


def _run_plain(argv: list[str], request: str, timeout: float) -> tuple[int, str, str, str | None]:
    try:
        result = subprocess.run(
            argv, input=request, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as error:
        out = error.stdout.decode() if isinstance(error.stdout, bytes) else error.stdout or ""
        return -9, out, "", f"ran longer than {timeout:g} s"
    return result.returncode, result.stdout, result.stderr, None
