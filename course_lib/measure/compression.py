"""How lecture 5 shows training with compressed gradients: loss curves against steps or
seconds, from the runs of `course_lib.compression.train_compressed`.

    plot_loss_curves(loss_curves(runs, against="time"), "seconds")
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from matplotlib.figure import Figure

from course_lib import plots
from course_lib.compression import CompressionLog, mean_losses


def plot_loss_curves(
    curves: dict[str, tuple[Sequence[float], Sequence[float]]],
    xlabel: str,
    ylabel: str = "training loss",
    title: str = "",
    log_y: bool = True,
) -> Figure:
    """One line per label from {label: (x, y)}, as `loss_curves` gives them."""
    return plots.plot_curves(
        {label: y for label, (_, y) in curves.items()},
        xlabel,
        ylabel,
        title,
        log_y=log_y,
        x_values={label: x for label, (x, _) in curves.items()},
    )


def loss_curves(runs: dict[str, Sequence[CompressionLog]], against: str = "step") -> dict:
    """Curves for `plot_loss_curves` from {label: per-rank runs}: mean loss against the step
    number, or against rank 0's cumulative wall-clock seconds (`against="time"`)."""
    curves = {}
    for label, per_rank in runs.items():
        losses = mean_losses(per_rank)
        if against == "time":
            x = list(torch.tensor(per_rank[0].step_s).cumsum(0).tolist())
        else:
            x = list(range(len(losses)))
        curves[label] = (x, losses)
    return curves
