"""Lecture 11's figures: peak memory against the sequence length, the causal work per hop."""

from __future__ import annotations

import itertools

import matplotlib.pyplot as plt
import torch
from matplotlib.ticker import NullFormatter


def plot_peak_bytes(seq_lens, one_process, per_rank: dict[str, list[int]], p: int):
    """Peak bytes against sequence length: one process, and the busiest rank of each method."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.loglog(seq_lens, one_process, "o-", color="black", label="one process, whole sequence")
    for name, peaks in per_rank.items():
        ax.loglog(seq_lens, peaks, "o-", label=f"{name}, busiest of {p} ranks")
    ax.set_xticks(seq_lens, [str(n) for n in seq_lens])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("sequence length N (tokens)")
    ax.set_ylabel("peak bytes during attention")
    ax.set_title("Attention's memory: N x N scores, or pieces of them")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    return fig


def plot_causal_work(per_layout: dict[str, list[list[int]]]):
    """Scores computed by each rank at each hop of the ring, one grid per layout
    (`per_layout[layout][rank][hop]`), with each rank's total under its column."""
    fig, axes = plt.subplots(1, len(per_layout), figsize=(3.4 * len(per_layout), 3.6))
    top = max(max(max(hops) for hops in work) for work in per_layout.values())
    for ax, (layout, work) in zip(axes, per_layout.items(), strict=True):
        grid = torch.tensor(work).T  # [hop, rank]
        ax.imshow(grid, cmap="Blues", vmin=0, vmax=top, aspect="auto")
        for hop, r in itertools.product(*map(range, grid.shape)):
            n = int(grid[hop, r])
            shade = "white" if n > top / 2 else "black"  # readable on dark and light cells
            ax.text(r, hop, str(n), ha="center", va="center", fontsize=8, color=shade)
        totals = [f"rank {r}\n{sum(hops)}" for r, hops in enumerate(work)]
        ax.set_xticks(range(len(work)), totals)
        ax.set_yticks(range(grid.shape[0]))
        ax.set_ylabel("hop")
        ax.set_title(f"{layout}: scores per hop")
    fig.suptitle("Causal ring attention: who works at each hop (totals under the ranks)")
    fig.tight_layout()
    return fig
