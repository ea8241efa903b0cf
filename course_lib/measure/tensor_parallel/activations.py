"""Lecture 9's activation memory: GB per GPU by tensor-parallel degree, with sequence
parallelism and selective recompute, against the formula, and the MLP's saved bytes measured."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from course_lib import models
from course_lib.costs import (
    TransformerShape,
    activation_memory,
)
from course_lib.memory import SavedTensors
from course_lib.tensor_parallel import (
    ParallelMLP,
)

if TYPE_CHECKING:  # matplotlib is imported only where a figure is drawn
    import matplotlib.figure

# --- activation memory (the formula: `course_lib.costs.activation_memory`) ---------------------

VARIANTS = {  # label: keyword arguments of activation_memory
    "TP": {},
    "TP + SP": {"sequence_parallel": True},
    "TP + SP + selective recompute": {"sequence_parallel": True, "recompute_attention": True},
}


def activation_table(shape: TransformerShape, tps: tuple[int, ...] = (1, 2, 4, 8)) -> str:
    """GB of activations per GPU for the whole model (all layers, one micro-batch) under each
    variant and tensor-parallel degree t."""
    s, b, h, a = shape.seq, shape.batch, shape.hidden, shape.heads
    rows = [f"{'':<32}" + "".join(f"{f't={t}':>10}" for t in tps)]
    for label, kwargs in VARIANTS.items():
        cells = [shape.layers * activation_memory(s, b, h, a, t, **kwargs) / 1e9 for t in tps]
        rows.append(f"{label:<32}" + "".join(f"{gb:>10.1f}" for gb in cells))
    return "\n".join(rows)


def plot_activation_memory(
    shape: TransformerShape, tps: tuple[int, ...] = (1, 2, 4, 8)
) -> matplotlib.figure.Figure:
    """GB of activations per GPU against t, one line per variant, with the 80 GB of a GPU."""
    from course_lib.plots import NotebookFigure

    fig = NotebookFigure(figsize=(6, 3.6), layout="constrained")
    ax = fig.add_subplot()
    s, b, h, a = shape.seq, shape.batch, shape.hidden, shape.heads
    for label, kwargs in VARIANTS.items():
        gb = [shape.layers * activation_memory(s, b, h, a, t, **kwargs) / 1e9 for t in tps]
        ax.plot(tps, gb, "o-", label=label)
    ax.axhline(80, color="black", ls="--", lw=1, label="one 80 GB GPU")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(tps), [str(t) for t in tps])
    ax.set_xlabel("tensor-parallel ranks t")
    ax.set_ylabel("activations per GPU (GB)")
    ax.set_title(f"{shape.layers} layers, h={h}, a={a}, s={s}, b={b}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def mlp_saved_formula(tokens: int, hidden: int, d_ff: int, t: int, element_size: int) -> int:
    """Bytes the course's (dropout-free) MLP saves for backward on one of t ranks: its input
    (replicated), and GeLU's input and output (d_ff/t wide each: split)."""
    return tokens * (hidden + 2 * d_ff // t) * element_size


def measure_mlp_saved(config: models.GPTConfig | None = None, batch: int = 2) -> int:
    """Bytes autograd saves in this rank's ParallelMLP forward (fp32), weights excluded."""
    config = config or models.GPTConfig()
    mlp = ParallelMLP(models.TinyGPT(config).blocks[0].mlp)
    x = torch.randn(batch, config.seq_len, config.d_model)
    with SavedTensors(exclude=mlp.parameters()) as saved:
        y = mlp(x)
    del y
    return saved.peak_bytes
