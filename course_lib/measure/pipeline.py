"""What lecture 8 measures about pipelines, and how it shows them.

    logs = launch(measure_bubbles, make_stage, x, y, loss_fn, schedules, ms, fwd, bwd, ...)
    plot_schedule(timeline); PipelineWidget()           # Gantt chart; sliders for P and m
    plot_side_by_side(simulated, measured)              # the same schedules, simulated | measured
    torch_pipeline_step(stage, x, y, loss_fn, m, "1f1b")  # torch.distributed.pipelining
    zero_bubble_step(stage, x, y, loss_fn, m, defer_w=True)  # backward split into B and W
    brute_force_partition(layer_times, activation_sizes, n_machines)  # every cut, to check
    profile_layers(layers, x)                           # each layer's seconds and output bytes
    check_bubble_shares(bubble, fewest_m)               # the exercise: right, or a hint

The schedules, the pipeline and the partition are in `course_lib.pipeline`.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import ipywidgets as widgets
import torch
import torch.distributed as dist
from IPython.display import display
from matplotlib.figure import Figure
from torch import nn

from course_lib.costs import bubble_formula
from course_lib.exercises import check_number, check_numbers, together
from course_lib.memory import SavedTensors
from course_lib.pipeline import (
    FORWARD,
    SCHEDULES,
    EmulatedDevice,
    LossFn,
    Op,
    Partition,
    Stage,
    StageLog,
    Task,
    Timeline,
    check_partition_input,
    link_times,
    pipeline_step,
    simulate,
    stage_time,
    sync_times,
)
from course_lib.pipeline.trainer import _recv, _send
from course_lib.plots import NotebookFigure
from course_lib.progress import progress
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
    opens the connections between neighbours (the first message on a link is slow)."""
    pipeline_step(make_stage(), x, y, loss_fn, m=1, schedule="gpipe")
    runs = [(schedule, m) for schedule in schedules for m in ms]
    return {
        (schedule, m): pipeline_step(
            make_stage(), x, y, loss_fn, m, schedule, forward_s=forward_s, backward_s=backward_s
        )
        for schedule, m in progress(runs, "schedules")
    }


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


# --- 4. pictures: the Gantt chart and the widget --------------------------------------------

_FORWARD_COLOURS = ["#9ecae1", "#c6dbef"]  # per chunk, light: forward
_BACKWARD_COLOURS = ["#3182bd", "#6baed6"]  # per chunk, dark: backward
_WEIGHT_COLOURS = ["#31a354", "#74c476"]  # green: the weight-gradient half (zero bubble)


def draw_schedule(timeline: Timeline, ax: Any, title: str | None = None) -> None:
    """Draw one lane per stage: forward (light) and backward (dark) boxes numbered by
    micro-batch, idle time left grey."""
    span = timeline.makespan
    origin = min(t.start for t in timeline.tasks)
    unit = 1000.0 if timeline.measured else 1.0  # measured seconds are drawn in ms
    for s in range(timeline.n_stages):
        ax.barh(s, span * unit, left=0, height=0.8, color="#eeeeee")  # idle unless covered
    for t in timeline.tasks:
        colours = {FORWARD: _FORWARD_COLOURS, WEIGHT_GRAD: _WEIGHT_COLOURS}.get(
            t.kind, _BACKWARD_COLOURS
        )
        left, width = (t.start - origin) * unit, (t.end - t.start) * unit
        ax.barh(t.stage, width, left=left, height=0.8, color=colours[t.chunk % 2], ec="white")
        if width > 0.015 * span * unit:  # label boxes wide enough to read
            colour = "black" if t.kind == FORWARD else "white"
            ax.text(
                left + width / 2,
                t.stage,
                str(t.micro),
                ha="center",
                va="center",
                fontsize=7,
                color=colour,
            )
    ax.set_yticks(range(timeline.n_stages), [f"stage {s}" for s in range(timeline.n_stages)])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)" if unit == 1000.0 else "time (simulated units)")
    if title is None:
        title = f"{timeline.schedule}: P={timeline.n_stages}, bubble {timeline.bubble:.1%}"
    ax.set_title(title, fontsize=10)


def plot_schedule(*timelines: Timeline, titles: Sequence[str] | None = None) -> Figure:
    """One Gantt chart per timeline, stacked, on a shared time axis."""
    fig = NotebookFigure(
        figsize=(10, 0.9 + 1.0 * sum(t.n_stages * 0.32 + 0.5 for t in timelines)),
        layout="constrained",
    )
    axes = fig.subplots(len(timelines), 1, sharex=True, squeeze=False)[:, 0]
    for i, (timeline, ax) in enumerate(zip(timelines, axes, strict=True)):
        draw_schedule(timeline, ax, titles[i] if titles else None)
    return fig


def plot_side_by_side(simulated: Sequence[Timeline], measured: Sequence[Timeline]) -> Figure:
    """Simulated schedules on the left (units), the same schedules measured on the right (ms)."""
    rows = max(t.n_stages for t in (*simulated, *measured)) * 0.32 + 0.5
    fig = NotebookFigure(figsize=(12, 0.9 + rows * len(simulated)), layout="constrained")
    axes = fig.subplots(len(simulated), 2, squeeze=False)
    for row, (sim, real) in enumerate(zip(simulated, measured, strict=True)):
        draw_schedule(sim, axes[row, 0], f"simulated {sim.schedule}: bubble {sim.bubble:.1%}")
        draw_schedule(real, axes[row, 1], f"measured {real.schedule}: bubble {real.bubble:.1%}")
    return fig


class PipelineWidget(widgets.VBox):
    """Sliders for P and m and a schedule menu, drawing the simulated schedule and its bubble
    against the formula. `timeline` and `figure` hold what is shown (for tests)."""

    def __init__(self, n_stages: int = 4, m: int = 4, schedule: str = "1f1b") -> None:
        self.stages = widgets.IntSlider(n_stages, min=1, max=8, description="P (stages)")
        self.micro = widgets.IntSlider(m, min=1, max=32, description="m (micro)")
        self.schedule = widgets.Dropdown(options=SCHEDULES, value=schedule, description="schedule")
        self.output = widgets.Output()
        super().__init__([widgets.HBox([self.stages, self.micro, self.schedule]), self.output])
        self.timeline: Timeline | None = None
        self.figure: Figure | None = None
        for control in (self.stages, self.micro, self.schedule):
            control.observe(self._redraw, names="value")
        self._redraw()

    def _redraw(self, _change: Any = None) -> None:
        P, m, schedule = self.stages.value, self.micro.value, self.schedule.value
        with self.output:
            self.output.clear_output(wait=True)
            if schedule == "interleaved" and m % P:
                print(f"interleaved needs m divisible by P: try m = {P * max(1, m // P)}")
                return
            self.timeline = simulate(P, m, schedule)
            chunks = 2 if schedule == "interleaved" else 1
            # The naive schedule runs one micro-batch at a time: m = 1.
            formula = bubble_formula(P, 1 if schedule == "naive" else m, chunks)
            self.figure = plot_schedule(
                self.timeline,
                titles=[
                    f"{schedule}, P={P}, m={m}: bubble {self.timeline.bubble:.1%} "
                    f"(formula {formula:.1%}); peak in-flight on stage 0: "
                    f"{self.timeline.peak_in_flight(0)}"
                ],
            )
            display(self.figure)


# --- checking and feeding the partition ------------------------------------------------


def brute_force_partition(
    layer_times: Sequence[float],
    activation_sizes: Sequence[float],
    n_machines: int,
    bandwidth: float = 1.0,
    weight_sizes: Sequence[float] | None = None,
    replicate: bool = True,
) -> Partition:
    """Every cut into consecutive stages and every split of the machines among them: the
    reference `optimal_partition` must match (exponential; small cases only)."""
    check_partition_input(layer_times, activation_sizes, n_machines, bandwidth)
    n = len(layer_times)
    sync = sync_times(weight_sizes, n, bandwidth)
    comm = link_times(activation_sizes, bandwidth)
    best: Partition | None = None
    for n_stages in range(1, min(n, n_machines) + 1):
        for cuts in itertools.combinations(range(n - 1), n_stages - 1):
            bounds = [-1, *cuts, n - 1]
            links = max((comm[c] for c in cuts), default=0.0)
            if replicate:  # every way to give each stage at least one of the machines
                splits = [
                    [b - a for a, b in zip((0, *cut), (*cut, n_machines), strict=True)]
                    for cut in itertools.combinations(range(1, n_machines), n_stages - 1)
                ]
            else:
                splits = [[1] * n_stages]
            for machines in splits:
                stages = tuple(
                    Stage(bounds[s] + 1, bounds[s + 1], machines[s]) for s in range(n_stages)
                )
                slowest = max(
                    links,
                    *(stage_time(layer_times, sync, s.first, s.last, s.machines) for s in stages),
                )
                if best is None or slowest < best.time:
                    best = Partition(slowest, stages)
    return best


def profile_layers(
    layers: Sequence[nn.Module], x: torch.Tensor, repeats: int = 5
) -> tuple[list[float], list[int]]:
    """Measure each layer's forward + backward seconds and the bytes of its output (what a
    stage boundary after it sends): the DP's T_l and a_l. Rounds go through all layers in
    turn, after one warm-up round, and each layer keeps its fastest time: on a shared
    machine, other processes only ever add time."""
    times = [math.inf] * len(layers)
    sizes = [0] * len(layers)
    for round_ in range(repeats + 1):
        inp = x
        for i, layer in enumerate(layers):
            inp = inp.detach().requires_grad_(inp.is_floating_point())
            start = time.perf_counter()
            out = layer(inp)
            out.backward(torch.ones_like(out))
            if round_ > 0:  # round 0 warms up (first calls allocate and dispatch slowly)
                times[i] = min(times[i], time.perf_counter() - start)
            sizes[i] = out.numel() * out.element_size()
            inp = out
    return times, sizes


# --- the zero-bubble schedule: backward split in two -------------------------------------------

INPUT_GRAD, WEIGHT_GRAD = "B", "W"  # zero bubble: B (input gradient) and W (weight gradient)


def simulate_zero_bubble(
    n_stages: int,
    m: int,
    forward_s: float = 1.0,
    input_grad_s: float = 1.0,
    weight_grad_s: float = 1.0,
    defer_w: bool = False,
) -> Timeline:
    """A zero-bubble schedule (Qi et al., 2023) on an idealised machine. A backward is two
    passes: B, the gradient with respect to the stage's input, which the previous stage waits
    for, and W, the gradient with respect to its weights, which nobody waits for. Whenever a
    stage is free it runs the first that is ready of: the next B (on the critical path); the
    next F, if fewer than P - s micro-batches hold activations (1F1B's limit); else a W left
    pending, filling time 1F1B leaves idle.

    defer_w=False: a micro-batch holds its activations until its W (1F1B's peak memory).
    defer_w=True: they are freed after B except what W needs (each linear layer's input and
    output gradient), so W's can wait for the end: ZB-H1's bubble, (P-1)(F + B - W), for
    memory that grows with the W's left pending (`pending_w_peak`)."""
    P = n_stages
    done: dict[tuple[str, int, int], float] = {}
    next_f, next_b, w_done = [0] * P, [0] * P, [0] * P
    pending: list[list[int]] = [[] for _ in range(P)]
    free, tasks, clock = [0.0] * P, [], 0.0

    def ready(key: tuple[str, int, int]) -> bool:
        return key in done and done[key] <= clock

    while len(tasks) < 3 * P * m:
        for s in range(P):
            if free[s] > clock:
                continue
            f, b = next_f[s], next_b[s]
            holding = f - (next_b[s] if defer_w else w_done[s])
            if b < m and ready((FORWARD, b, s)) and (s == P - 1 or ready((INPUT_GRAD, b, s + 1))):
                kind, micro, seconds = INPUT_GRAD, b, input_grad_s
                next_b[s] += 1
                pending[s].append(b)
            elif f < m and holding < P - s and (s == 0 or ready((FORWARD, f, s - 1))):
                kind, micro, seconds = FORWARD, f, forward_s
                next_f[s] += 1
            elif pending[s]:
                kind, micro, seconds = WEIGHT_GRAD, pending[s].pop(0), weight_grad_s
                w_done[s] += 1
            else:
                continue
            done[(kind, micro, s)] = free[s] = clock + seconds
            tasks.append(Task(s, kind, micro, 0, clock, clock + seconds))
        clock = min((t for t in (*free, *done.values()) if t > clock), default=clock)
    return Timeline(P, tasks, zero_bubble_name(defer_w))


def zero_bubble_name(defer_w: bool) -> str:
    return "zero bubble, " + ("W's deferred" if defer_w else "1F1B's memory")


def pending_w_peak(timeline: Timeline, stage: int) -> int:
    """Most W's owed at once on `stage`: B done, W not yet (each keeps what W needs)."""
    owed = peak = 0
    for t in sorted((t for t in timeline.tasks if t.stage == stage), key=lambda t: t.start):
        owed += {INPUT_GRAD: 1, WEIGHT_GRAD: -1}.get(t.kind, 0)
        peak = max(peak, owed)
    return peak


def peak_activations(timeline: Timeline, stage: int, freed_by: str = INPUT_GRAD) -> int:
    """Most micro-batches holding activations on `stage` at once: from a forward to the op
    that frees them, the backward (`"B"`, also 1F1B's whole backward) or the W."""
    live = peak = 0
    for t in sorted((t for t in timeline.tasks if t.stage == stage), key=lambda t: t.start):
        live += 1 if t.kind == FORWARD else -1 if t.kind == freed_by else 0
        peak = max(peak, live)
    return peak


# --- the zero-bubble schedule, run for real --------------------------------------------------


def zero_bubble_order(
    n_stages: int, m: int, defer_w: bool = False, times: Sequence[float] = (1.0, 1.0, 1.0)
) -> list[list[Op]]:
    """Each stage's F, B and W ops in the order `simulate_zero_bubble` ran them with
    `times` = (F, B, W): the runtime plays the simulator's schedule, not one of its own."""
    timeline = simulate_zero_bubble(n_stages, m, *times, defer_w=defer_w)
    tasks = sorted(timeline.tasks, key=lambda t: (t.stage, t.start))
    return [[Op(t.kind, t.micro) for t in tasks if t.stage == s] for s in range(n_stages)]


class VirtualDevice(EmulatedDevice):
    """An emulated device on a logical clock: an op starts when its input is ready (the
    sender's clock, in the message) and the device is free, and lasts exactly `op_s`; nobody
    sleeps. The real messages still decide what waits for what, so the timeline is counted,
    not timed: the same on a busy machine as on an idle one (for tests)."""

    def start(self, ready: float | None) -> float:
        self.lateness.append(0.0)
        return max((t for t in (ready, self.free_at) if t is not None), default=0.0)

    def finish(self, start: float, op_s: float) -> float:
        self.free_at = start + op_s
        return self.free_at


def zero_bubble_step(
    stage: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: LossFn,
    m: int,
    defer_w: bool = False,
    times: Sequence[float] = (0.0, 0.0, 0.0),
    clock: type[EmulatedDevice] = EmulatedDevice,
) -> StageLog:
    """One step of the zero-bubble pipeline on rank r = stage index, in `zero_bubble_order`.

    F as in `pipeline_step`; B: the gradient of the stage's input only, sent upstream at
    once; W: the weights' gradients, later. `times` = (F, B, W) seconds on the rank's
    emulated device (0: real compute only; the order then comes from F = B = W).
    """
    P, r = world_size(), rank()
    if x.shape[0] % m:
        raise ValueError(f"a batch of {x.shape[0]} samples does not split into m={m} equal parts")
    order = zero_bubble_order(P, m, defer_w, times if all(t > 0 for t in times) else (1, 1, 1))
    stage.to(device())
    xs, ys = ([c.to(device(), copy=True) for c in t.chunk(m)] for t in (x, y))
    log, dev = StageLog(r, zero_bubble_name(defer_w)), clock()
    params = list(stage.parameters())
    weight_grads = [torch.zeros_like(p) for p in params]
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}  # micro-batch -> output, its graph kept until W
    grads_out: dict[int, torch.Tensor | None] = {}  # micro-batch -> gradient W starts from
    pending: list[Any] = []
    total_loss = 0.0
    # W from the graph B kept (retain_graph=True), not by saving each linear layer's input and
    # recomputing: it works for any stage (embedding, layer norm, attention) and is exact. The
    # price: a micro-batch holds all its activations until its W, and W walks the chain of
    # activation gradients again. Both cost real memory and compute, not the emulated time.
    with SavedTensors(exclude=params) as saved:
        for op in order[r]:
            i = op.micro
            if op.kind == FORWARD:
                inp, ready = (xs[i], None) if r == 0 else _recv(r - 1)
                start, before = dev.start(ready), saved.live_bytes
                out = stage(inp.requires_grad_() if r > 0 else inp)
                if r == P - 1:
                    out = loss_fn(out, ys[i]) / m  # mean over micro-batches
                    total_loss += out.item()
                end = dev.finish(start, times[0])
                if r < P - 1:
                    pending += _send(out, r + 1, ready=end)
                log.activation_bytes.append(saved.live_bytes - before)
                inputs[i], outputs[i] = inp, out
                log.peak_in_flight = max(log.peak_in_flight, len(outputs))
            elif op.kind == INPUT_GRAD:
                grad, ready = (None, None) if r == P - 1 else _recv(r + 1)
                start, inp = dev.start(ready), inputs.pop(i)
                if r > 0:  # stage 0's input is data: no gradient to send
                    (grad_in,) = torch.autograd.grad(outputs[i], [inp], grad, retain_graph=True)
                end = dev.finish(start, times[1])
                if r > 0:
                    pending += _send(grad_in, r - 1, ready=end)
                grads_out[i] = grad
            else:  # WEIGHT_GRAD: nobody waits for it
                start = dev.start(None)
                got = torch.autograd.grad(
                    outputs.pop(i), params, grads_out.pop(i), allow_unused=True
                )
                for total, g in zip(weight_grads, got, strict=True):
                    if g is not None:
                        total += g
                end = dev.finish(start, times[2])
            log.tasks.append(Task(r, op.kind, i, 0, start, end))
        log.peak_activation_bytes = saved.peak_bytes
    for work in pending:
        if isinstance(work, dist.Work):
            work.wait()
    for p, g in zip(params, weight_grads, strict=True):
        p.grad = g
    log.loss = total_loss if r == P - 1 else None
    log.lateness = dev.lateness
    log.grads = [g.detach().clone() for g in weight_grads]
    return log


def measure_zero_bubble(
    make_stage: Callable[[], nn.Module],
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: LossFn,
    m: int,
    times: Sequence[float],
) -> dict[str, StageLog]:
    """Run on every rank: 1F1B (backward = B + W in one op) and both zero-bubble variants,
    F, B, W lasting `times`, after warm-up steps that open the links and make the first calls."""
    pipeline_step(make_stage(), x, y, loss_fn, m=1, schedule="gpipe")
    zero_bubble_step(make_stage(), x, y, loss_fn, m=1)
    f, b, w = times
    return {
        "1f1b": pipeline_step(make_stage(), x, y, loss_fn, m, "1f1b", f, b + w),
        **{
            zero_bubble_name(defer): zero_bubble_step(make_stage(), x, y, loss_fn, m, defer, times)
            for defer in (False, True)
        },
    }


# --- the lecture's exercise on the bubble ------------------------------------------------------


def check_bubble_shares(bubble: object, fewest_m_under_3_percent: object) -> bool | None:
    """The idle share of 8 stages with 8 and 64 micro-batches, and the fewest m under 3%."""
    return together(
        check_numbers(
            bubble,
            {f"P=8, m={m}": bubble_formula(8, m) for m in (8, 64)},
            hint="Idle stage-time over all stage-time, as derived above.",
        ),
        check_number(
            fewest_m_under_3_percent,
            next(m for m in range(1, 10_000) if bubble_formula(8, m) < 0.03),
            rtol=0,
            atol=0.5,
            hint="Solve (P-1)/(m+P-1) < 0.03 for m; m is a whole number.",
        ),
    )
