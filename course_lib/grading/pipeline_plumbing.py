"""The plumbing of Assignment 8's pipeline, and what the checks measure a stage with.

    schedule_order(schedule, P, m, r)    the forwards and backwards of stage r, in order
    in_flight_bound(schedule, P, m, r)   the most micro-batches stage r may keep
    peak_in_flight(kinds)                the most in flight along a stage's F and B
    send_tensor / recv_tensor            a tensor of any shape and dtype between two ranks
    SendLog                              the sends made while it is active, waited or not
    InFlightProbe                        a stage that counts its micro-batches in flight
    watch(stage)                         a stage that logs its forwards and backwards

The notebook imports `send_tensor`, `recv_tensor` and `InFlightProbe` from the topic's check
module, which takes them from here; the schedule functions are the checks' own (an answer
that runs them is refused, see the check module's FORBIDDEN).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

SCHEDULES = ("gpipe", "1f1b")

# --- the schedules ------------------------------------------------------------------------


def schedule_order(schedule: str, P: int, m: int, r: int) -> list[tuple[str, int]]:
    """The forwards ("F", i) and backwards ("B", i) of stage r in the order they run; each
    kind takes the micro-batches i in order."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(P - r - 1, m)
        order = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", warmup + i), ("B", i)]
        return order + [("B", i) for i in range(m - warmup, m)]
    raise ValueError(f"unknown schedule {schedule!r}: use 'gpipe' or '1f1b'")


def in_flight_bound(schedule: str, P: int, m: int, r: int) -> int:
    """Most micro-batches stage r keeps activations for: m (GPipe), min(m, P - r) (1F1B)."""
    return m if schedule == "gpipe" else min(m, P - r)


def peak_in_flight(kinds: Iterable[str]) -> int:
    """The most micro-batches in flight (forward done, backward not yet) along a stage's
    "F" and "B", in the order they ran."""
    live = peak = 0
    for kind in kinds:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


# --- sending tensors of any shape between stages ----------------------------------------

_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32]
_HEADER = 8  # dtype code, number of dimensions, up to 6 sizes


class PendingSend:
    """The sends of one tensor, under way; `wait()` returns when they are done."""

    def __init__(self, works: list, tensors: list[torch.Tensor]) -> None:
        self.works, self._tensors = works, tensors  # the tensors must live until then
        self.waited = False
        if SendLog.active is not None:
            SendLog.active.sends.append(self)

    def wait(self) -> None:
        if self.waited:  # a gloo send waited for twice would wait forever
            return
        for work in self.works:
            work.wait()
        self.waited = True


class SendLog:
    """While active (`with SendLog() as log:`), every send `send_tensor` starts; `unwaited`
    counts those never waited for. Leaving waits for them, so that what comes next starts
    with no message under way."""

    active: SendLog | None = None

    def __enter__(self) -> SendLog:
        self.sends: list[PendingSend] = []
        SendLog.active = self
        return self

    def __exit__(self, *exc_info: object) -> None:
        SendLog.active = None
        for send in self.sends:
            if not send.waited:
                for work in send.works:
                    work.wait()

    def unwaited(self) -> int:
        return sum(not send.waited for send in self.sends)


def send_tensor(tensor: torch.Tensor, dst: int) -> PendingSend:
    """Start sending `tensor` (any shape and dtype) to rank dst: a small header with its
    dtype and shape, then the data. Returns at once, so two neighbours that send to each
    other cannot deadlock; call `.wait()` on the result before the step ends."""
    if tensor.dim() > _HEADER - 2:
        raise ValueError(f"send_tensor sends up to {_HEADER - 2} dimensions, got {tensor.dim()}")
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    payload = tensor.detach().contiguous()
    works = [dist.isend(header, dst), dist.isend(payload, dst)]
    return PendingSend(works, [header, payload])


def recv_tensor(src: int) -> torch.Tensor:
    """Receive a tensor sent by `send_tensor` from rank src (waits until it arrives)."""
    header = torch.empty(_HEADER, dtype=torch.int64)
    dist.recv(header, src)
    shape = header[2 : 2 + int(header[1])].tolist()
    tensor = torch.empty(shape, dtype=_DTYPES[int(header[0])])
    dist.recv(tensor, src)
    return tensor


# --- measuring a stage --------------------------------------------------------------------


class _Track(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output, probe):
        ctx.probe = probe
        probe.live += 1
        probe.peak = max(probe.peak, probe.live)
        probe.events.append("F")
        return output.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.probe.live -= 1
        ctx.probe.events.append("B")
        return grad, None


class InFlightProbe(nn.Module):
    """A stage that counts its micro-batches in flight (forward done, backward not yet).

    `events` lists "F" and "B" in the order they ran; `peak` is the most in flight at once."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage
        self.reset()

    def reset(self) -> None:
        self.live, self.peak, self.events = 0, 0, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Track.apply(self.stage(x), self)


def watch(stage: nn.Module) -> tuple[nn.Module, list[tuple[str, int]], list[torch.Tensor]]:
    """`stage` as a check hands it to pipeline_step, with the log it writes: `events` gets
    ("F", k) when the stage's forward number k runs and ("B", k) when the backward through
    that forward's output runs; `inputs[k]` is a copy of that forward's input, by which the
    judge tells which micro-batch it was. The log is no attribute of the module handed over."""
    events: list[tuple[str, int]] = []
    inputs: list[torch.Tensor] = []

    class Logged(torch.autograd.Function):
        @staticmethod
        def forward(ctx, output, k):
            ctx.k = k
            events.append(("F", k))
            return output.clone()

        @staticmethod
        def backward(ctx, grad):
            events.append(("B", ctx.k))
            return grad, None

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stage = stage

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            inputs.append(x.detach().clone())
            return Logged.apply(self.stage(x), len(inputs) - 1)

    return Stage(), events, inputs
