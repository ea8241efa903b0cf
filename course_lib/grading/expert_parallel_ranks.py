"""What runs on each rank for Assignment 12's checks: the student's layer on this rank's own
tokens and experts, case after case (forward, and backward with the router's gradients
synchronised), and what it returned.

A rank holds nothing else. The other ranks' tokens and experts, the layer on one process and
its gradients are drawn and computed in the checking process (`expert_parallel_cases`), and
the calls each rank makes are reported to the launcher as they happen
(`course_lib.counted_group`), between the marks that say which case, and which half of it,
they belong to: the layer (forward and backward), then `sync_router_grads`, which no part
counts.

    run_cases(fn, sync, cases, given)   what every rank runs: one record per case
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from course_lib import counted_group
from course_lib.grading.expert_parallel_cases import Case
from course_lib.grading.provenance import Provenance

# Lecture 12's module answers every part as it stands (`ExpertParallelMoE`, its routing and its
# all-to-all), and its all-to-all is lecture 11's: an answer that runs any of it, or a copy,
# is not the student's own.
LECTURE_EP = (
    "course_lib.expert_parallel",
    "course_lib.measure.expert_parallel",
    "course_lib.sequence_parallel._all_to_all",
)


def _grads(module: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in module.parameters()]


def _run_case(fn: Callable, sync: Callable | None, case: Case, given: tuple, i: int) -> dict:
    x, g, router, experts = given
    mine = nn.ModuleList(experts)
    x.requires_grad_(sync is not None)
    record = {"out": None, "returned": None, "raised": None, "x_grad": None}
    counted_group.mark(2 * i)  # the layer's calls, forward and backward
    try:
        out = fn(x, router, mine, case.k, case.capacity_factor)
    except ValueError as error:  # the checks judge whether it was asked for
        out, record["raised"] = None, str(error) or "ValueError()"
    record["returned"] = type(out).__name__
    ok = isinstance(out, torch.Tensor) and out.shape == x.shape
    if ok and sync is not None and out.requires_grad:
        out.backward(g)
    counted_group.mark(2 * i + 1)  # sync_router_grads' calls, which no part counts
    if isinstance(out, torch.Tensor):
        record["out"] = out.detach().clone()
    if sync is not None and ok:
        # x's and the experts' gradients as the layer's backward left them: sync_router_grads,
        # which no part counts, must not be where they are made (it could run the whole
        # exchange there unseen); it is for the router's gradient only.
        record["x_grad"] = None if x.grad is None else x.grad.clone()
        record["expert_grads"] = [_grads(expert) for expert in mine]
        sync(router)
        record["router_grad"] = _grads(router)[0]
    return record


def run_cases(fn: Callable, sync: Callable | None, cases: list[Case], given: list[tuple]) -> dict:
    """On each rank: every case in turn, in the same order on every rank, on this rank's own
    share of it (`given`, one tuple per case: `expert_parallel_cases.given`); with `sync`,
    the backward of sum(out * g) too, then `sync(router)`. Marks 2i and 2i + 1 open case i's
    layer and its sync; mark 2n closes the last."""
    with Provenance(LECTURE_EP) as seen:
        results = [
            _run_case(fn, sync, case, share, i)
            for i, (case, share) in enumerate(zip(cases, given, strict=True))
        ]
        counted_group.mark(2 * len(cases))  # what comes after the last case belongs to none
    return {"cases": results, "copied": seen.complaint()}


__all__ = ["LECTURE_EP", "run_cases"]
