"""What lecture 4 runs and measures: the training loops compared, and asynchronous SGD with
stale gradients simulated in one process.

    log = train_decentralized("sgp", model, batches, F.mse_loss, lr=0.1, topology=expo)
    losses = stale_sgd(model, batches, F.mse_loss, lr=0.1, staleness=4)
    async_log = parameter_server(model, batches, F.mse_loss, 0.05, worker_times, eval_data)
    plot_mixing_matrices({"ring": Ring(8).mixing_matrix()})
    plot_contraction(SIZES, contraction_by_size({"ring": Ring}, SIZES))

The checks of the lecture's exercises (`check_ring_of_5`, `check_rounds_for_1000x`,
`check_first_to_agree`, `check_random_peer_plain_agrees`, `check_non_iid_gossip`) compute
their expected values and say why here, off the page. The gossip itself (topologies, rounds,
push-sum in one process, AsyncPushSum) is course_lib/gossip.py.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from matplotlib.figure import Figure
from torch import nn

from course_lib.comm import CommCounter, written_bytes
from course_lib.data import shard
from course_lib.data_parallel import allreduce_gradients, flat_gradients, flat_parameters
from course_lib.exercises import check_choice, check_matrix, check_number
from course_lib.gossip import (
    AsyncPushSum,
    ExponentialGraph,
    GroupAllReduce,
    RandomGroups,
    Ring,
    Topology,
    contraction_rate,
    gossip_round,
)
from course_lib.plots import NotebookFigure
from course_lib.progress import progress
from course_lib.runtime import rank, world_size

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# --- asynchronous SGD with stale gradients (simulated in one process) ---------------------


def _vector_to_model(vector: torch.Tensor, model: nn.Module) -> None:
    with torch.no_grad():
        nn.utils.vector_to_parameters(vector, model.parameters())


def _gradient_at(
    model: nn.Module, params: torch.Tensor, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """(gradient, loss) of `loss_fn` at the parameter vector `params`."""
    _vector_to_model(params, model)
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    return flat_gradients(model).clone(), loss.item()


def stale_sgd(
    model: nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: LossFn,
    lr: float,
    staleness: int,
) -> list[float]:
    """SGD where the gradient applied at step t was computed on the parameters of step
    t - staleness (what a parameter server sees when workers lag behind): returns the loss
    of the current parameters on each step's batch. staleness=0 is plain SGD."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    params = flat_parameters(model).clone()
    history = [params.clone()]  # history[-1 - s]: the parameters s steps ago
    losses = []
    for x, y in batches:
        old = history[max(0, len(history) - 1 - staleness)]
        grad, _ = _gradient_at(model, old, loss_fn, x, y)
        with torch.no_grad():
            losses.append(loss_fn(_model_at(model, params)(x), y).item())
        params = params - lr * grad
        history = [*history[-staleness:], params.clone()] if staleness else [params.clone()]
    _vector_to_model(params, model)
    return losses


def _model_at(model: nn.Module, params: torch.Tensor) -> nn.Module:
    _vector_to_model(params, model)
    return model


@dataclass
class ServerLog:
    """What `parameter_server` saw, one entry per applied gradient."""

    time: list[float] = field(default_factory=list)  # simulated seconds when it was applied
    worker: list[int] = field(default_factory=list)  # which worker sent it
    staleness: list[int] = field(default_factory=list)  # updates since that worker read
    losses: list[float] = field(default_factory=list)  # loss of the server's parameters


def parameter_server(
    model: nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: LossFn,
    lr: float,
    worker_times: Sequence[float],
    eval_data: tuple[torch.Tensor, torch.Tensor],
) -> ServerLog:
    """Asynchronous SGD with a parameter server, simulated event by event in one process.

    Worker k reads the server's parameters, spends worker_times[k] simulated seconds on a
    gradient (of the next batch), and sends it; the server applies each gradient as it
    arrives, without waiting for the others. A gradient is as stale as the number of updates
    that landed while it was being computed."""
    params = flat_parameters(model).clone()
    version = 0
    batch_iter = iter(batches)
    # (finish time, worker, parameters it read, version it read, its batch)
    events: list = []
    for k, seconds in enumerate(worker_times):
        events.append((seconds, k, params.clone(), version, next(batch_iter)))
    heapq.heapify(events)
    log = ServerLog()
    x_eval, y_eval = eval_data
    while events:
        now, k, read, read_version, (x, y) = heapq.heappop(events)
        grad, _ = _gradient_at(model, read, loss_fn, x, y)
        params = params - lr * grad
        log.staleness.append(version - read_version)
        version += 1
        with torch.no_grad():
            log.losses.append(loss_fn(_model_at(model, params)(x_eval), y_eval).item())
        log.time.append(now)
        log.worker.append(k)
        batch = next(batch_iter, None)
        if batch is not None:
            heapq.heappush(events, (now + worker_times[k], k, params.clone(), version, batch))
    _vector_to_model(params, model)
    return log


def synchronous_server(
    model: nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: LossFn,
    lr: float,
    worker_times: Sequence[float],
    eval_data: tuple[torch.Tensor, torch.Tensor],
) -> ServerLog:
    """The synchronous counterpart of `parameter_server`: each step waits for one gradient
    from every worker (max(worker_times) simulated seconds) and applies their average."""
    params = flat_parameters(model).clone()
    log, n = ServerLog(), len(worker_times)
    x_eval, y_eval = eval_data
    for step in range(len(batches) // n):
        grads = [_gradient_at(model, params, loss_fn, x, y)[0] for x, y in batches[step * n :][:n]]
        params = params - lr * torch.stack(grads).mean(dim=0)
        with torch.no_grad():
            log.losses.append(loss_fn(_model_at(model, params)(x_eval), y_eval).item())
        log.time.append((step + 1) * max(worker_times))
        log.worker.append(-1)  # all of them
        log.staleness.append(0)
    _vector_to_model(params, model)
    return log


# --- training loops compared --------------------------------------------------------------


METHODS = ("allreduce", "gossip", "sgp", "group", "async_sgp")


@dataclass
class GossipLog:
    """What one rank measured in `train_decentralized`, one entry per step."""

    method: str
    losses: list[float] = field(default_factory=list)  # loss on this rank's shard, at z
    step_s: list[float] = field(default_factory=list)  # wall time of the step
    bytes_sent: list[int] = field(default_factory=list)  # counted by CommCounter
    bytes_written: list[int] = field(default_factory=list)  # to the sockets, per the OS
    weights: list[float] = field(default_factory=list)  # push-sum weight w after the step
    parameters: torch.Tensor | None = None  # this rank's final z (a flat vector)
    gossip_rounds: int = 0  # rounds of the asynchronous gossip thread


def train_decentralized(
    method: str,
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: LossFn,
    lr: float,
    *,
    topology: Topology | None = None,
    straggler=None,
    max_seconds: float | None = None,
) -> GossipLog:
    """Train with plain SGD steps and one of five ways of keeping the copies together.

    - "allreduce": all-reduce the gradients (synchronous data parallel);
    - "gossip": D-PSGD, step then one `gossip_round` on `topology` (default: ring);
    - "sgp": SGP, Algorithm 1, on its one-peer exponential graph (the default): every rank
      receives exactly one share per round, so every weight stays w = (1 + 1) / 2 = 1 and
      z = x; a round is then `gossip_round` on the directed graph, and no weight is sent
      (push-sum's weights matter on irregular graphs and in "async_sgp");
    - "group": step, then average within random groups (`topology`: RandomGroups, default 2);
    - "async_sgp": push-sum in a thread of its own that never waits (`AsyncPushSum`).
    Each rank trains on its shard of every batch. `straggler.step()` (a `network.Straggler`)
    runs after backward, before communication: a rank's compute is slowed, not its network.
    With `max_seconds`, "async_sgp" ranks stop stepping after that much wall time (or at the
    end of `batches`), each on its own: a slow rank then simply makes fewer steps.
    """
    p, me = world_size(), rank()
    topology = _checked_topology(method, topology, max_seconds)
    groups = GroupAllReduce(topology) if method == "group" else None
    log = GossipLog(method)
    x = flat_parameters(model).clone()  # numerators (the parameters, for non-push methods)
    w = torch.ones((), dtype=x.dtype)  # push-sum weight (stays 1 for the others)
    dist.barrier()  # start the clocks together
    pusher = AsyncPushSum(topology, x) if method == "async_sgp" else None
    began = time.perf_counter()
    with CommCounter() as counter:
        for step, (xb, yb) in enumerate(progress(batches, f"{method} steps")):
            if max_seconds is not None and time.perf_counter() - began > max_seconds:
                break
            start, sent_before = time.perf_counter(), counter.bytes_sent
            written_before = written_bytes()
            z = pusher.z() if pusher else x / w
            _vector_to_model(z, model)  # gradients are computed at z = x / w
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model(shard(xb, me, p)), shard(yb, me, p))
            loss.backward()
            if straggler is not None:
                straggler.step()
            if method == "allreduce":
                allreduce_gradients(model)
            update = lr * flat_gradients(model)
            if pusher:
                pusher.step(update)  # the gossip thread mixes on its own
            else:
                x = x - update  # Algorithm 1, line 4
            x, w = _mix(method, x, w, topology, groups, step)
            log.losses.append(loss.item())
            log.step_s.append(time.perf_counter() - start)
            log.bytes_sent.append(counter.bytes_sent - sent_before)
            log.bytes_written.append(written_bytes() - written_before)
            log.weights.append(float(pusher.w if pusher else w))
        if pusher:
            x, w = pusher.finish()
            log.gossip_rounds = pusher.rounds
    _vector_to_model(x / w, model)
    log.parameters = (x / w).clone()
    return log


def _checked_topology(method: str, topology: Topology | None, max_seconds) -> Topology:
    """`topology`, or the method's default graph, once the arguments are known to fit."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
    p = world_size()
    topology = topology or _default_topology(method, p)
    if topology.world_size != p:
        raise ValueError(f"{topology!r} is for {topology.world_size} ranks, but {p} are running")
    if max_seconds is not None and method != "async_sgp":
        raise ValueError(
            f"{method!r} is synchronous: its ranks must agree on the number of steps, so it "
            "cannot stop on a per-rank time budget; pass max_seconds only with 'async_sgp'"
        )
    return topology


def _mix(method: str, x: torch.Tensor, w: torch.Tensor, topology: Topology, groups, step: int):
    """One synchronous round of `method`'s communication after a step: (x, w)."""
    if method in ("gossip", "sgp"):
        # For "sgp": Algorithm 1, lines 5-7, on a regular graph, where w stays 1.
        return gossip_round(x, topology, step), w
    if method == "group":
        return groups.average(x, step), w
    return x, w  # "allreduce" averaged the gradients; "async_sgp" mixes in its own thread


def _default_topology(method: str, p: int) -> Topology:
    if method == "group":
        return RandomGroups(p, group_size=2 if p % 2 == 0 else 1)
    if method == "gossip":
        return Ring(p)
    return ExponentialGraph(p)


# --- data that differ from rank to rank ---------------------------------------------------------


def class_sharded_batches(
    x: torch.Tensor, y: torch.Tensor, batch_size: int, steps: int, world_size: int, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches whose rank-r shard (`data.shard`, contiguous) holds only samples of class r:
    non-IID data, each rank seeing one class, where the usual batches give every rank a
    sample of all of them. Needs one class per rank and a batch that splits evenly."""
    classes = int(y.max()) + 1
    if classes != world_size or batch_size % world_size:
        raise ValueError(
            f"need one class per rank ({classes} classes, {world_size} ranks) and a batch "
            f"that splits evenly ({batch_size} over {world_size})"
        )
    g = torch.Generator().manual_seed(seed)
    members = [torch.nonzero(y == c).flatten() for c in range(classes)]
    per_rank = batch_size // world_size
    batches = []
    for _ in range(steps):
        idx = torch.cat([m[torch.randint(len(m), (per_rank,), generator=g)] for m in members])
        batches.append((x[idx], y[idx]))
    return batches


# --- the mixing matrices and their contraction, drawn ------------------------------------------


def plot_mixing_matrices(matrices: dict[str, torch.Tensor]) -> Figure:
    """Heatmaps of mixing matrices side by side, {title: W}: row i is what rank i ends up
    with, column j where rank j's values go. Entries are written in when P <= 8."""
    fig = NotebookFigure(figsize=(3.1 * len(matrices), 3.2), layout="constrained")
    axes = fig.subplots(1, len(matrices), squeeze=False)[0]
    for ax, (title, w) in zip(axes, matrices.items(), strict=True):
        p = w.shape[0]
        image = ax.imshow(w.numpy(), cmap="Blues", vmin=0, vmax=1)
        if p <= 8:
            for i, j in itertools.product(range(p), range(p)):
                if w[i, j] > 0:
                    text = f"{w[i, j].item():.2g}"
                    ax.text(j, i, text, ha="center", va="center", fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("from rank j")
        ax.set_ylabel("to rank i")
        ax.set_xticks(range(p))
        ax.set_yticks(range(p))
    fig.colorbar(image, ax=fig.axes, shrink=0.8, label="$W_{ij}$")
    return fig


def contraction_by_size(
    topologies: dict[str, Callable[[int], Topology]], sizes: Sequence[int]
) -> dict[str, list[float]]:
    """lambda for each topology (a maker, P -> Topology) at each P in `sizes`:
    `contraction_rate`, ||W - J||_2 for a fixed graph, the per-round rate over one period
    for a graph that changes with the step."""
    return {name: [contraction_rate(make(p)) for p in sizes] for name, make in topologies.items()}


def plot_contraction(sizes: Sequence[int], rates: dict[str, Sequence[float]]) -> Figure:
    """lambda against P, one line per topology: near 1 the copies agree slowly, at 0 in one
    period exactly."""
    fig = NotebookFigure(figsize=(6, 3.6), layout="constrained")
    ax = fig.add_subplot()
    for name, values in rates.items():
        ax.plot(sizes, values, "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(sizes), [str(p) for p in sizes])
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("ranks P")
    ax.set_ylabel(r"$\lambda = \|W - J\|_2$ per round")
    ax.set_title("how much of the disagreement one round leaves", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


# --- the exercises, checked off the page -------------------------------------------------------


def check_ring_of_5(ring_of_5: object) -> bool | None:
    """Lecture 4: the push-style mixing matrix of a ring of 5 ranks, entry by entry."""
    return check_matrix(
        ring_of_5, Ring(5).mixing_matrix(), hint="Row i holds the shares rank i receives."
    )


def check_rounds_for_1000x(rounds_for_1000x: object) -> bool | None:
    """Lecture 4: the rounds a ring of 16 needs for lambda**t to shrink the error 1000 times."""
    return check_number(
        rounds_for_1000x,
        math.log(1000) / -math.log(contraction_rate(Ring(16))),
        rtol=0.03,
        unit="rounds",
        hint="Solve lambda**t = 1/1000 for t: take logarithms.",
    )


AGREEING = ("ring", "exponential graph", "random groups of 2")


def check_first_to_agree(first_to_agree: object, curves: dict[str, list[float]]) -> bool | None:
    """Lecture 4: which topology's consensus error (`curves[name]`, one value per round) fell
    below 1e-12 in the fewest rounds."""
    rounds = {
        name: next((t for t, e in enumerate(curves[name]) if e < 1e-12), len(curves[name]))
        for name in AGREEING
    }
    seen = ", ".join(
        f"{name} {t if t < len(curves[name]) else 'never'}" for name, t in rounds.items()
    )
    return check_choice(
        first_to_agree,
        min(rounds, key=rounds.get),
        AGREEING,
        why=f"Rounds to reach 1e-12: {seen}. Each exponential-graph round doubles the window of "
        "values every copy averages.",
    )


def check_random_peer_plain_agrees(
    random_peer_plain_agrees: object, curves: dict[str, list[float]]
) -> bool | None:
    """Lecture 4: whether plain averaging on the random peer graph (no push-sum) reached the
    average (`curves["random peer, plain x"]`, its consensus error per round)."""
    return check_choice(
        random_peer_plain_agrees,
        "yes" if curves["random peer, plain x"][-1] < 1e-6 else "no",
        ["yes", "no"],
        why="Its rows do not sum to 1: read on.",
    )


def check_non_iid_gossip(
    non_iid_gossip: object, copy_loss: dict[tuple[str, str], float]
) -> bool | None:
    """Lecture 4: whether gossip's copies end clearly worse than all-reduce's on class-sharded
    data (`copy_loss[data, method]`: the mean loss of the copies on all the data)."""
    worse = copy_loss["class-sharded", "gossip"] / copy_loss["class-sharded", "allreduce"]
    iid_worse = copy_loss["IID", "gossip"] / copy_loss["IID", "allreduce"]
    return check_choice(
        non_iid_gossip,
        "clearly worse" if worse > 1.3 else "about the same",
        ["about the same", "clearly worse"],
        why=f"Measured: gossip's copies {worse:.2f}x all-reduce's with class-sharded data, "
        f"{iid_worse:.2f}x with IID data. Mixed with two neighbours a step, each copy keeps "
        "leaning towards its own class; all-reduce's averaged gradient is the full batch's.",
    )
