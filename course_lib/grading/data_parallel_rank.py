"""What runs on each rank in Assignment 3's checks: training with the student's code, on this
rank's own shards and weights, and nothing else.

The samples, the initial weights and the reference are drawn and computed in the checking
process (`data_parallel_cases`, `data_parallel_training`). The calls a rank makes are reported
to the launcher as they happen (`course_lib.counted_group`), between the marks that say which
case (`data_parallel_cases.cases`) they belong to; the rank keeps no tally the check judges
by. What it returns: per step its gradients after synchronization and its parameters after the
optimizer's step, for Part 2 its state right after construction, and how often it waited
during backward (`comm_log.WaitLog`: the one fact the launcher cannot see).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from course_lib.comm_log import WaitLog
from course_lib.grading.data_parallel_runs import (
    FORBIDDEN,
    RankRun,
    _grads,
    build_model,
    rank_loss,
)
from course_lib.grading.provenance import Provenance
from course_lib.grading.traffic import CaseMarks
from course_lib.grading.training import make_optimizer, snapshot


class _GradientMarks:
    """The check's own hook on every trainable parameter, registered before the student's so
    that it runs first: it marks each of the step's `expected` gradients as it is accumulated,
    so the launcher sees which all-reduces were launched before backward's last gradient. A
    step whose hooks fired fewer times (a wrapper that swapped the parameters) is padded at the
    end of backward, so that the cases stay those the check expects."""

    def __init__(self, marks: CaseMarks, expected: int) -> None:
        self.marks, self.expected, self.fired = marks, expected, 0

    def watch(self, module: nn.Module) -> None:
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, _param) -> None:
        if self.fired < self.expected:
            self.marks.next()
        self.fired += 1

    def finish(self) -> None:
        while self.fired < self.expected:
            self.marks.next()
            self.fired += 1
        self.fired = 0


def _train_one(impl: Callable, kind: str, run: RankRun, mine: dict, marks: CaseMarks) -> dict:
    """Train one run on this rank with the student's code; its gradients after
    synchronization and parameters after each step (and for DDP its state right after
    construction), and the waits it made during each step's backward."""
    gradient_marks = _GradientMarks(marks, run.gradients)
    model, initial = _model_on_rank(impl, kind, run, mine["seed"], marks, gradient_marks)
    # torch.optim refuses an empty parameter list; a wrapper that hides the model's
    # parameters trains nothing here, and the comparison says what is missing.
    params = list(model.parameters())
    optimizer = make_optimizer(run.optimizer, params) if params else None
    steps = []
    with WaitLog() as log:
        for given in mine["steps"]:
            x, y = given["x"], given["y"]
            marks.next()
            log.phase = "forward"
            model.zero_grad()  # the model's own: a DDP may change what it does
            loss = rank_loss(kind, run, model(x), y, given["scale"])
            if kind == "ddp":
                marks.next()
            log.phase = "backward"
            waits = len(log.waits)
            loss.backward()
            if kind == "ddp":
                gradient_marks.finish()
                marks.next()
            waited = sum(phase == "backward" for phase in log.waits[waits:])
            log.phase = "sync"
            if kind == "ddp":
                model.finish_gradient_synchronization()
            else:
                impl(model, len(x))
            log.phase = "step"
            grads = _grads(model)
            if optimizer is not None:
                optimizer.step()
            params_after = snapshot(model.named_parameters())
            steps.append({"grads": grads, "params": params_after, "waited": waited})
    return {"initial": initial, "steps": steps}


def _model_on_rank(impl, kind: str, run: RankRun, seed: int, marks, gradient_marks):
    """The model this rank trains, and for DDP its parameters and buffers right after
    construction. Part 2 builds this rank's model from its own weights and wraps it in the
    student's class, after the check's gradient hooks (ours run first); part 1 trains the
    model itself, the same weights on every rank."""
    module = build_model(run, seed)
    if kind != "ddp":
        return module, None
    gradient_marks.watch(module)  # before the student's hooks: ours run first
    marks.next()  # the construction
    model = impl(module, bucket_cap_mb=run.cap_mb)
    initial = {
        "params": snapshot(model.named_parameters()),
        "buffers": snapshot(model.named_buffers()),
    }
    return model, initial


def train_on_rank(impl: Callable, kind: str, runs: list[RankRun], mine: list[dict]) -> dict:
    """What every rank runs: every run with the student's code, on this rank's own `mine`
    (per run: the seed of its initial weights and its shards), watched for the course's own
    implementations; the cases marked for the launcher in the order of
    `data_parallel_cases.cases`, and a last mark after them."""
    marks = CaseMarks()
    with Provenance(FORBIDDEN[kind]) as seen:
        results = [
            _train_one(impl, kind, run, given, marks) for run, given in zip(runs, mine, strict=True)
        ]
        marks.next()  # what comes after the last case belongs to none
    return {"runs": results, "copied": seen.complaint()}
