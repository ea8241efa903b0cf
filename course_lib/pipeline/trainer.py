"""A real pipeline, one stage per rank: activations go forward and gradients back by
send/recv, each op timed on the rank's `EmulatedDevice`; `pipeline_step` trains one step under
the naive schedule, GPipe or 1F1B and returns the rank's `StageLog` (lecture 8)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib.memory import SavedTensors
from course_lib.pipeline.schedules import BACKWARD, FORWARD, schedule_order
from course_lib.pipeline.timeline import StageLog, Task
from course_lib.runtime import device, rank, world_size

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# --- a real pipeline: one stage per rank, activations and gradients by send/recv -------------

# A tensor travels as a small header (the sender's clock when it was ready, dtype code, number
# of dimensions, the dimensions) and then its data, so a stage need not know its neighbour's
# output shape in advance. Ranks on one machine share `time.perf_counter` (a system-wide
# monotonic clock on Linux and macOS), so the timestamps of all ranks are comparable.
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64]
_MAX_DIMS = 6


def _send(tensor: torch.Tensor, dst: int, ready: float) -> list[Any]:
    """Start sending `tensor` (ready at time `ready`) to rank `dst`; returns the handles to
    wait on, with the buffers they must keep alive until the message has left."""
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"can send tensors of at most {_MAX_DIMS} dimensions, got {tensor.dim()}")
    header = torch.zeros(_MAX_DIMS + 3, dtype=torch.float64)
    header[0], header[1], header[2] = ready, _DTYPES.index(tensor.dtype), tensor.dim()
    header[3 : 3 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.float64)
    data = tensor.detach().contiguous()
    return [dist.isend(header, dst), dist.isend(data, dst), header, data]


def _recv(src: int) -> tuple[torch.Tensor, float]:
    """Receive the next tensor rank `src` sends us (blocks until it arrives), and the time
    at which the sender had it ready."""
    header = torch.empty(_MAX_DIMS + 3, dtype=torch.float64)
    dist.recv(header, src)
    shape = [int(d) for d in header[3 : 3 + int(header[2])].tolist()]
    tensor = torch.empty(shape, dtype=_DTYPES[int(header[1])], device=device())
    dist.recv(tensor, src)
    return tensor, float(header[0])


class EmulatedDevice:
    """A rank's stand-in for an accelerator: each op takes a fixed time, real compute included.

    An op starts when its input is ready (the sender's clock, carried by the message) and the
    device is free, and ends `op_s` later: the rank sleeps until then, leaving the cores to
    the other ranks, so 4 ranks on 2 cores act like 4 devices. A rank that wakes up late (the
    OS ran something else) catches up if it is less than one op late; `lateness` records it.
    """

    def __init__(self) -> None:
        self.free_at: float | None = None  # when the last op ended (None: nothing ran yet)
        self.lateness: list[float] = []  # how late the host noticed each op's input

    def start(self, ready: float | None) -> float:
        """When an op whose input was ready at `ready` (None: local, ready now) starts."""
        now = time.perf_counter()
        known = [t for t in (ready, self.free_at) if t is not None]
        start = max(known) if known else now
        self.lateness.append(max(0.0, now - start))
        return start

    def finish(self, start: float, op_s: float) -> float:
        """End the op `op_s` after `start`, or when its compute ended if that was later."""
        end = max(start + op_s, time.perf_counter())
        time.sleep(max(0.0, end - time.perf_counter()))
        self.free_at = end
        return end


def pipeline_step(
    stage: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: LossFn,
    m: int,
    schedule: str = "1f1b",
    forward_s: float = 0.0,
    backward_s: float = 0.0,
    optimizer: torch.optim.Optimizer | None = None,
) -> StageLog:
    """One training step of a P-stage pipeline; rank r runs `stage`, the r-th stage.

    The batch `x, y` is cut into `m` equal micro-batches (rank 0 reads x, the last rank y);
    the loss is the mean of the micro-batches' mean losses, so the gradients are those of
    the whole batch. Each forward / backward lasts `forward_s` / `backward_s` seconds on the
    rank's `EmulatedDevice` (0: just the real compute).
    """
    P, r = world_size(), rank()
    if schedule not in ("naive", "gpipe", "1f1b"):
        raise ValueError(f"pipeline_step runs 'naive', 'gpipe' or '1f1b', not {schedule!r}")
    if x.shape[0] % m:
        raise ValueError(f"a batch of {x.shape[0]} samples does not split into m={m} equal parts")
    stage.to(device())  # in place: the caller's stage and its gradients live on the rank's device
    # each micro-batch in storage of its own, as a data loader would hand it over
    xs, ys = ([c.to(device(), copy=True) for c in t.chunk(m)] for t in (x, y))
    log, clock = StageLog(r, schedule), EmulatedDevice()
    inputs: dict[int, torch.Tensor] = {}  # micro-batch -> the input we return a gradient for
    outputs: dict[int, torch.Tensor] = {}  # micro-batch -> output (last stage: its loss)
    pending: list[Any] = []  # sends in flight, waited for at the end
    total_loss = 0.0
    stage.zero_grad(set_to_none=True)
    with SavedTensors(exclude=stage.parameters()) as saved:
        for op in schedule_order(schedule, P, m)[r]:
            i = op.micro
            if op.kind == FORWARD:
                inp, ready = (xs[i], None) if r == 0 else _recv(r - 1)
                start, before = clock.start(ready), saved.live_bytes
                out = stage(inp.requires_grad_() if r > 0 else inp)
                if r == P - 1:
                    out = loss_fn(out, ys[i]) / m  # mean over micro-batches
                    total_loss += out.item()
                end = clock.finish(start, forward_s)
                if r < P - 1:
                    pending += _send(out, r + 1, ready=end)  # the output exists only now
                log.tasks.append(Task(r, FORWARD, i, 0, start, end))
                log.activation_bytes.append(saved.live_bytes - before)
                inputs[i], outputs[i] = inp, out
                log.peak_in_flight = max(log.peak_in_flight, len(outputs))
            else:
                grad, ready = (None, None) if r == P - 1 else _recv(r + 1)
                start = clock.start(ready)
                torch.autograd.backward(outputs.pop(i), grad)  # frees this micro-batch's graph
                end = clock.finish(start, backward_s)
                inp = inputs.pop(i)
                if r > 0:
                    pending += _send(inp.grad, r - 1, ready=end)
                log.tasks.append(Task(r, BACKWARD, i, 0, start, end))
        log.peak_activation_bytes = saved.peak_bytes
    for work in pending:
        if isinstance(work, dist.Work):
            work.wait()
    if optimizer is not None:
        optimizer.step()
    log.loss = total_loss if r == P - 1 else None
    log.lateness = clock.lateness
    log.grads = [
        p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for p in stage.parameters()
    ]
    return log
