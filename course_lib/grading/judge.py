"""Grade a submission's test cells in a process that never runs the student's code.

    python -m course_lib.grading.judge  < request.json

The request holds the notebook's cells, each with a role: "setup" (the instructor's locked
set-up cell), "answer" (a student's answer cell) and "test" (the instructor's test cell,
hidden tests included). This process imports the checks, runs the set-up cells, binds each
name the answer cells define to an `Answer` (their source code, which only the grading
ranks execute), then runs every test cell statement by statement and turns what the checks
report into the cell's outputs and score. A statement that fails a part's result ends the
cell, as in a notebook; a partial failure (bytes, say) lets the next checks run, since they
may find more to deduct. Student code never runs here, so it cannot rebind
a check, patch the judging code or fake a result: the ranks send back data only, and a rank
whose libraries were changed fails the part (`course_lib._integrity`).

It answers on stdout, one JSON line after the request's token per message: lines the ranks
print go to stdout too, and they cannot know the token. `{"judging": id}` before each test
cell, the cell's verdict (`{"id": id, "score": ...}`) after it, and `{"broken": why}` if the
judge itself failed outside a test cell. Before any student code runs it starts grading ranks
and runs a call on them (`_start_ranks`): a launcher that cannot start is the grader's
failure, not a part's. `course_lib.grading.verdicts.run_judge` starts this process inside the
sandbox, reads those lines and decides whose fault an early stop was: a judge that cannot
import, breaks, or stops outside a test cell leaves the submission ungraded; one stopped by a
limit while a test cell ran the student's code scores the cells left 0.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import io
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from course_lib.grading._harness import (
    RESULT,
    CheckFailed,
    close_pool,
    grading_pool,
    share,
    take_measurements,
)
from course_lib.grading.answers import Answer, defined_names
from course_lib.grading.sandbox import PROFILE_ENV, phase

PR_SET_DUMPABLE = 4
START_RANKS = 2  # the world size of the grading ranks started before any student code runs


@dataclass
class CellVerdict:
    """What the judge found for one test cell."""

    id: str
    points: float
    failed: set[str] = field(default_factory=set)
    weights: dict[str, float] = field(default_factory=lambda: {RESULT: 1.0})
    errors: list[dict] = field(default_factory=list)  # {"ename", "evalue"}
    tampering: list[str] = field(default_factory=list)
    output: str = ""
    seconds: float = 0.0  # how long the cell took to judge
    # what an open part's check measured here (`_harness.measured`), for the leaderboard
    measurements: list[dict] = field(default_factory=list)

    @property
    def score(self) -> float:
        if self.tampering or any(e["ename"] != "CheckFailed" for e in self.errors):
            return 0.0
        return round(self.points * share(self.weights, self.failed), 4)

    def outputs(self) -> list[dict]:
        """The cell's outputs as nbformat dicts, from which nbgrader reads the score: an error
        scores 0, a number is partial credit, anything else is full marks."""
        text = self.output
        if self.tampering:
            text += "TAMPERING DETECTED: " + "; ".join(self.tampering) + "\n"
        outputs = [{"output_type": "stream", "name": "stdout", "text": text}] if text else []
        score = self.score
        if score >= self.points:
            summary = f"{self.points:g} of {self.points:g} points\n"
            return outputs + [{"output_type": "stream", "name": "stdout", "text": summary}]
        if score > 0:
            summary = f"{score:g} of {self.points:g} points"
            outputs.append({"output_type": "stream", "name": "stdout", "text": summary + "\n"})
            return outputs + [
                {
                    "output_type": "execute_result",
                    "data": {"text/plain": f"{score:g}"},
                    "metadata": {},
                    "execution_count": None,
                }
            ]
        first = self.errors[0] if self.errors else {"ename": "CheckFailed", "evalue": ""}
        if self.tampering:
            first = {"ename": "TamperingDetected", "evalue": "; ".join(self.tampering)}
        return outputs + [
            {
                "output_type": "error",
                "ename": first["ename"],
                "evalue": first["evalue"],
                "traceback": [f"{first['ename']}: {first['evalue']}"],
            }
        ]


def grade(
    cells: list[dict], judging: Callable[[str], None] = lambda cell_id: None
) -> Iterator[CellVerdict]:
    """Run the test cells against the answer cells; one verdict per test cell, as each is
    done. `judging(cell_id)` is called as each test cell starts."""
    namespace: dict = {"__name__": "__main__"}
    setup_names: set[str] = set()
    for cell in cells:
        if cell["role"] == "setup":
            exec(compile(cell["source"], f"<cell {cell['id']}>", "exec"), namespace)  # noqa: S102
            setup_names |= set(defined_names(cell["source"]))
    answer_cells = tuple((c["id"], c["source"]) for c in cells if c["role"] in ("setup", "answer"))
    rebound: dict[str, str] = {}
    for cell in cells:
        if cell["role"] != "answer":
            continue
        for name in defined_names(cell["source"]):
            if name in setup_names:
                rebound[name] = cell["id"]  # the set-up cell's binding stays
            else:
                namespace[name] = Answer(name, answer_cells)
    for cell in cells:
        if cell["role"] == "test":
            judging(cell["id"])
            yield _measured(_run_test, cell, dict(namespace), rebound)


def _measured(run: Callable[..., CellVerdict], *args) -> CellVerdict:
    """`run(*args)`'s verdict with what its checks measured in this process (and nothing left
    over from an earlier cell)."""
    take_measurements()
    verdict = run(*args)
    verdict.measurements = take_measurements()
    return verdict


def _run_test(cell: dict, namespace: dict, rebound: dict[str, str]) -> CellVerdict:
    verdict = CellVerdict(cell["id"], float(cell["points"]))
    tree = ast.parse(cell["source"])
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    for name in sorted(used & set(rebound)):
        verdict.tampering.append(
            f"answer cell {rebound[name]!r} rebinds {name}, which this test uses"
        )
    captured, start = io.StringIO(), time.perf_counter()
    with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
        for statement in tree.body:
            code = compile(ast.Module([statement], []), f"<cell {cell['id']}>", "exec")
            try:
                exec(code, namespace)  # noqa: S102 (the instructor's test cell)
            except CheckFailed as error:
                if error.tampering:
                    verdict.tampering.append(str(error))
                verdict.failed |= error.failed
                verdict.weights = error.weights if len(error.weights) > 1 else verdict.weights
                verdict.errors.append({"ename": "CheckFailed", "evalue": str(error)})
                print(f"CheckFailed: {error}")
                if RESULT in error.failed:
                    break  # the part scores 0: later checks cannot change that (a cell stops)
            except Exception as error:  # noqa: BLE001 (reported in the cell, scores 0)
                verdict.failed.add(RESULT)
                verdict.errors.append({"ename": type(error).__name__, "evalue": str(error)})
                print("".join(traceback.format_exception_only(type(error), error)), end="")
                break
    verdict.output = captured.getvalue()
    verdict.seconds = time.perf_counter() - start
    return verdict


def _not_dumpable() -> None:
    """Keep the ranks (same user, same sandbox) out of this process: no ptrace, no reading
    its memory or its file descriptors through /proc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


def _start_ranks() -> None:
    """Start grading ranks (kept warm for the checks) and run a call on them, before any
    student code runs: if the launcher cannot start here, the grader is broken."""
    answers = grading_pool(START_RANKS).launch(int, timeout=120)
    if answers != [0] * START_RANKS:
        raise RuntimeError(f"grading ranks answered {answers!r} to int()")


def _started_at() -> float:
    """When this process started, in Unix time to the clock tick (psutil's `create_time` is
    off by up to a second: it adds the boot time, which /proc/stat gives in whole seconds)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age


def main() -> None:
    if os.environ.get(PROFILE_ENV):  # when the sandbox started it, then what it imported
        phase("judge-process", at=_started_at())
        phase("judge-imported")  # its interpreter, torch and every check
    _not_dumpable()
    request = json.loads(sys.stdin.read())
    sys.stdin.close()
    token = request["token"]

    def say(message: dict) -> None:
        sys.stdout.write("\n" + token + json.dumps(message) + "\n")
        sys.stdout.flush()

    # One line per test cell as soon as it is graded: if the sandbox is stopped later (a
    # limit reached), the cells graded so far keep their scores.
    try:
        _start_ranks()
        phase("judge-ranks-started")  # the fork server (torch and the checks again), 2 ranks
        for v in grade(request["cells"], lambda cell_id: say({"judging": cell_id})):
            phase(f"judge-cell {v.id}")
            say(
                {
                    "id": v.id,
                    "score": v.score,
                    "outputs": v.outputs(),
                    "tampering": v.tampering,
                    "seconds": round(v.seconds, 3),
                    "points": v.points,
                    "measurements": v.measurements,
                }
            )
        close_pool()
        phase("judge-done")
    except Exception as error:  # noqa: BLE001 (a test cell's own errors are caught in it)
        lines = traceback.format_exception(type(error), error, error.__traceback__)
        say({"broken": f"{type(error).__name__}: {error}\n" + "".join(lines[-12:])})
        sys.exit(3)


if __name__ == "__main__":
    main()
