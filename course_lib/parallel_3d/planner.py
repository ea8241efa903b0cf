"""The planner (lecture 10, from section 3 on): every way to lay a cluster out with TP inside a
node, every plan on it priced by `estimate`, fastest first, and the fastest that fits."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from course_lib.memory import divisors
from course_lib.parallel_3d.estimates import Estimate, estimate
from course_lib.parallel_3d.plans import CHECKPOINTING, Cluster, Model, Plan, problem
from course_lib.zero import STAGES


def factorizations(cluster: Cluster, cp: int = 1) -> list[tuple[int, int, int]]:
    """Every (tp, pp, dp) with tp * cp * pp * dp = GPUs and tp dividing a node: TP never
    crosses nodes, its all-reduces are on the critical path of every layer."""
    node, gpus = min(cluster.gpus, cluster.gpus_per_node), cluster.gpus
    return [
        (tp, pp, gpus // (tp * cp * pp))
        for tp in divisors(node)
        if gpus % (tp * cp) == 0
        for pp in divisors(gpus // (tp * cp))
    ]


def candidates(
    model: Model,
    cluster: Cluster,
    zero_stages: Iterable[str] = STAGES,
    checkpointing: Iterable[str] = CHECKPOINTING,
    sequence_parallel: bool = True,
    cp: Iterable[int] = (1,),
    ep: Iterable[int] = (1,),
) -> list[Estimate]:
    """Every plan that can split `model` on `cluster` (fitting in memory or not), fastest
    first: each (tp, pp, dp) factorization with TP inside a node, for each CP and EP degree
    asked for (only 1 by default), each ZeRO stage and each checkpointing choice. With dp = 1
    every ZeRO stage is the same plan: only the first of `zero_stages` is kept."""
    zero_stages, checkpointing = tuple(zero_stages), tuple(checkpointing)
    if not zero_stages or not checkpointing:
        raise ValueError("give at least one ZeRO stage and one checkpointing choice")
    estimates = [
        estimate(model, cluster, Plan(tp, pp, dp, zero, ckpt, sequence_parallel, c, e))
        for c in cp
        for tp, pp, dp in factorizations(cluster, c)
        for e in ep
        if problem(model, tp, pp, dp, c, e) is None
        for zero in (zero_stages if dp > 1 else zero_stages[:1])
        for ckpt in checkpointing
    ]
    return sorted(estimates, key=lambda e: (e.step_seconds, e.total_memory))


def best(model: Model, cluster: Cluster, **options: Any) -> Estimate | None:
    """The fastest plan that fits in GPU memory, or None if none does."""
    return next((e for e in candidates(model, cluster, **options) if e.fits), None)
