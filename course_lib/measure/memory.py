"""What lecture 6 measures beyond the byte counts of `course_lib.memory`: a transformer layer
built as Korthikanti et al. count it, against sbh(34 + 5as/h), and mixed precision as
frameworks run it (autocast, fp32 master weights, fp16 loss scaling with skipped steps).

    block = PaperBlock(h=64, a=4)                      # 16-bit, dropout, fused mask-softmax
    layer_activations(block, s=128, b=2).live_bytes    # bytes saved for backward, one layer
    rows = activation_sweep(SWEEP); activation_table(rows); plot_activation_sweep(rows)
    split = sequence_split(activations, config, [16, 64], batch=4); sequence_table(split)
    autocast_memory(model, optimizer, lambda m: lm_loss(m(x), y))  # 16-bit copies, fp32 rest
    losses = train_losses(model, optimizer, steps=30, autocast=torch.bfloat16)
    log = scaled_training(model, LossScaler(2.0**30, growth_interval=3), steps=12)
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

from course_lib import data, models
from course_lib.costs import activation_memory
from course_lib.memory import (
    CastMemory,
    MemoryBreakdown,
    MixedPrecisionAdamW,
    Row,
    SavedSnapshot,
    SavedTensors,
    attention_square_bytes,
    square_bytes,
    training_memory,
)
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


# --- mixed precision as frameworks run it ------------------------------------------------------

# A TinyGPT small enough that bf16 and fp16, emulated on CPUs without 16-bit units, train in
# seconds (a 16-bit step is several times slower than an fp32 one there).
SMALL_GPT = models.GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=2, d_ff=256)


def lm_batches(
    config: models.GPTConfig, steps: int, batch: int = 8
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` batches of one Markov chain (`data.tokens`, seed 0): a language the model can
    learn, the same for every run."""
    x, y = data.tokens(steps * batch, seq_len=config.seq_len, vocab_size=config.vocab_size)
    return list(zip(x.split(batch), y.split(batch), strict=True))


def autocast_memory(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[nn.Module], torch.Tensor],
    dtype: torch.dtype = torch.bfloat16,
) -> MemoryBreakdown:
    """One training step, `loss_fn(model)` computed under `torch.autocast`, counted as the
    formula's categories: "weights" are the 16-bit copies autocast casts from the fp32
    parameters (their peak, from forward to the end of backward), "master weights" the fp32
    parameters the optimizer steps, then the (fp32) gradients and the optimizer's state."""
    with CastMemory(model.parameters()) as casts:
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_fn(model)
        loss.backward()
    optimizer.step()
    kept = training_memory(model, optimizer)
    rows = [Row("weights", str(dtype).removeprefix("torch."), casts.peak_bytes)]
    for row in kept.rows:
        category = "master weights" if row.category == "weights" else row.category
        rows.append(Row(category, row.dtype, row.bytes))
    return MemoryBreakdown(rows, kept.n_params)


def train_losses(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | MixedPrecisionAdamW,
    steps: int,
    autocast: torch.dtype | None = None,
    batch: int = 8,
) -> list[float]:
    """Train `model` (a TinyGPT) for `steps` steps on `lm_batches` (the same data for every
    run), the forward under autocast to `autocast` if given; the losses."""
    losses = []
    for inputs, targets in lm_batches(model.config, steps, batch):
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = models.lm_loss(model(inputs).float(), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def plot_losses(
    curves: dict[str, Sequence[float]], tolerance: float | None = None, title: str = ""
) -> Figure:
    """Training loss against step, one line per run (top), and each run's loss minus the
    first run's (bottom), with the band of +-`tolerance` if given."""
    fig = NotebookFigure(figsize=(6, 4.6), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    reference = list(curves.values())[0]
    for i, (label, losses) in enumerate(curves.items()):
        style = {"lw": 4, "alpha": 0.4} if i == 0 else {"lw": 1.2, "ls": "--"}
        top.plot(range(len(losses)), losses, color=f"C{i}", label=label, **style)
        gaps = [a - b for a, b in zip(losses, reference, strict=True)]
        bottom.plot(range(len(losses)), gaps, color=f"C{i}", **style)
    if tolerance is not None:
        for sign in (1, -1):
            bottom.axhline(sign * tolerance, color="grey", ls=":", label="tolerance" * (sign > 0))
        bottom.legend(fontsize=8)
    top.set_ylabel("training loss")
    top.set_title(title, fontsize=10)
    top.legend(fontsize=8)
    bottom.set_xlabel("step")
    bottom.set_ylabel(f"loss - {list(curves)[0]} loss")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    return fig


# --- fp16 loss scaling ---------------------------------------------------------------------------


class LossScaler:
    """Dynamic loss scaling in a few lines, with `torch.amp.GradScaler`'s interface and rules:
    multiply the loss by the scale, so that small fp16 gradients do not flush to zero; before
    the step, check the gradients: any inf or NaN means the scale overflowed fp16, so skip the
    step and multiply the scale by `backoff_factor`; else divide the gradients by the scale and
    step. After `growth_interval` good steps in a row, multiply the scale by `growth_factor`."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self._scale = init_scale
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self._good_steps = 0
        self.found_inf = False

    def get_scale(self) -> float:
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.found_inf = not all(bool(torch.isfinite(g).all()) for g in grads)
        if self.found_inf:
            return  # an overflowed gradient would wreck the weights: skip the step
        for g in grads:
            g.mul_(1.0 / self._scale)
        optimizer.step()

    def update(self) -> None:
        if self.found_inf:
            self._scale *= self.backoff_factor
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps == self.growth_interval:
            self._scale *= self.growth_factor
            self._good_steps = 0


@dataclass(frozen=True)
class ScaledStep:
    """One fp16 step: the loss scale it used, whether the weights changed, the loss."""

    step: int
    scale: float
    skipped: bool  # the weights are bit for bit what they were before the step
    loss: float


def scaled_training(
    model: nn.Module,
    scaler: LossScaler | torch.amp.GradScaler,
    steps: int,
    lr: float = 3e-3,
    dtype: torch.dtype = torch.float16,
    batch: int = 8,
) -> list[ScaledStep]:
    """Train `model` (a TinyGPT, fp32 parameters) with AdamW for `steps` steps, the forward
    under fp16 autocast and the loss scaled by `scaler`; what each step did."""
    log = []
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for i, (inputs, targets) in enumerate(lm_batches(model.config, steps, batch)):
        with torch.autocast("cpu", dtype=dtype):
            loss = models.lm_loss(model(inputs), targets)
        before = [p.detach().clone() for p in model.parameters()]
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        same = all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        log.append(ScaledStep(i, scale, same, loss.item()))
    return log


def scaling_table(log: Sequence[ScaledStep]) -> str:
    """One line per step: the scale as a power of two, taken or skipped, the loss."""
    lines = [f"{'step':>4}{'loss scale':>12}  {'':<30}{'loss':>8}"]
    for r in log:
        what = "inf gradients: step skipped" if r.skipped else "finite: weights updated"
        lines.append(f"{r.step:>4}{f'2^{math.log2(r.scale):g}':>12}  {what:<30}{r.loss:>8.4f}")
    return "\n".join(lines)
