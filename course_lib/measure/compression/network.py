"""Lecture 5 on a slow network: the bytes and seconds of each method per step as tables, one
run's table, and step time swept over bandwidths."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import torch
from matplotlib.figure import Figure

from course_lib.compression import (
    bytes_per_step,
    comm_seconds,
    latency_steps,
)
from course_lib.measure.compression.training import CompressionLog, mean_losses, train_compressed
from course_lib.plots import NotebookFigure

# --- the slow network: a table of one run, and a sweep over bandwidths -----------------------


def network_table(
    methods: Sequence[str],
    shapes: Sequence[torch.Size],
    world_size: int,
    links: dict[str, float],
    latency: float,
    **options,
) -> tuple[dict[tuple[str, str], float], str]:
    """The alpha-beta model's network time per step of each method at each of `links` ({name:
    bytes/s}), as {(method, link): seconds}, and a table of it: bytes and messages per step,
    the time at every link, and what each method saves against fp32 per parameter. All by
    the formulas (`bytes_per_step`, `comm_seconds`); `options` go to them (powersgd_rank)."""
    n_params = sum(math.prod(s) for s in shapes)
    network_s = {
        (m, link): comm_seconds(m, shapes, world_size, bw, latency, **options)
        for m in methods
        for link, bw in links.items()
    }
    lines = [f"{n_params:,} parameters, {4 * n_params / 1e6:.1f} MB of fp32 gradients"]
    for m in methods:
        sent = bytes_per_step(m, shapes, world_size, **options)
        times = ", ".join(f"{1e3 * network_s[m, link]:5.1f} ms at {link}" for link in links)
        lines.append(
            f"{m:<8} {sent:>9,} bytes/step, {latency_steps(m, world_size)} messages: "
            f"network {times}"
        )
    for m in [m for m in methods if m != "fp32"]:
        saved = ", ".join(
            f"{1e9 * (network_s['fp32', link] - network_s[m, link]) / n_params:3.0f} ns at {link}"
            for link in links
        )
        lines.append(f"{m:<8} saves per parameter: {saved}")
    return network_s, "\n".join(lines)


def slow_network_table(
    rank_runs: Sequence[dict[str, CompressionLog]],
    network_s: dict[tuple[str, str], float],
    link: str,
    n_params: int,
    start: int,
) -> str:
    """Lecture 5's table of a run on the emulated `link`, from every rank's {method: log}
    (rank 0's times): per step (after `start`) compute, network wait, total, the predicted
    network time `network_s[method, link]` and the speed-up over fp32; for the whole run its
    time, speed-up and largest loss gap to fp32; then each method's extra compute per
    parameter next to the network time it saves at every link of `network_s`."""
    runs = rank_runs[0]
    if "fp32" not in runs:
        raise ValueError(f"the table compares with fp32: run it too (got {', '.join(runs)})")
    links = list(dict.fromkeys(name for _, name in network_s))
    links.sort(key=lambda name: name != link)  # the run's link first
    losses = {m: mean_losses([per_rank[m] for per_rank in rank_runs]) for m in runs}
    split = {}
    for m, run in runs.items():  # mean compute, network wait and total per step, in ms
        total, wait = run.step_s[start:], run.wait_s[start:]
        split[m] = (1e3 * (sum(total) - sum(wait)) / len(total), 1e3 * sum(wait) / len(total))
        split[m] += (1e3 * sum(total) / len(total),)
    lines = [
        f"{'per step (ms)':<14}{'compute':>8}{'net wait':>10}{'total':>8}{'predicted net':>15}"
        f"{'speed-up':>10}"
    ]
    for m, (compute, wait, total) in split.items():
        speed_up = split["fp32"][2] / total
        lines.append(
            f"{m:<14}{compute:8.1f}{wait:10.1f}{total:8.1f}{1e3 * network_s[m, link]:15.1f}"
            f"{speed_up:9.2f}x"
        )
    lines.append(
        f"\n{'whole run':<14}{'time':>8}{'speed-up':>10}{'max |loss - fp32|':>19}{'final loss':>12}"
    )
    for m, run in runs.items():
        gap = max(abs(a - b) for a, b in zip(losses[m], losses["fp32"], strict=True))
        speed_up = sum(runs["fp32"].step_s) / sum(run.step_s)
        lines.append(
            f"{m:<14}{sum(run.step_s):7.2f}s{speed_up:9.2f}x{gap:19.1e}{losses[m][-1]:12.4f}"
        )
    lines.append("")
    for m in [m for m in runs if m != "fp32"]:
        extra = 1e6 * (split[m][0] - split["fp32"][0]) / n_params  # ms -> ns
        saved = [1e9 * (network_s["fp32", n] - network_s[m, n]) / n_params for n in links]
        lines.append(
            f"{m}: extra compute {extra:.0f} ns per parameter; network saved {saved[0]:.0f} ns "
            f"at {links[0]}"
            + "".join(f" ({v:.0f} ns at {n})" for v, n in zip(saved[1:], links[1:], strict=True))
        )
    return "\n".join(lines)


def sweep_bandwidth(
    methods: Sequence[str],
    bandwidths: Sequence[float],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    latency: float,
    *,
    skip: int = 2,
    **options,
) -> dict[str, list[float]]:
    """Median step seconds of each method (after the first `skip` steps) on `SlowNetwork` at
    each bandwidth in bytes/s, run on every rank in `launch`; `options` go to
    `train_compressed` (sizes, lr, powersgd_rank, start_powersgd_iter)."""
    if len(batches) <= skip:
        raise ValueError(f"need more than skip={skip} batches to time a step, got {len(batches)}")
    times: dict[str, list[float]] = {m: [] for m in methods}
    for bandwidth in bandwidths:
        network = {"bandwidth": bandwidth, "latency": latency}
        for m in methods:
            run = train_compressed(m, batches, network=network, **options)
            times[m].append(statistics.median(run.step_s[skip:]))
    return times


def plot_step_time_vs_bandwidth(
    bandwidths: Sequence[float],
    measured: dict[str, Sequence[float]],
    predicted: dict[str, Sequence[float]],
) -> Figure:
    """Measured step time (dots) and the alpha-beta network time alone (lines) of each method
    against the bandwidth, log-log: the gap between a dot and its line is the compute. One
    legend entry per method (methods with the same bytes share a line)."""
    fig = NotebookFigure(figsize=(7.5, 3.8), layout="constrained")
    ax = fig.add_subplot()
    gbits = [8 * b / 1e9 for b in bandwidths]
    for i, m in enumerate(measured):
        ax.plot(gbits, [1e3 * s for s in predicted[m]], "-", color=f"C{i}", alpha=0.4, lw=2)
        ax.plot(gbits, [1e3 * s for s in measured[m]], "o", color=f"C{i}", label=m)
    ax.plot([], [], "-", color="black", alpha=0.4, lw=2, label="lines: network time (model)")
    ax.plot([], [], "o", color="black", label="dots: measured step")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bandwidth (Gbit/s)")
    ax.set_ylabel("time per step (ms)")
    ax.set_title("step time against bandwidth, emulated network", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig
