"""What runs on each rank for Assignment 9's checks: the student's layer built from the dense
one, run forward and backward, its shards nudged, run again; its collective calls counted.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import torch
from torch import nn

from course_lib.comm import CommCounter
from course_lib.grading.provenance import Provenance
from course_lib.grading.tensor_parallel_shards import (
    Case,
    block,
    dense_layer,
    layer_data,
    shard_index,
)
from course_lib.runtime import rank, world_size

# The lecture's tensor-parallel module answers every part as it stands: an answer that runs
# any of it, or a copy, is not the student's own.
LECTURE_TP = ("course_lib.tensor_parallel", "course_lib.measure.tensor_parallel")


def run_cases(cls: Callable, cases: list[Case]) -> dict:
    with Provenance(LECTURE_TP) as seen:
        results = [_run_case(cls, case) for case in cases]
    return {"cases": results, "copied": seen.complaint()}


def _run_case(cls: Callable, case: Case) -> dict:
    """Build the student's layer from the dense one, run forward and backward, and record
    the weights it holds, its output, the gradients and the collectives it called. Then
    nudge every shard it holds by a secret amount and run forward and backward again: the
    layer must compute with the shards the ranks hold, not with a copy of the dense layer.
    Last, the dense layer as the layer left it: its values, and which parameters got .grad."""
    r, ranks = rank(), world_size()
    dense = dense_layer(case)
    layer = cls(dense, gather_output=True) if case.gather_output else cls(dense)
    held = {name: p.detach().clone() for name, p in layer.named_parameters()}
    first = _forward_backward(case, layer, r, ranks)
    grads = {name: _copy(p.grad) for name, p in layer.named_parameters()}
    nudged = _nudge(case, layer, r, ranks)
    second = _forward_backward(case, layer, r, ranks) if nudged is not None else None
    dense_after = {name: _copy(p) for name, p in dense.named_parameters()}
    dense_grads = sorted(name for name, p in dense.named_parameters() if p.grad is not None)
    return {
        "held": held,
        **first,
        "grads": grads,
        "nudged": nudged,
        "after_nudge": second,
        "dense_after": dense_after,
        "dense_grads": dense_grads,
    }


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


def _forward_backward(case: Case, layer: nn.Module, r: int, ranks: int) -> dict:
    x, grad = layer_data(case)
    if case.kind == "row":  # the input arrives split by features
        x = x[..., block(case.in_features, r, ranks)]
    x = x.clone().requires_grad_(True)
    if case.kind == "column" and not case.gather_output:  # the output stays split
        grad = grad[..., block(case.out_features, r, ranks)]
    with CommCounter() as forward_comm:
        out = layer(x)
    with CommCounter() as backward_comm:
        out.backward(grad)
    return {
        "out": out.detach(),
        "x_grad": x.grad,
        "forward_calls": dict(forward_comm.calls),
        "backward_calls": dict(backward_comm.calls),
    }


def _nudge(case: Case, layer: nn.Module, r: int, ranks: int) -> dict | None:
    """Add a secret random amount to each sharded parameter, in place, as an optimizer step
    would; return the parameters after it (None if they are not the expected ones)."""
    params = dict(layer.named_parameters())
    if set(params) != {name for name, _ in dense_layer(case).named_parameters()}:
        return None  # compare_held (tensor_parallel_judge) reports it
    g = torch.Generator().manual_seed(secrets.randbits(62))
    with torch.no_grad():
        for name, p in params.items():
            if shard_index(case, name, r, ranks) is not None:
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            p.grad = None
    return {name: p.detach().clone() for name, p in params.items()}
