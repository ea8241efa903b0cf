"""What runs on each rank for Assignment 9's checks: the student's layer built from the dense
layer as this rank is given it, run forward and backward, its shards nudged, run again.

A rank holds only what a rank of a tensor-parallel layer holds: the dense layer with
everything outside its own shard zeroed, its input and upstream gradient, and its own nudge,
all drawn in the checking process (`tensor_parallel_shards.draw`, `given`). The dense layer's
output and gradients are computed there too, never on a rank. The collective calls are
reported to the launcher as they happen (`course_lib.counted_group`), between marks that say
which case, and which phase of it, they belong to:

    mark 4i       construction (not judged)
    mark 4i + 1   forward of the first pass (judged)
    mark 4i + 2   backward of the first pass (judged)
    mark 4i + 3   the nudge and the second pass (not judged)
    mark 4n       after the last case
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from course_lib import counted_group
from course_lib.grading.provenance import Provenance
from course_lib.grading.tensor_parallel_shards import Case, dense_layer, shard_index
from course_lib.runtime import rank, world_size

# The lecture's tensor-parallel module answers every part as it stands: an answer that runs
# any of it, or a copy, is not the student's own.
LECTURE_TP = ("course_lib.tensor_parallel", "course_lib.measure.tensor_parallel")
MARKS_PER_CASE = 4


def run_cases(cls: Callable, cases: list[Case], given: list[tuple]) -> dict:
    """On each rank: every case in turn, on this rank's share of it (`given`, one tuple per
    case: `tensor_parallel_shards.given`)."""
    with Provenance(LECTURE_TP) as seen:
        results = [
            _run_case(cls, case, share, i)
            for i, (case, share) in enumerate(zip(cases, given, strict=True))
        ]
        counted_group.mark(MARKS_PER_CASE * len(cases))  # what comes after belongs to none
    return {"cases": results, "copied": seen.complaint()}


def _run_case(cls: Callable, case: Case, share: tuple, i: int) -> dict:
    """Build the student's layer from the dense one, run forward and backward, and record
    the weights it holds, its output and the gradients. Then nudge every shard it holds by
    the check's secret amount and run forward and backward again: the layer must compute
    with the shards the ranks hold, not with a copy of the dense layer. Last, the dense
    layer as the layer left it: its values, and which parameters got .grad."""
    params, x, grad, nudge = share
    dense = dense_layer(case, params)
    counted_group.mark(MARKS_PER_CASE * i)
    layer = cls(dense, gather_output=True) if case.gather_output else cls(dense)
    held = {name: p.detach().clone() for name, p in layer.named_parameters()}
    first = _forward_backward(layer, x, grad, MARKS_PER_CASE * i + 1)
    grads = {name: _copy(p.grad) for name, p in layer.named_parameters()}
    counted_group.mark(MARKS_PER_CASE * i + 3)
    nudged = _nudge(case, layer, nudge)
    second = _forward_backward(layer, x, grad, None) if nudged else None
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


def _forward_backward(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor, mark) -> dict:
    """Forward, then backward with the upstream gradient; with `mark`, the marks `mark` and
    `mark + 1` open the forward and the backward."""
    x = x.clone().requires_grad_(True)
    if mark is not None:
        counted_group.mark(mark)
    out = layer(x)
    if mark is not None:
        counted_group.mark(mark + 1)
    out.backward(grad)
    return {"out": out.detach().clone(), "x_grad": _copy(x.grad)}


def _nudge(case: Case, layer: nn.Module, nudge: dict[str, torch.Tensor]) -> bool:
    """Add the check's nudge to each sharded parameter, in place, as an optimizer step
    would (False, untouched, if the parameters are not the expected ones)."""
    params = dict(layer.named_parameters())
    if set(params) != {name for name, _ in dense_layer(case).named_parameters()}:
        return False  # compare_held (tensor_parallel_judge) reports it
    with torch.no_grad():
        for name, p in params.items():
            if shard_index(case, name, rank(), world_size()) is not None:
                if p.shape != nudge[name].shape:
                    return False  # compare_held reports it
                p.add_(nudge[name])
            p.grad = None
    return True
