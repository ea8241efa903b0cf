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
   only on the grading ranks (`course_lib.grading.verdicts` prepares what it is sent and
   reads what it answers). Its verdict becomes each test cell's outputs, from which
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
import json
import os
import shutil
import threading

import nbformat
from jupyter_client.manager import AsyncKernelManager
from nbclient.exceptions import DeadKernelError
from nbgrader.api import Gradebook, MissingEntry
from nbgrader.coursedir import CourseDirectory
from nbgrader.preprocessors import Execute
from traitlets import Bool, Float

from course_lib.grading import measurements, sandbox
from course_lib.grading.batch import NOT_GRADED
from course_lib.grading.verdicts import (
    GraderFailed,
    apply_verdicts,
    extra_credit,
    judge_cells,
    role,
    run_judge,
    save_extra_credit,
)

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
        sandbox.phase("kernel-launched")

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
                sandbox.phase("judge-returned")
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
                sandbox.phase("notebook-run-start")
                nb, resources = super().preprocess(nb, resources)
                sandbox.phase("notebook-run-done")
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
        measurements.save(nb, resources)  # for the leaderboard (`make leaderboard`)
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
        measurements.forget(info["db_url"], info["student"], info["assignment"])  # no rank
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
