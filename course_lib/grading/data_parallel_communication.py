"""Judging the communication of Assignment 3's checks, from the launcher's tallies.

Every call a rank's process group made reached the launcher as it happened, between the marks
of the check's cases (`data_parallel_cases.cases`): each step's forward, its backward before
the first gradient and after each gradient, and its synchronization. `step_calls` sorts them
by step; check_ddp's three properties are judged on them, step by step on every rank: the
result (every trainable gradient all-reduced exactly once per step, nothing else
communicated), the buckets (each step's all-reduce sizes are those of the assignment's rule)
and the overlap (launched during backward, early enough, and backward never waited: the one
fact the rank reports itself, `comm_log.WaitLog`).
"""

from __future__ import annotations

from collections.abc import Callable

from course_lib.costs import all_reduce_bytes
from course_lib.grading._harness import RESULT, fail
from course_lib.grading.data_parallel_runs import MB, DDPRun, build_model
from course_lib.grading.traffic import Sent


def tensor_bytes(call: Sent) -> int:
    """The bytes of the tensor an all-reduce reduced, from what the launcher was told it sends
    (`costs.all_reduce_bytes` of them, which grows with them on 2 ranks or more)."""
    p = len(call.group)
    if p < 2:
        return 0
    n = call.sent * p // (2 * (p - 1))
    while all_reduce_bytes(n, p) < call.sent:
        n += 1
    return n


def step_calls(labels: list[tuple], per_case: list[list[Sent]]) -> dict[tuple, dict]:
    """One rank's calls by (run, step): "calls", all of them; "all_reduces", (tensor bytes,
    phase, k) of each all-reduce, k the number of the step's gradients accumulated before it
    was launched (backward only); "others", the other ops but barriers."""
    out: dict[tuple, dict] = {}
    for (phase, i, s, k), calls in zip(labels, per_case, strict=True):
        if s is None:  # Part 2's construction: not judged
            continue
        step = out.setdefault((i, s), {"calls": [], "all_reduces": [], "others": []})
        step["calls"] += calls
        for call in calls:
            if call.op == "all_reduce":
                step["all_reduces"].append((tensor_bytes(call), phase, k))
            elif call.op != "barrier":
                step["others"].append(call.op)
    return out


def _each_step(check: str, run: DDPRun, steps: list[list[dict]], judge: Callable, prop: str):
    """Fail at the first (step, rank) where `judge(step)` returns a problem."""
    __tracebackhide__ = True
    where = run.describe(len(steps))
    for s in range(run.steps):
        for r, per_step in enumerate(steps):
            problem = judge(per_step[s])
            if problem:
                fail(check, f"rank {r}, step {s} ({where}): {problem}", prop=prop)


def _traffic_problem(trainable_bytes: int):
    """Part of the result: each step, every trainable gradient is all-reduced exactly once
    and nothing else is communicated. (So fake all-reduces cannot stand in for real ones.)"""

    def judge(step: dict) -> str | None:
        others = sorted(set(step["others"]))
        if others:
            return (
                f"the step used {', '.join(others)}: average the gradients with "
                "dist.all_reduce only, one call per bucket"
            )
        if not step["all_reduces"]:
            return (
                "no all-reduce was seen during the step: launch each bucket's all-reduce "
                "with dist.all_reduce(flat, async_op=True)"
            )
        carried = sum(nbytes for nbytes, _, _ in step["all_reduces"])
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
    module = build_model(run, 0)
    names = {id(p): "module." + n for n, p in module.named_parameters()}
    cap = run.cap_mb()
    expected = rule(list(module.parameters()), cap * MB)
    sizes = sorted(sum(p.numel() * p.element_size() for p in b) for b in expected)
    layout = "; ".join(f"[{', '.join(names[id(p)] for p in b)}]" for b in expected)

    def judge(step: dict) -> str | None:
        got = sorted(nbytes for nbytes, _, _ in step["all_reduces"])
        if got == sizes:
            return None
        return (
            f"all-reduces of {got} bytes; with bucket_cap_mb={cap:.6g} ({cap * MB:g} "
            f"bytes) the rule gives {len(expected)} buckets of {sizes} bytes: {layout}. "
            "Take the trainable parameters last registered first, and start a new bucket "
            "only when the next parameter would take it over the cap (1 MB = 2**20 bytes)"
        )

    return judge, len(expected)


def _overlap_problem(n_buckets: int, gradients: int, no_grad: int):
    """The overlap property: backward never waits for an all-reduce; only buckets holding a
    parameter without gradient (`no_grad` of them this step) are left for after backward;
    and with several buckets, one starts before backward has accumulated the last of its
    `gradients` gradients."""

    def judge(step: dict) -> str | None:
        calls = step["all_reduces"]
        in_backward = [k for _, phase, k in calls if phase == "backward"]
        if step["waited"]:
            return (
                "backward waited for an all-reduce (a dist.all_reduce without "
                "async_op=True, or a wait(), in a gradient hook): launch it with "
                "async_op=True and wait only in finish_gradient_synchronization"
            )
        late = len(calls) - len(in_backward)
        if late > no_grad:
            return (
                f"{late} of {len(calls)} all-reduces were launched after backward; only a "
                "bucket holding a parameter that got no gradient "
                f"({no_grad} this step) may be left to "
                "finish_gradient_synchronization. Launch each bucket's all-reduce from the "
                "hook (register_post_accumulate_grad_hook) that completes it"
            )
        if n_buckets > 1 and not any(k < gradients for k in in_backward):
            return (
                f"with {n_buckets} buckets, no all-reduce started before backward had computed "
                "its last gradient: launch each bucket as soon as its own gradients are "
                "ready, so that communication overlaps the rest of backward"
            )
        return None

    return judge


def _judge_communication(
    check: str, run: DDPRun, steps: list[list[dict]], ref: dict, gradients: int, verdict, rule
) -> None:
    """check_ddp's communication, one verdict case per property: `steps[r][s]`, rank r's
    calls at step s (`step_calls`) and whether it waited in backward; `gradients`, how many
    parameters get a gradient each step; `rule`, the bucket rule."""
    trainable_bytes = sum(p.numel() * p.element_size() for p in ref["trainable"])
    bucket_judge, n_buckets = _bucket_problem(run, rule)
    no_grad = len(ref["trainable"]) - gradients
    for judge, prop in (
        (_traffic_problem(trainable_bytes), RESULT),
        (bucket_judge, "buckets"),
        (_overlap_problem(n_buckets, gradients, no_grad), "overlap"),
    ):
        with verdict.case():
            _each_step(check, run, steps, judge, prop)
