"""Capacity against dropless, counted: for each capacity factor, what lecture 12's layer really
computed when it ran (the rows each expert was given), what it dropped, and what fixed-size
buffers of C rows per expert would have computed; and "dropless", where no expert has a bound.

Nothing here is a formula of the routing: the rows are counted by hooks on the experts while
the layer runs, so a change in how the layer drops changes the numbers.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import torch

from course_lib.exercises import check_number
from course_lib.expert_parallel import MoE, route
from course_lib.measure.expert_parallel.routing import batch, small_moe

DROPLESS = "dropless"


def expert_rows(moe: MoE, x: torch.Tensor) -> list[int]:
    """Run `moe` on x and return the number of rows each expert was given (hooks on the
    experts' forward, so what the layer did, not what the routing says it should)."""
    rows = [0] * moe.n_experts

    def hook(e: int):
        def count(module, inputs, output) -> None:
            rows[e] += inputs[0].shape[0]

        return count

    handles = [expert.register_forward_hook(hook(e)) for e, expert in enumerate(moe.experts)]
    try:
        with torch.no_grad():
            moe(x)
    finally:
        for handle in handles:
            handle.remove()
    return rows


def capacity_work(moe: MoE, x: torch.Tensor, capacity_factors: list[float | str]) -> list[dict]:
    """For each capacity factor (a number, or `DROPLESS`), run `moe` on x and count: the choices
    made (T k), the rows the experts computed, the share of choices dropped, the rows computed
    with every expert padded to its capacity C (E C; dropless pads nothing), the share of those
    padded rows that carry no token, and the largest expert batch."""
    n_tokens, n_experts = x.shape[0], moe.n_experts
    saved = moe.capacity_factor
    work = []
    try:
        for factor in capacity_factors:
            # Dropless as a capacity of T: a token chooses an expert at most once, so no
            # expert can get more than T choices and nothing is dropped.
            moe.capacity_factor = n_experts / moe.k if factor == DROPLESS else float(factor)
            rows = expert_rows(moe, x)
            r = route(x, moe.router.weight.detach(), moe.k, moe.capacity_factor)
            computed, choices = sum(rows), r.experts.numel()
            # Fixed-size buffers compute C rows per expert, full or not; a grouped GEMM over
            # variable-sized batches (dropless) computes exactly the rows it was given.
            capacity = None if factor == DROPLESS else r.capacity
            padded = computed if capacity is None else n_experts * capacity
            work.append(
                {
                    "factor": factor,
                    "capacity": capacity,
                    "choices": choices,
                    "computed": computed,
                    "dropped": 1 - computed / choices,
                    "padded rows": padded,
                    "padding": 1 - computed / padded,
                    "largest batch": max(rows),
                    "even share": n_tokens * moe.k / n_experts,
                }
            )
    finally:
        moe.capacity_factor = saved
    return work


def lecture_capacity_work(capacity_factors: list[float | str], n_tokens: int = 256) -> list[dict]:
    """`capacity_work` of the lecture's router (`small_moe`) on the lecture's `batch(n_tokens)`."""
    return capacity_work(small_moe(), batch(n_tokens), capacity_factors)


def print_capacity_work(work: list[dict]) -> None:
    """The table: one row per capacity factor."""
    print(
        f"{'factor':>9} {'C':>4} {'dropped':>8} {'rows computed':>14} {'with padding':>13} "
        f"{'padding':>8} {'largest batch':>14}"
    )
    for w in work:
        factor = w["factor"] if w["factor"] == DROPLESS else f"{w['factor']:g}"
        capacity = "-" if w["capacity"] is None else str(w["capacity"])
        print(
            f"{factor:>9} {capacity:>4} {w['dropped']:8.1%} {w['computed']:14d} "
            f"{w['padded rows']:13d} {w['padding']:8.1%} {w['largest batch']:14d}"
        )


def plot_capacity_work(work: list[dict]):
    """Left: the rows the experts compute per setting, those with a token and the padding.
    Right: the share of the T k choices dropped."""
    fig, (rows, drops) = plt.subplots(1, 2, figsize=(9, 3.5))
    labels = [str(w["factor"]) for w in work]
    real = [w["computed"] for w in work]
    pad = [w["padded rows"] - w["computed"] for w in work]
    rows.bar(labels, real, label="rows with a token")
    rows.bar(labels, pad, bottom=real, color="lightgray", label="padding (no token)")
    rows.axhline(work[0]["choices"], color="black", linestyle="--", label="choices T k")
    rows.set_ylim(0, 1.3 * max(w["padded rows"] for w in work))  # room for the legend
    rows.set_xlabel("capacity factor")
    rows.set_ylabel("expert rows computed")
    rows.set_title("Rows computed, padded to C")
    rows.legend(fontsize=8, loc="upper left", ncol=2)
    drops.bar(labels, [100 * w["dropped"] for w in work], color="tab:red")
    drops.set_xlabel("capacity factor")
    drops.set_ylabel("% of choices dropped")
    drops.set_title("Choices dropped")
    fig.tight_layout()
    return fig


def check_no_drop_factor(no_drop_factor: object, work: list[dict]) -> bool | None:
    """The smallest capacity factor at which nothing drops: the largest expert batch (the
    dropless run's) over the even share T k / E. The capacity is ceil(factor * even share),
    so any factor within one row of it, 1 / (even share), counts."""
    dropless = next(w for w in work if w["factor"] == DROPLESS)
    share = dropless["even share"]
    return check_number(
        no_drop_factor,
        dropless["largest batch"] / share,
        rtol=0,
        atol=1 / share,
        hint="Nothing drops once C reaches the busiest expert's count: C / (T k / E).",
    )
