"""Averaging over the ranks: a model's gradients (or parameters) as one flat tensor, averaged
by one all-reduce (`allreduce_gradients`; `average_parameters`, local SGD's)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from course_lib.runtime import world_size

# --- flat views of parameters and gradients -----------------------------------------------


def gradients(model: nn.Module) -> list[torch.Tensor]:
    """The gradient of every parameter of `model`, in order; a parameter that got none in
    this backward gets zeros, so all ranks hold the same list of shapes."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in model.parameters()]


def flat_gradients(model: nn.Module) -> torch.Tensor:
    """All gradients of `model` in one new 1-D tensor (see `gradients`)."""
    return torch.cat([g.reshape(-1) for g in gradients(model)])


def flat_parameters(model: nn.Module) -> torch.Tensor:
    """All parameters of `model` in one new 1-D tensor."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _unflatten_into(flat: torch.Tensor, tensors: Iterable[torch.Tensor]) -> None:
    """Copy consecutive pieces of `flat` into `tensors`, in order."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


# --- averaging: one all-reduce -------------------------------------------------------------


def allreduce_gradients(model: nn.Module) -> None:
    """Replace every gradient by its average over all ranks (one all-reduce, after backward)."""
    grads = flat_gradients(model)
    dist.all_reduce(grads)  # sum over ranks
    grads /= world_size()
    _unflatten_into(grads, gradients(model))


def average_parameters(model: nn.Module) -> None:
    """Replace every parameter by its average over all ranks (one all-reduce)."""
    flat = flat_parameters(model)
    dist.all_reduce(flat)
    flat /= world_size()
    _unflatten_into(flat, model.parameters())
