"""What runs on each rank for Assignment 12's checks: the student's layer on this rank's own
tokens and experts, case after case (forward, and backward with the router's gradients
synchronised), and what it returned.

A rank holds nothing else. The other ranks' tokens and experts, the layer on one process and
its gradients are drawn and computed in the checking process (`expert_parallel_cases`), and
the calls each rank makes are reported to the launcher as they happen
(`course_lib.counted_group`), between the marks that say which case they belong to.

`sync_router_grads`, which no part counts, runs in a call of its own, after the layer's
records have reached the launcher: it could otherwise make (uncounted) the gradients the
layer's backward was meant to make, and write them into whatever the rank kept of them.

    run_cases(fn, backward, cases, given, key)   the layer on every case: one record per case
    sync_cases(sync, key)                        then sync on the routers run_cases kept
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


# The routers of the last run, kept on the rank from its layer's call to its sync's, under
# the run's key: the sync must find the very modules the layer's backward wrote to.
_held: dict[str, list[nn.Module | None]] = {}


def _run_case(fn: Callable, backward: bool, case: Case, given: tuple, i: int) -> tuple:
    x, g, router, experts = given
    mine = nn.ModuleList(experts)
    x.requires_grad_(backward)
    record = {"out": None, "returned": None, "raised": None, "x_grad": None}
    counted_group.mark(i)  # the layer's calls, forward and backward
    try:
        out = fn(x, router, mine, case.k, case.capacity_factor)
    except ValueError as error:  # the checks judge whether it was asked for
        out, record["raised"] = None, str(error) or "ValueError()"
    record["returned"] = type(out).__name__
    ok = isinstance(out, torch.Tensor) and out.shape == x.shape
    if ok and backward and out.requires_grad:
        out.backward(g)
    if isinstance(out, torch.Tensor):
        record["out"] = out.detach().clone()
    if backward and ok:
        record["x_grad"] = None if x.grad is None else x.grad.clone()
        record["expert_grads"] = [_grads(expert) for expert in mine]
        return record, router
    return record, None


def run_cases(
    fn: Callable, backward: bool, cases: list[Case], given: list[tuple], key: str
) -> dict:
    """On each rank: every case in turn, in the same order on every rank, on this rank's own
    share of it (`given`, one tuple per case: `expert_parallel_cases.given`); with `backward`,
    the backward of sum(out * g) too, keeping the routers for `sync_cases(sync, key)`. Mark i
    opens case i; mark n closes the last."""
    _held.clear()
    with Provenance(LECTURE_EP) as seen:
        done = [
            _run_case(fn, backward, case, share, i)
            for i, (case, share) in enumerate(zip(cases, given, strict=True))
        ]
        counted_group.mark(len(cases))  # what comes after the last case belongs to none
    _held[key] = [router for _, router in done]
    return {"cases": [record for record, _ in done], "copied": seen.complaint()}


def sync_cases(sync: Callable, key: str) -> dict:
    """On each rank, after `run_cases(..., key)` returned: `sync(router)` on each case's router
    whose layer ran its backward, in the same order on every rank; each router's gradient
    after it (None where no sync ran)."""
    routers = _held.pop(key, None)
    if routers is None:
        raise RuntimeError(
            "the ranks that ran your layer are gone, so sync_router_grads has no router to "
            "sync (did your layer destroy the process group?)"
        )
    grads: list[torch.Tensor | None] = []
    with Provenance(LECTURE_EP) as seen:
        for router in routers:
            if router is not None:
                sync(router)
            grads.append(None if router is None else _grads(router)[0])
    return {"router_grads": grads, "copied": seen.complaint()}


__all__ = ["LECTURE_EP", "run_cases", "sync_cases"]
