"""Assignment 8's trainer runs, drawn and solved in the checking process: the model's weights,
the data and the .grad handed over come from a secret new for every call of the check
(`_harness.new_secret`), the single-process reference is trained here, and each rank is
given only its share (`share`): its stage, and of the batch only what its stage needs.

A rank therefore holds nothing it could copy a right answer from: not the other stages'
weights (so activations and gradients must travel as messages), not the reference, not a
seed to draw them again from.

    PipelineRun                      one run: model, micro-batches, batch size, steps, secret
    pipeline_runs(models, ...)       the runs of one call of the check, each with its secret
    share(run, P, r)                 what rank r is given for a run (its stage, its data)
    reference_steps(run, P)          single-process training of the run, step by step
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from course_lib import data
from course_lib.grading._harness import new_secret
from course_lib.grading.training import make_optimizer
from course_lib.models import MLP, GPTConfig, TinyGPT, lm_loss

DTYPE = torch.float64
MLP_SIZES = (8, 16, 16, 16, 16, 4)  # 9 layers (5 linear): every stage of 1-4 has weights


@dataclass(frozen=True)
class PipelineRun:
    """One pipelined training run: model, micro-batches, batch size and steps; `secret` is
    what its weights and data are drawn from (kept in the checking process, never shown)."""

    model: str = "mlp"  # "mlp" or "gpt"
    n_micro: int = 4
    batch_size: int = 16
    steps: int = 2
    secret: int = field(default=0, repr=False)

    def describe(self, P: int) -> str:
        return (
            f"{self.model} model, batch of {self.batch_size} in {self.n_micro} "
            f"micro-batches, {P} stage{'s' if P > 1 else ''}"
        )


def build_model(run: PipelineRun) -> nn.Module:
    """The run's model, its weights drawn from the run's secret."""
    if run.model == "mlp":
        return MLP(MLP_SIZES, seed=run.secret, dtype=DTYPE)
    if run.model == "gpt":
        return TinyGPT(GPTConfig(n_layers=2), seed=run.secret, dtype=DTYPE)
    raise ValueError(f"unknown model {run.model!r}: use 'mlp' or 'gpt'")


def stages(model: nn.Module, P: int) -> list[nn.Module]:
    """The model's layers cut into P contiguous stages of near-equal layer counts."""
    if isinstance(model, TinyGPT):
        return model.pipeline_stages(P)
    layers = list(model.layers)
    bounds = [round(i * len(layers) / P) for i in range(P + 1)]
    return [nn.Sequential(*layers[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def loss_function(run: PipelineRun) -> Callable:
    return lm_loss if run.model == "gpt" else F.mse_loss


def global_batches(run: PipelineRun) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The run's batches, one per step, drawn from its secret."""
    if run.model == "gpt":
        x, y = data.tokens(4 * run.batch_size, seed=run.secret + 1)
    else:
        x, y = data.regression(4 * run.batch_size, in_dim=8, seed=run.secret + 1, dtype=DTYPE)
    return data.batches(x, y, run.batch_size, run.steps, seed=run.secret)


def handed_grad(run: PipelineRun, step: int, name: str, shape: torch.Size) -> torch.Tensor:
    """What parameter `name`'s .grad holds when pipeline_step starts at `step`: backward
    adds to it, so a step that zeroes or replaces .grad shows."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{run.secret}/{step}/{name}".encode()))
    return 0.1 * torch.randn(shape, generator=g, dtype=DTYPE)


def pipeline_runs(
    models: tuple[str, ...], n_micro: tuple[int, ...], steps: int
) -> list[PipelineRun]:
    """One run per model and number of micro-batches (a batch of 8 sequences for "gpt",
    16 rows for "mlp"), each drawn from a new secret; ValueError if a number of
    micro-batches does not divide the batch."""
    runs = []
    for model in models:
        batch = 8 if model == "gpt" else 16
        for m in n_micro:
            if batch % m:
                raise ValueError(f"n_micro={m} does not divide the batch of {batch}")
            runs.append(PipelineRun(model, m, batch, steps, secret=new_secret()))
    return runs


def share(run: PipelineRun, P: int, r: int) -> dict:
    """What rank r is given for a run: its stage of the model (the others stay here), its
    parameters' names in the model, and per step the batch's inputs (stage 0 only) and
    targets (the last stage only), zeros of the same shape elsewhere, and the .grad each of
    its parameters holds when the step starts."""
    model = build_model(run)
    stage = stages(model, P)[r]
    mine = {id(p) for p in stage.parameters()}
    names = {id(p): n for n, p in model.named_parameters() if id(p) in mine}
    order = [names[id(p)] for p in stage.parameters()]
    steps = []
    for step, (x, y) in enumerate(global_batches(run)):
        steps.append(
            {
                # A stage needs no rows it does not compute with; zeros keep every answer
                # that splits `inputs` and `targets` on every rank working.
                "inputs": x if r == 0 else torch.zeros_like(x),
                "targets": y if r == P - 1 else torch.zeros_like(y),
                "handed": [
                    handed_grad(run, step, n, p.shape)
                    for n, p in zip(order, stage.parameters(), strict=True)
                ],
            }
        )
    return {"stage": stage, "names": order, "steps": steps}


def reference_steps(run: PipelineRun, P: int) -> list[dict]:
    """Single-process training of the run's model on whole batches: per step the loss, the
    gradients, the .grad handed over, the parameters after SGD (on the two added) and each
    stage's input, cut into micro-batches."""
    model = build_model(run)
    cut = stages(model, P)
    optimizer = make_optimizer("sgd", model.parameters())
    out = []
    for step, (x, y) in enumerate(global_batches(run)):
        inputs, h = [], x
        with torch.no_grad():
            for stage in cut:
                inputs.append(h.tensor_split(run.n_micro))
                h = stage(h)
        optimizer.zero_grad()
        loss = loss_function(run)(model(x), y)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        handed = {n: handed_grad(run, step, n, p.shape) for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            p.grad += handed[n]
        optimizer.step()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        out.append(
            {
                "loss": loss.item(),
                "grads": grads,
                "handed": handed,
                "params": params,
                "inputs": inputs,
            }
        )
    return out
