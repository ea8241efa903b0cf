"""Decentralized training: gossip averaging, group all-reduce, push-sum in one process and
push-sum in a thread that never waits (lecture 4).

    ring, expo = Ring(4), ExponentialGraph(4)         # who talks to whom at each step
    x = gossip_round(x, ring, step)                   # D-PSGD: average with neighbours
    errors = simulate_consensus(expo, x0, rounds=10)  # the same mixing in one process
    history = simulate_push_sum(RandomPeer(4), x0, rounds=10)  # SGP's (x, w), one process
    pusher = AsyncPushSum(expo, x)                    # push-sum in a thread that never waits

Every rank keeps its own copy of the model. Instead of one all-reduce per step, a rank mixes
its parameters with a few peers: after t rounds all copies approach their average, at a rate
set by the topology. Mixing matrices are written "push" style, as in SGP: rank j keeps the
share 1 / (1 + d_j) of what it has and sends the same share to each of its d_j out-neighbours.
`gossip_round` runs regular rounds only (every rank sends and receives the same number of
copies), where that is plain averaging; on irregular graphs push-sum's weights are needed, and
its synchronous round over messages is what Assignment 4 asks students to write: the library
follows it in one process (`simulate_push_sum`) and runs only the asynchronous variant.
The lecture's experiments (the training loops compared, asynchronous SGD with stale
gradients) are in course_lib/measure/gossip.py.
"""

from __future__ import annotations

import itertools
import math
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from course_lib.runtime import rank, world_size

GOSSIP_TAG = 404  # messages of the asynchronous gossip, kept apart from anything else

# --- 1. topologies ---------------------------------------------------------------------------


class Topology:
    """Who sends to whom at each step. Subclasses define `out_neighbors`; the rest follows."""

    name = "topology"

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"a topology needs at least one rank, got world_size={world_size}")
        self.world_size = world_size

    def out_neighbors(self, node: int, step: int = 0) -> list[int]:
        """The ranks `node` sends to at `step` (never itself), sorted."""
        raise NotImplementedError

    def in_neighbors(self, node: int, step: int = 0) -> list[int]:
        """The ranks `node` receives from at `step`: those that have it as an out-neighbour."""
        self._check(node)
        return [j for j in range(self.world_size) if node in self.out_neighbors(j, step)]

    def period(self) -> int:
        """After this many steps the pattern repeats (1 for a fixed graph)."""
        return 1

    def all_out_neighbors(self, node: int) -> list[int]:
        """Every rank `node` ever sends to, over one period."""
        return sorted({j for s in range(self.period()) for j in self.out_neighbors(node, s)})

    def all_in_neighbors(self, node: int) -> list[int]:
        """Every rank `node` ever receives from, over one period."""
        return sorted({j for s in range(self.period()) for j in self.in_neighbors(node, s)})

    def out_neighbor_lists(self, step: int = 0) -> list[list[int]]:
        """Every rank's out-neighbours at `step`, in rank order: the graph of one round."""
        return [self.out_neighbors(j, step) for j in range(self.world_size)]

    def mixing_matrix(self, step: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """W with W[i, j] = the share of rank j's values that rank i holds after one round
        (`push_mixing_matrix` of this step's graph)."""
        return push_mixing_matrix(self.out_neighbor_lists(step), dtype)

    def _check(self, node: int) -> None:
        if not 0 <= node < self.world_size:
            raise ValueError(f"rank {node} is not in 0..{self.world_size - 1} ({self.name})")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.world_size})"


def push_mixing_matrix(
    out_neighbors: Sequence[Sequence[int]], dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """The mixing matrix of one push-style round in which rank j sends to `out_neighbors[j]`.

    Rank j keeps 1 / (1 + d_j) and sends as much to each of its d_j out-neighbours:
    W[i, j] = 1 / (1 + d_j) when i = j or i is an out-neighbour of j, else 0. Every column sums
    to 1 (column-stochastic: the total is conserved). Rows sum to 1 too (doubly stochastic:
    plain averaging converges to the mean) only when every rank receives as much as it keeps,
    as on the ring and the exponential graph."""
    p = len(out_neighbors)
    w = torch.zeros(p, p, dtype=dtype)
    for j, sends_to in enumerate(out_neighbors):
        targets = [j, *sends_to]
        w[targets, j] = 1.0 / len(targets)
    return w


class Ring(Topology):
    """Undirected ring: every rank exchanges with its left and right neighbours each step."""

    name = "ring"

    def out_neighbors(self, node: int, step: int = 0) -> list[int]:
        self._check(node)
        return sorted({(node - 1) % self.world_size, (node + 1) % self.world_size} - {node})


class ExponentialGraph(Topology):
    """SGP's directed exponential graph: rank i sends to i + 2^k (mod P), one peer per step,
    cycling k = 0, 1, ..., floor(log2(P - 1)). For P a power of two, log2(P) rounds of it
    average exactly: each round doubles the window of starting values averaged into every
    copy (after round k, copy i is the mean of x_{i-2^(k+1)+1}, ..., x_i)."""

    name = "exponential graph"

    def hops(self) -> list[int]:
        """The distances 1, 2, 4, ... below P that rank i sends over, in cycling order."""
        return [2**k for k in range(max(1, math.ceil(math.log2(self.world_size))))][
            : self.world_size - 1
        ]

    def period(self) -> int:
        return max(1, len(self.hops()))

    def out_neighbors(self, node: int, step: int = 0) -> list[int]:
        self._check(node)
        if self.world_size == 1:
            return []
        hop = self.hops()[step % self.period()]
        return [(node + hop) % self.world_size]


class RandomPeer(Topology):
    """Each step every rank pushes to one peer drawn at random (the same draw on every rank,
    from `seed` and the step). In-degrees differ from rank to rank, so plain averaging is
    biased here and push-sum's weights are what correct it."""

    name = "random peer"

    def __init__(self, world_size: int, seed: int = 0, period: int = 64) -> None:
        super().__init__(world_size)
        self.seed, self._period = seed, period

    def period(self) -> int:
        return self._period

    def out_neighbors(self, node: int, step: int = 0) -> list[int]:
        self._check(node)
        if self.world_size == 1:
            return []
        draw = random.Random(self.seed * 1_000_003 + step % self._period)
        peers = [draw.randrange(self.world_size - 1) for _ in range(self.world_size)]
        # Skip over oneself: peer k >= node means rank k + 1.
        return [peers[node] + (peers[node] >= node)]


class RandomGroups(Topology):
    """Gossip with group all-reduce: each step the ranks are split into groups of
    `group_size` at random (the same split on every rank) and each group averages. As a
    mixing matrix: a rank's out-neighbours are its groupmates, and it keeps 1 / group_size."""

    name = "random groups"

    def __init__(
        self, world_size: int, group_size: int = 2, seed: int = 0, period: int = 64
    ) -> None:
        super().__init__(world_size)
        if group_size < 1 or world_size % group_size:
            raise ValueError(
                f"group_size={group_size} must divide the world size {world_size} into equal groups"
            )
        self.group_size, self.seed, self._period = group_size, seed, period

    def period(self) -> int:
        return self._period

    def groups(self, step: int = 0) -> list[tuple[int, ...]]:
        """The split of all ranks into groups at `step`, each group sorted."""
        order = list(range(self.world_size))
        random.Random(self.seed * 1_000_003 + step % self._period).shuffle(order)
        g = self.group_size
        return sorted(tuple(sorted(order[i : i + g])) for i in range(0, self.world_size, g))

    def group_of(self, node: int, step: int = 0) -> tuple[int, ...]:
        self._check(node)
        return next(group for group in self.groups(step) if node in group)

    def out_neighbors(self, node: int, step: int = 0) -> list[int]:
        return [j for j in self.group_of(node, step) if j != node]


# --- 2. one round over point-to-point messages -------------------------------------------------


def _exchange(
    payload: torch.Tensor, out_neighbors: Sequence[int], in_neighbors: Sequence[int]
) -> list[torch.Tensor]:
    """Send `payload` to every out-neighbour and receive one tensor of the same shape from
    every in-neighbour. All sends and receives are posted before any wait: no rank can block
    another (a blocking send to a rank that is itself sending would deadlock)."""
    received = [torch.empty_like(payload) for _ in in_neighbors]
    works = [dist.isend(payload, dst=j) for j in out_neighbors]
    works += [dist.irecv(buf, src=j) for j, buf in zip(in_neighbors, received, strict=True)]
    for work in works:
        work.wait()
    return received


def regular_degree(topology: Topology, step: int = 0) -> int:
    """The d of a regular round, in which every rank sends to d ranks and receives from d;
    a ValueError for an irregular one (on which plain averaging is biased)."""
    ranks = range(topology.world_size)
    degrees = {len(topology.out_neighbors(j, step)) for j in ranks}
    degrees |= {len(topology.in_neighbors(j, step)) for j in ranks}
    if len(degrees) != 1:
        raise ValueError(
            f"{topology!r}, step {step}: ranks send and receive different numbers of copies "
            f"({sorted(degrees)}), so averaging them would be biased (the rows of W do not "
            "sum to 1); this takes push-sum's weights (lecture 4, section 4)"
        )
    return degrees.pop()


def gossip_round(x: torch.Tensor, topology: Topology, step: int = 0) -> torch.Tensor:
    """One round of gossip averaging (D-PSGD's mixing) on a regular round: every rank sends
    its x to its d out-neighbours and averages it with the d copies it receives.

    x_i <- (x_i + sum of the in-neighbours' x_j) / (1 + d). With every rank sending and
    receiving d copies (ring, exponential graph, random groups) that is x <- W x with the
    push-style W, doubly stochastic: the mean is kept and the copies converge to it. An
    irregular round (a random peer) is refused: there plain averaging is biased."""
    d = regular_degree(topology, step)
    me = rank()
    out_nbrs, in_nbrs = topology.out_neighbors(me, step), topology.in_neighbors(me, step)
    received = _exchange(x.contiguous(), out_nbrs, in_nbrs)
    return (x + sum(received, torch.zeros_like(x))) / (1 + d)


class GroupAllReduce:
    """Averaging within groups re-drawn every step (gossip + group all-reduce).

    `dist.new_group` is slow (it connects the group's ranks) and collective (every rank calls
    it, in the same order), so every possible group is created once here; each step only
    picks among them, with the seeded draw of `RandomGroups` that all ranks share."""

    MAX_GROUPS = 70  # C(8, 4): beyond that, creating every group costs more than it saves

    def __init__(self, topology: RandomGroups) -> None:
        if topology.world_size != world_size():
            raise ValueError(f"{topology!r} is for {topology.world_size} ranks, not {world_size()}")
        self.topology = topology
        subsets = list(itertools.combinations(range(topology.world_size), topology.group_size))
        if len(subsets) > self.MAX_GROUPS:
            raise ValueError(
                f"{len(subsets)} possible groups of {topology.group_size} among "
                f"{topology.world_size} ranks is too many to create; use smaller groups"
            )
        self.handles = {members: dist.new_group(list(members)) for members in subsets}

    def average(self, x: torch.Tensor, step: int) -> torch.Tensor:
        """x averaged over this rank's group at `step` (in place; also returned)."""
        members = self.topology.group_of(rank(), step)
        if len(members) > 1:
            dist.all_reduce(x, group=self.handles[members])
        return x.div_(len(members))


# --- 3. consensus --------------------------------------------------------------------------


def rms_from_mean(z: torch.Tensor) -> float:
    """The consensus error: root-mean-square distance of the ranks' estimates (one row of z
    per rank) from their average."""
    return math.sqrt(((z - z.mean(dim=0)) ** 2).sum().item() / z.shape[0])


def simulate_push_sum(
    topology: Topology, x0: torch.Tensor, rounds: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Push-sum in one process: the (x, w) of every rank (one row each, float64) before the
    first round and after each of `rounds` rounds, x <- W x and w <- W w with the mixing
    matrices of the topology's rounds. The ranks' z = x / w tends to the average of x0."""
    x, w = x0.double().clone(), torch.ones(x0.shape[0], 1, dtype=torch.float64)
    history = [(x, w)]
    for step in range(rounds):
        mixing = topology.mixing_matrix(step)
        x, w = mixing @ x, mixing @ w
        history.append((x, w))
    return history


def simulate_consensus(
    topology: Topology, x0: torch.Tensor, rounds: int, push_sum: bool = True
) -> list[float]:
    """Consensus error after 0..rounds rounds of mixing x0 (one row per rank) in one process,
    with the same mixing matrices the ranks use. Without push-sum the rows of x are the
    estimates; with it, z = x / w."""
    history = simulate_push_sum(topology, x0, rounds)
    return [rms_from_mean(x / w if push_sum else x) for x, w in history]


def contraction_rate(topology: Topology, rounds: int | None = None) -> float:
    """Per-round factor by which the distance from the average shrinks at least, for a
    doubly-stochastic mixing: ||W_T ... W_1 - J||_2^(1/T), the spectral norm over one period
    of T rounds, J = 11^T/P. For a fixed graph (T = 1) it is ||W - J||_2, which equals W's
    second-largest eigenvalue modulus only when W is normal (W W^T = W^T W: symmetric, as on
    the ring, or a circulant such as one exponential-graph step); for a non-normal W the
    norm can be larger than that modulus."""
    rounds = rounds or topology.period()
    p = topology.world_size
    product = torch.eye(p, dtype=torch.float64)
    for step in range(rounds):
        product = topology.mixing_matrix(step) @ product
    norm = torch.linalg.matrix_norm(product - torch.full((p, p), 1.0 / p), ord=2).item()
    return norm ** (1.0 / rounds)


# --- 4. push-sum that never waits ------------------------------------------------------------


class AsyncPushSum:
    """Push-sum whose communication never waits for computation, nor computation for it.

    A gossip thread mixes (x, w) every `interval` seconds, whatever the training loop is
    doing: it adds the messages that have arrived, keeps its share and pushes the rest to
    the round's out-neighbours. A receiver thread per in-neighbour blocks in `dist.recv` and
    drops messages in a mailbox. The training loop reads z = x / w and subtracts its gradient
    steps from x whenever it has one. A slow rank (a straggler in its computation) thus still
    mixes at the common pace, and the others never wait for it: it only contributes fewer
    gradient steps. The weight w travels with x, so late messages do not bias z.
    `finish` stops the gossip and adds what was still in flight; after it the totals of x and
    w over all ranks are exactly the starting totals plus the gradient steps.
    """

    def __init__(self, topology: Topology, x: torch.Tensor, interval: float = 0.002) -> None:
        self.topology, self.me, self.interval = topology, rank(), interval
        self.x, self.w = x.clone(), torch.ones((), dtype=x.dtype)
        self.rounds = 0  # gossip rounds done by this rank
        self.lock = threading.Lock()
        self.mailbox: queue.Queue = queue.Queue()
        self.errors: list[BaseException] = []
        self.done = threading.Event()
        self.threads = [
            threading.Thread(target=self._guard, args=(self._receive, j), daemon=True)
            for j in topology.all_in_neighbors(self.me)
        ]
        self.gossiper = threading.Thread(target=self._guard, args=(self._gossip,), daemon=True)
        for thread in [*self.threads, self.gossiper]:
            thread.start()

    # The training loop's side.

    def z(self) -> torch.Tensor:
        """This rank's current estimate z = x / w (a copy), with every message arrived so far."""
        with self.lock:
            self._check()
            self._add_arrived()
            return self.x / self.w

    def step(self, update: torch.Tensor) -> None:
        """Move z by -update: x <- x - w * update.

        Algorithm 1 (line 4) subtracts lr * gradient from x, which moves z = x / w by that
        divided by w. Synchronously on a regular graph w = 1 and nothing changes; here w
        drifts with the timing of messages, and scaling by w keeps every step on z the same
        size instead of letting a rank with a small w take huge steps."""
        with self.lock:
            self.x -= self.w * update

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Once every rank is done (a rank that stopped alone would soak up the others' mass
        and never give it back), stop gossiping, wait for every in-neighbour to stop, and
        add what is left: (x, w)."""
        dist.barrier()
        self.done.set()
        self.gossiper.join()
        for thread in self.threads:
            thread.join()
        with self.lock:
            self._check()
            self._add_arrived()
            return self.x.clone(), self.w.clone()

    # The threads' side.

    def _guard(self, target: Callable, *args) -> None:
        try:
            target(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the training thread
            self.errors.append(exc)

    def _check(self) -> None:
        if self.errors:
            raise RuntimeError(f"rank {self.me}: asynchronous gossip failed") from self.errors[0]

    def _receive(self, source: int) -> None:
        while True:
            buf = torch.empty(self.x.numel() + 2, dtype=self.x.dtype)  # x, w, stop flag
            dist.recv(buf, src=source, tag=GOSSIP_TAG)
            if buf[-1] != 0:
                return
            self.mailbox.put(buf[:-1])

    def _add_arrived(self) -> None:
        while not self.mailbox.empty():
            message = self.mailbox.get_nowait()
            self.x += message[:-1]
            self.w += message[-1]

    def _send(self, payload: torch.Tensor, targets: Sequence[int]) -> None:
        for work in [dist.isend(payload, dst=j, tag=GOSSIP_TAG) for j in targets]:
            work.wait()

    def _gossip(self) -> None:
        while not self.done.is_set():
            out_nbrs = self.topology.out_neighbors(self.me, self.rounds)
            with self.lock:
                self._add_arrived()
                share = 1.0 / (1 + len(out_nbrs))
                self.x *= share
                self.w *= share
                payload = torch.cat([self.x, self.w.reshape(1), torch.zeros(1, dtype=self.x.dtype)])
            self._send(payload, out_nbrs)
            self.rounds += 1
            time.sleep(self.interval)
        stop = torch.zeros(self.x.numel() + 2, dtype=self.x.dtype)
        stop[-1] = 1
        self._send(stop, self.topology.all_out_neighbors(self.me))
