"""Lecture 9 on links: why TP stays inside a node and PP crosses nodes, the bytes of each per
micro-batch and their seconds on each link beside the compute."""

from __future__ import annotations

from collections.abc import Mapping

from course_lib.costs import (
    TransformerShape,
    compute_seconds,
    traffic_per_microbatch,
)

# --- why TP stays inside a node and PP crosses nodes ---------------------------------------------


def link_table(
    shape: TransformerShape,
    t: int,
    p: int,
    links: Mapping[str, float],
    flops_per_s: float,
) -> str:
    """Per micro-batch and GPU: bytes of TP and PP traffic, and their seconds on each link,
    next to the compute time."""
    traffic = traffic_per_microbatch(shape, t, p)
    compute = compute_seconds(shape, t, p, flops_per_s)
    rows = [f"compute per micro-batch per GPU: {compute * 1e3:.0f} ms"]
    for kind, nbytes in traffic.items():
        times = ", ".join(f"{name} {nbytes / bw * 1e3:.1f} ms" for name, bw in links.items())
        rows.append(f"{kind}: {nbytes / 1e9:.2f} GB sent per micro-batch -> {times}")
    return "\n".join(rows)
