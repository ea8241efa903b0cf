"""Running lecture 8's pipelines on ranks: the schedules' bubbles measured, and torch's own
pipelining for comparison (GPipe, 1F1B and interleaved 1F1B)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from course_lib.pipeline import (
    LossFn,
    StageLog,
    Timeline,
    pipeline_step,
)
from course_lib.runtime import device, rank, world_size

# --- running the pipeline for the lecture ---------------------------------------------------


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
    """Run on every rank: one `pipeline_step` per (schedule, m), after a warm-up step that
    opens the connections between neighbours (the first message on a link is slow). No
    progress bar: a text bar saved in the executed notebook stayed frozen half-way."""
    pipeline_step(make_stage(), x, y, loss_fn, m=1, schedule="gpipe")
    runs = [(schedule, m) for schedule in schedules for m in ms]
    return {
        (schedule, m): pipeline_step(
            make_stage(), x, y, loss_fn, m, schedule, forward_s=forward_s, backward_s=backward_s
        )
        for schedule, m in runs
    }


def stretched_ops(timeline: Timeline, seconds: Mapping[str, float], slack: float = 1e-3) -> int:
    """How many ops of a run on emulated devices lasted longer than their set time (`seconds`
    by kind, F / B / W) by more than `slack`: the OS held the rank up past the op's end (a late
    wake-up plus the compute), so that op, and the bubble read from it, stretched."""
    return sum(1 for t in timeline.tasks if t.end - t.start > seconds[t.kind] + slack)


def torch_pipeline_step(
    stage: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn, m: int, schedule: str
) -> list[torch.Tensor]:
    """The same step with torch.distributed.pipelining (ScheduleGPipe / Schedule1F1B); returns
    this stage's gradients. `scale_grads` (default True) divides by m: the loss must be a mean."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    P, r = world_size(), rank()
    kinds = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    if schedule not in kinds:
        raise ValueError(f"torch_pipeline_step runs {tuple(kinds)}, not {schedule!r}")
    stage.to(device())
    runner = kinds[schedule](PipelineStage(stage, r, P, device()), m, loss_fn=loss_fn)
    stage.zero_grad(set_to_none=True)
    inputs = (x.to(device()),) if r == 0 else ()  # one rank may be first and last (P = 1)
    runner.step(*inputs, **({"target": y.to(device())} if r == P - 1 else {}))
    return [p.grad.detach().clone() for p in stage.parameters()]


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
