"""Benchmark: `SlowNetwork` against a real network whose links are shaped by the kernel.

    sudo python bench/shaped_network.py          # needs root, `ip` and `tc` (Linux)

`SlowNetwork` emulates links by sleeping; here the same traffic patterns cross real links.
Each of P = 4 ranks runs in a network namespace of its own, joined to a software switch (a
bridge) by a virtual Ethernet pair; the kernel's token-bucket shaper (`tc ... tbf`) limits
every port, each way, to RATE: one port out and one in per rank, as `SlowNetwork` models.
gloo then moves real bytes over TCP, with its headers, acknowledgements and congestion
control. The same patterns then run on loopback inside `SlowNetwork(bandwidth=RATE)` with
the latency measured on the shaped network (a small message's one-way time).

Patterns, each timed from a barrier to the last delivery on any rank, median of REPS:
  p2p      rank 0 sends one message to rank 1
  gather   ranks 1..3 send to rank 0 at once (rank 0 receives them one by one)
  scatter  rank 0 isends one message to each of ranks 1..3
  ring     every rank sends to the next and receives from the previous at once
Target: emulated / real within 0.8-1.2 for each (TCP's headers alone cost a few percent).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

P, RATE, NUMEL, REPS = 4, 12.5e6, 250_000, 5  # 100 Mbit/s; 1 MB messages (80 ms each)
PATTERNS = ("p2p", "gather", "scatter", "ring")
SUBNET, PORT = "10.77.0", 29577


def pattern(name: str, rank: int, world: int, numel: int) -> None:
    """One repetition of a traffic pattern on this rank (plain torch.distributed calls)."""
    t = torch.ones(numel)
    if name == "p2p" and rank < 2:
        dist.send(t, 1) if rank == 0 else dist.recv(t, 0)
    elif name == "gather":
        if rank == 0:
            for peer in range(1, world):
                dist.recv(t, peer)
        else:
            dist.send(t, 0)
    elif name == "scatter":
        if rank == 0:
            for work in [dist.isend(torch.ones(numel), peer) for peer in range(1, world)]:
                work.wait()
        else:
            dist.recv(t, 0)
    elif name == "ring":
        into = torch.empty(numel)
        works = [dist.isend(t, (rank + 1) % world), dist.irecv(into, (rank - 1) % world)]
        for work in works:
            work.wait()


def timings(rank: int, world: int, emulate: dict | None) -> dict[str, list[list[float]]]:
    """[start, end] of each repetition of each pattern on this rank (clock shared by all
    ranks on one machine), with `SlowNetwork(**emulate)` if given."""
    from contextlib import nullcontext

    from course_lib.network import SlowNetwork

    out = {}
    for name in ("latency", *PATTERNS):
        out[name] = []
        for _ in range(REPS):
            dist.barrier()
            with SlowNetwork(**emulate) if emulate else nullcontext():
                start = time.time()
                if name == "latency" and rank < 2:  # a 4-byte round trip
                    ball = torch.ones(1)
                    for sender in (0, 1):
                        dist.send(ball, 1 - rank) if rank == sender else dist.recv(ball, 1 - rank)
                elif name != "latency":
                    pattern(name, rank, world, NUMEL)
                out[name].append([start, time.time()])
    return out


def summary(per_rank: list[dict]) -> dict[str, float]:
    """Per pattern, the median over repetitions of the first start to the last end on any
    rank: until every message is delivered, whatever a sender's call returned earlier (a real
    send returns once the kernel has buffered its bytes). Latency: half rank 0's round trip."""
    out = {}
    for name in ("latency", *PATTERNS):
        reps = zip(*(timings[name] for timings in per_rank), strict=True)
        if name == "latency":
            out[name] = statistics.median(r[0][1] - r[0][0] for r in reps) / 2
        else:
            out[name] = statistics.median(max(e for _, e in r) - min(s for s, _ in r) for r in reps)
    return out


# --- the shaped network: namespaces, a bridge, veth pairs, tbf --------------------------------


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


def build_network() -> None:
    sh("ip", "netns", "add", "cl-switch")
    sh("ip", "-n", "cl-switch", "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", "cl-switch", "link", "set", "br0", "up")
    for r in range(P):
        ns, port = f"cl-rank{r}", f"port{r}"
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", port, "netns",
           "cl-switch")  # fmt: skip
        sh("ip", "-n", "cl-switch", "link", "set", port, "master", "br0", "up")
        sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{r + 1}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        rate = f"{int(RATE * 8)}bit"
        # Shape both directions: the rank's port out (its eth0) and in (the switch's port).
        for where, dev in ((ns, "eth0"), ("cl-switch", port)):
            sh("ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
               "rate", rate, "burst", "32kb", "latency", "2s")  # fmt: skip


def remove_network() -> None:
    for ns in ("cl-switch", *(f"cl-rank{r}" for r in range(P))):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def shaped() -> dict[str, float]:
    """The patterns' times on the shaped network."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            ["ip", "netns", "exec", f"cl-rank{r}", sys.executable, __file__, "--rank", str(r)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(P)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank failed on the shaped network: {outs}")
    return summary([json.loads(out.strip().splitlines()[-1]) for out in outs])


def rank_main(rank: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://{SUBNET}.1:{PORT}", rank=rank, world_size=P)
    result = timings(rank, P, None)
    dist.destroy_process_group()
    print(json.dumps(result), flush=True)


def emulated_rank(latency: float) -> dict[str, list[list[float]]]:
    from course_lib import rank, world_size

    return timings(rank(), world_size(), {"bandwidth": RATE, "latency": latency})


def emulated(latency: float) -> dict[str, float]:
    """The patterns' times on loopback inside `SlowNetwork`."""
    from course_lib import launch

    return summary(launch(emulated_rank, latency, world_size=P, timeout=300))


def main() -> None:
    why = None
    if os.geteuid() != 0:
        why = "needs root (network namespaces and tc)"
    elif not (shutil.which("ip") and shutil.which("tc")):
        why = "needs iproute2's `ip` and `tc`"
    if why:
        print(f"shaped_network: skipped, {why}")
        return
    remove_network()
    try:
        build_network()
        real = shaped()
    except (subprocess.CalledProcessError, RuntimeError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        print(f"shaped_network: skipped, the kernel would not build the network: {detail}")
        return
    finally:
        remove_network()
    emu = emulated(real["latency"])
    wire = 4 * NUMEL / RATE
    print(f"P = {P} ranks, every port {RATE * 8 / 1e6:.0f} Mbit/s each way, messages of "
          f"{4 * NUMEL / 1e6:.0f} MB ({1e3 * wire:.0f} ms on a wire); one-way latency measured "
          f"{1e3 * real['latency']:.2f} ms")  # fmt: skip
    print(f"{'pattern':>8} {'real (s)':>9} {'emulated (s)':>13} {'emulated/real':>14} {'wires':>6}")
    for name in PATTERNS:
        ratio = emu[name] / real[name]
        flag = "" if 0.8 <= ratio <= 1.2 else "  <- outside 0.8-1.2"
        print(f"{name:>8} {real[name]:9.3f} {emu[name]:13.3f} {ratio:14.2f} "
              f"{real[name] / wire:6.2f}{flag}")  # fmt: skip


if __name__ == "__main__":
    if "--rank" in sys.argv:
        rank_main(int(sys.argv[sys.argv.index("--rank") + 1]))
    else:
        main()
