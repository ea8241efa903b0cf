"""Benchmark: the emulated network's times against its model, measured in one run.

    python bench/network.py

On 4 ranks inside `SlowNetwork(bandwidth=125e6, latency=5e-3)` (1 Gbit/s, 5 ms), each
transfer is timed from the sender's start (point-to-point) or the last rank's start
(collectives) to the end of the call, median of 5. The same transfer without emulation is
timed too: the emulation holds while the model's time is well above the real one.
Target: measured / model within 0.8-1.2.
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from course_lib import launch, rank
from course_lib.network import SlowNetwork

BANDWIDTH, LATENCY, REPS = 125e6, 5e-3, 5


def timed(op: str, numel: int, dtype: torch.dtype, emulate: bool) -> list[tuple[float, float]]:
    """(start, end) of each repetition of `op` on this rank."""
    records = []
    for _ in range(REPS):
        t = torch.ones(numel, dtype=dtype)
        dist.barrier()
        with SlowNetwork(BANDWIDTH, LATENCY) if emulate else nullcontext():
            start = time.time()
            if op == "send/recv" and rank() < 2:
                dist.send(t, 1) if rank() == 0 else dist.recv(t, 0)
            elif op == "all_reduce":
                dist.all_reduce(t)
            elif op == "broadcast":
                dist.broadcast(t, src=0)
            records.append((start, time.time()))
    return records


def measure(op: str, numel: int, dtype: torch.dtype, emulate: bool) -> float:
    """Median seconds from the sender's (or last rank's) start to the slowest rank's end."""
    results = launch(timed, op, numel, dtype, emulate, world_size=4, timeout=120)
    ranks = [0, 1] if op == "send/recv" else range(4)
    reps = []
    for i in range(REPS):
        start = results[0][i][0] if op == "send/recv" else max(results[r][i][0] for r in ranks)
        reps.append(max(results[r][i][1] for r in ranks) - start)
    return statistics.median(reps)


def model(op: str, nbytes: int) -> float:
    p = 4
    if op == "send/recv":
        return LATENCY + nbytes / BANDWIDTH
    if op == "all_reduce":
        return 2 * (p - 1) * (LATENCY + nbytes / p / BANDWIDTH)
    return (p - 1) * (LATENCY + nbytes / BANDWIDTH)  # flat-tree broadcast


def main() -> None:
    cases = [
        ("send/recv", 1_000, torch.float32),
        ("send/recv", 1_000_000, torch.uint8),
        ("send/recv", 1_000_000, torch.float32),
        ("all_reduce", 1_000, torch.float32),
        ("all_reduce", 1_000_000, torch.uint8),
        ("all_reduce", 1_000_000, torch.float32),
        ("broadcast", 250_000, torch.float32),
    ]
    header = ("op", "bytes", "model (ms)", "emulated (ms)", "ratio", "real (ms)")
    print("{:<12}{:>11}{:>12}{:>15}{:>7}{:>11}".format(*header))
    for op, numel, dtype in cases:
        nbytes = numel * torch.tensor([], dtype=dtype).element_size()
        expected = model(op, nbytes)
        emulated = measure(op, numel, dtype, emulate=True)
        real = measure(op, numel, dtype, emulate=False)
        print(
            f"{op:<12}{nbytes:>11,}{expected * 1e3:>12.1f}{emulated * 1e3:>15.1f}"
            f"{emulated / expected:>7.2f}{real * 1e3:>11.1f}"
        )


if __name__ == "__main__":
    main()
