"""All-reduce five ways, built from torch.distributed point-to-point sends and receives.

    from course_lib.collectives import ring_all_reduce
    ring_all_reduce(t)      # inside a launched function: t becomes the sum over all ranks

Every algorithm sums `tensor` over all ranks in place, like `dist.all_reduce(tensor)`:

- `naive_all_reduce`: everyone sends to a root; the root sums and sends the sum back.
- `tree_all_reduce`: sums flow up a binary tree to rank 0, the result flows back down.
- `butterfly_all_reduce`: recursive doubling; in round k each rank swaps its whole vector with
  the rank whose number differs in bit k (needs a power-of-two number of ranks).
- `ring_all_reduce`: reduce-scatter then all-gather around a ring, talking to neighbours only,
  driven by `ring_schedule` -- the same schedule `course_lib.measure.collectives.RingWidget` draws.
- `halving_doubling_all_reduce`: Rabenseifner's; recursive halving (a reduce-scatter) then
  recursive doubling (an all-gather): the butterfly's log P rounds each way with the ring's
  bytes (a power-of-two number of ranks).

`bytes_sent` and `messages_sent` give what each rank sends, as formulas in N and P, to hold
against `course_lib.CommCounter`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from course_lib.costs import all_reduce_seconds
from course_lib.runtime import rank as _rank
from course_lib.runtime import world_size as _world_size

REDUCE_SCATTER = "reduce-scatter"
ALL_GATHER = "all-gather"

# --- talking to one peer ------------------------------------------------------------------
# Every algorithm below talks through these two helpers. They look `dist.send` (etc.) up at
# call time, so CommCounter and record_peers, which wrap those names, see every message.


def _exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> None:
    """Send `send` to `dst` while receiving `recv` from `src` (no deadlock: both are posted
    before either is waited on). Empty tensors are skipped: both sides know the sizes."""
    works = []
    if send.numel():
        works.append(dist.isend(send, dst))
    if recv.numel():
        works.append(dist.irecv(recv, src))
    for work in works:
        work.wait()


def _flat(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """A 1-D view of `tensor` that shares its storage, so the algorithms work in place."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} needs a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} works in place on a contiguous tensor; pass t.contiguous()")
    return tensor.view(-1)


# --- naive: everyone talks to the root ----------------------------------------------------


def naive_all_reduce(tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
    """Sum `tensor` over all ranks in place: all send to `root`, which sums and sends back.

    The root receives and sends (P-1)*N bytes: its link is the bottleneck as P grows.
    """
    p, me = _world_size(), _rank()
    flat = _flat(tensor, "naive_all_reduce")
    if not 0 <= root < p:
        raise ValueError(f"root must be a rank in 0..{p - 1}, got {root}")
    if p == 1 or flat.numel() == 0:
        return tensor
    if me == root:
        incoming = torch.empty_like(flat)
        for other in range(p):  # in rank order, so the sum is the same on every run
            if other != root:
                dist.recv(incoming, src=other)
                flat.add_(incoming)
        for other in range(p):
            if other != root:
                dist.send(flat, dst=other)
    else:
        dist.send(flat, dst=root)
        dist.recv(flat, src=root)
    return tensor


# --- binary tree: reduce up, broadcast down -----------------------------------------------


def tree_children(rank: int, world_size: int) -> list[int]:
    """Children of `rank` in the binary tree rooted at 0 (heap numbering: 2r+1 and 2r+2)."""
    return [c for c in (2 * rank + 1, 2 * rank + 2) if c < world_size]


def tree_parent(rank: int) -> int | None:
    """Parent of `rank` in the binary tree rooted at 0 (None for the root)."""
    return None if rank == 0 else (rank - 1) // 2


def tree_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks in place: partial sums go up a binary tree to rank 0,
    the total comes back down. 2*floor(log2 P) levels; no rank sends more than 3N."""
    p, me = _world_size(), _rank()
    flat = _flat(tensor, "tree_all_reduce")
    if p == 1 or flat.numel() == 0:
        return tensor
    children, parent = tree_children(me, p), tree_parent(me)
    # Reduce: wait for each child's subtree sum, add it, pass our subtree's sum up.
    incoming = torch.empty_like(flat)
    for child in children:
        dist.recv(incoming, src=child)
        flat.add_(incoming)
    if parent is not None:
        dist.send(flat, dst=parent)
        dist.recv(flat, src=parent)  # ...and the total comes back from the parent
    # Broadcast: hand the total down to our children.
    for child in children:
        dist.send(flat, dst=child)
    return tensor


# --- butterfly: recursive doubling --------------------------------------------------------


def _log2_world(world_size: int, name: str) -> int:
    if world_size < 1 or world_size & (world_size - 1):
        raise ValueError(
            f"{name} needs a power-of-two number of ranks (1, 2, 4, 8, ...), got {world_size}; "
            "use ring_all_reduce or tree_all_reduce for other world sizes"
        )
    return world_size.bit_length() - 1


def butterfly_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks in place by recursive doubling: in round k, swap the whole
    vector with rank `me XOR 2**k` and add. log2 P rounds of N bytes each; P a power of two."""
    p, me = _world_size(), _rank()
    rounds = _log2_world(p, "butterfly_all_reduce")  # every rank raises: nobody is left waiting
    flat = _flat(tensor, "butterfly_all_reduce")
    if flat.numel() == 0:
        return tensor
    incoming = torch.empty_like(flat)
    for k in range(rounds):
        partner = me ^ (1 << k)
        _exchange(flat, partner, incoming, partner)
        # a + b == b + a exactly in floating point, so both partners hold identical sums.
        flat.add_(incoming)
    return tensor


# --- ring: reduce-scatter then all-gather, neighbours only --------------------------------


@dataclass(frozen=True)
class RingStep:
    """One step of the ring: every rank r sends chunk `send[r]` to rank r+1 and receives
    chunk `recv[r]` from rank r-1, then adds it (reduce-scatter) or keeps it (all-gather)."""

    phase: str  # REDUCE_SCATTER or ALL_GATHER
    step: int  # 0 .. P-2 within the phase
    send: tuple[int, ...]  # send[r]: the chunk rank r sends to (r + 1) % P
    recv: tuple[int, ...]  # recv[r]: the chunk rank r receives from (r - 1) % P


def ring_step(world_size: int, step: int) -> RingStep:
    """Step `step` (0 .. 2(P-1)-1) of the ring all-reduce on `world_size` ranks.

    Reduce-scatter step s: rank r sends chunk r-s-1 and receives chunk r-s-2 (mod P), so
    after P-1 steps rank r holds the full sum of chunk r. All-gather step s: rank r sends
    chunk r-s (its finished chunk first) and receives chunk r-s-1.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= step < 2 * (world_size - 1):
        raise ValueError(
            f"step must be in 0..{2 * (world_size - 1) - 1} for {world_size} ranks, got {step}"
        )
    ranks = range(world_size)
    if step < world_size - 1:
        s = step
        send = tuple((r - s - 1) % world_size for r in ranks)
        recv = tuple((r - s - 2) % world_size for r in ranks)
        return RingStep(REDUCE_SCATTER, s, send, recv)
    s = step - (world_size - 1)
    send = tuple((r - s) % world_size for r in ranks)
    recv = tuple((r - s - 1) % world_size for r in ranks)
    return RingStep(ALL_GATHER, s, send, recv)


def ring_schedule(world_size: int) -> list[RingStep]:
    """All 2(P-1) steps of the ring all-reduce: P-1 of reduce-scatter, then P-1 of all-gather."""
    return [ring_step(world_size, s) for s in range(2 * (world_size - 1))]


def ring_state(world_size: int, steps_done: int) -> list[list[frozenset[int]]]:
    """What the schedule says each rank holds after `steps_done` steps, symbolically:
    state[r][c] is the set of ranks whose chunk c is summed into rank r's copy of chunk c.
    A chunk is fully reduced on a rank when its set has all P ranks."""
    if not 0 <= steps_done <= 2 * (world_size - 1):
        raise ValueError(f"steps_done must be in 0..{2 * (world_size - 1)}, got {steps_done}")
    state = [[frozenset({r}) for _ in range(world_size)] for r in range(world_size)]
    for step in ring_schedule(world_size)[:steps_done]:
        before = [row[:] for row in state]  # every rank sends what it had before the step
        for r in range(world_size):
            left = (r - 1) % world_size
            chunk = step.recv[r]
            incoming = before[left][chunk]
            state[r][chunk] = (
                before[r][chunk] | incoming if step.phase == REDUCE_SCATTER else incoming
            )
    return state


def chunk_sizes(numel: int, world_size: int) -> list[int]:
    """Sizes of the P chunks the ring cuts N elements into (as `torch.tensor_split`: the
    first N mod P chunks have one element more; some are empty when N < P)."""
    return [numel // world_size + (1 if c < numel % world_size else 0) for c in range(world_size)]


def ring_all_reduce(tensor: torch.Tensor, steps: int | None = None) -> torch.Tensor:
    """Sum `tensor` over all ranks in place around a ring, following `ring_schedule`.

    Each rank only talks to its neighbours and sends 2(P-1)/P * N bytes, whatever P.
    `steps`: stop after this many steps (to look at the half-done state); None runs all.
    """
    flat = _flat(tensor, "ring_all_reduce")
    _ring(flat, list(range(_world_size())), steps)
    return tensor


def _ring(flat: torch.Tensor, members: list[int], steps: int | None = None) -> None:
    """The ring all-reduce of `flat` among the global ranks `members` (this rank among them),
    in the order listed: each talks to the members before and after it."""
    p, me = len(members), members.index(_rank())
    schedule = ring_schedule(p)
    if steps is not None:
        if not 0 <= steps <= len(schedule):
            raise ValueError(f"steps must be in 0..{len(schedule)} for {p} ranks, got {steps}")
        schedule = schedule[:steps]
    chunks = flat.tensor_split(p)  # views into `tensor`: updating a chunk updates the tensor
    right, left = members[(me + 1) % p], members[(me - 1) % p]
    for step in schedule:
        outgoing, target = chunks[step.send[me]], chunks[step.recv[me]]
        incoming = torch.empty_like(target)
        _exchange(outgoing, right, incoming, left)
        if step.phase == REDUCE_SCATTER:
            target.add_(incoming)  # one more rank's contribution to this chunk
        else:
            target.copy_(incoming)  # a finished chunk: keep it as it is


# --- two levels: inside each node, then across nodes -----------------------------------------


def two_level_all_reduce(tensor: torch.Tensor, node_size: int = 2) -> torch.Tensor:
    """Sum `tensor` over all ranks in place, for ranks in nodes of `node_size` consecutive
    ranks: each node's ranks send to its leader (its first rank), which sums them; the leaders
    all-reduce around a ring of their own; each leader sends the total back into its node.
    Only the leaders' ring crosses between nodes: 2(L-1)/L * N bytes per leader, L = P/node_size
    nodes, where a flat ring sends that much on every rank, over the slow links too."""
    p, me = _world_size(), _rank()
    if not (isinstance(node_size, int) and node_size >= 1 and p % node_size == 0):
        raise ValueError(
            f"two_level_all_reduce needs nodes of equal size: node_size must divide the "
            f"{p} ranks, got {node_size!r}"
        )
    flat = _flat(tensor, "two_level_all_reduce")
    if p == 1 or flat.numel() == 0:
        return tensor
    leader = me - me % node_size
    if me != leader:
        dist.send(flat, dst=leader)
        dist.recv(flat, src=leader)
        return tensor
    incoming = torch.empty_like(flat)
    for peer in range(leader + 1, leader + node_size):  # in rank order: the same sum every run
        dist.recv(incoming, src=peer)
        flat.add_(incoming)
    _ring(flat, list(range(0, p, node_size)))
    for peer in range(leader + 1, leader + node_size):
        dist.send(flat, dst=peer)
    return tensor


# --- halving-doubling: the butterfly's few messages with the ring's few bytes -------------


@dataclass(frozen=True)
class HalvingRound:
    """One round of halving-doubling for one rank: exchange with `partner`, sending chunks
    send[0]..send[1]-1 and receiving chunks recv[0]..recv[1]-1 (of the P chunks)."""

    phase: str  # REDUCE_SCATTER (add what arrives) or ALL_GATHER (keep it)
    partner: int
    send: tuple[int, int]
    recv: tuple[int, int]


def halving_doubling_rounds(world_size: int, rank: int) -> list[HalvingRound]:
    """Rabenseifner's all-reduce, as a schedule for `rank`. Reduce-scatter by recursive
    halving: with partners P/2, P/4, ..., 1 apart, give away half of the chunks still held and
    add the partner's copy of the half kept, until only chunk `rank` is left, fully summed.
    All-gather by recursive doubling: with partners 1, 2, ..., P/2 apart, swap everything held.
    2 log2 P messages, and 2(P-1)/P * N elements sent, like the ring."""
    _log2_world(world_size, "halving_doubling_all_reduce")
    rounds, lo, hi, d = [], 0, world_size, world_size // 2
    while d >= 1:  # reduce-scatter: [lo, hi) halves each round
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if rank & d else ((lo, mid), (mid, hi))
        rounds.append(HalvingRound(REDUCE_SCATTER, rank ^ d, give, keep))
        (lo, hi), d = keep, d // 2
    d = 1
    while d < world_size:  # all-gather: [lo, hi) doubles each round
        size = hi - lo
        theirs = (lo - size, lo) if rank & d else (hi, hi + size)
        rounds.append(HalvingRound(ALL_GATHER, rank ^ d, (lo, hi), theirs))
        lo, hi, d = min(lo, theirs[0]), max(hi, theirs[1]), 2 * d
    return rounds


def halving_round(world_size: int, rank: int, k: int) -> tuple[int, int, int]:
    """Round `k` (0 .. log2 P - 1) of halving-doubling's reduce-scatter on `rank`, as
    (partner, first, end): it swaps with `partner` and keeps chunks first .. end-1, adding the
    partner's copy of them (the k-th of `halving_doubling_rounds`)."""
    if not 0 <= k < _log2_world(world_size, "halving_round"):
        raise ValueError(f"k must be in 0..log2({world_size}) - 1, got {k}")
    step = halving_doubling_rounds(world_size, rank)[k]
    return (step.partner, *step.recv)


def halving_doubling_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks in place by recursive halving, then recursive doubling:
    log2 P rounds each way, 2(P-1)/P * N bytes per rank; P a power of two."""
    p, me = _world_size(), _rank()
    rounds = halving_doubling_rounds(p, me)  # every rank raises: nobody is left waiting
    flat = _flat(tensor, "halving_doubling_all_reduce")
    starts = [0, *itertools.accumulate(chunk_sizes(flat.numel(), p))]  # chunk c's elements:

    def span(chunks: tuple[int, int]) -> torch.Tensor:  # starts[c] .. starts[c + 1] - 1
        return flat[starts[chunks[0]] : starts[chunks[1]]]

    for step in rounds:
        target = span(step.recv)
        incoming = torch.empty_like(target)
        _exchange(span(step.send), step.partner, incoming, step.partner)
        if step.phase == REDUCE_SCATTER:
            target.add_(incoming)  # the partner's copy of the half this rank keeps
        else:
            target.copy_(incoming)  # the partner's finished chunks
    return tensor


ALGORITHMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "naive": naive_all_reduce,
    "tree": tree_all_reduce,
    "butterfly": butterfly_all_reduce,
    "ring": ring_all_reduce,
    "halving_doubling": halving_doubling_all_reduce,
}

# --- what each rank sends: the formulas ---------------------------------------------------


def _check(algorithm: str, numel: int, world_size: int, rank: int) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {sorted(ALGORITHMS)}, got {algorithm!r}")
    if numel < 0 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            "need numel >= 0, world_size >= 1 and 0 <= rank < world_size; "
            f"got {numel}, {world_size}, {rank}"
        )
    if algorithm in ("butterfly", "halving_doubling"):
        _log2_world(world_size, f"{algorithm}_all_reduce")


def elements_sent(algorithm: str, numel: int, world_size: int, rank: int, root: int = 0) -> int:
    """Elements `rank` sends in one all-reduce of `numel` elements over `world_size` ranks."""
    _check(algorithm, numel, world_size, rank)
    n, p = numel, world_size
    if p == 1 or n == 0:
        return 0
    if algorithm == "naive":
        return (p - 1) * n if rank == root else n
    if algorithm == "tree":
        to_parent = 0 if tree_parent(rank) is None else n
        return to_parent + n * len(tree_children(rank, p))
    if algorithm == "butterfly":
        return n * int(math.log2(p))
    if algorithm == "halving_doubling":
        sizes = chunk_sizes(n, p)
        return sum(sum(sizes[slice(*r.send)]) for r in halving_doubling_rounds(p, rank))
    # ring: the reduce-scatter sends every chunk but its own (chunk r), the all-gather every
    # chunk but the one it receives last (chunk r+1). With P | N: 2N - 2N/P = 2(P-1)/P * N.
    sizes = chunk_sizes(n, p)
    return 2 * n - sizes[rank] - sizes[(rank + 1) % p]


def bytes_sent(
    algorithm: str, numel: int, world_size: int, rank: int, element_size: int = 4, root: int = 0
) -> int:
    """Bytes `rank` sends in one all-reduce of `numel` elements of `element_size` bytes."""
    return element_size * elements_sent(algorithm, numel, world_size, rank, root)


def messages_sent(algorithm: str, numel: int, world_size: int, rank: int, root: int = 0) -> int:
    """Messages (sends) `rank` makes in one all-reduce: each costs a latency alpha."""
    _check(algorithm, numel, world_size, rank)
    n, p = numel, world_size
    if p == 1 or n == 0:
        return 0
    if algorithm == "naive":
        return p - 1 if rank == root else 1
    if algorithm == "tree":
        return (tree_parent(rank) is not None) + len(tree_children(rank, p))
    if algorithm == "butterfly":
        return int(math.log2(p))
    if algorithm == "halving_doubling":  # empty spans (N < P) are not sent
        sizes = chunk_sizes(n, p)
        return sum(sum(sizes[slice(*r.send)]) > 0 for r in halving_doubling_rounds(p, rank))
    # ring: one message per step, except that empty chunks (N < P) are not sent
    return sum(chunk_sizes(n, p)[step.send[rank]] > 0 for step in ring_schedule(p))


def model_seconds(
    algorithm: str, numel: int, world_size: int, alpha: float, beta: float, element_size: int = 4
) -> float:
    """Time the alpha-beta model predicts for one all-reduce of `numel` elements of
    `element_size` bytes: `course_lib.costs.all_reduce_seconds` (alpha in seconds, beta in
    seconds per byte)."""
    _check(algorithm, numel, world_size, 0)
    return all_reduce_seconds(algorithm, numel * element_size, world_size, alpha, beta)
