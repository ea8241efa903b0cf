"""Judging check_ddp's communication, step by step on every rank, one property each.

The result (every trainable gradient all-reduced exactly once per step, nothing else
communicated), the buckets (each step's all-reduce sizes are those of the assignment's
rule) and the overlap (launched during backward without waiting, and early enough).
"""

from __future__ import annotations

from collections.abc import Callable

from course_lib.grading._harness import RESULT, fail
from course_lib.grading.data_parallel_runs import MB, DDPRun, build_model


def _each_step(check: str, run: DDPRun, results: list[dict], judge: Callable, prop: str) -> None:
    """Fail at the first (step, rank) where `judge(step)` returns a problem."""
    __tracebackhide__ = True
    where = run.describe(len(results))
    for s in range(run.steps):
        for r, result in enumerate(results):
            problem = judge(result["steps"][s])
            if problem:
                fail(check, f"rank {r}, step {s} ({where}): {problem}", prop=prop)


def _traffic_problem(trainable_bytes: int):
    """Part of the result: each step, every trainable gradient is all-reduced exactly once
    and nothing else is communicated. (So fake all-reduces cannot stand in for real ones.)"""

    def judge(step: dict) -> str | None:
        others = sorted({op for op in step["others"] if op != "barrier"})
        if others:
            return (
                f"the step used {', '.join(others)}: average the gradients with "
                "dist.all_reduce only, one call per bucket"
            )
        if not step["calls"]:
            return (
                "no all-reduce was seen during the step: launch each bucket's all-reduce "
                "with dist.all_reduce(flat, async_op=True)"
            )
        carried = sum(c["nbytes"] for c in step["calls"])
        if carried != trainable_bytes:
            return (
                f"the all-reduces carried {carried} bytes; the gradients of the trainable "
                f"parameters are {trainable_bytes} bytes: all-reduce each exactly once per "
                "step (frozen parameters never)"
            )
        return None

    return judge


def _bucket_problem(run: DDPRun, rule: Callable):
    """The buckets property: each step's all-reduce sizes are the buckets of `rule` (the
    assignment's, `buckets`), in any order, so the order inside a bucket and the order of
    sending are free."""
    module = build_model(run, run.seed)
    names = {id(p): "module." + n for n, p in module.named_parameters()}
    cap = run.cap_mb()
    expected = rule(list(module.parameters()), cap * MB)
    sizes = sorted(sum(p.numel() * p.element_size() for p in b) for b in expected)
    layout = "; ".join(f"[{', '.join(names[id(p)] for p in b)}]" for b in expected)

    def judge(step: dict) -> str | None:
        got = sorted(c["nbytes"] for c in step["calls"])
        if got == sizes:
            return None
        return (
            f"all-reduces of {got} bytes; with bucket_cap_mb={cap:.6g} ({cap * MB:g} "
            f"bytes) the rule gives {len(expected)} buckets of {sizes} bytes: {layout}. "
            "Take the trainable parameters last registered first, and start a new bucket "
            "only when the next parameter would take it over the cap (1 MB = 2**20 bytes)"
        )

    return judge, len(expected)


def _overlap_problem(n_buckets: int):
    """The overlap property: backward never waits for an all-reduce; only buckets holding a
    parameter without gradient are left for after backward; and with several buckets, one
    starts while backward still has gradients to compute."""

    def judge(step: dict) -> str | None:
        calls = step["calls"]
        in_backward = [c for c in calls if c["phase"] == "backward"]
        if "backward" in step["waits"] or any(not c["async"] for c in in_backward):
            return (
                "backward waited for an all-reduce (a dist.all_reduce without "
                "async_op=True, or a wait(), in a gradient hook): launch it with "
                "async_op=True and wait only in finish_gradient_synchronization"
            )
        late = len(calls) - len(in_backward)
        if late > step["no_grad"]:
            return (
                f"{late} of {len(calls)} all-reduces were launched after backward; only a "
                "bucket holding a parameter that got no gradient "
                f"({step['no_grad']} this step) may be left to "
                "finish_gradient_synchronization. Launch each bucket's all-reduce from the "
                "hook (register_post_accumulate_grad_hook) that completes it"
            )
        if n_buckets > 1 and not any(c["early"] for c in calls):
            return (
                f"with {n_buckets} buckets, no all-reduce started before backward had computed "
                "its last gradient: launch each bucket as soon as its own gradients are "
                "ready, so that communication overlaps the rest of backward"
            )
        return None

    return judge


def _judge_communication(
    check: str, run: DDPRun, results: list[dict], ref, verdict, rule: Callable
) -> None:
    """check_ddp's communication, one verdict case per property; `rule` is the bucket rule."""
    trainable_bytes = sum(p.numel() * p.element_size() for p in ref["trainable"])
    bucket_judge, n_buckets = _bucket_problem(run, rule)
    for judge, prop in (
        (_traffic_problem(trainable_bytes), RESULT),
        (bucket_judge, "buckets"),
        (_overlap_problem(n_buckets), "overlap"),
    ):
        with verdict.case():
            _each_step(check, run, results, judge, prop)
