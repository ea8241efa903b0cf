"""Lecture 2's ring all-reduce, drawn step by step: a rank x chunk grid of what each rank holds
and how much of it is summed, and arrows for what each rank sends next (`RingWidget`, a
slider; `ring_steps_figure`, every step as a strip). It draws `course_lib.collectives`'
`ring_state` / `ring_schedule`, the schedule the ring implementation runs, so the picture and
the code cannot disagree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ipywidgets as widgets
import numpy as np
from IPython.display import display
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from course_lib.collectives import (
    ALL_GATHER,
    REDUCE_SCATTER,
    ring_schedule,
    ring_state,
)
from course_lib.plots import NotebookFigure

PHASE_COLOURS = {REDUCE_SCATTER: "tab:orange", ALL_GATHER: "tab:green"}
RANK_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class RingFrame:
    """What the ring picture shows after `steps_done` steps: the data behind the drawing."""

    world_size: int
    steps_done: int
    holdings: list[list[frozenset[int]]]  # holdings[r][c]: ranks summed into r's chunk c
    arrows: list[tuple[int, int, int]]  # (from rank, to rank, chunk) of the next step
    phase: str | None  # phase of the next step; None when the all-reduce is done

    @property
    def fraction(self) -> np.ndarray:
        """P x P array: the share of all ranks summed into each rank's copy of each chunk."""
        return np.array([[len(s) / self.world_size for s in row] for row in self.holdings])

    @property
    def title(self) -> str:
        total = 2 * (self.world_size - 1)
        if self.phase is None:
            return f"after {self.steps_done} of {total} steps: every rank holds the full sum"
        verb = "adds" if self.phase == REDUCE_SCATTER else "keeps"
        return (
            f"step {self.steps_done + 1} of {total} ({self.phase}): each rank sends one chunk "
            f"to its right neighbour, which {verb} it"
        )

    @property
    def short_title(self) -> str:
        done = f"{self.steps_done} step{'' if self.steps_done == 1 else 's'} done"
        return f"{done}: all-reduced" if self.phase is None else f"{done}; next: {self.phase}"


def ring_frame(world_size: int, steps_done: int) -> RingFrame:
    """The state after `steps_done` steps and the sends of the next step, from the schedule."""
    schedule = ring_schedule(world_size)
    holdings = ring_state(world_size, steps_done)
    if steps_done == len(schedule):
        return RingFrame(world_size, steps_done, holdings, [], None)
    step = schedule[steps_done]
    arrows = [(r, (r + 1) % world_size, step.send[r]) for r in range(world_size)]
    return RingFrame(world_size, steps_done, holdings, arrows, step.phase)


def _label(ranks: frozenset[int], world_size: int) -> str:
    """Text of one cell: which ranks' pieces are summed in it ("a+c"), or "sum" when all."""
    if len(ranks) == world_size and world_size > 1:
        return "sum"
    if len(ranks) > 4:
        return f"{len(ranks)}/{world_size}"
    return "+".join(RANK_LETTERS[r % 26] for r in sorted(ranks))


def draw_ring_frame(frame: RingFrame, ax: Axes, short_title: bool = False) -> None:
    """Draw `frame` on `ax`: rows are ranks, columns chunks; darker = more ranks summed in."""
    p = frame.world_size
    ax.imshow(frame.fraction, cmap="Blues", vmin=0, vmax=1.6)  # 1.6: text stays readable
    for r in range(p):
        for c in range(p):
            ranks = frame.holdings[r][c]
            full = len(ranks) == p and p > 1
            ax.text(
                c,
                r,
                _label(ranks, p),
                ha="center",
                va="center",
                fontsize=9,
                fontweight="bold" if full else "normal",
            )
    colour = PHASE_COLOURS.get(frame.phase, "black")
    arrow = dict(arrowstyle="-|>", color=colour, lw=1.8)
    x = 0.38  # arrows run down the right edge of the chunk's column
    for src, dst, chunk in frame.arrows:
        if dst > src:
            ax.annotate(
                "", xy=(chunk + x, dst - 0.1), xytext=(chunk + x, src + 0.1), arrowprops=arrow
            )
        else:  # the wrap-around, last rank to rank 0: out at the bottom, in at the top
            ax.annotate(
                "", xy=(chunk + x, src + 0.75), xytext=(chunk + x, src + 0.1), arrowprops=arrow
            )
            ax.annotate(
                "", xy=(chunk + x, dst - 0.1), xytext=(chunk + x, dst - 0.75), arrowprops=arrow
            )
    ax.set_ylim(p - 0.5 + 0.3, -0.5 - 0.3)  # room for the wrap-around stubs
    ax.set_xticks(range(p), [f"chunk {c}" for c in range(p)])
    ax.set_yticks(range(p), [f"rank {r} ({RANK_LETTERS[r % 26]})" for r in range(p)])
    ax.tick_params(length=0)
    ax.set_title(frame.short_title if short_title else frame.title, fontsize=9)


def ring_figure(world_size: int, steps_done: int) -> Figure:
    """One frame of the ring as a figure of its own."""
    fig = NotebookFigure(
        figsize=(1.3 * world_size + 2.2, 1.0 * world_size + 0.9), layout="constrained"
    )
    draw_ring_frame(ring_frame(world_size, steps_done), fig.add_subplot())
    return fig


def ring_steps_figure(world_size: int = 4) -> Figure:
    """Every frame of the ring side by side, for reading without a live kernel."""
    frames = [ring_frame(world_size, s) for s in range(2 * (world_size - 1) + 1)]
    cols = min(len(frames), 4)
    rows = -(-len(frames) // cols)
    fig = NotebookFigure(figsize=(4.4 * cols, 3.4 * rows), layout="constrained")
    for i, frame in enumerate(frames):
        draw_ring_frame(frame, fig.add_subplot(rows, cols, i + 1), short_title=True)
    return fig


class RingWidget(widgets.VBox):
    """Sliders over the number of ranks and the step of the ring all-reduce, and the picture.

    `frame` and `figure` hold what is shown, so a test can check it without looking at pixels.
    """

    def __init__(self, world_size: int = 4, max_world: int = 8) -> None:
        if not 2 <= world_size <= max_world:
            raise ValueError(f"world_size must be in 2..{max_world}, got {world_size}")
        self.ranks = widgets.IntSlider(world_size, min=2, max=max_world, description="ranks")
        self.step = widgets.IntSlider(0, min=0, max=2 * (world_size - 1), description="steps done")
        self.output = widgets.Output()
        super().__init__([widgets.HBox([self.ranks, self.step]), self.output])
        self.frame: RingFrame | None = None
        self.figure: Figure | None = None
        self.ranks.observe(self._on_ranks, names="value")
        self.step.observe(self._redraw, names="value")
        self._redraw()

    def _on_ranks(self, _change: Any = None) -> None:
        self.step.value = 0  # a new ring starts from the beginning
        self.step.max = 2 * (self.ranks.value - 1)
        self._redraw()

    def _redraw(self, _change: Any = None) -> None:
        self.frame = ring_frame(self.ranks.value, self.step.value)
        self.figure = ring_figure(self.ranks.value, self.step.value)
        with self.output:
            self.output.clear_output(wait=True)
            display(self.figure)
