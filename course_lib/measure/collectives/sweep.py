"""Lecture 2's all-reduce against its model on an emulated network: each algorithm of
`course_lib.collectives`, and the two-level all-reduce, swept over sizes on every rank
(`sweep_all_reduce`), drawn over the alpha-beta model's lines with the sizes where the model's
fastest algorithm changes (`plot_all_reduce_sweep`, `crossovers`), and sliders over the model
(`AllReduceModelWidget`)."""

from __future__ import annotations

from functools import partial
from typing import Any

import ipywidgets as widgets
import numpy as np
from IPython.display import display
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from course_lib.collectives import (
    ALGORITHMS,
    model_seconds,
    two_level_all_reduce,
)
from course_lib.costs import two_level_all_reduce_seconds
from course_lib.measure.collectives.timing import time_all_reduce
from course_lib.network import SlowNetwork
from course_lib.plots import NotebookFigure
from course_lib.progress import progress

# --- all-reduce against its model, on an emulated network ---------------------------------

TWO_LEVEL = "two_level"  # the sweep's sixth algorithm: `collectives.two_level_all_reduce`


def sweep_all_reduce(
    sizes: list[int], network: dict, repeats: int = 3, node_size: int = 2
) -> dict[str, list[float]]:
    """On every rank: {algorithm: median seconds per size} for one all-reduce of each number
    of float32s in `sizes`, inside `SlowNetwork(**network)`, message by message: each
    algorithm of `ALGORITHMS`, then "two_level" (`two_level_all_reduce` with nodes of
    `node_size` ranks, on the same network: its links inside a node are only faster if
    `network` says so with its own `node_size` and `node_bandwidth`)."""
    algorithms = {**ALGORITHMS, TWO_LEVEL: partial(two_level_all_reduce, node_size=node_size)}
    runs = [(name, n) for name in algorithms for n in sizes]
    seconds = {name: [] for name in algorithms}
    for name, n in progress(runs, "all-reduces"):
        seconds[name].append(time_all_reduce(algorithms[name], n, repeats, network))
    return seconds


def two_level_model(nbytes: list[float], world_size: int, node_size: int, network: dict) -> list:
    """The model's seconds of `two_level_all_reduce` for each size in bytes on `network`: the
    links inside a node are the network's own unless it gives nodes faster ones."""
    net = SlowNetwork(**network)  # its `link` decides which links two ranks share
    _, bandwidth, latency = net.link(0, node_size)  # the first ranks of two nodes
    _, node_bandwidth, node_latency = net.link(0, 1)  # two ranks of the first node
    outside, inside = (latency, 1 / bandwidth), (node_latency, 1 / node_bandwidth)
    return [
        two_level_all_reduce_seconds(round(n), world_size, node_size, *outside, *inside)
        for n in nbytes
    ]


def model_lines(
    nbytes: list[float], world_size: int, alpha: float, beta: float
) -> dict[str, list[float]]:
    """{algorithm: the model's seconds for each size in bytes} (`collectives.model_seconds`)."""
    return {
        name: [model_seconds(name, round(n / 4), world_size, alpha, beta) for n in nbytes]
        for name in ALGORITHMS
    }


def fastest(nbytes: list[float], world_size: int, alpha: float, beta: float) -> list[str]:
    """The model's fastest algorithm at each size (the first listed wins a tie)."""
    lines = model_lines(nbytes, world_size, alpha, beta)
    return [min(lines, key=lambda name: lines[name][i]) for i in range(len(nbytes))]


def crossovers(
    world_size: int, alpha: float, beta: float, lo: float = 1e2, hi: float = 1e10
) -> list[tuple[float, str, str]]:
    """(bytes, from, to) where the model's fastest algorithm changes, on a grid of 200
    sizes per decade between `lo` and `hi` bytes."""
    grid = list(np.logspace(np.log10(lo), np.log10(hi), int(200 * np.log10(hi / lo)) + 1))
    best = fastest(grid, world_size, alpha, beta)
    return [
        (float(grid[i]), best[i - 1], best[i])
        for i in range(1, len(grid))
        if best[i] != best[i - 1]
    ]


def _draw_model(ax: Axes, nbytes: list[float], world_size: int, alpha: float, beta: float) -> None:
    for i, (name, seconds) in enumerate(model_lines(nbytes, world_size, alpha, beta).items()):
        ax.plot(nbytes, seconds, "-", color=f"C{i}", alpha=0.5, lw=3, label=f"{name}: model")
    for at, _, to in crossovers(world_size, alpha, beta, min(nbytes), max(nbytes)):
        ax.axvline(at, color="grey", ls=":", lw=1)
        ax.annotate(f"{to} from {at / 1e3:,.0f} kB", (at, 0.02), xycoords=("data", "axes fraction"),
                    rotation=90, fontsize=7, color="grey", ha="right")  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("N: bytes all-reduced")
    ax.set_ylabel("seconds")
    ax.grid(alpha=0.3, which="both")


def plot_all_reduce_sweep(
    sizes: list[int],
    measured: dict[str, list[float]],
    world_size: int,
    network: dict,
    node_size: int = 2,
) -> Figure:
    """Measured times (dots) over the model's lines, for `sizes` float32s on `network`
    (`sweep_all_reduce`'s result; its "two_level" with nodes of `node_size`)."""
    alpha, beta = network["latency"], 1 / network["bandwidth"]
    nbytes = [4 * n for n in sizes]
    fig = NotebookFigure(figsize=(7, 4.2), layout="constrained")
    ax = fig.add_subplot()
    grid = list(np.logspace(np.log10(nbytes[0]), np.log10(nbytes[-1]), 60))
    _draw_model(ax, grid, world_size, alpha, beta)
    if TWO_LEVEL in measured:  # not in the crossovers: those compare the flat algorithms
        colour = f"C{list(measured).index(TWO_LEVEL)}"
        seconds = two_level_model(grid, world_size, node_size, network)
        label = f"{TWO_LEVEL} (nodes of {node_size}): model"
        ax.plot(grid, seconds, "-", color=colour, alpha=0.5, lw=3, label=label)
    for i, (name, seconds) in enumerate(measured.items()):
        ax.plot(nbytes, seconds, "o", color=f"C{i}", label=f"{name}: measured")
    ax.set_title(
        f"all-reduce on {world_size} ranks, {network['bandwidth'] * 8 / 1e9:g} Gbit/s, "
        f"{network['latency'] * 1e3:g} ms per message (emulated)",
        fontsize=10,
    )
    ax.legend(fontsize=7, ncol=2)
    return fig


class AllReduceModelWidget(widgets.VBox):
    """The model's time against N for each algorithm, with sliders for alpha, bandwidth and P.
    `best` holds the crossovers shown, so a test can check them without looking at pixels."""

    def __init__(self, latency_us: float = 10.0, gbits: float = 10.0, world_size: int = 8) -> None:
        style = {"description_width": "initial"}
        self.latency = widgets.FloatLogSlider(
            latency_us, base=10, min=0, max=4, description="latency α (µs)", style=style
        )
        self.bandwidth = widgets.FloatLogSlider(
            gbits, base=10, min=-1, max=3, description="bandwidth (Gbit/s)", style=style
        )
        powers = [2**k for k in range(1, 11)]
        self.ranks = widgets.SelectionSlider(
            options=powers, value=world_size, description="ranks P", style=style
        )
        self.output = widgets.Output()
        super().__init__([widgets.HBox([self.latency, self.bandwidth, self.ranks]), self.output])
        self.best: list[tuple[float, str, str]] = []
        self.figure: Figure | None = None
        for slider in (self.latency, self.bandwidth, self.ranks):
            slider.observe(self._redraw, names="value")
        self._redraw()

    def _redraw(self, _change: Any = None) -> None:
        alpha, beta = self.latency.value * 1e-6, 8 / (self.bandwidth.value * 1e9)
        p = self.ranks.value
        self.best = crossovers(p, alpha, beta, 1e3, 1e10)
        self.figure = NotebookFigure(figsize=(7, 4), layout="constrained")
        ax = self.figure.add_subplot()
        _draw_model(ax, list(np.logspace(3, 10, 80)), p, alpha, beta)
        ax.legend(fontsize=7)
        with self.output:
            self.output.clear_output(wait=True)
            display(self.figure)
