"""Lecture 6's mixed precision as frameworks run it: the bytes autocast keeps (16-bit copies
of the Linear weights, fp32 the rest), training losses of fp32 against 16-bit recipes, and fp16
loss scaling with skipped steps (`LossScaler`, GradScaler's rules in a few lines).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from matplotlib.figure import Figure
from torch import nn

from course_lib import data, models
from course_lib.memory import CastMemory, MemoryBreakdown, MixedPrecisionAdamW, Row, training_memory
from course_lib.plots import NotebookFigure

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
