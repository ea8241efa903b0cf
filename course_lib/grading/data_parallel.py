"""Checks for Assignment 3, data-parallel training.

    check_sync_gradients(sync_gradients)   the full-batch gradient from shards of uneven sizes
    check_ddp(DDP)                         a DDP wrapper: broadcast, gradient buckets, overlap
    check_communicate_less(fn)             Part 3 (open): a quarter of the bytes, a good model
                                           (data_parallel_budget.py)

Both train seeded models for a few steps of SGD and of AdamW with every global batch split
across the ranks in shards of random, uneven sizes, and compare every rank's gradients, after
every step, with single-process training on the whole batch, and its parameters with what
torch's optimizer makes of those gradients (`_Replay`).

The checking process draws every rank's samples and initial weights from a secret new for
each call (`data_parallel_cases`) and gives each rank only its own (`PerRank`); the reference
is trained on all of them here. A rank holds nothing of another's, so communication is the
only way to the full-batch gradient (and, in Part 2, to rank 0's weights). The ranks run only
the student's code and return their gradients and parameters (`data_parallel_rank`).

Part 1: rank r's loss is the mean over its own n_r samples, and `sync_gradients(model, n_r)`
must leave the full-batch gradient sum_r n_r g_r / sum_r n_r. The lecture's
`allreduce_gradients` takes the plain average, right for equal shards only; an answer that
calls or copies the lecture's code is refused (`Provenance`).

Part 2: the DDP averages plainly, as torch's does, so rank r's loss is weighted instead:
sum over its shard * world_size / batch size, whose plain average over the ranks is the
full-batch mean. Ranks start from different weights (a different seed per rank): only a
broadcast at construction makes them match. `ProbeModel` has what trips implementations up:
parameters of uneven sizes, a frozen one, one that never gets a gradient, and a buffer; a
parameter that gets no gradient keeps .grad None, as with torch's DDP and
find_unused_parameters=True. Communication is judged by the launcher's tallies (every call of
the ranks' process groups, whatever route it took, reported as it happened between the marks
of the steps' phases and gradients), as three properties: the result (which gates the
others), the buckets and the overlap (`DDP_WEIGHTS`).

This module holds the checks, the assignment's bucket rule (`buckets`, `bucket_layout`) and
everything the notebook imports; their parts:

    data_parallel_runs.py           the runs: models (ProbeModel), shards, samples, losses
    data_parallel_cases.py          what is drawn, what each rank gets, the cases it marks
    data_parallel_rank.py           what runs on each rank: training with the student's code
    data_parallel_training.py       the single-process reference; comparing training, hints
    data_parallel_communication.py  the tallies by step; check_ddp's traffic, buckets, overlap
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from course_lib.calls import PerRank
from course_lib.grading._harness import (
    RESULT,
    CheckFailed,
    Verdict,
    calls_by_case,
    fail,
    judge_unreported,
    run_on_ranks,
)
from course_lib.grading.data_parallel_budget import check_communicate_less
from course_lib.grading.data_parallel_cases import cases, draw, given, rank_run
from course_lib.grading.data_parallel_communication import _judge_communication, step_calls
from course_lib.grading.data_parallel_rank import train_on_rank
from course_lib.grading.data_parallel_runs import (
    BUCKET_ELEMENTS,
    FORBIDDEN,
    LECTURE_DP,
    MB,
    TOLERANCE,
    DDPRun,
    ProbeModel,
    shard_sizes,
)
from course_lib.grading.data_parallel_training import (
    _compare_initial,
    _compare_training,
    _reference,
)
from course_lib.launch import LaunchTimeout

# check_ddp's points: half for the buckets, half for the overlap, neither unless the result
# (training, broadcast, every gradient all-reduced once) is right.
DDP_WEIGHTS = {RESULT: 0.0, "buckets": 0.5, "overlap": 0.5}

# --- the assignment's bucket rule (students are pointed here: it stays in this module) ----


def buckets(parameters: list[nn.Parameter], cap_bytes: float) -> list[list]:
    """The assignment's rule: trainable parameters in reverse order of registration; start a
    new bucket when the next parameter would take the bucket over `cap_bytes` (so a bucket
    may fill the cap exactly, and a parameter larger than the cap gets one of its own)."""
    out: list[list] = [[]]
    size = 0
    for p in reversed([p for p in parameters if p.requires_grad]):
        nbytes = p.numel() * p.element_size()
        if out[-1] and size + nbytes > cap_bytes:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return [bucket for bucket in out if bucket]


# --- the checks ---------------------------------------------------------------------------


def _run(check: str, impl: Callable, kind: str, runs: list[DDPRun], ranks: int, timeout: float):
    """Draw every rank's weights and samples, train on the ranks, each with its own; the
    results, the launcher's tallies by case, and what was drawn."""
    __tracebackhide__ = True
    what = "your sync_gradients" if kind == "sync" else "your DDP"
    drawn = draw(runs, ranks)
    labels = cases(kind, runs, drawn)
    on_ranks = [rank_run(run, d) for run, d in zip(runs, drawn, strict=True)]
    try:
        results, traffic = run_on_ranks(
            check,
            train_on_rank,
            impl,
            kind,
            on_ranks,
            PerRank(given(kind, runs, drawn, ranks)),
            world_size=ranks,
            timeout=timeout,
            what=what,
            traffic=True,
        )
    except CheckFailed as error:
        probed = any(run.model == "probe" for run in runs)
        if not (isinstance(error.__context__, LaunchTimeout) and kind == "ddp" and probed):
            raise
        raise CheckFailed(
            f"{error}\n\nHint: ProbeModel's parameter 'unused.weight' never gets a gradient, "
            "so its hook never fires: finish_gradient_synchronization must send a bucket that is "
            "still incomplete itself instead of waiting for it. Also check that every rank "
            "makes the same all-reduce calls in the same order."
        ) from None
    copied = next((result["copied"] for result in results if result["copied"]), None)
    if copied:
        fail(check, copied)
    per_case = calls_by_case(check, traffic.tallies, len(labels))
    judge_unreported(check, traffic)
    calls = [step_calls(labels, sent) for sent in per_case]
    return results, calls, drawn


def _judge(check, kind, runs, results, calls, drawn, verdict: Verdict):
    """Every run's training (and for DDP its communication), each a case of the verdict."""
    prefix = "module." if kind == "ddp" else ""
    for i, (run, d) in enumerate(zip(runs, drawn, strict=True)):
        steps = [
            [
                {**step, **calls[r][(i, s)], "communicated": bool(calls[r][(i, s)]["calls"])}
                for s, step in enumerate(result["runs"][i]["steps"])
            ]
            for r, result in enumerate(results)
        ]
        per_rank = [
            {"initial": result["runs"][i]["initial"], "steps": steps[r]}
            for r, result in enumerate(results)
        ]
        ref = _reference(run, d, prefix)
        with verdict.case():
            if kind == "ddp":
                _compare_initial(check, run, per_rank, ref)
            _compare_training(check, kind, run, per_rank, ref)
        if kind == "ddp" and len(per_rank) > 1:  # one rank may rightly skip communicating
            _judge_communication(check, run, steps, ref, d.gradients, verdict, buckets)


def _grade(check: str, impl: Callable, kind: str, runs: list[DDPRun], ranks: int, timeout, verdict):
    """Run the student's code on the ranks, then judge what came back (each a verdict case)."""
    __tracebackhide__ = True
    ran = None
    with verdict.case():
        ran = _run(check, impl, kind, runs, ranks, timeout)
    if ran is not None:
        _judge(check, kind, runs, *ran, verdict)


def _runs(models, optimizers, **fields) -> list[DDPRun]:
    return [DDPRun(model=m, optimizer=o, **fields) for m in models for o in optimizers]


def _validate(ranks: int, batch_size: int, dtype: torch.dtype, runs: list[DDPRun]) -> None:
    """Refuse bad arguments before any rank starts."""
    for run in runs:
        if run.model not in BUCKET_ELEMENTS:
            raise ValueError(f"unknown model {run.model!r}: use 'mlp', 'probe' or 'gpt'")
        if run.optimizer not in ("sgd", "adamw"):
            raise ValueError(f"unknown optimizer {run.optimizer!r}: use 'sgd' or 'adamw'")
    if not runs:
        raise ValueError("give at least one model and one optimizer")
    if not 1 <= ranks <= 8:
        raise ValueError(f"world_size must be 1..8, got {ranks}")
    if batch_size < ranks:
        raise ValueError(f"batch_size={batch_size} leaves some of {ranks} ranks without data")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")


def _what_ran(runs: list[DDPRun], ranks: int) -> str:
    first = runs[0]
    rtol, atol = TOLERANCE[first.dtype]
    models = "/".join(dict.fromkeys(run.model for run in runs))
    optimizers = "/".join(dict.fromkeys(run.optimizer for run in runs))
    return (
        f"{len(runs)} training run(s) ({models} x {optimizers}, "
        f"{str(first.dtype).removeprefix('torch.')}, seed {first.seed}) of {first.steps} steps "
        f"on {ranks} rank(s), shards of random sizes (step 0: "
        f"{shard_sizes(first, ranks, 0)}): every rank's gradients (rtol={rtol:g}, "
        f"atol={atol:g}) after every step match single-process training, and its parameters "
        "are what the optimizer makes of them"
    )


def check_sync_gradients(
    sync_gradients: Callable[[nn.Module, int], None],
    *,
    world_size: int = 4,
    seed: int = 0,
    steps: int = 3,
    batch_size: int = 16,
    dtype: torch.dtype = torch.float32,
    models: tuple[str, ...] = ("mlp", "probe"),
    optimizers: tuple[str, ...] = ("sgd", "adamw"),
    timeout: float = 30.0,
) -> None:
    """`sync_gradients(model, num_samples)`, called on every rank after backward of the mean
    loss over its own `num_samples` samples, leaves in every .grad the full-batch gradient
    sum_r n_r g_r / sum_r n_r (parameters without .grad are skipped). Every rank's gradients
    and parameters must match single-process training after each step."""
    __tracebackhide__ = True
    check = "check_sync_gradients"
    runs = _runs(models, optimizers, seed=seed, dtype=dtype, steps=steps, batch_size=batch_size)
    _validate(world_size, batch_size, dtype, runs)
    verdict = Verdict(check)
    _grade(check, sync_gradients, "sync", runs, world_size, timeout, verdict)
    verdict.conclude(_what_ran(runs, world_size))


def check_ddp(
    ddp_class: Callable[..., nn.Module],
    *,
    world_size: int = 4,
    seed: int = 0,
    steps: int = 3,
    batch_size: int = 16,
    dtype: torch.dtype = torch.float32,
    models: tuple[str, ...] = ("probe", "mlp"),
    optimizers: tuple[str, ...] = ("sgd", "adamw"),
    bucket_cap_mb: float | None = None,
    timeout: float = 30.0,
) -> None:
    """`ddp_class(module, bucket_cap_mb=...)` wraps a model as torch's DDP does (parameters
    named "module.<name>", rank 0's weights broadcast at construction); its gradient hooks
    launch one async all-reduce per bucket during backward, and
    `finish_gradient_synchronization()` waits and leaves averaged gradients in .grad.
    Partial credit (`DDP_WEIGHTS`): the buckets and the overlap, each only with a right result."""
    __tracebackhide__ = True
    check = "check_ddp"
    runs = _runs(
        models,
        optimizers,
        seed=seed,
        dtype=dtype,
        steps=steps,
        batch_size=batch_size,
        bucket_cap_mb=bucket_cap_mb,
    )
    _validate(world_size, batch_size, dtype, runs)
    verdict = Verdict(check, DDP_WEIGHTS)
    _grade(check, ddp_class, "ddp", runs, world_size, timeout, verdict)
    verified = _what_ran(runs, world_size) + "; rank 0's weights broadcast at construction"
    if world_size > 1:
        verified += (
            "; each step one all-reduce per bucket of the rule's layout, every trainable "
            "gradient exactly once, launched during backward without waiting"
        )
    verdict.conclude(verified)


def bucket_layout(module: nn.Module, bucket_cap_mb: float) -> list[list[str]]:
    """Names of the parameters in each bucket, by the assignment's rule (for a notebook)."""
    names = {id(p): n for n, p in module.named_parameters()}
    groups = buckets(list(module.parameters()), bucket_cap_mb * MB)
    return [[names[id(p)] for p in bucket] for bucket in groups]


__all__ = [
    "DDP_WEIGHTS",
    "ProbeModel",
    "DDPRun",
    "bucket_layout",
    "buckets",
    "FORBIDDEN",
    "LECTURE_DP",
    "check_communicate_less",
    "check_ddp",
    "check_sync_gradients",
    "shard_sizes",
]
