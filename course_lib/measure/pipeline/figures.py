"""Lecture 8's pictures: the Gantt chart of a schedule, simulated beside measured, and the
widget with sliders for P and m."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ipywidgets as widgets
from IPython.display import display
from matplotlib.figure import Figure

from course_lib.costs import bubble_formula
from course_lib.measure.pipeline.zero_bubble import WEIGHT_GRAD
from course_lib.pipeline import (
    FORWARD,
    SCHEDULES,
    Timeline,
    simulate,
)
from course_lib.plots import NotebookFigure

# --- pictures: the Gantt chart and the widget --------------------------------------------

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
    """Simulated schedules on the left (units), the same schedules run on ranks on the right
    (ms, on the wall clock)."""
    rows = max(t.n_stages for t in (*simulated, *measured)) * 0.32 + 0.5
    fig = NotebookFigure(figsize=(12, 0.9 + rows * len(simulated)), layout="constrained")
    axes = fig.subplots(len(simulated), 2, squeeze=False)
    for row, (sim, real) in enumerate(zip(simulated, measured, strict=True)):
        draw_schedule(sim, axes[row, 0], f"simulated {sim.schedule}: bubble {sim.bubble:.1%}")
        draw_schedule(real, axes[row, 1], f"run on ranks {real.schedule}: bubble {real.bubble:.1%}")
    return fig


def plot_bubbles(
    ms: Sequence[int],
    bubbles: dict[str, Sequence[float]],
    n_stages: int,
    title: str,
    kind: str = "simulated",
) -> Figure:
    """Bubbles by schedule (one per m in `ms`; `kind` says where they come from: "simulated",
    "on the ranks") as dots over the course's formula (P-1)/(m+P-1): the formula stays here,
    off the page of the exercise that asks for it."""
    fig = NotebookFigure(figsize=(6, 3.6), layout="constrained")
    ax = fig.add_subplot()
    formula = [bubble_formula(n_stages, m) for m in ms]
    ax.plot(ms, formula, "-", color="grey", alpha=0.5, lw=3, label="formula (P-1)/(m+P-1)")
    for i, (schedule, values) in enumerate(bubbles.items()):
        ax.plot(ms, values, "o", color=f"C{i}", ms=8 - 3 * i, label=f"{schedule}: {kind}")
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble (idle share)")
    ax.set_xticks(list(ms))
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
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
