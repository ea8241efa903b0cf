"""What the checks that train a model share: the optimizers, the same on the ranks and in the
single-process reference, and copies of named tensors taken during training.

    optimizer = make_optimizer("adamw", model.parameters())
    before = snapshot(model.named_parameters())      # {name: detached copy}
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

SGD_LR = 0.1
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}


def make_optimizer(name: str, parameters) -> torch.optim.Optimizer:
    """torch.optim's SGD or AdamW, the same on the ranks and in the single-process reference.
    Weight decay moves a parameter that wrongly gets a (zero) gradient, so that mistake
    shows; parameters without .grad are skipped. AdamW runs its single-tensor code
    (foreach=False), as torch.optim.AdamW does on the CPU."""
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=SGD_LR)
    if name == "adamw":
        return torch.optim.AdamW(parameters, **ADAMW, foreach=False)
    raise ValueError(f"unknown optimizer {name!r}: use 'sgd' or 'adamw'")


def snapshot(
    named: Iterable[tuple[str, torch.Tensor | None]],
) -> dict[str, torch.Tensor | None]:
    """Detached copies of (name, tensor) pairs, e.g. `model.named_parameters()`; a None (a
    parameter without .grad) stays None."""
    return {name: None if t is None else t.detach().clone() for name, t in named}
