"""Communication costs: the alpha-beta model of a message's time, the bytes a rank sends in
each collective, and the seconds an all-reduce takes by algorithm (lecture 2)."""

from __future__ import annotations

import math

# --- time: the alpha-beta model -------------------------------------------------------------


def alpha_beta_time(nbytes, latency: float, bandwidth: float, messages: int = 1):
    """Seconds to send `nbytes` bytes in `messages` messages one after another: each message
    pays the latency alpha (s), and the bytes cross the link at `bandwidth` (bytes/s):
    messages * alpha + N / beta (Hockney's model). Works on numpy arrays of sizes too."""
    return messages * latency + nbytes / bandwidth


def collective_steps(op: str, world_size: int) -> int:
    """Messages one after another in the textbook algorithm of collective `op`, each costing
    one latency: 2(P-1) for a ring all-reduce (reduce-scatter, then all-gather), ceil(log2 P)
    for a dissemination barrier, P-1 for a ring all-gather or reduce-scatter, a direct
    all-to-all, and the root of a flat tree."""
    p = world_size
    if op == "all_reduce":
        return 2 * (p - 1)
    if op == "barrier":
        return math.ceil(math.log2(p)) if p > 1 else 0
    return p - 1


# --- volume: bytes a rank sends in each collective -------------------------------------------


def ring_bytes(nbytes, world_size: int, passes: int = 1):
    """Bytes one rank sends in `passes` passes around a ring over an N-byte tensor cut into P
    chunks: each pass (a reduce-scatter, or an all-gather) sends the P-1 chunks that are not
    its own, (P-1)/P * N (Patarasuk and Yuan, 2009)."""
    if isinstance(nbytes, int):  # whole bytes, rounded down, as CommCounter counts them
        return passes * (world_size - 1) * nbytes // world_size
    return passes * (world_size - 1) / world_size * nbytes


def all_reduce_bytes(nbytes, world_size: int):
    """Ring all-reduce: a reduce-scatter then an all-gather, 2(P-1)/P * N per rank, nearly
    2N whatever P (bandwidth-optimal)."""
    return ring_bytes(nbytes, world_size, passes=2)


def all_gather_bytes(piece_bytes, world_size: int):
    """All-gather of one `piece_bytes` piece per rank: a rank sends (P-1) pieces, its own and
    the P-2 it passes on. A reduce-scatter into `piece_bytes` outputs sends the same, and so
    does the root of a flat-tree broadcast, scatter, gather or reduce (one piece per other
    rank)."""
    return (world_size - 1) * piece_bytes


def all_to_all_bytes(nbytes, world_size: int):
    """All-to-all of an N-byte tensor cut into P chunks: a rank sends every chunk but its own
    straight to its owner, (P-1)/P * N, the volume of one ring pass."""
    return ring_bytes(nbytes, world_size)


def host_bytes(model_bytes: int, batch_bytes: int, world_size: int) -> dict[str, tuple[int, int]]:
    """(sent, received) per step of the naive host scheme (`data_parallel.host_step`), for the
    host (rank 0) and for one worker: the host scatters the batch (it keeps its own 1/P), every
    worker sends its whole gradient to the host, and the host sends the parameters back to
    each. The host's traffic grows as (P - 1) model sizes; a ring all-reduce's stays under 2."""
    scattered = (
        (world_size - 1) * batch_bytes // world_size
    )  # all of the batch but the host's share
    return {
        "host": ((world_size - 1) * model_bytes + scattered, (world_size - 1) * model_bytes),
        "worker": (model_bytes, model_bytes + batch_bytes // world_size),
    }


def all_reduce_seconds(
    algorithm: str, nbytes: int, world_size: int, alpha: float, beta: float
) -> float:
    """Seconds one all-reduce of N bytes takes under the alpha-beta model of lecture 2 (Thakur,
    Rabenseifner and Gropp, 2005): a message of b bytes costs alpha + b * beta (beta in seconds
    per byte: 1 / bandwidth), each rank has its own full-duplex link, and a rank handles one
    message per direction at a time.

    naive 2(P-1)(a + Nb) (the root's link carries everything); tree 2 * sum over levels of
    (children of the busiest parent)(a + Nb); butterfly log2(P)(a + Nb); ring 2(P-1)(a + Nb/P);
    halving-doubling (Rabenseifner) 2 log2(P) a + 2(P-1)/P Nb.
    """
    if world_size == 1:
        return 0.0
    if algorithm == "naive":
        return 2 * (world_size - 1) * (alpha + nbytes * beta)
    if algorithm == "tree":
        messages, level_start = 0, 1  # nodes of level l are numbered 2**l - 1 .. 2**(l+1) - 2
        while level_start < world_size:  # level_start: first node of the next level down
            below = min(level_start + 1, world_size - level_start)  # nodes on the level below
            messages += min(2, below)  # the level's first parent has the most children
            level_start = 2 * level_start + 1
        return 2 * messages * (alpha + nbytes * beta)
    if algorithm == "butterfly":
        return math.log2(world_size) * (alpha + nbytes * beta)
    if algorithm == "ring":
        return collective_steps("all_reduce", world_size) * (alpha + nbytes / world_size * beta)
    if algorithm == "halving_doubling":  # rounds of N/2, N/4, ..., N/P bytes, each way
        return 2 * math.log2(world_size) * alpha + all_reduce_bytes(nbytes * beta, world_size)
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r}")


def two_level_all_reduce_seconds(
    nbytes: int,
    world_size: int,
    node_size: int,
    alpha: float,
    beta: float,
    node_alpha: float,
    node_beta: float,
) -> float:
    """Seconds the alpha-beta model predicts for `collectives.two_level_all_reduce` of N
    bytes: inside each node, the leader takes in and then sends out the other k - 1 ranks'
    N bytes, 2(k-1)(a_node + N b_node) as the naive algorithm's root does; across nodes, a
    ring of the P/k leaders, `all_reduce_seconds("ring", N, P/k, a, b)`."""
    if world_size % node_size:
        raise ValueError(f"node_size {node_size} does not divide world_size {world_size}")
    inside = 2 * (node_size - 1) * (node_alpha + nbytes * node_beta)
    return inside + all_reduce_seconds("ring", nbytes, world_size // node_size, alpha, beta)


# How `CommCounter` counts each built-in collective (it cannot see inside the backend), for a
# group of P ranks, N = bytes of the tensor argument. `busiest_bytes` is the same in numbers.
COLLECTIVE_MODEL = {
    "all_reduce": "ring: sends and receives 2(P-1)/P * N",
    "all_gather": "ring: sends and receives (P-1) * N (N = this rank's tensor)",
    "all_gather_single": "ring: sends and receives (P-1) * N (N = this rank's input)",
    "all_gather_into_tensor": "ring: sends and receives (P-1) * N (N = this rank's input)",
    "reduce_scatter": "ring: sends and receives (P-1) * N (N = this rank's output)",
    "reduce_scatter_single": "ring: sends and receives (P-1) * N (N = this rank's output)",
    "reduce_scatter_tensor": "ring: sends and receives (P-1) * N (N = this rank's output)",
    "broadcast": "flat tree: the source sends (P-1) * N, every other rank receives N",
    "reduce": "flat tree: every other rank sends N, the destination receives (P-1) * N",
    "gather": "flat tree: every other rank sends N, the destination receives (P-1) * N",
    "scatter": "flat tree: the source sends (P-1) * N, every other rank receives N",
    "all_to_all_single": "direct: sends and receives all but its own chunk",
    "all_to_all": "direct: sends and receives all but its own chunk",
    "barrier": "no payload: 0 bytes",
}


def busiest_bytes(op: str, nbytes: int, world_size: int) -> int:
    """Bytes the busiest rank of collective `op` sends or receives, N = `nbytes` as
    `COLLECTIVE_MODEL` reads it (a flat tree's busiest rank is its root)."""
    if op == "all_reduce":
        return all_reduce_bytes(nbytes, world_size)
    if op == "barrier":
        return 0
    if op in ("all_to_all", "all_to_all_single"):
        return all_to_all_bytes(nbytes, world_size)
    return all_gather_bytes(nbytes, world_size)
