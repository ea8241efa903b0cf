"""What runs on each rank for Assignment 8's trainer check: the student's `pipeline_step` on
this rank's own stage and data, step after step, and what it did, as plain data.

A rank holds only its share (`pipeline_cases.share`): its stage, drawn in the checking
process, and of each batch only what its stage needs. The reference is trained in the
checking process, and the calls each rank makes are reported to the launcher as they happen
(`course_lib.counted_group`), between the marks that say which step of which run they belong
to: mark i opens step i (counting on through the runs), the last mark closes the last.

Each forward and backward of the stage is reported too, the moment it runs, as a note among
the calls (`watch`: ("F", a fingerprint of its input), ("B", the same)): the judge reads the
order of forwards and backwards, micro-batch by micro-batch, from what the launcher received,
never from a list on the rank. One record is still kept on the rank, beside the student's
code: the sends of `send_tensor` not waited for (`SendLog`), which no call shows. No number
the verdict reads comes from the rank's own records: the gradients, parameters and loss are
held to the reference trained in the checking process, the messages and the order of the
stage's work to the launcher's.

    run_runs(pipeline_step, schedule, runs, shares, forbidden)   what every rank runs
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from course_lib import counted_group
from course_lib.grading.pipeline_cases import PipelineRun, loss_function
from course_lib.grading.pipeline_plumbing import SendLog, watch
from course_lib.grading.provenance import Provenance
from course_lib.grading.training import make_optimizer


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


def _run(
    pipeline_step: Callable, schedule: str, run: PipelineRun, given: dict, seen, first: int
) -> list[dict]:
    """One run on this rank: per step, what its stage did and computed. Step s is case
    `first + s` of the marks."""
    stage, names = given["stage"], given["names"]
    watched = watch(stage)
    optimizer = make_optimizer("sgd", stage.parameters())
    steps = []
    for s, batch in enumerate(given["steps"]):
        for p, handed in zip(stage.parameters(), batch["handed"], strict=True):
            p.grad = handed
        counted_group.mark(first + s)
        with SendLog() as sends, seen:
            returned = pipeline_step(
                watched,
                batch["inputs"],
                batch["targets"],
                loss_function(run),
                run.n_micro,
                schedule,
            )
        grads = {n: _copy(p.grad) for n, p in zip(names, stage.parameters(), strict=True)}
        optimizer.step()
        steps.append(
            {
                "returned": "float" if isinstance(returned, float) else type(returned).__name__,
                "loss": float(returned) if isinstance(returned, float) else None,
                "grads": grads,
                "params": {
                    n: p.detach().clone() for n, p in zip(names, stage.parameters(), strict=True)
                },
                "unwaited": sends.unwaited(),
            }
        )
    return steps


def run_runs(
    pipeline_step: Callable,
    schedule: str,
    runs: list[PipelineRun],
    shares: list[dict],
    forbidden: tuple,
) -> dict:
    """Every run in turn, in the same order on every rank, on this rank's share of each;
    the steps are marked 0, 1, ... through the runs, and a last mark closes them."""
    seen = Provenance(forbidden)  # watches the student's calls only, not the check's code
    results, first = [], 0
    for run, given in zip(runs, shares, strict=True):
        results.append(_run(pipeline_step, schedule, run, given, seen, first))
        first += run.steps
    counted_group.mark(first)  # what comes after the last step belongs to none
    return {"result": results, "copied": seen.complaint()}


__all__ = ["run_runs"]
