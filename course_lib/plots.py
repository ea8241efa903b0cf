"""Figures and widgets the lectures share.

    from course_lib.plots import NotebookFigure, plot_against_formula, show_ranks

- `NotebookFigure`: a figure that shows itself in a notebook.
- `plot_against_formula`: measured points over the curve a formula predicts.
- `show_ranks`: a small text table of what each rank held before and after a call.

A topic's own figures and widgets live with its measurements, in `course_lib/measure/`.
Figures are `matplotlib.figure.Figure` objects (`NotebookFigure`), not pyplot state: a notebook
displays them, a test inspects them, and nothing leaks from one figure into the next.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure


class NotebookFigure(Figure):
    """A matplotlib Figure that shows itself as a PNG in a notebook, with no pyplot state."""

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.savefig(buffer, format="png")
        return buffer.getvalue()


# --- measurements against formulas -------------------------------------------------------


def plot_against_formula(
    x: Sequence[float],
    measured: Mapping[str, Sequence[float]],
    formula: Mapping[str, Sequence[float]],
    xlabel: str,
    ylabel: str,
    title: str = "",
) -> Figure:
    """Measured values as dots over the formula's values as a line, one colour per label."""
    fig = NotebookFigure(figsize=(6, 3.6), layout="constrained")
    ax = fig.add_subplot()
    for i, label in enumerate(measured):
        colour = f"C{i}"
        if label in formula:
            ax.plot(
                x, formula[label], "-", color=colour, alpha=0.5, lw=3, label=f"{label}: formula"
            )
        ax.plot(x, measured[label], "o", color=colour, label=f"{label}: measured")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_xticks(list(x))
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


# --- who holds what ------------------------------------------------------------------------


def _cell(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return "-" if value is None else str(value)


def show_ranks(per_rank: Sequence[Mapping[str, Any]]) -> None:
    """Print one row per rank and one column per key: `launch`'s results side by side."""
    columns = list(per_rank[0])
    rows = [
        [f"rank {r}"] + [_cell(result[c]) for c in columns] for r, result in enumerate(per_rank)
    ]
    header = [""] + columns
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("   ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def plot_curves(
    curves: Mapping[str, Sequence[float]],
    xlabel: str,
    ylabel: str,
    title: str = "",
    log_y: bool = False,
    x_values: Mapping[str, Sequence[float]] | None = None,
    ax: Axes | None = None,
) -> Figure:
    """One line per label (loss curves, say); `x_values[label]` (default: 0, 1, 2, ...) is
    its x axis. Draws on `ax`, or on a new figure."""
    if ax is None:
        ax = NotebookFigure(figsize=(6.5, 3.6), layout="constrained").add_subplot()
    for label, values in curves.items():
        xs = (x_values or {}).get(label, range(len(values)))
        ax.plot(list(xs), list(values), label=label)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return ax.figure
