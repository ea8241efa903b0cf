"""Watching backward and DDP's buckets: `DDPTimeline` records when each layer's backward and
each bucket's all-reduce ran (`Event`s), through autograd hooks and a DDP comm hook, and
`plot_timeline` draws them, rank by rank, as a Gantt chart."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from course_lib.runtime import rank, world_size

# --- watching backward and DDP's buckets ---------------------------------------------------


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
