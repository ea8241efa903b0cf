"""What runs on each rank in Assignment 3's checks: training with the student's code.

`AllReduceLog` records every all-reduce (when, how many bytes, async or not, in which phase
of the step) and every wait; `_train_one` trains one run with the student's sync_gradients
or DDP and sends back, per step, the samples this rank drew, its gradients after
synchronization, its parameters after the optimizer's step and its communication.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm
from course_lib.grading.data_parallel_runs import (
    INIT_SEED_STRIDE,
    DDPRun,
    _grads,
    build_model,
    draw_shard,
    rank_loss,
    shard_sizes,
)
from course_lib.grading.training import make_optimizer, snapshot
from course_lib.runtime import rank, world_size

# --- recording all-reduce calls -----------------------------------------------------------


@dataclass
class AllReduceCall:
    """One all-reduce: when it was launched (perf_counter seconds), its bytes, whether it
    returned unfinished (a Work), and the log's `phase` at that moment. A synchronous call
    seen only at the process group (made through a name bound earlier) returns a Work to
    torch's function, which waits for it: that wait is in `AllReduceLog.waits`."""

    time: float
    nbytes: int
    async_op: bool
    phase: str = ""


@dataclass
class AllReduceLog:
    """Records every all-reduce made while the block runs, and every wait for one.

        with AllReduceLog() as log:
            loss.backward()
        log.calls   # [AllReduceCall(time=..., nbytes=..., async_op=True, phase=""), ...]

    Built on `course_lib.comm`'s around hooks: on grading ranks, whose process group reports
    every call, that is every route (`dist.all_reduce`, a name bound earlier, the group
    object, DDP's C++ reducer); elsewhere, the calls made as `dist.all_reduce(...)`. `waits`
    holds the phase of every `wait()` on a Work or a Future made from Python (a synchronous
    all-reduce waits too), `others` the (op, phase) of every other collective. Set `phase` to
    label what follows ("backward", ...)."""

    calls: list[AllReduceCall] = field(default_factory=list)
    waits: list[str] = field(default_factory=list)
    others: list[tuple[str, str]] = field(default_factory=list)
    phase: str = ""

    def _hook(self, op: str, args: dict, sent: int, received: int, call: Callable):
        if op != "all_reduce":
            self.others.append((op, self.phase))
            return call()
        tensor, launched, phase = args["tensor"], time.perf_counter(), self.phase
        work = call()
        nbytes = tensor.numel() * tensor.element_size()
        self.calls.append(AllReduceCall(launched, nbytes, work is not None, phase))
        return work

    def __enter__(self) -> AllReduceLog:
        comm.add_around_hook(self._hook)
        self._saved = [(cls, cls.wait) for cls in (dist.Work, torch._C.Future)]
        for cls, original in self._saved:
            cls.wait = self._logged_wait(original)
        return self

    def _logged_wait(self, original: Callable) -> Callable:
        def wait(work, *args, **kwargs):
            self.waits.append(self.phase)
            return original(work, *args, **kwargs)

        return wait

    def __exit__(self, *exc_info: object) -> None:
        for cls, original in self._saved:
            cls.wait = original
        comm.remove_around_hook(self._hook)


def _train_one(impl: Callable, kind: str, run: DDPRun) -> dict:
    """Train `run` on this rank with the student's code; record this rank's samples, its
    gradients after synchronization, its parameters after each step, and its communication."""
    ranks, me = world_size(), rank()
    ready: list[float] = []  # when each gradient of this step was accumulated
    model, initial = _model_on_rank(impl, kind, run, ready)
    # torch.optim refuses an empty parameter list; a wrapper that hides the model's
    # parameters trains nothing here, and the comparison says what is missing.
    params = list(model.parameters())
    optimizer = make_optimizer(run.optimizer, params) if params else None
    steps = []
    with AllReduceLog() as log:
        for s in range(run.steps):
            sizes = shard_sizes(run, ranks, s)
            x, y = draw_shard(run, sizes[me])
            model.zero_grad()  # the model's own: a DDP may change what it does
            marks = (len(log.calls), len(log.waits), len(log.others))
            ready.clear()
            log.phase = "forward"
            loss = rank_loss(kind, run, model(x), y, sizes)
            log.phase = "backward"
            loss.backward()
            no_grad = sum(p.grad is None for p in params if p.requires_grad)
            log.phase = "sync"
            if kind == "ddp":
                model.finish_gradient_synchronization()
            else:
                impl(model, sizes[me])
            log.phase = "step"
            grads = _grads(model)
            if optimizer is not None:
                optimizer.step()
            steps.append(
                {
                    "x": x,
                    "y": y,
                    "grads": grads,
                    "params": snapshot(model.named_parameters()),
                    **_communication(log, marks, ready),
                    "no_grad": no_grad,
                }
            )
    return {"initial": initial, "steps": steps}


def _model_on_rank(impl: Callable, kind: str, run: DDPRun, ready: list[float]):
    """The model this rank trains, and for DDP its parameters and buffers right after
    construction. Part 2 builds rank r's model from its own seed and wraps it in the
    student's class, after hooks that time each gradient (ours run first); part 1 trains
    the model itself."""
    if kind != "ddp":
        return build_model(run, run.seed), None
    module = build_model(run, run.seed + INIT_SEED_STRIDE * rank())
    _watch_gradients(module, ready)  # before the student's hooks: ours run first
    model = impl(module, bucket_cap_mb=run.cap_mb())
    initial = {
        "params": snapshot(model.named_parameters()),
        "buffers": snapshot(model.named_buffers()),
    }
    return model, initial


def _communication(log: AllReduceLog, marks: tuple[int, int, int], ready: list[float]) -> dict:
    """What `log` recorded since `marks`: each all-reduce's bytes, whether it returned
    unfinished, its phase and whether it started before backward's last gradient; the
    phases of the waits; the other collectives."""
    last_gradient = max(ready, default=float("inf"))
    return {
        "calls": [
            {
                "nbytes": c.nbytes,
                "async": c.async_op,
                "phase": c.phase,
                "early": c.time < last_gradient,
            }
            for c in log.calls[marks[0] :]
        ],
        "waits": log.waits[marks[1] :],
        "others": [op for op, _ in log.others[marks[2] :]],
    }


def _watch_gradients(module: nn.Module, ready: list[float]) -> None:
    for p in module.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda _p: ready.append(time.perf_counter()))
