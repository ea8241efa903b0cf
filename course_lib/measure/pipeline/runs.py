"""Running lecture 8's pipelines on ranks with torch's own schedules
(`torch.distributed.pipelining`: ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B), and
timing what they really did: each stage's forward and backward of every micro-batch, start and
end on the wall clock, recorded while torch's schedule runs them."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from course_lib.memory import SavedTensors
from course_lib.pipeline import BACKWARD, FORWARD, StageLog, Task, Timeline
from course_lib.runtime import device, rank, world_size

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
SCHEDULE_CLASSES = ("gpipe", "1f1b")  # torch's one-stage-per-rank schedules the lecture runs

# --- a stage whose ops last long enough to see ----------------------------------------------


class _Pause(torch.autograd.Function):
    """Identity that sleeps `forward_s` on the way forward and `backward_s` on the way back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class TimedStage(nn.Module):
    """`stage` whose forward lasts `forward_s` seconds longer (a sleep after its real compute)
    and whose backward `backward_s` longer: ops long enough to see on a machine where a
    TinyGPT stage computes in about a millisecond. A sleeping rank leaves the cores to the
    others, so 4 ranks on 2 cores act like 4 devices; the time is real all the same (a rank
    the OS wakes late is late, and the timeline shows it). Its parameters are the stage's."""

    def __init__(self, stage: nn.Module, forward_s: float = 0.0, backward_s: float = 0.0) -> None:
        super().__init__()
        self.stage, self.forward_s, self.backward_s = stage, forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.stage(x)
        if self.forward_s or self.backward_s:
            out = _Pause.apply(out, self.forward_s, self.backward_s)
        return out


# --- what torch's schedule did, op by op ----------------------------------------------------


@contextmanager
def recorded(pipe_stage: Any, log: StageLog, saved: SavedTensors) -> Iterator[None]:
    """While active, every forward and backward torch's `PipelineStage` runs goes into `log`:
    its start and end (`time.perf_counter`, one clock all processes on a machine share) and,
    for a forward, the bytes autograd saved for it. Wraps the stage's `forward_one_chunk`,
    `backward_one_chunk` and `backward_weight_one_chunk` (zero bubble's W), the calls each
    schedule makes once per op; the receive before an op is outside it, as on a device."""
    originals = {
        name: getattr(pipe_stage, name)
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
    }

    def timed(name: str, kind: str | None) -> Callable:
        inner = originals[name]

        def run(micro: int, *args: Any, **kwargs: Any) -> Any:
            full = kwargs.get("full_backward", True)
            op = kind or (BACKWARD if full else "B")  # B: the input gradient alone
            start, before = time.perf_counter(), saved.live_bytes
            out = inner(micro, *args, **kwargs)
            log.tasks.append(Task(log.stage, op, micro, 0, start, time.perf_counter()))
            if op == FORWARD:
                log.activation_bytes.append(saved.live_bytes - before)
            return out

        return run

    pipe_stage.forward_one_chunk = timed("forward_one_chunk", FORWARD)
    pipe_stage.backward_one_chunk = timed("backward_one_chunk", None)
    pipe_stage.backward_weight_one_chunk = timed("backward_weight_one_chunk", "W")
    try:
        yield
    finally:
        for name in originals:
            delattr(pipe_stage, name)  # the instance attribute; the class's method is back


def _loss_into_forward(loss_fn: LossFn, log: StageLog, saved: SavedTensors) -> LossFn:
    """`loss_fn` whose time and saved bytes count in the forward just recorded: torch computes
    the last stage's loss right after its forward, outside `forward_one_chunk`."""

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        before = saved.live_bytes
        value = loss_fn(out, target)
        if log.tasks and log.tasks[-1].kind == FORWARD:
            t = log.tasks[-1]
            log.tasks[-1] = Task(t.stage, t.kind, t.micro, t.chunk, t.start, time.perf_counter())
            log.activation_bytes[-1] += saved.live_bytes - before
        return value

    return loss


def torch_pipeline_step(
    stage: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: LossFn,
    m: int,
    schedule: str,
    forward_s: float = 0.0,
    backward_s: float = 0.0,
    warmups: int = 0,
    during: AbstractContextManager | None = None,
) -> StageLog:
    """One training step of torch's `ScheduleGPipe` / `Schedule1F1B` on rank r = stage index,
    timed op by op; returns the rank's `StageLog` (its tasks on the wall clock, the bytes
    autograd saved, its gradients, the loss on the last rank).

    `forward_s` / `backward_s`: seconds each op lasts beyond its real compute (`TimedStage`).
    `warmups`: untimed steps first, with no sleep, on the same schedule (the first one infers
    the shapes between stages and opens the links); `during`: a context entered around the
    timed step only (a `CommCounter`, say). torch's `scale_grads` (default True) divides the
    gradients by m: `loss_fn` must be a mean.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    P, r = world_size(), rank()
    kinds = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    if schedule not in kinds:
        raise ValueError(f"torch_pipeline_step runs {tuple(kinds)}, not {schedule!r}")
    if x.shape[0] % m:  # torch would cut unequal micro-batches, and the mean loss would be off
        raise ValueError(f"a batch of {x.shape[0]} samples does not split into m={m} equal parts")
    stage.to(device())
    timed = TimedStage(stage)
    pipe_stage = PipelineStage(timed, r, P, device())
    log = StageLog(r, schedule)
    x, y = x.to(device()), y.to(device())
    # Not activations: the weights, and the batch, whose micro-batches torch cuts as views of
    # it (a stage that saves its input or target for backward would count all of it at once).
    saved = SavedTensors(exclude=[*stage.parameters(), x, y])
    runner = kinds[schedule](pipe_stage, m, loss_fn=_loss_into_forward(loss_fn, log, saved))
    inputs = (x,) if r == 0 else ()  # one rank may be first and last (P = 1)
    target = {"target": y} if r == P - 1 else {}
    for _ in range(warmups):
        runner.step(*inputs, **target)
    stage.zero_grad(set_to_none=True)
    timed.forward_s, timed.backward_s = forward_s, backward_s
    losses: list[torch.Tensor] = []
    with during or nullcontext(), saved, recorded(pipe_stage, log, saved):
        runner.step(*inputs, **target, **({"losses": losses} if r == P - 1 else {}))
    log.peak_activation_bytes = saved.peak_bytes
    log.peak_in_flight = Timeline(r + 1, log.tasks).peak_in_flight(r)
    log.loss = sum(v.item() for v in losses) / m if r == P - 1 else None
    log.grads = [p.grad.detach().clone() for p in stage.parameters()]
    return log


def measure_bubbles(
    make_stage: Callable[[], nn.Module],
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: LossFn,
    schedules: Sequence[str],
    ms: Sequence[int],
    forward_s: float,
    backward_s: float,
) -> dict[tuple[str, int], StageLog]:
    """Run on every rank: one timed step of torch's schedule per (schedule, m), each after an
    untimed warm-up step. No progress bar: a text bar saved in the executed notebook stayed
    frozen half-way."""
    return {
        (schedule, m): torch_pipeline_step(
            make_stage(), x, y, loss_fn, m, schedule, forward_s, backward_s, warmups=1
        )
        for schedule in schedules
        for m in ms
    }


def op_seconds(timeline: Timeline) -> dict[str, list[float]]:
    """How long each op lasted, by kind (F, B, W), read from a run's timestamps."""
    lengths: dict[str, list[float]] = {}
    for t in timeline.tasks:
        lengths.setdefault(t.kind, []).append(t.end - t.start)
    return lengths


def torch_interleaved_step(
    pieces: Sequence[nn.Module], x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn, m: int
) -> list[torch.Tensor]:
    """One step of torch's ScheduleInterleaved1F1B: the model cut in `len(pieces)` = v * P
    pieces, rank r holding pieces r, r + P, r + 2P, ... (Megatron's placement); returns the
    gradients of this rank's pieces, in that order. `scale_grads` divides by m, as above."""
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    P, r = world_size(), rank()
    mine = list(pieces)[r::P]
    stages = [
        PipelineStage(p.to(device()), r + c * P, len(pieces), device()) for c, p in enumerate(mine)
    ]
    runner = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
    inputs = (x.to(device()),) if r == 0 else ()
    runner.step(*inputs, **({"target": y.to(device())} if r == P - 1 else {}))
    return [p.grad.detach().clone() for piece in mine for p in piece.parameters()]
