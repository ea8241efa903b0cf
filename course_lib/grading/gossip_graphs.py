"""Assignment 4's graphs, which both sides need: a rank, to hand the student's push-sum step
its neighbours; the checking process, to compute the reference and judge the messages.

    out_neighbors(graph, r, P, round)   who rank r sends to in that round
    in_neighbors(graph, r, P, round)    who sends to rank r

The notebook's set-up cell imports both from `course_lib.grading.gossip`, which re-exports
them (they are in `course_lib.grading.GIVEN`: the student's code may call them in Part 1, not
in Part 2, whose schedule is the student's own).
"""

from __future__ import annotations

GRAPHS = ("exponential", "one-peer exponential", "irregular")


def out_neighbors(graph: str, r: int, world_size: int, round_: int = 0) -> list[int]:
    """The ranks that rank r sends to in round `round_` of `graph`, on world_size ranks."""
    offsets = [
        2**k for k in range(world_size.bit_length()) if 2**k < world_size
    ]  # 1, 2, 4, ... below P
    if graph == "exponential":
        return [(r + d) % world_size for d in offsets]
    if graph == "one-peer exponential":
        return [(r + offsets[round_ % len(offsets)]) % world_size] if offsets else []
    if graph == "irregular":
        if world_size == 1:
            return []
        return [j for j in range(world_size) if j != 0] if r == 0 else [(r + 1) % world_size]
    raise ValueError(f"unknown graph {graph!r}: use one of {GRAPHS}")


def in_neighbors(graph: str, r: int, world_size: int, round_: int = 0) -> list[int]:
    """The ranks that send to rank r in that round (in increasing order)."""
    return [j for j in range(world_size) if r in out_neighbors(graph, j, world_size, round_)]
