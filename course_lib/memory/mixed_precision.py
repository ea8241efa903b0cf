"""The mixed-precision recipe: bf16 compute with fp32 master weights and AdamW state
(`MixedPrecisionAdamW`), and what a model needs under it against a GPU's memory (`budget`)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from course_lib.costs import BYTES_PER_PARAMETER
from course_lib.memory.counting import GB


class MixedPrecisionAdamW:
    """AdamW on an fp32 master copy of a model that computes in bf16.

    The model is cast to bf16 in place (forward, backward and its gradients are bf16); the
    optimizer owns fp32 copies of the parameters. `step()` copies the gradients up to fp32,
    steps the master copy, frees the fp32 gradients and copies the weights back down.
    """

    def __init__(self, model: nn.Module, **adamw_kwargs: float) -> None:
        self.master = [nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
        self.model = model.to(torch.bfloat16)
        self.optimizer = torch.optim.AdamW(self.master, **adamw_kwargs)

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    @torch.no_grad()
    def step(self) -> None:
        for master, p in zip(self.master, self.model.parameters(), strict=True):
            master.grad = None if p.grad is None else p.grad.float()
        self.optimizer.step()
        for master, p in zip(self.master, self.model.parameters(), strict=True):
            # The fp32 gradients lived only for this step: at rest they cost nothing.
            master.grad = None
            p.copy_(master)  # rounds to bf16; the master keeps the bits bf16 would lose


def budget(
    n_params: float, bytes_per_parameter: Mapping[str, float] = BYTES_PER_PARAMETER
) -> dict[str, float]:
    """Bytes per category for a model of `n_params` parameters, by the formula."""
    return {category: b * n_params for category, b in bytes_per_parameter.items()}


def budget_table(models: Mapping[str, float], gpu_bytes: float = 80 * GB) -> str:
    """The formula's memory for each named model size, and how many GPUs of `gpu_bytes` it
    needs just to hold weights, gradients and optimizer state (activations come on top)."""
    width = 12
    lines = [f"{'category':<24}" + "".join(f"{name:>{width}}" for name in models)]
    budgets = {name: budget(n) for name, n in models.items()}
    for category in BYTES_PER_PARAMETER:
        cells = "".join(f"{b[category] / GB:>{width - 3},.0f} GB" for b in budgets.values())
        lines.append(f"{category:<24}{cells}")
    totals = {name: sum(b.values()) for name, b in budgets.items()}
    lines.append(
        f"{'total':<24}" + "".join(f"{t / GB:>{width - 3},.0f} GB" for t in totals.values())
    )
    gpus = "".join(f"{math.ceil(t / gpu_bytes):>{width}}" for t in totals.values())
    lines.append(f"{f'GPUs of {gpu_bytes / GB:.0f} GB, at least':<24}{gpus}")
    return "\n".join(lines)
