"""Lecture 7's FSDP2 prefetching on a timeline: when each unit's all-gather (slowed to a
modelled link) and its forward and backward ran on each rank, with and without prefetching,
and how many bytes of gathered parameters that costs.

    tl = prefetch_timeline(batches, prefetch=True)    # on every rank: FSDP2 events in time
    plot_timeline(per_rank_timelines); print(timeline_summary({"off": off, "on": on}))
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from course_lib import comm, models
from course_lib.data import shard
from course_lib.network import SlowNetwork
from course_lib.plots import NotebookFigure
from course_lib.runtime import device, rank, world_size
from course_lib.zero import held_bytes, shard_units

GATHERS = ("all_gather_single", "all_gather_into_tensor")


@dataclass
class Event:
    """One bar of the timeline: seconds since the step started on this rank."""

    kind: str  # "all_gather", "forward" or "backward"
    unit: int  # index in shard_units(model)
    start: float
    end: float


@dataclass
class Timeline:
    """One rank's last training step under FSDP2 (ZeRO-3), with or without prefetching."""

    prefetch: bool
    events: list[Event]
    step_seconds: float
    gathered_peak: int  # most bytes of gathered (or being gathered) units as a forward ends
    unit_bytes: list[int]  # bytes of each unit's full parameters
    params: dict[str, torch.Tensor] = field(repr=False)

    def of(self, kind: str, unit: int) -> list[Event]:
        return [e for e in self.events if e.kind == kind and e.unit == unit]

    @property
    def compute_seconds(self) -> float:
        return sum(e.end - e.start for e in self.events if e.kind != "all_gather")

    @property
    def exposed_seconds(self) -> float:
        """Seconds the rank waited for all-gathers with no compute to do: for each compute
        bar, the part of its unit's all-gather that ran after the previous compute bar ended.
        Without prefetching that is every all-gather whole; prefetching hides the part that
        ran under the previous unit's compute."""
        exposed, previous_end = 0.0, 0.0
        computes = sorted((e for e in self.events if e.kind != "all_gather"), key=lambda e: e.start)
        for c in computes:
            gathers = [e for e in self.of("all_gather", c.unit) if e.start <= c.start]
            if gathers:
                g = max(gathers, key=lambda e: e.start)
                exposed += max(0.0, g.end - max(previous_end, g.start))
            previous_end = c.end
        return exposed

    @property
    def gather_seconds(self) -> float:
        return sum(e.end - e.start for e in self.events if e.kind == "all_gather")


class _DelayedWork(dist.Work):
    """An async all-gather's handle whose `wait()` returns no earlier than the modelled
    finish; FSDP2 only waits on handles that are `dist.Work`, hence the subclass. The
    all-gather's end is the later of the modelled finish and the moment the real one
    completed (a callback on its future: a prefetched all-gather may have completed long
    before FSDP2 waits on it, and that wait is not its end)."""

    def __init__(self, work: dist.Work, finish: float, done) -> None:
        super().__init__()
        self._work, self._finish, self._done = work, finish, done
        self._completed_at: float | None = None
        work.get_future().add_done_callback(self._completed)

    def _completed(self, _future) -> None:
        self._completed_at = time.time()

    def wait(self, timeout=None) -> bool:
        self._work.wait()
        real_end = self._completed_at if self._completed_at is not None else time.time()
        delay = self._finish - time.time()
        if delay > 0:
            time.sleep(delay)
        self._done(max(self._finish, real_end))
        return True


class _Recorder:
    """Records FSDP2's all-gathers and each unit's compute, with all-gathers slowed to a
    modelled link (`SlowNetwork.collective_time`: latency per ring step + bytes / bandwidth).
    Only the all-gathers are slowed; the reduce-scatters run at loopback speed."""

    def __init__(self, groups: list, link: SlowNetwork) -> None:
        self.groups, self.link = groups, link
        self.t0 = time.time()
        self.events: list[Event] = []
        self.gathered_peak = 0
        self._unit: int | None = None
        self._open: dict[tuple[str, int], float] = {}
        for i, group in enumerate(groups):
            self._wrap(group, i)

    def now(self) -> float:
        return time.time() - self.t0

    def reset(self) -> None:
        self.t0, self.events, self.gathered_peak = time.time(), [], 0

    def hook(self, op, args, sent, received, call):
        if op not in GATHERS or self._unit is None:
            return call()
        unit, start = self._unit, time.time()
        result = call()
        finish = start + self.link.collective_time(op, max(sent, received), world_size())

        def done(end: float) -> None:
            self.events.append(Event("all_gather", unit, start - self.t0, end - self.t0))

        if args.get("async_op"):
            return _DelayedWork(result, finish, done)
        time.sleep(max(0.0, finish - time.time()))
        done(time.time())
        return result

    def _gathered_bytes(self) -> int:
        total = 0
        for group in self.groups:
            pending = group._all_gather_result
            if pending is not None:
                out = pending.all_gather_output
                total += out.numel() * out.element_size()
            elif group.is_unsharded:
                total += sum(
                    p._unsharded_param.numel() * p._unsharded_param.element_size()
                    for p in group.fsdp_params
                )
        return total

    def _wrap(self, group, i: int) -> None:
        unshard, pre_fw, post_fw = group.unshard, group.pre_forward, group.post_forward
        pre_bw, post_bw = group.pre_backward, group.post_backward

        def tagged_unshard(*a, **k):
            self._unit = i
            try:
                return unshard(*a, **k)
            finally:
                self._unit = None

        def begin(kind, original):
            def wrapped(*a, **k):
                out = original(*a, **k)
                self._open[(kind, i)] = self.now()
                return out

            return wrapped

        def end(kind, original):
            def wrapped(*a, **k):
                if kind == "forward":  # the unit is still gathered, a prefetch under way
                    self.gathered_peak = max(self.gathered_peak, self._gathered_bytes())
                if (kind, i) in self._open:
                    self.events.append(Event(kind, i, self._open.pop((kind, i)), self.now()))
                return original(*a, **k)

            return wrapped

        group.unshard = tagged_unshard
        group.pre_forward, group.post_forward = begin("forward", pre_fw), end("forward", post_fw)
        group.pre_backward = begin("backward", pre_bw)
        group.post_backward = end("backward", post_bw)


def _unit_group(unit: nn.Module):
    (group,) = unit._get_fsdp_state()._fsdp_param_groups
    return group


def prefetch_timeline(
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    prefetch: bool,
    config: models.GPTConfig | None = None,
    latency: float = 2e-3,
    bandwidth: float = 20e6,
    lr: float = 1e-2,
    dtype: torch.dtype = torch.float32,
) -> Timeline:
    """Train the seeded TinyGPT under FSDP2 with resharding (ZeRO-3; call on every rank), its
    all-gathers issued asynchronously and slowed to a `latency`/`bandwidth` link; record when
    each unit's all-gather and compute ran in the last step. `prefetch=True` tells each unit
    to start the next unit's all-gather in forward and the previous one's in backward; False
    gathers each unit only when it is needed (FSDP2's default backward prefetch switched off
    by naming the unit itself as its backward prefetch)."""
    model = models.TinyGPT(config, seed=0, dtype=dtype).to(device())
    mesh = init_device_mesh(device().type, (world_size(),))
    units = shard_units(model)
    unit_bytes = [held_bytes(unit.parameters()) for unit in units]  # before sharding: full
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    for i, unit in enumerate(units):
        unit._set_unshard_async_op(True)  # all-gathers return a handle; FSDP waits on it later
        if prefetch:
            unit.set_modules_to_forward_prefetch(units[i + 1 : i + 2])
            unit.set_modules_to_backward_prefetch(units[max(i - 1, 0) : i] or [unit])
        else:
            unit.set_modules_to_backward_prefetch([unit])  # prefetching itself: a no-op
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    recorder = _Recorder([_unit_group(u) for u in units], SlowNetwork(bandwidth, latency))
    comm.add_around_hook(recorder.hook)
    steps = []  # (seconds, events, gathered peak) of each step
    try:
        for x, y in batches:
            x, y = (shard(t, rank(), world_size()).to(device()) for t in (x, y))
            dist.barrier()
            recorder.reset()
            loss = models.lm_loss(model(x), y)
            loss.backward()
            # The step's compute and communication, not AdamW; the slowest rank decides.
            seconds = torch.tensor([recorder.now()], dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            steps.append((seconds.item(), recorder.events, recorder.gathered_peak))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        comm.remove_around_hook(recorder.hook)
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    # The fastest step after the first (which also sets FSDP up): the least disturbed by
    # other processes sharing the cores. Every rank picks the same step.
    seconds, events, peak = min(steps[1:] or steps, key=lambda s: s[0])
    events = sorted(events, key=lambda e: e.start)
    return Timeline(prefetch, events, seconds, peak, unit_bytes, params)


def plot_timeline(*runs: Sequence[Timeline], titles: Sequence[str] = ()):
    """A Gantt chart per run: for each rank a row of all-gathers and a row of compute (forward
    blue, backward orange), each bar labelled with its unit."""
    fig = NotebookFigure(figsize=(10, 1.2 + 1.4 * len(runs) * len(runs[0]) / 2))
    axes = fig.subplots(len(runs), 1, squeeze=False)[:, 0]
    colours = {"all_gather": "tab:grey", "forward": "tab:blue", "backward": "tab:orange"}
    end = max(t.step_seconds for ranks in runs for t in ranks) * 1e3
    for ax, ranks, title in zip(axes, runs, [*titles, *[""] * len(runs)], strict=False):
        labels = []
        for r, timeline in enumerate(ranks):
            for row, kinds in enumerate((("all_gather",), ("forward", "backward"))):
                y = (len(ranks) - 1 - r) * 2.5 + (1 - row)
                labels.append((y, f"rank {r} {'comm' if row == 0 else 'compute'}"))
                for e in timeline.events:
                    if e.kind in kinds:
                        width = (e.end - e.start) * 1e3
                        ax.broken_barh(
                            [(e.start * 1e3, width)],
                            (y, 0.8),
                            color=colours[e.kind],
                            edgecolor="white",
                            linewidth=0.6,
                        )
                        ax.text(
                            e.start * 1e3 + width / 2,
                            y + 0.4,
                            str(e.unit),
                            ha="center",
                            va="center",
                            fontsize=6,
                            color="white",
                        )
        ax.set_yticks([y + 0.4 for y, _ in labels], [name for _, name in labels], fontsize=7)
        ax.set_xlim(0, end * 1.02)
        ax.set_title(title, fontsize=9)
    axes[-1].set_xlabel(
        "ms since the step started (numbers: unit; grey all-gather, blue forward, orange backward)"
    )
    fig.tight_layout()
    return fig


def timeline_summary(runs: Mapping[str, Sequence[Timeline]]) -> str:
    """Per rank: step time (the slowest rank's), compute, all-gather and exposed all-gather
    time, and the gathered peak."""
    head = ["step ms", "compute ms", "gathers ms", "exposed ms", "gathered peak B"]
    lines = [f"{'':<20}" + "".join(f"{h:>12}" for h in head[:-1]) + f"{head[-1]:>17}"]
    for name, ranks in runs.items():
        for r, t in enumerate(ranks):
            cells = (t.step_seconds, t.compute_seconds, t.gather_seconds, t.exposed_seconds)
            lines.append(
                f"{f'{name}, rank {r}':<20}"
                + "".join(f"{v * 1e3:>12.1f}" for v in cells)
                + f"{t.gathered_peak:>17,}"
            )
    return "\n".join(lines)
