"""Lecture 11's exercises, checked off the page: each check computes its expected value, from
the formulas or from the run the notebook just made, and says why, out of the notebook's sight.
"""

from __future__ import annotations

import math

import torch

from course_lib.costs import ring_attention_bytes
from course_lib.exercises import check_choice, check_function, check_number
from course_lib.measure.sequence_parallel.ranks import METHODS
from course_lib.sequence_parallel import (
    merge_block,
)

# --- the lecture's coded task: the online softmax's merge ------------------------------------


def _joined(merge):
    """`merge(state, scores, v)` with its (max, sum, output) joined into one tensor along the
    last dimension, for `check_function`; None (unanswered) passes through."""

    def joined(state, scores, v):
        out = merge(tuple(t.clone() for t in state), scores, v)
        if out is None or out is ...:
            return out
        if not (isinstance(out, tuple | list) and len(out) == 3):
            raise ValueError("return the three tensors (row_max, row_sum, acc) as a tuple")
        return torch.cat([torch.as_tensor(t, dtype=torch.float64) for t in out], dim=-1)

    return joined


SHAPES = ((3, 4), (4, 2), (3, 4))  # scores of 3 queries x 4 keys, values of width 2


def merge_cases() -> dict[str, tuple]:
    """States and blocks that test a merge: the first block (max -inf), a block that raises
    the max of every query, one that raises no max, and a causal block with masked scores."""
    g = torch.Generator().manual_seed(0)
    scores, v, earlier = (torch.randn(n, generator=g, dtype=torch.float64) for n in SHAPES)
    empty = (torch.full((3, 1), float("-inf")), torch.zeros(3, 1), torch.zeros(3, 2))
    empty = tuple(t.double() for t in empty)  # before any block: max -inf, nothing summed
    seen = merge_block(empty, earlier, v.flip(0))
    masked = scores.masked_fill(torch.ones(3, 4).triu(1).bool(), float("-inf"))
    return {
        "the first block": (empty, scores, v),
        "a block with larger scores": (seen, scores + 4, v),
        "a block with smaller scores": (seen, scores - 4, v),
        "a causal block (some scores -inf)": (seen, masked, v),
    }


def check_rescale(rescale: object) -> bool | None:
    """The factor a running sum is multiplied by when a query's maximum rises from 3 to 5."""
    return check_number(
        rescale,
        math.exp(3.0 - 5.0),
        rtol=1e-3,
        hint="Each term was exp(score - 3); it must become exp(score - 5).",
    )


def check_merge(candidate) -> bool | None:
    """Lecture 11's task: the student's merge(state, scores, v) against `merge_block`, on
    `merge_cases`; the three parts of the state are compared as one tensor."""
    hint = (
        "Per query: the new max is the larger of the old one and the block's largest score; "
        "what was kept is rescaled by exp(old max - new max), then the block's "
        "exp(scores - new max) is added (summed over the keys, or times v)."
    )
    answer = candidate if candidate is ... else _joined(candidate)
    return check_function(answer, _joined(merge_block), merge_cases(), hint=hint)


def check_ring_bytes_per_rank(ring_bytes_per_rank: object) -> bool | None:
    """Bytes one rank sends per attention pass: ring attention, P = 8, N = 32k, h = 4096, 16-bit."""
    return check_number(
        ring_bytes_per_rank,
        ring_attention_bytes(2 * 32 * 1024 * 4096 * 2, 8),
        hint=(
            "K and V of the whole sequence: 2Nh values of 2 bytes; the ring passes (P-1)/P of them."
        ),
    )


SAVINGS = ("2x", "4x", "16x")
IMBALANCES = ("1x", "2x", "4x", "8x")


def _nearest(ratio: float, options: tuple[str, ...]) -> str:
    """The option ("4x") whose factor is nearest to `ratio`, relatively."""
    return min(options, key=lambda option: abs(ratio / int(option[:-1]) - 1))


def check_memory_saving(
    ring_saving: object, ulysses_saving: object, one_process: list[int], busiest: dict
) -> tuple[bool | None, bool | None]:
    """Lecture 11's memory prediction: how many times less than one process the busiest rank
    holds at its peak, at the longest sequence measured (`one_process` and `busiest[method]`
    are peak bytes per length), each answer against the option nearest to the run."""
    ring = check_choice(
        ring_saving,
        _nearest(one_process[-1] / busiest["ring"][-1], SAVINGS),
        SAVINGS,
        why="A ring rank holds (N/P) x (N/P) scores per head: towards P^2 = 16 as N grows.",
    )
    ulysses = check_choice(
        ulysses_saving,
        _nearest(one_process[-1] / busiest["ulysses"][-1], SAVINGS),
        SAVINGS,
        why="Ulysses holds N x N scores, for H/P heads: P times less, however long the sequence.",
    )
    return ring, ulysses


def check_fewer_bytes_with_one_kv_head(answer: object, sent: dict) -> bool | None:
    """Lecture 11's GQA prediction: which method sent fewer bytes with a single K/V head
    (`sent[method]`: bytes per number of K/V heads, the last one 1)."""
    fewer = min(METHODS, key=lambda m: sent[m][-1])
    return check_choice(
        answer,
        fewer,
        tuple(METHODS),
        why="The ring moves only K and V, which shrink with the K/V heads; Ulysses moves q and "
        "the output whole, and every rank needs at least one K/V head.",
    )


def check_waits_at_the_largest_block(answer: object, run: dict[str, list]) -> bool | None:
    """Lecture 11's overlap prediction: does the ring wait for the network with the largest
    blocks of `ring_overlap`'s run? "no" when it waited under a tenth of a hop's transfer."""
    transfer = run["hop bytes"][-1] / run["bandwidth"]
    waits = "yes" if run["waited"][-1] > transfer / 10 else "no"
    return check_choice(
        answer,
        waits,
        ("yes", "no"),
        why=f"A block's compute took {run['one block'][-1] * 1e3:.0f} ms, its transfer "
        f"{transfer * 1e3:.0f} ms: the hop hides the transfer when compute is the longer.",
    )


def check_busiest_over_idlest(busiest_over_idlest: object, work: dict) -> bool | None:
    """Lecture 11's causal prediction: on contiguous shards, how many times more scores the
    busiest rank computed than the least busy (`work[layout][rank]`: scores per hop)."""
    contiguous = [sum(hops) for hops in work["contiguous"]]
    return check_choice(
        busiest_over_idlest,
        f"{max(contiguous) // min(contiguous)}x",
        IMBALANCES,
        why="Rank r meets r+1 blocks it needs, so the last rank waits on nothing and the first "
        "idles.",
    )
