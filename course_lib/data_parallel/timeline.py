"""Data parallelism: the naive host scheme, all-reduce data parallel, and a look inside DDP.

    host_step(model, opt, loss_fn, x, y)                  # rank 0 is the host
    log = train_data_parallel(model, opt, loss_fn, batches)  # all-reduce DP, with timings
    accumulation_step(ddp_model, opt, loss_fn, micro_batches)  # k backwards, one all-reduce
    losses = local_sgd(model, opt, loss_fn, batches, every=8)  # average parameters every 8
    timeline = DDPTimeline(ddp_model)                     # when each layer / bucket ran
    plot_timeline({r: log.events for r, log in enumerate(logs)})

Every rank holds the whole model. The host scheme routes all gradients and parameters through
rank 0; all-reduce data parallel averages gradients among equals. `DDPTimeline` watches torch's
own DistributedDataParallel (buckets, overlap) through autograd hooks and a DDP comm hook; it
never replaces DDP's bucketing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from course_lib.data import shard
from course_lib.progress import progress
from course_lib.runtime import rank, world_size

HOST = 0  # the rank that plays the host (parameter server) in the naive scheme

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# --- flat views of parameters and gradients -----------------------------------------------


def gradients(model: nn.Module) -> list[torch.Tensor]:
    """The gradient of every parameter of `model`, in order; a parameter that got none in
    this backward gets zeros, so all ranks hold the same list of shapes."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in model.parameters()]


def flat_gradients(model: nn.Module) -> torch.Tensor:
    """All gradients of `model` in one new 1-D tensor (see `gradients`)."""
    return torch.cat([g.reshape(-1) for g in gradients(model)])


def flat_parameters(model: nn.Module) -> torch.Tensor:
    """All parameters of `model` in one new 1-D tensor."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _unflatten_into(flat: torch.Tensor, tensors: Iterable[torch.Tensor]) -> None:
    """Copy consecutive pieces of `flat` into `tensors`, in order."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def _check_divisible(batch: torch.Tensor, p: int) -> None:
    # Equal shards are what makes the mean of the shards' mean losses the full-batch mean.
    if batch.shape[0] % p:
        raise ValueError(
            f"a batch of {batch.shape[0]} samples does not split into {p} equal shards; "
            f"use a batch size divisible by the world size {p}"
        )


# --- 1. the naive host (parameter-server) scheme -------------------------------------------


# The host talks to every worker in turn with point-to-point messages, as a parameter server
# does; CommCounter counts point-to-point bytes exactly, so its numbers are measurements.


def _workers() -> list[int]:
    return [k for k in range(world_size()) if k != HOST]


def _scatter_from_host(batch: torch.Tensor) -> torch.Tensor:
    """Rank k receives the k-th equal shard of the host's `batch`."""
    if rank() != HOST:
        shard_shape = (batch.shape[0] // world_size(), *batch.shape[1:])
        out = torch.empty(shard_shape, dtype=batch.dtype)
        dist.recv(out, src=HOST)
        return out
    pieces = [piece.contiguous() for piece in batch.tensor_split(world_size())]
    for work in [dist.isend(pieces[k], dst=k) for k in _workers()]:
        work.wait()
    return pieces[HOST]


def _gather_to_host(tensor: torch.Tensor) -> list[torch.Tensor] | None:
    """The host receives every rank's `tensor` (its own included); the others get None."""
    if rank() != HOST:
        dist.send(tensor, dst=HOST)
        return None
    received = [torch.empty_like(tensor) for _ in _workers()]
    for work in [dist.irecv(buf, src=k) for k, buf in zip(_workers(), received, strict=True)]:
        work.wait()
    return [tensor, *received]


def _broadcast_from_host(tensor: torch.Tensor) -> None:
    """Every rank's `tensor` becomes a copy of the host's."""
    if rank() != HOST:
        dist.recv(tensor, src=HOST)
        return
    for work in [dist.isend(tensor, dst=k) for k in _workers()]:
        work.wait()


def host_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
) -> float:
    """One step of the naive host scheme; returns this rank's loss on its shard.

    The host (rank 0) scatters the batch `x, y`; every rank computes gradients on its shard;
    the host gathers them, averages, steps its `optimizer` and broadcasts the parameters. On the
    other ranks `x, y` only give the batch's shape and dtype (their values are never read) and
    `optimizer` may be None: only the host keeps optimizer state.
    """
    p = world_size()
    _check_divisible(x, p)
    if rank() == HOST and optimizer is None:
        raise ValueError("the host (rank 0) needs an optimizer: it is the rank that steps")
    x_shard, y_shard = _scatter_from_host(x), _scatter_from_host(y)

    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(x_shard), y_shard)
    loss.backward()

    # Every rank sends its whole gradient to the host: (P - 1) model sizes arrive there.
    grads = flat_gradients(model)
    gathered = _gather_to_host(grads)
    if rank() == HOST:
        average = torch.stack(gathered).sum(dim=0) / p
        _unflatten_into(average, gradients(model))
        optimizer.step()

    # ... and the host sends the new parameters back to every rank: (P - 1) model sizes out.
    params = flat_parameters(model)
    _broadcast_from_host(params)
    _unflatten_into(params, model.parameters())
    return loss.item()


# --- 2. all-reduce data parallel, with timings ---------------------------------------------


def allreduce_gradients(model: nn.Module) -> None:
    """Replace every gradient by its average over all ranks (one all-reduce, after backward)."""
    grads = flat_gradients(model)
    dist.all_reduce(grads)  # sum over ranks
    grads /= world_size()
    _unflatten_into(grads, gradients(model))


@dataclass(frozen=True)
class Event:
    """Something a rank did between two `time.perf_counter()` readings (seconds).

    kind: "forward", "backward" (one layer), "allreduce" (one bucket, or all gradients),
    "straggle" (an emulated slow rank's sleep) or "optimizer".
    """

    rank: int
    step: int
    kind: str
    name: str
    start: float
    end: float


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


# --- 2b. fewer all-reduces: gradient accumulation, local SGD -----------------------------------


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


def average_parameters(model: nn.Module) -> None:
    """Replace every parameter by its average over all ranks (one all-reduce)."""
    flat = flat_parameters(model)
    dist.all_reduce(flat)
    flat /= world_size()
    _unflatten_into(flat, model.parameters())


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


# --- 3. watching backward and DDP's buckets ------------------------------------------------


class DDPTimeline:
    """Records when each layer's backward and each gradient all-reduce start and end.

    Layers: a hook on each layer's output marks the start of its backward (its output's
    gradient is ready); hooks on its parameters mark the end (all their gradients are
    accumulated). Buckets: on a DistributedDataParallel model, a comm hook
    (`register_comm_hook`) starts each bucket's all-reduce and notes when it completes.
    Only layers that own parameters are watched.
    """

    def __init__(self, model: nn.Module) -> None:
        self.events: list[Event] = []
        self.step = 0
        self.rank = rank()
        self._handles: list = []
        self._pending: dict[str, list] = {}  # layer -> [start, parameters not yet done]
        net = model.module if isinstance(model, DistributedDataParallel) else model
        for name, module in net.named_modules():
            params = list(module.parameters(recurse=False))
            if params:
                self._watch_layer(name or type(module).__name__, module, params)
        if isinstance(model, DistributedDataParallel):
            model.register_comm_hook(self, timed_allreduce_hook)

    def add(self, kind: str, name: str, start: float, end: float) -> None:
        self.events.append(Event(self.rank, self.step, kind, name, start, end))

    @contextmanager
    def span(self, kind: str, name: str) -> Iterator[None]:
        """Record the time the `with` block takes as one event."""
        start = time.perf_counter()
        yield
        self.add(kind, name, start, time.perf_counter())

    def clear(self) -> None:
        self.events.clear()

    def remove(self) -> None:
        """Remove the layer hooks (a DDP comm hook stays: DDP cannot unregister it)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _watch_layer(self, name: str, module: nn.Module, params: list[nn.Parameter]) -> None:
        def backward_starts(_grad: torch.Tensor) -> None:
            self._pending[name] = [time.perf_counter(), len(params)]

        def on_forward(_module, _inputs, output) -> None:
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(backward_starts)

        def parameter_done(_param: torch.Tensor) -> None:
            pending = self._pending.get(name)
            if pending is None:
                return
            pending[1] -= 1
            if pending[1] == 0:
                del self._pending[name]
                self.add("backward", name, pending[0], time.perf_counter())

        self._handles.append(module.register_forward_hook(on_forward))
        for param in params:
            if param.requires_grad:
                self._handles.append(param.register_post_accumulate_grad_hook(parameter_done))


def timed_allreduce_hook(
    timeline: DDPTimeline, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook: average the bucket like DDP's default hook, and record when its
    all-reduce starts and completes."""
    start = time.perf_counter()
    tensor = bucket.buffer().div_(world_size())
    index, n_params = bucket.index(), len(bucket.parameters())

    def done(fut: torch.futures.Future) -> torch.Tensor:
        label = f"bucket {index} ({n_params} tensors)"
        timeline.add("allreduce", label, start, time.perf_counter())
        return fut.value()[0]

    return dist.all_reduce(tensor, async_op=True).get_future().then(done)


# DDP checks a comm hook's annotations as objects; `from __future__ import annotations` left
# them as strings, so give it the objects it compares against.
timed_allreduce_hook.__annotations__.update(
    bucket=dist.GradBucket, timeline=DDPTimeline, **{"return": torch.futures.Future[torch.Tensor]}
)


# --- plots ---------------------------------------------------------------------------------

_COLOURS = {
    "forward": "#9ecae1",
    "backward": "#3182bd",
    "allreduce": "#e6550d",
    "straggle": "#bdbdbd",
    "optimizer": "#31a354",
}


def plot_timeline(
    events_by_rank: Mapping[int, Sequence[Event]],
    step: int | None = None,
    ax=None,
    title: str = "",
):
    """A Gantt chart: per rank, one lane of compute (forward, each layer's backward, optimizer)
    and one lane of all-reduces, in milliseconds since the step's first event."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    chosen = {
        r: [e for e in events if step is None or e.step == step]
        for r, events in events_by_rank.items()
    }
    starts = [e.start for events in chosen.values() for e in events]
    if not starts:
        raise ValueError(f"no events to plot (step={step}); was a DDPTimeline given?")
    origin = min(starts)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.45 * 2 * len(chosen) + 1.2))
    labels = []
    for lane_rank, events in sorted(chosen.items()):
        compute_y, comm_y = len(labels), len(labels) + 1
        labels += [f"rank {lane_rank} compute", f"rank {lane_rank} all-reduce"]
        for i, e in enumerate(events):
            y = comm_y if e.kind == "allreduce" else compute_y
            left, width = 1000 * (e.start - origin), 1000 * (e.end - e.start)
            # Alternate shades so neighbouring layers stay distinguishable.
            ax.barh(
                y,
                width,
                left=left,
                height=0.7,
                color=_COLOURS.get(e.kind, "k"),
                edgecolor="white",
                alpha=1.0 if i % 2 else 0.8,
            )
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    ax.legend(
        handles=[Patch(color=c, label=k) for k, c in _COLOURS.items()],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize="small",
    )
    return ax
