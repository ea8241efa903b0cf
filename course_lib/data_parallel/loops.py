"""The training loops: `train_data_parallel`, all-reduce data parallel with timings (a
straggler, a `DDPTimeline`), and two with fewer all-reduces, `accumulation_step` (DDP's
`no_sync`) and `local_sgd`. `LossFn` and the check that a batch splits into equal shards serve
`host_step` too."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from course_lib.data import shard
from course_lib.data_parallel.sync import allreduce_gradients, average_parameters
from course_lib.data_parallel.timeline import DDPTimeline, Event
from course_lib.progress import progress
from course_lib.runtime import rank, world_size

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _check_divisible(batch: torch.Tensor, p: int) -> None:
    # Equal shards are what makes the mean of the shards' mean losses the full-batch mean.
    if batch.shape[0] % p:
        raise ValueError(
            f"a batch of {batch.shape[0]} samples does not split into {p} equal shards; "
            f"use a batch size divisible by the world size {p}"
        )


# --- all-reduce data parallel, with timings ------------------------------------------------


@dataclass
class TrainLog:
    """What one rank measured in `train_data_parallel`, one entry per step."""

    losses: list[float] = field(default_factory=list)  # loss on this rank's shard
    step_s: list[float] = field(default_factory=list)  # wall time of the whole step
    backward_s: list[float] = field(default_factory=list)  # backward (DDP's overlapped comm too)
    sync_s: list[float] = field(default_factory=list)  # all-reduce after backward (0 for DDP)
    events: list[Event] = field(default_factory=list)  # filled when a DDPTimeline is given


def straggle(slow_rank: int | None, delay_s: float) -> None:
    """Emulate a slow rank: rank `slow_rank` sleeps `delay_s` seconds, the others go on."""
    if slow_rank is not None and rank() == slow_rank:
        time.sleep(delay_s)


def train_data_parallel(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    sync: Callable[[nn.Module], None] = allreduce_gradients,
    straggler: tuple[int, float] | None = None,
    timeline: DDPTimeline | None = None,
) -> TrainLog:
    """Synchronous data-parallel training: each rank trains on its shard of every full batch.

    After backward, `sync(model)` averages the gradients (skipped when `model` is a
    DistributedDataParallel, which averages during backward). `straggler=(rank, seconds)`
    makes that rank sleep before every backward. With a `timeline`, every step's events are
    recorded in the returned log.
    """
    p, r = world_size(), rank()
    if straggler is not None and not 0 <= straggler[0] < p:
        raise ValueError(f"straggler rank {straggler[0]} is not in 0..{p - 1}")
    slow_rank, delay_s = straggler if straggler is not None else (None, 0.0)
    is_ddp = isinstance(model, DistributedDataParallel)
    log = TrainLog()
    for step, (x, y) in enumerate(progress(batches, "training steps")):
        _check_divisible(x, p)
        x_shard, y_shard = shard(x, r, p), shard(y, r, p)
        if timeline is not None:
            timeline.step = step
        span = timeline.span if timeline is not None else _no_span

        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with span("forward", "forward"):
            loss = loss_fn(model(x_shard), y_shard)
        if straggler is not None:
            with span("straggle", "sleep"):
                straggle(slow_rank, delay_s)
        backward_start = time.perf_counter()
        loss.backward()
        sync_start = time.perf_counter()
        if not is_ddp:
            with span("allreduce", "all gradients"):
                sync(model)
        sync_end = time.perf_counter()
        with span("optimizer", "step"):
            optimizer.step()
        end = time.perf_counter()

        log.losses.append(loss.item())
        log.step_s.append(end - start)
        log.backward_s.append(sync_start - backward_start)
        log.sync_s.append(sync_end - sync_start)
    if timeline is not None:
        log.events = list(timeline.events)
    return log


@contextmanager
def _no_span(kind: str, name: str) -> Iterator[None]:
    yield


# --- fewer all-reduces: gradient accumulation, local SGD -----------------------------------


def accumulation_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    no_sync: bool = True,
) -> float:
    """One optimizer step of a DDP `model` over k micro-batches (this rank's shards): each
    loss is divided by k so the summed gradients are the mean over all of them. With
    `no_sync`, DDP skips the all-reduce of the first k-1 backward passes (the gradients just
    accumulate locally) and averages once, in the last: 1/k of the traffic for the same
    step. Returns the mean loss."""
    if not isinstance(model, DistributedDataParallel):
        raise TypeError("accumulation_step needs a DistributedDataParallel model (no_sync)")
    k = len(micro_batches)
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        last = i == k - 1
        with model.no_sync() if no_sync and not last else nullcontext():
            loss = loss_fn(model(x), y) / k
            loss.backward()
        total += loss.item()
    optimizer.step()
    return total


def local_sgd(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    every: int,
) -> list[float]:
    """Local SGD (periodic averaging): every rank steps on its own shard with no
    communication, and every `every` steps the ranks average their parameters. With
    every = 1 and plain SGD it is all-reduce data parallel (averaging the parameters after
    equal steps = stepping with the averaged gradient); larger `every` sends 1/every of the
    bytes, and the copies drift apart between averages. Returns this rank's shard loss per
    step (average them over the ranks for the loss of the whole batch)."""
    if every < 1:
        raise ValueError(f"average every >= 1 steps, got {every}")
    p, r = world_size(), rank()
    losses = []
    for step, (x, y) in enumerate(batches, start=1):
        _check_divisible(x, p)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(shard(x, r, p)), shard(y, r, p))
        loss.backward()
        optimizer.step()
        if step % every == 0:
            average_parameters(model)
        losses.append(loss.item())
    return losses
