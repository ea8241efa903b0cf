"""The plumbing of Assignment 8's pipeline, and what the checks measure a stage with.

    schedule_order(schedule, P, m, r)    the forwards and backwards of stage r, in order
    in_flight_bound(schedule, P, m, r)   the most micro-batches stage r may keep
    peak_in_flight(kinds)                the most in flight along a stage's F and B
    send_tensor / recv_tensor            a tensor of any shape and dtype between two ranks
    SendLog                              the sends made while it is active, waited or not
    InFlightProbe                        a stage that counts its micro-batches in flight
    fingerprint(x)                       a few numbers that tell a stage's input apart
    watch(stage)                         a stage that reports its forwards and backwards

The notebook imports `send_tensor`, `recv_tensor` and `InFlightProbe` from the topic's check
module, which takes them from here; the schedule functions are the checks' own (an answer
that runs them is refused, see the check module's FORBIDDEN).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from course_lib import counted_group

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
HEADER_BYTES = 8 * _HEADER  # what send_tensor sends before the data (int64s)


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


def fingerprint(x: torch.Tensor) -> tuple:
    """A few numbers that tell a stage's input apart from any other micro-batch's: its shape,
    its sum, a sum weighted by position (rows swapped show) and the sum of its magnitudes (the
    scale to compare them at). In float64, whatever x's dtype (token ids too)."""
    v = x.detach().flatten().to(torch.float64)
    weights = torch.linspace(1.0, 2.0, len(v), dtype=torch.float64)
    sums = (v.sum(), (v * weights).sum(), v.abs().sum())
    return (tuple(x.shape), *(float(s) for s in sums))


def watch(stage: nn.Module) -> nn.Module:
    """`stage` as a check hands it to pipeline_step: each forward and each backward through
    its output is reported to the launcher the moment it runs, as a note among the stage's
    calls (`counted_group.note`): ("F", fingerprint of the forward's input), then ("B", the
    same fingerprint). The judge tells the micro-batch by it. Nothing is kept on the rank: what
    the launcher was told, code on the rank cannot take back."""

    class Noted(torch.autograd.Function):
        @staticmethod
        def forward(ctx, output, seen):
            ctx.seen = seen
            counted_group.note(("F", seen))
            return output.clone()

        @staticmethod
        def backward(ctx, grad):
            counted_group.note(("B", ctx.seen))
            return grad, None

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stage = stage

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Noted.apply(self.stage(x), fingerprint(x))

    return Stage()
