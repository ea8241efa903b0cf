"""Lecture 2's exercises, checked off the page: the crossover worked out by hand, and the
predictions checked against what the emulated network measured (the fastest algorithm at 4 kB,
naive over ring at 16 MB, ring or two-level on two nodes); each computes its expected value and
says why here, out of the notebook's sight."""

from __future__ import annotations

import math

from course_lib.collectives import (
    ALGORITHMS,
)
from course_lib.exercises import check_choice, check_number
from course_lib.measure.collectives.sweep import crossovers

# --- the crossover, by hand -------------------------------------------------------------------


def check_crossover(crossover_bytes: object) -> bool | None:
    """Lecture 2: the N at which butterfly and halving-doubling tie, P = 8, 10 us, 10 Gbit/s."""
    return check_number(
        crossover_bytes,
        crossovers(8, 10e-6, 8 / 10e9)[0][0],
        rtol=0.02,
        unit="bytes",
        hint="Set the two times equal and solve for N; beta is seconds per byte: 8 / 10e9.",
    )


# --- the predictions, checked against the emulated network ----------------------------------------

RATIOS = ("1x", "2x", "4x", "8x")


def check_fastest_at_4kB(fastest_at_4kB: object, swept: dict[str, list[float]]) -> bool | None:
    """Which of the five algorithms was fastest at the sweep's first size, 4 kB (`swept[name]`:
    seconds at each size, from `sweep_all_reduce`)."""
    fastest = min(ALGORITHMS, key=lambda name: swept[name][0])  # the five of the question
    return check_choice(
        fastest_at_4kB,
        fastest,
        list(ALGORITHMS),
        why="Few messages win when latency dominates.",
    )


def check_naive_over_ring_at_16MB(
    naive_over_ring_at_16MB: object, swept: dict[str, list[float]]
) -> bool | None:
    """How many times longer than the ring the naive algorithm took at the sweep's last size,
    16 MB, against the nearest option on a log scale."""
    ratio = swept["naive"][-1] / swept["ring"][-1]
    nearest = min(RATIOS, key=lambda r: abs(math.log(ratio / int(r[:-1]))))
    return check_choice(
        naive_over_ring_at_16MB,
        nearest,
        RATIOS,
        why=f"Measured: {ratio:.1f}x. The root's port takes in and sends out (P-1)N bytes; a ring "
        "rank 2(P-1)/P N.",
    )


def check_faster_on_two_nodes(
    faster_on_two_nodes: object, on_two_nodes: dict[str, float]
) -> bool | None:
    """Which finished first on 2 nodes of 4, the flat ring or the two-level all-reduce
    (`on_two_nodes[name]`: seconds measured)."""
    return check_choice(
        faster_on_two_nodes,
        min(on_two_nodes, key=on_two_nodes.get),
        ["ring", "two_level"],
        why="The flat ring sends 2(P-1)/P N = 1.75N over a slow link; the leaders' ring of 2 "
        "sends N.",
    )
