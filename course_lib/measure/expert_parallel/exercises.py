"""The checks of lecture 12's exercises: each computes its expected value, and says why, here,
out of the notebook's sight."""

from __future__ import annotations

from course_lib.costs import ep_bytes, expert_capacity
from course_lib.exercises import check_choice, check_number, faster


def check_capacity(capacity: object) -> bool | None:
    """Tokens one expert can take: 4096 tokens, 64 experts, top-2, capacity factor 1.25."""
    return check_number(
        capacity,
        expert_capacity(4096, 64, 2, 1.25),
        rtol=0,
        atol=0.5,
        hint="The even share is T * k / E choices per expert; the factor adds headroom.",
    )


def check_worst_balance_loss(worst_balance_loss: object) -> bool | None:
    """The balancing loss of 8 experts, top-1, every token sent to expert 0 with probability 1."""
    n_experts = 8  # f and P are 1 at expert 0 and 0 elsewhere: E * 1 * 1
    return check_number(
        worst_balance_loss,
        float(n_experts),
        rtol=0,
        atol=1e-6,
        hint=(
            "One expert gets every choice and all the probability: f and P are 1 there, 0 "
            "elsewhere."
        ),
    )


def check_ep_forward_bytes(ep_forward_bytes: object) -> bool | None:
    """Bytes one rank sends in a forward pass: 4096 tokens, top-2, d = 4096, bf16, 8 ranks."""
    return check_number(
        ep_forward_bytes,
        ep_bytes(4096 * 2 * 4096 * 2, 8),
        hint="N = tokens * k * d * 2 bytes; dispatch and combine each send (P-1)/P of it.",
    )


DROPPED = ("none", "under 10%", "10% to 30%", "over 30%")


def check_dropped_at_one(
    dropped_at_one: object, capacity_factors: list[float], shares: list[float]
) -> bool | None:
    """The share of the Tk choices dropped at capacity factor 1.0, in brackets, from the
    `dropped_share` measured at each of `capacity_factors`."""
    share = shares[capacity_factors.index(1.0)]
    bracket = DROPPED[(share > 0) + (share >= 0.1) + (share >= 0.3)]  # none, <10%, <30%, more
    return check_choice(
        dropped_at_one,
        bracket,
        DROPPED,
        why="Only the experts above the even share drop, and only their excess.",
    )


def check_faster_ep_or_tp(
    faster_at_10_mbit: object,
    faster_at_1_gbit: object,
    bandwidths: list[float],
    spread: dict[str, list[tuple[float, ...]]],
) -> tuple[bool | None, bool | None]:
    """Which step was faster, EP's or TP's, at 10 Mbit/s and at 1 Gbit/s, by the medians of
    `spread[kind][i]` (`step_spread` at `bandwidths[i]`, bytes/s). Medians within 20% of each
    other can swap places from run to run: then either answer counts."""
    why = (
        "The slope of time against 1/bandwidth is bytes; the time at high bandwidth is fixed costs."
    )
    verdicts = []
    for answer, bandwidth in ((faster_at_10_mbit, 1.25e6), (faster_at_1_gbit, 125e6)):
        i = bandwidths.index(bandwidth)
        winner = faster({kind: spread[kind][i][0] for kind in ("EP", "TP")}, margin=0.2)
        verdicts.append(check_choice(answer, winner, ["EP", "TP"], why=why))
    return verdicts[0], verdicts[1]
