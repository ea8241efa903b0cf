"""When a hop of ring attention hides its transfer: a block's compute measured on a rank, its
transfer over an emulated link (`SlowNetwork`), and how long the ring really waited for it.
"""

from __future__ import annotations

import statistics
import time

import matplotlib.pyplot as plt
import torch.distributed as dist
from matplotlib.ticker import NullFormatter

from course_lib.comm import CommCounter
from course_lib.measure.sequence_parallel.ranks import qkv
from course_lib.network import SlowNetwork
from course_lib.runtime import rank, world_size
from course_lib.sequence_parallel import (
    ring_attention,
    sequence_positions,
)


def _median_seconds(repeats: int, run, *args) -> float:
    """The median wall time of `run(*args)` over `repeats` runs, the ranks started together."""
    times = []
    for _ in range(repeats):
        dist.barrier()  # a hop waits for its neighbour's block: start at the same moment
        start = time.perf_counter()
        run(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ring_overlap(seq_lens: list[int], bandwidth: float, repeats: int = 3) -> dict:
    """On each rank: for each sequence length, float32, the median seconds (of `repeats`) of
    one block's ring attention on this rank alone (what a hop computes while its block travels);
    then ring attention on a `SlowNetwork` of `bandwidth` bytes/s (no latency): the median
    seconds it waited for that network beyond the real transfer (`SlowNetwork.waited`: the
    transfer time compute did not hide) and the bytes this rank sent per hop (`CommCounter`).
    The median, as one descheduled run would otherwise stand for all of them."""
    out: dict = {"bandwidth": bandwidth, "one block": [], "waited": [], "hop bytes": []}
    # A ring of one rank computes its own block with the ring's own code and sends nothing:
    # the compute a hop has to hide its transfer behind. (Every rank makes every group.)
    alone = [dist.new_group([r]) for r in range(world_size())][rank()]
    for n in seq_lens:
        mine = sequence_positions(n, rank(), world_size())
        q, k, v = (t[..., mine, :].float().contiguous() for t in qkv(n))
        out["one block"].append(
            _median_seconds(repeats, ring_attention, q, k, v, mine, False, alone)
        )
        waited = []
        with SlowNetwork(bandwidth, latency=0.0) as network, CommCounter() as counter:
            for _ in range(repeats):
                before = network.waited
                _median_seconds(1, ring_attention, q, k, v, mine)
                waited.append(network.waited - before)
        out["waited"].append(statistics.median(waited))
        out["hop bytes"].append(counter.bytes_sent // (repeats * (world_size() - 1)))
    return out


def plot_ring_overlap(seq_lens: list[int], run: dict, heads: int = 4, dim: int = 16):
    """Milliseconds against tokens per rank (`ring_overlap`'s `run` on 2 ranks): a block's
    compute (measured), its transfer (the measured bytes of a hop over the bandwidth: the
    network's model), and the time the ring waited for the emulated network (measured by
    `SlowNetwork.waited`). The dotted line is where compute and transfer meet by the
    block-size condition, with F (FLOP/s) from the largest block's measured time."""
    tokens, bandwidth = [n // 2 for n in seq_lens], run["bandwidth"]
    ms = {
        "a block's compute (measured)": [t * 1e3 for t in run["one block"]],
        "a block's transfer (bytes / bandwidth)": [b / bandwidth * 1e3 for b in run["hop bytes"]],
        "waited for the network (measured)": [t * 1e3 for t in run["waited"]],
    }
    flop_rate = 4 * tokens[-1] ** 2 * heads * dim / run["one block"][-1]
    bytes_per_token = run["hop bytes"][-1] / tokens[-1]
    crossover = flop_rate * bytes_per_token / (4 * heads * dim * bandwidth)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for (label, values), style in zip(ms.items(), ("o-", "s--", "^-"), strict=True):
        ax.loglog(tokens, [max(v, 1e-2) for v in values], style, label=label)
    ax.axvline(crossover, color="gray", linestyle=":", label=f"compute = transfer: {crossover:.0f}")
    ax.set_xticks(tokens, [str(n) for n in tokens])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("tokens per rank N/P (2 ranks)")
    ax.set_ylabel("milliseconds (below 0.01 drawn at 0.01)")
    ax.set_title(f"Ring attention over {bandwidth / 1e6:g} MB/s: does a hop hide its transfer?")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    return fig
