"""The budgets of check_sharded_adamw (grading/parallel_3d_zero.py), in bytes: what a rank
may keep between steps and send per step outside Part 2's TP traffic, from the sizes of its
TP shard of TinyGPT's parameters and its DP size. Computed in the checking process only."""

from __future__ import annotations

import math
from collections.abc import Iterable

from course_lib import models
from course_lib.grading.parallel_3d_layout import CONFIG, tp_shard

MOMENTS = 2  # AdamW's exp_avg and exp_avg_sq, one value each per parameter element


def rank_sizes(tp_rank: int, tp_size: int) -> dict[str, int]:
    """Elements of each parameter a rank of TP rank `tp_rank` holds (its TP shard)."""
    dense = models.TinyGPT(CONFIG)
    return {n: tp_shard(n, p, tp_rank, tp_size).numel() for n, p in dense.named_parameters()}


def state_budget(sizes: Iterable[int], dp_size: int, element_size: int = 8) -> int:
    """The most bytes a rank may keep between steps: AdamW's two moments of ceil(n/d)
    elements of each of its parameters (n elements each), plus those of its largest one."""
    sizes = list(sizes)
    share = sum(math.ceil(n / dp_size) for n in sizes)
    return MOMENTS * element_size * (share + max(sizes))


def unsharded_state(sizes: Iterable[int], element_size: int = 8) -> int:
    """AdamW's two moments of every parameter of the rank: what each replica keeps unsharded."""
    return MOMENTS * element_size * sum(sizes)


def comm_budget(sizes: Iterable[int], dp_size: int, element_size: int = 8) -> int:
    """The most bytes a rank may send per step outside Part 2's TP traffic: 1.5 ring
    all-reduces of its parameters padded to d equal chunks, 1.5 x 2(d-1)/d x d ceil(n/d) e
    = 3(d-1) e sum ceil(n/d), plus (d-1) e times its largest parameter."""
    sizes = list(sizes)
    share = sum(math.ceil(n / dp_size) for n in sizes)
    return (dp_size - 1) * element_size * (3 * share + max(sizes))


def over_budget(prop: str, where: str, step: dict, allowed: int, sizes: list, dp: int) -> str:
    """The verdict's words for a step over its budget of `prop` ("memory", "communication")."""
    if prop == "memory":
        return (
            f"{where}: your code keeps {step['kept']:,} bytes of tensors besides the model's "
            f"parameters and gradients; at most {allowed:,} allowed (AdamW's two moments of "
            f"1/{dp} of each parameter, plus those of the largest; unsharded AdamW keeps "
            f"{unsharded_state(sizes):,}). Largest: {', '.join(step['largest'])}.\nHint: keep "
            "the moments of your chunk of each parameter only, and free gradient chunks, "
            "buffers and copies before step() returns"
        )
    return (
        f"{where}: sent {step['sent']:,} bytes outside the TP all-reduces of forward and "
        f"backward; at most {allowed:,} allowed (1.5 ring all-reduces of its parameters in a "
        f"DP group of {dp}, plus {dp - 1} x its largest parameter).\nHint: a rank needs the "
        "averaged gradient of its own chunk only, and sends each updated chunk once"
    )
