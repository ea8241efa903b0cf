"""Benchmark: the reference ring all-reduce against gloo's own `dist.all_reduce`.

    python bench/ring.py

The ring is Assignment 2's reference `ring_all_reduce`, run from the solution notebook's own
setup and solution cells (found by cell id), not a copy. For 1 MB to 64 MB of float32 on
P = 2 and 4 ranks, one table: the median time of each, their ratio, and the bytes each rank of
the ring sends against 2(P-1)/P * N. Targets: within 1.5x of gloo at 64 MB; exactly
2(P-1)/P * N bytes per rank.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib import CommCounter, launch

ROOT = Path(__file__).resolve().parents[1]
SIZES_MB = (1, 4, 16, 64)
WORLD_SIZES = (2, 4)
REPEATS = 7
TARGET_RATIO = 1.5  # ring time / gloo time at the largest size


def load_ring() -> Callable:
    """The solution's ring_all_reduce, defined by running its notebook cells."""
    sys.path.insert(0, str(ROOT))  # tests/ holds the one loader of solution notebooks
    from tests.adapters import solution

    return solution("collectives").ring_all_reduce


def gloo_all_reduce(tensor: torch.Tensor) -> None:
    dist.all_reduce(tensor)


def measure(ring: Callable, numel: int, repeats: int) -> dict:
    """On each rank: seconds per call of the ring and of gloo (alternating, after a barrier),
    and the bytes the ring sends."""
    tensor = torch.ones(numel)
    with CommCounter() as counter:
        ring(tensor)  # also the warm-up
    gloo_all_reduce(tensor)
    seconds: dict[str, list[float]] = {"ring": [], "gloo": []}
    for _ in range(repeats):
        for name, all_reduce in (("ring", ring), ("gloo", gloo_all_reduce)):
            tensor.fill_(1.0)
            dist.barrier()
            start = time.perf_counter()
            all_reduce(tensor)
            seconds[name].append(time.perf_counter() - start)
    if not torch.equal(tensor, torch.full_like(tensor, float(dist.get_world_size()))):
        raise AssertionError("the all-reduce gave a wrong sum")
    return {"seconds": seconds, "sent": counter.bytes_sent}


def median_of_slowest(per_rank: list[dict], name: str) -> float:
    """A collective ends when its slowest rank does: max over ranks, median over repeats."""
    rounds = zip(*(rank["seconds"][name] for rank in per_rank), strict=True)
    return statistics.median(max(times) for times in rounds)


def main() -> None:
    ring = load_ring()
    print(
        f"{'P':>2}{'size':>7}{'ring (ms)':>11}{'gloo (ms)':>11}{'ring/gloo':>11}"
        f"{'sent/rank (B)':>15}{'2(P-1)/P*N':>13}{'sent/formula':>14}"
    )
    for p in WORLD_SIZES:
        for mb in SIZES_MB:
            numel = mb * 2**20 // 4
            per_rank = launch(measure, ring, numel, REPEATS, world_size=p, timeout=600)
            ring_s, gloo_s = (
                median_of_slowest(per_rank, "ring"),
                median_of_slowest(per_rank, "gloo"),
            )
            sent = max(rank["sent"] for rank in per_rank)
            formula = 2 * (p - 1) * numel * 4 // p
            print(
                f"{p:>2}{mb:>5}MB{1e3 * ring_s:>11.1f}{1e3 * gloo_s:>11.1f}"
                f"{ring_s / gloo_s:>11.2f}{sent:>15,}{formula:>13,}{sent / formula:>14.3f}"
            )
    print(f"target: ring/gloo <= {TARGET_RATIO} at {SIZES_MB[-1]} MB; sent/formula = 1.000")


if __name__ == "__main__":
    main()
