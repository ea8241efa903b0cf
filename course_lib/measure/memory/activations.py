"""Lecture 6's activation memory, measured: what a model saves for backward against the
sequence length (the s x s part against its formula, the rest against a line), a transformer
layer built as Korthikanti et al. count it (`PaperBlock`) against sbh(34 + 5as/h), and the
sweep over s, b, h, a that sets it beside torch's CPU dropout and the course's own block.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter
from torch import nn

from course_lib import models
from course_lib.costs import activation_memory
from course_lib.memory import SavedSnapshot, SavedTensors, attention_square_bytes, square_bytes
from course_lib.models import GPTConfig
from course_lib.plots import NotebookFigure, plot_against_formula

# --- activation memory against the sequence length ------------------------------------------


@dataclass
class SequenceSplit:
    """Bytes a model saved for backward at each sequence length: the storages ending in (s, s)
    (measured, and by `attention_square_bytes`) and the rest (measured, and the straight line
    through its first two points)."""

    seqs: list[int]
    total: list[int]
    square: list[int]
    formula: list[int]
    rest: list[int]
    line: list[float]


def sequence_split(
    measure: Callable[[int, int], SavedSnapshot],
    config: GPTConfig,
    seqs: Sequence[int],
    batch: int,
) -> SequenceSplit:
    """Measure `measure(batch, seq)` (the saved tensors of one forward) at every length in
    `seqs` and split it: the (s, s) part against its formula, the rest against a line."""
    saved = [measure(batch, s) for s in seqs]
    total = [v.live_bytes for v in saved]
    square = [square_bytes(v, s) for v, s in zip(saved, seqs, strict=True)]
    rest = [t - q for t, q in zip(total, square, strict=True)]
    slope = (rest[1] - rest[0]) / (seqs[1] - seqs[0])
    return SequenceSplit(
        list(seqs),
        total,
        square,
        [attention_square_bytes(config, batch=batch, seq=s) for s in seqs],
        rest,
        [rest[0] + slope * (s - seqs[0]) for s in seqs],
    )


def sequence_table(split: SequenceSplit) -> str:
    """One row per sequence length: total, (s, s) part, its formula, the rest, the line."""
    columns = ("total", "square", "formula", "rest", "line")
    lines = [f"{'seq':>4}{'total':>12}{'s x s part':>12}{'formula':>12}{'rest':>12}{'line':>12}"]
    for i, s in enumerate(split.seqs):
        lines.append(f"{s:>4}" + "".join(f"{getattr(split, c)[i]:>12,.0f}" for c in columns))
    return "\n".join(lines)


def plot_sequence_split(split: SequenceSplit) -> Figure:
    """The (s, s) part, the rest and the total in MB against s: dots measured, lines the
    (s, s) formula and the rest's straight line."""
    mb = lambda values: [v / 1e6 for v in values]
    square = "s x s part (attention)"
    return plot_against_formula(
        split.seqs,
        {square: mb(split.square), "rest": mb(split.rest), "total": mb(split.total)},
        {square: mb(split.formula), "rest": mb(split.line)},
        xlabel="sequence length s",
        ylabel="MB saved for backward",
        title="activation memory: linear in s, plus b·a·s² per block from attention",
    )


# --- a layer as the formula counts it ---------------------------------------------------------


class PaperBlock(nn.Module):
    """A GPT layer as Korthikanti et al. (2022) count it: 16-bit weights and activations, hidden
    size h, a heads, a 4h MLP, dropout (probability p) on the attention probabilities and after
    each of the two sublayers, and a fused scale-mask-softmax that keeps only its output.

    `fused_dropout=True` calls `torch.native_dropout`, which keeps a 1-byte mask as GPU kernels
    do; False calls `F.dropout`, which on the CPU multiplies by a noise tensor of the input's
    dtype and keeps that (2 bytes in bf16)."""

    def __init__(
        self,
        h: int,
        a: int,
        p: float = 0.1,
        dtype: torch.dtype = torch.bfloat16,
        fused_dropout: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if h % a:
            raise ValueError(f"h={h} must be divisible by a={a}")
        self.h, self.a, self.p, self.fused_dropout = h, a, p, fused_dropout
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.ln1 = nn.LayerNorm(h, dtype=dtype)
            self.qkv = nn.Linear(h, 3 * h, dtype=dtype)
            self.proj = nn.Linear(h, h, dtype=dtype)
            self.ln2 = nn.LayerNorm(h, dtype=dtype)
            self.fc = nn.Linear(h, 4 * h, dtype=dtype)
            self.fc2 = nn.Linear(4 * h, h, dtype=dtype)

    def dropout(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_dropout:
            return torch.native_dropout(x, self.p, True)[0]
        return F.dropout(x, self.p, training=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        d = h // self.a
        q, k, v = (
            t.view(b, s, self.a, d).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(h, -1)
        )
        # An additive mask and a scalar scale keep nothing for backward, as a fused kernel.
        future = torch.full((s, s), float("-inf"), dtype=x.dtype).triu(1)
        probs = self.dropout((q @ k.transpose(-2, -1) * (1 / math.sqrt(d)) + future).softmax(-1))
        x = x + self.dropout(self.proj((probs @ v).transpose(1, 2).reshape(b, s, h)))
        return x + self.dropout(self.fc2(F.gelu(self.fc(self.ln2(x)))))


def course_block(h: int, a: int, seed: int = 0) -> nn.Module:
    """The course's own layer (`models.Block` of TinyGPT, fp32, no dropout), h wide, a heads."""
    config = models.GPTConfig(d_model=h, n_heads=a, d_ff=4 * h)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return models.Block(config, torch.float32)


def layer_activations(block: nn.Module, s: int, b: int, seed: int = 0) -> SavedSnapshot:
    """Forward a (b, s, h) input that requires grad, as the previous layer's output does,
    through `block` under `SavedTensors`, and count what the layer keeps for backward (read
    while the output, and so the graph, is alive)."""
    weight = next(block.parameters())
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, weight.shape[-1], generator=g).to(weight.dtype).requires_grad_(True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # the dropout masks
        with SavedTensors(exclude=block.parameters()) as saved:
            out = block(x)
    snapshot = SavedSnapshot(saved.live_bytes, saved.peak_bytes, tuple(saved.records))
    del out
    return snapshot


def records_table(saved: SavedSnapshot, s: int, b: int, h: int, a: int) -> str:
    """Each storage a layer saved, in the order forward saved it, with its bytes in the
    formula's units: sbh bytes for a tensor of tokens, as^2b bytes for one of (s, s) scores."""
    lines = [f"{'shape':<20}{'dtype':<10}{'bytes':>10}{'in units of':>16}"]
    for r in saved.records:
        square = r.shape[-2:] == (s, s) and len(r.shape) > 2
        unit, name = (a * s * s * b, "as^2b") if square else (s * b * h, "sbh")
        dtype = str(r.dtype).removeprefix("torch.")
        lines.append(f"{str(r.shape):<20}{dtype:<10}{r.nbytes:>10,}{r.nbytes / unit:>10.3g} {name}")
    lines.append(f"{'total':<30}{saved.live_bytes:>10,}")
    return "\n".join(lines)


# --- the sweep over s, b, h, a ----------------------------------------------------------------

# One thing changed at a time from s = 128, b = 2, h = 64, a = 4.
BASE = {"s": 128, "b": 2, "h": 64, "a": 4}
VALUES = {"s": (32, 64, 256), "b": (1, 4), "h": (32, 128), "a": (2, 8)}
SWEEP = [tuple(BASE.values())] + [
    tuple({**BASE, name: v}.values()) for name, values in VALUES.items() for v in values
]


@dataclass(frozen=True)
class LayerRow:
    """One configuration: the formula's bytes and the bytes each layer measured."""

    s: int
    b: int
    h: int
    a: int
    formula: float  # sbh(34 + 5as/h), costs.activation_memory
    paper: int  # PaperBlock, bf16, 1-byte masks
    unfused: int  # PaperBlock, bf16, F.dropout (CPU: 2-byte masks)
    course: int  # the course's fp32 block, no dropout


def activation_sweep(configs: Iterable[tuple[int, int, int, int]] = SWEEP) -> list[LayerRow]:
    """Measure each layer kind's saved bytes for every (s, b, h, a) in `configs`."""
    rows = []
    for s, b, h, a in configs:
        rows.append(
            LayerRow(
                s,
                b,
                h,
                a,
                activation_memory(s, b, h, a),
                layer_activations(PaperBlock(h, a), s, b).live_bytes,
                layer_activations(PaperBlock(h, a, fused_dropout=False), s, b).live_bytes,
                layer_activations(course_block(h, a), s, b).live_bytes,
            )
        )
    return rows


def activation_table(rows: Sequence[LayerRow]) -> str:
    """The formula's bytes per layer, the Megatron-style layer's measured bytes, and each
    measured layer's bytes over the formula's, for each configuration."""
    lines = [
        f"{'bytes per layer':>39}{'measured / formula':>33}",
        f"{'s':>4}{'b':>3}{'h':>5}{'a':>3}{'formula':>12}{'measured':>12}"
        f"{'Megatron':>10}{'CPU dropout':>12}{'course fp32':>12}",
    ]
    for r in rows:
        lines.append(
            f"{r.s:>4}{r.b:>3}{r.h:>5}{r.a:>3}{r.formula:>12,.0f}{r.paper:>12,}"
            f"{r.paper / r.formula:>10.4f}{r.unfused / r.formula:>12.3f}"
            f"{r.course / r.formula:>12.3f}"
        )
    return "\n".join(lines)


def plot_activation_sweep(rows: Sequence[LayerRow]) -> Figure:
    """Measured MB against the formula's, one dot per configuration and layer kind, on a
    log-log plot with the line measured = formula (and measured = 2 x formula)."""
    fig = NotebookFigure(figsize=(6, 4), layout="constrained")
    ax = fig.add_subplot()
    formula = [r.formula / 1e6 for r in rows]
    span = [min(formula) * 0.8, max(formula) * 1.25]
    ax.plot(span, span, "-", color="grey", alpha=0.5, lw=3, label="measured = formula")
    ax.plot(span, [2 * v for v in span], ":", color="grey", label="measured = 2 x formula")
    kinds = {
        "paper": "Megatron-style layer, bf16",
        "unfused": "same, torch's CPU dropout",
        "course": "course's TinyGPT block, fp32",
    }
    for i, (field, label) in enumerate(kinds.items()):
        measured = [getattr(r, field) / 1e6 for r in rows]
        ax.plot(formula, measured, "o", color=f"C{i}", label=label)
    ticks = [0.1, 0.2, 0.5, 1, 2, 5, 10]
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_minor_formatter(NullFormatter())  # labels only on the ticks above
    ax.set_xlim(span)
    ax.set_ylim(span[0], 2 * span[1])
    ax.set_xlabel("formula sbh(34 + 5as/h), MB per layer")
    ax.set_ylabel("measured MB saved per layer")
    ax.set_title("activations of one layer over s, b, h, a: measured against formula", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return fig
