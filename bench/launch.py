"""Benchmark: course_lib.launch against torch.multiprocessing.spawn, measured in one run.

    python bench/launch.py [--repeats 3] [--warm-calls 50]

For world sizes 2 and 4, each rank joins a gloo process group and all-reduces one number.
- mp.spawn: a fresh Python process (torch imported) times `mp.spawn` of that function.
- cold launch: a fresh Python process (torch and course_lib imported, as in a notebook after
  its import cell) times its first `launch`: fork server, workers, process group, call.
- warm call: median time of a call to workers that are already running.
Targets on a 2-core CPU: warm call for 4 ranks under 20 ms and over 100x faster than mp.spawn;
cold launch faster than mp.spawn (which cannot run notebook-defined functions at all).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SPAWN_SCRIPT = """
import socket, sys, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def entry(rank, world, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    dist.destroy_process_group()


if __name__ == "__main__":
    world = int(sys.argv[1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()
    mp.spawn(entry, args=(world, port), nprocs=world, join=True)
    print(time.perf_counter() - start)
"""

COLD_SCRIPT = """
import sys, time
import torch
import torch.distributed as dist
from course_lib import launch, rank


def work():
    t = torch.tensor([float(rank())])
    dist.all_reduce(t)
    return t.item()


world = int(sys.argv[1])
start = time.perf_counter()
launch(work, world_size=world)
print(time.perf_counter() - start)
"""

WARM_SCRIPT = """
import statistics, sys, time
import torch
import torch.distributed as dist
from course_lib import WorkerPool, rank


def work():
    t = torch.tensor([float(rank())])
    dist.all_reduce(t)
    return t.item()


world, calls = int(sys.argv[1]), int(sys.argv[2])
with WorkerPool(world) as pool:
    pool.launch(work)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        pool.launch(work)
        times.append(time.perf_counter() - start)
print(statistics.median(times))
"""


def run(script: Path, *args: object) -> float:
    """Run a script in a fresh interpreter; it prints one duration in seconds."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per cold timing")
    parser.add_argument("--warm-calls", type=int, default=50)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    options = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        scripts = {}
        for name, source in (("spawn", SPAWN_SCRIPT), ("cold", COLD_SCRIPT), ("warm", WARM_SCRIPT)):
            scripts[name] = Path(tmp) / f"{name}.py"
            scripts[name].write_text(textwrap.dedent(source))
        header = (
            f"{'ranks':>5} | {'mp.spawn':>9} | {'cold launch':>11} | {'spawn/cold':>10} | "
            f"{'warm call':>9} | {'spawn/warm':>10}"
        )
        print(header)
        print("-" * len(header))
        for world_size in options.world_sizes:
            spawn = statistics.median(
                run(scripts["spawn"], world_size) for _ in range(options.repeats)
            )
            cold = statistics.median(
                run(scripts["cold"], world_size) for _ in range(options.repeats)
            )
            warm = run(scripts["warm"], world_size, options.warm_calls)
            print(
                f"{world_size:>5} | {spawn:>8.2f}s | {cold:>10.2f}s | {spawn / cold:>9.1f}x | "
                f"{1000 * warm:>7.1f}ms | {spawn / warm:>9.0f}x"
            )
    print("\ntargets: warm call (4 ranks) < 20 ms and > 100x faster than mp.spawn; cold < mp.spawn")


if __name__ == "__main__":
    main()
