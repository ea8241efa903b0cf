"""What lecture 2 measures and draws: the ring step by step, and all-reduce against its model.

    from course_lib.measure.collectives import RingWidget, ring_steps_figure
    from course_lib.measure.collectives import AllReduceModelWidget, plot_all_reduce_sweep

- `RingWidget(4)`: a slider over the steps of the ring all-reduce, drawing a rank x chunk grid
  (what each rank holds, how much of it is summed) and arrows for what each rank sends next.
  It draws `course_lib.collectives.ring_state` / `ring_schedule`, the schedule the ring
  implementation runs, so the picture and the code cannot disagree.
- `ring_steps_figure(4)`: every step as a strip of small panels, for reading without widgets.
- `record_peers()` counts whom a rank talks to; `time_all_reduce(algorithm, N)` times one
  all-reduce (on an emulated network with `network=`).
- `time_against_model(N, P, alpha, beta)` times each algorithm on this machine's loopback and
  prints the table of measured and modelled times.
- `sweep_all_reduce(sizes, network)` (on every rank, under `launch`) times each algorithm of
  `course_lib.collectives`, and the two-level all-reduce, on an emulated network;
  `plot_all_reduce_sweep` draws the times over the alpha-beta model's lines and marks where
  the model's fastest algorithm changes.
- `AllReduceModelWidget()`: sliders for latency, bandwidth and ranks over the model's lines.
- `check_crossover(crossover_bytes)`: the exercise's check, its expected value off the page.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import ipywidgets as widgets
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from IPython.display import display
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from course_lib.collectives import (
    ALGORITHMS,
    ALL_GATHER,
    REDUCE_SCATTER,
    bytes_sent,
    model_seconds,
    ring_schedule,
    ring_state,
    two_level_all_reduce,
)
from course_lib.costs import two_level_all_reduce_seconds
from course_lib.exercises import check_number
from course_lib.launch import launch
from course_lib.network import SlowNetwork
from course_lib.plots import NotebookFigure
from course_lib.progress import progress

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


# --- measuring: who talks to whom, and how long it takes ---------------------------------


_peer_depth = threading.local()  # dist.send calls dist.isend: count the outer call only


@contextmanager
def record_peers() -> Iterator[Counter]:
    """Count, by peer rank, the messages this rank sends or receives while the block runs
    (calls through `dist.send/recv/isend/irecv`): `{peer: messages}`."""
    peers: Counter = Counter()
    # Wrap both namespaces, as CommCounter does, so that the two nest in either order.
    originals = {op: getattr(c10d, op) for op in ("send", "recv", "isend", "irecv")}

    def recorder(op: str, original: Callable) -> Callable:
        peer_arg = "dst" if "send" in op else "src"

        def recorded(tensor, *args, **kwargs):
            depth = getattr(_peer_depth, "value", 0)
            if depth == 0:
                peers[kwargs.get(peer_arg, args[0] if args else None)] += 1
            _peer_depth.value = depth + 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                _peer_depth.value = depth

        return recorded

    for op, original in originals.items():
        wrapped = recorder(op, original)
        setattr(c10d, op, wrapped)
        setattr(dist, op, wrapped)
    try:
        yield peers
    finally:
        for op, original in originals.items():
            setattr(c10d, op, original)
            setattr(dist, op, original)


def time_all_reduce(
    algorithm: str | Callable[[torch.Tensor], torch.Tensor],
    numel: int,
    repeats: int = 5,
    network: dict | None = None,
) -> float:
    """On each rank: median seconds of `repeats` all-reduces of `numel` float32s with
    `algorithm` (a name in ALGORITHMS, "torch" for dist.all_reduce, or a function such as
    `two_level_all_reduce`), after one warm-up.
    With `network` (`SlowNetwork`'s keyword arguments), each runs on that emulated network:
    message by message for the algorithms built here, by the model for torch's own."""
    if callable(algorithm):
        run = algorithm
    else:
        run = dist.all_reduce if algorithm == "torch" else ALGORITHMS[algorithm]
    tensor = torch.ones(numel)
    run(tensor)  # warm-up: first-touch memory and connection set-up are not the algorithm
    times = []
    for _ in range(repeats):
        dist.barrier()  # start together, so no rank's time includes waiting for a late one
        start = time.perf_counter()
        with SlowNetwork(**network) if network is not None else nullcontext():
            run(tensor)
        dist.barrier()  # the all-reduce is done when the slowest rank is done
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def time_against_model(
    numel: int, world_size: int, alpha: float, beta: float, repeats: int = 7
) -> tuple[dict[str, float], dict[str, float]]:
    """Time one all-reduce of `numel` float32s on `world_size` ranks of this machine (torch's
    own, then each algorithm: the slowest rank's median of `repeats`), print it next to the
    alpha-beta model's time and the bytes all ranks send together, and return
    ({name: measured seconds}, {name: model seconds})."""
    measured, model = {}, {}
    link = f"model, {8 / beta / 1e9:g} Gbit/s"
    print(f"{'algorithm':<17} {'measured here':>14} {link:>17} {'all ranks send':>15}")
    for name in ["torch", *ALGORITHMS]:
        measured[name] = max(launch(time_all_reduce, name, numel, repeats, world_size=world_size))
        if name == "torch":  # gloo's own: no model of ours, no count of its bytes
            print(f"{name:<17} {1000 * measured[name]:11.0f} ms")
            continue
        model[name] = model_seconds(name, numel, world_size, alpha, beta)
        total = sum(bytes_sent(name, numel, world_size, r) for r in range(world_size))
        print(
            f"{name:<17} {1000 * measured[name]:11.0f} ms {1000 * model[name]:14.0f} ms "
            f"{total / (4 * numel):13.0f} N"
        )
    return measured, model


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


def check_crossover(crossover_bytes: object) -> bool | None:
    """Lecture 2: the N at which butterfly and halving-doubling tie, P = 8, 10 us, 10 Gbit/s."""
    return check_number(
        crossover_bytes,
        crossovers(8, 10e-6, 8 / 10e9)[0][0],
        rtol=0.02,
        unit="bytes",
        hint="Set the two times equal and solve for N; beta is seconds per byte: 8 / 10e9.",
    )


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
