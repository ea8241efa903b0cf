"""What lecture 12 measures: how many tokens each expert gets and how many are dropped, that
expert parallelism equals one process, the bytes its all-to-alls send, and its step time on an
emulated slow network against tensor parallelism with as many parameters.

Every function with "on each rank" in its docstring runs inside `launch`; the others run in
the notebook. The formulas the numbers are held against are in `course_lib.costs`. The checks
of the lecture's exercises (`check_dropped_at_one`, `check_capacity`,
`check_worst_balance_loss`, `check_ep_forward_bytes`, `check_faster_ep_or_tp`) compute their
expected values and say why here, out of the notebook's sight.
"""

from __future__ import annotations

import statistics
import time

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

from course_lib import models
from course_lib.comm import CommCounter, WireCounter
from course_lib.costs import all_to_all_bytes, ep_bytes, expert_capacity
from course_lib.exercises import check_choice, check_number, faster
from course_lib.expert_parallel import ExpertParallelMoE, MoE, load_balancing_loss, route
from course_lib.network import SlowNetwork
from course_lib.runtime import rank, world_size
from course_lib.tensor_parallel import ParallelMLP

D_MODEL, D_FF, N_EXPERTS, K = 16, 32, 8, 2


def small_moe(capacity_factor: float = 1.25, n_experts: int = N_EXPERTS, **kw) -> MoE:
    """The lecture's layer: width 16, experts of 32, top-2, seeded (float64)."""
    return MoE(D_MODEL, D_FF, n_experts, K, capacity_factor, **kw)


def batch(n_tokens: int, d_model: int = D_MODEL, seed: int = 1) -> torch.Tensor:
    """The same n_tokens x d_model tokens (float64) wherever it is called."""
    return torch.randn(
        n_tokens, d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
    )


def balanced(moe: MoE, n_tokens: int) -> torch.Tensor:
    """Make `moe`'s router send token t to experts t, t+1, ... (mod E) and return such tokens:
    every expert gets the same number of tokens from every stretch of E tokens."""
    n, d = moe.n_experts, moe.router.weight.shape[1]
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(n, d, dtype=moe.router.weight.dtype))
    x = torch.zeros(n_tokens, d, dtype=torch.float64)
    for j in range(moe.k):  # choice j of token t: expert t + j, a little less probable
        x[torch.arange(n_tokens), (torch.arange(n_tokens) + j) % n] = 2.0 - j / moe.k
    return x


# --- routing, on one process ----------------------------------------------------------------


def expert_load(n_tokens: int = 256, capacity_factor: float = 1.0) -> dict:
    """Choices each expert got from the router of `small_moe` on `batch(n_tokens)`, how many
    it kept, and the capacity."""
    moe = small_moe(capacity_factor)
    r = route(batch(n_tokens), moe.router.weight.detach(), moe.k, capacity_factor)
    n = moe.n_experts
    return {
        "chosen": torch.bincount(r.experts.flatten(), minlength=n).tolist(),
        "kept": torch.bincount(r.experts[r.kept], minlength=n).tolist(),
        "capacity": r.capacity,
    }


def plot_expert_load(load: dict):
    """Bars of tokens per expert, kept and dropped, and the capacity as a line."""
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    experts = range(len(load["chosen"]))
    dropped = [c - k for c, k in zip(load["chosen"], load["kept"], strict=True)]
    ax.bar(experts, load["kept"], label="kept")
    ax.bar(experts, dropped, bottom=load["kept"], color="tab:red", label="dropped")
    ax.axhline(load["capacity"], color="black", linestyle="--", label="capacity C")
    ax.set_xticks(list(experts), [f"expert {e}" for e in experts], fontsize=8)
    ax.set_ylabel("tokens routed to it")
    ax.set_ylim(0, 1.35 * max(load["chosen"]))  # room for the legend above the bars
    ax.set_title("Tokens per expert (top-2 router at initialisation)")
    ax.legend(loc="upper center", ncol=3)
    return fig


def dropped_share(capacity_factors: list[float], n_tokens: int = 256) -> list[float]:
    """Share of the T*k choices dropped, for each capacity factor (`small_moe`'s router)."""
    moe = small_moe()
    x, w = batch(n_tokens), moe.router.weight.detach()
    return [1 - route(x, w, moe.k, cf).kept.double().mean().item() for cf in capacity_factors]


def plot_dropped_share(capacity_factors: list[float], shares: list[float]):
    """The measured dropped share against the capacity factor, and a perfectly even router's."""
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    ax.plot(capacity_factors, shares, "o-", label="this router")
    even = [max(0.0, 1 - cf) for cf in capacity_factors]
    ax.plot(capacity_factors, even, "--", color="gray", label="a perfectly even router: 1 - factor")
    ax.set_xlabel("capacity factor")
    ax.set_ylabel("share of choices dropped")
    ax.set_title("Dropped tokens against capacity")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig


def balance_router(steps: int = 60, lr: float = 1.0, n_tokens: int = 256) -> dict[str, list]:
    """Train `small_moe`'s router by SGD on the load-balancing loss alone, on `batch(n_tokens)`:
    the loss, the share of choices dropped at capacity factor 1 and the tokens per expert,
    before each step."""
    moe = small_moe(capacity_factor=1.0)
    x, weight = batch(n_tokens), moe.router.weight
    optimizer = torch.optim.SGD([weight], lr=lr)
    history: dict[str, list] = {"loss": [], "dropped": [], "chosen": []}
    for _ in range(steps + 1):
        r = route(x, weight, moe.k, 1.0)
        loss = load_balancing_loss(r.probs, r.experts)
        history["loss"].append(loss.item())
        history["dropped"].append(1 - r.kept.double().mean().item())
        history["chosen"].append(torch.bincount(r.experts.flatten(), minlength=N_EXPERTS).tolist())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return history


def plot_balancing(history: dict[str, list]):
    """The dropped share (capacity factor 1) as SGD on the balancing loss alone goes on."""
    fig, ax = plt.subplots(figsize=(6.5, 3))
    ax.plot(history["dropped"], "o-", markersize=3)
    ax.set_xlabel("SGD step on the load-balancing loss")
    ax.set_ylabel("share of choices dropped")
    ax.set_title("The balancing loss evens out the router (capacity factor 1)")
    ax.grid(True, alpha=0.3)
    return fig


# --- expert parallelism against one process -------------------------------------------------


def largest_errors(tokens_per_rank: int = 32, capacity_factor: float = 1.0) -> dict[str, float]:
    """On each rank: `ExpertParallelMoE` on this rank's tokens against `small_moe` on the whole
    batch, forward and backward (loss: a fixed weighting of the output plus the balancing
    loss), float64. The largest |difference| of each, and the choices dropped in the batch."""
    p, me = world_size(), rank()
    moe = small_moe(capacity_factor)
    x = batch(tokens_per_rank * p).requires_grad_()
    weight = batch(tokens_per_rank * p, seed=2)
    y, aux = moe(x)
    ((y * weight).sum() + aux).backward()

    ep = ExpertParallelMoE(moe)
    mine = slice(me * tokens_per_rank, (me + 1) * tokens_per_rank)
    x_mine = x.detach()[mine].clone().requires_grad_()
    y_mine, aux_mine = ep(x_mine)
    ((y_mine * weight[mine]).sum() + aux_mine).backward()
    if p > 1:  # the router saw only this rank's tokens: sum its gradient over the ranks
        dist.all_reduce(ep.router.weight.grad)
    expert_errors = [
        (a.grad - b.grad).abs().max().item()
        for i, expert in enumerate(ep.experts)
        for a, b in zip(expert.parameters(), moe.experts[ep.first + i].parameters(), strict=True)
    ]
    r = route(x.detach(), moe.router.weight.detach(), moe.k, capacity_factor)
    return {
        "output": (y_mine - y[mine]).abs().max().item(),
        "loss": abs(aux_mine.item() - aux.item()),
        "input grad": (x_mine.grad - x.grad[mine]).abs().max().item(),
        "router grad": (ep.router.weight.grad - moe.router.weight.grad).abs().max().item(),
        "expert grads": max(expert_errors),
        "dropped": int((~r.kept).sum()),
    }


def bytes_sent(tokens_per_rank: int = 64, even: bool = False) -> dict[str, int]:
    """On each rank: bytes one forward and one backward of `ExpertParallelMoE` sent
    (`CommCounter`): the all-to-alls (by their splits) and the small all-gather of counts;
    what the forward pass really wrote to its sockets (`WireCounter`, gloo's headers too); and
    N, this rank's routed tokens T/P * k * d * 8 bytes. `even`: a router that spreads the
    tokens evenly (`balanced`), else the seeded one; capacity factor 2 (nothing dropped)."""
    p, me = world_size(), rank()
    moe = small_moe(capacity_factor=2.0)
    x = balanced(moe, tokens_per_rank * p) if even else batch(tokens_per_rank * p)
    ep = ExpertParallelMoE(moe)
    mine = x[me * tokens_per_rank : (me + 1) * tokens_per_rank].clone().requires_grad_()
    with CommCounter() as forward, WireCounter() as wire:
        y, aux = ep(mine)
    with CommCounter() as backward:
        (y.sum() + aux).backward()
    return {
        "forward all-to-alls": forward.by_op.get("all_to_all_single", [0, 0])[0],
        "backward all-to-alls": backward.by_op.get("all_to_all_single", [0, 0])[0],
        "all-gather of counts": forward.by_op.get("all_gather_single", [0, 0])[0],
        "forward, written to sockets": wire.bytes_written,
        "N": tokens_per_rank * moe.k * D_MODEL * 8,
    }


def torch_all_to_all() -> dict:
    """On each rank: torch's own `all_to_all_single` with uneven splits (rank r sends r + j + 1
    rows to rank j) on this backend: does it run and deliver the right rows, the bytes that
    left this rank by the splits, what `CommCounter` counts, and an even split's count."""
    p, r = world_size(), rank()
    send = [r + j + 1 for j in range(p)]
    receive = [j + r + 1 for j in range(p)]
    x = torch.full((sum(send), 4), float(r), dtype=torch.float64)
    out = torch.empty(sum(receive), 4, dtype=torch.float64)
    try:
        with CommCounter() as counter:
            dist.all_to_all_single(out, x, receive, send)
    except Exception as error:  # report what torch says
        return {"runs": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    expected = torch.cat(
        [torch.full((n, 4), float(j), dtype=torch.float64) for j, n in enumerate(receive)]
    )
    return {
        "runs": bool(torch.equal(out, expected)),
        "really sent": sum(n for j, n in enumerate(send) if j != r) * 4 * 8,
        "CommCounter": counter.bytes_sent,
        "even model": all_to_all_bytes(x.numel() * 8, p),
    }


# --- step time on a slow network, against tensor parallelism --------------------------------


def step_times(
    kind: str,
    n_tokens: int = 512,
    d_model: int = 64,
    d_ff: int = 64,
    n_experts: int = 8,
    steps: int = 5,
    bandwidth: float = 12.5e6,
    latency: float = 1e-3,
) -> dict:
    """On each rank: the seconds of each of `steps` forward and backward steps (after a
    barrier, so that step s starts together on every rank) on a `SlowNetwork`, of
    "EP" (`ExpertParallelMoE`, E experts of width d_ff, this rank's n_tokens/P tokens) or
    "TP" (`ParallelMLP` of width E * d_ff, as many parameters, every token on every rank),
    float32; with the parameters and the bytes this rank sent per step."""
    p, me = world_size(), rank()
    x = batch(n_tokens, d_model).float()
    if kind == "EP":
        moe = MoE(d_model, d_ff, n_experts, K, capacity_factor=1.25, dtype=torch.float32)
        layer, params = ExpertParallelMoE(moe), sum(t.numel() for t in moe.parameters())
        share = n_tokens // p
        x = x[me * share : (me + 1) * share]
    elif kind == "TP":
        dense = models.MLPBlock(
            models.GPTConfig(d_model=d_model, d_ff=n_experts * d_ff), torch.float32
        )
        layer, params = ParallelMLP(dense), sum(t.numel() for t in dense.parameters())
    else:
        raise ValueError(f"kind is 'EP' or 'TP', got {kind!r}")

    x.requires_grad_()  # as from the layers below: backward sends its gradient back too

    def step():
        out = layer(x)
        loss = out[0].sum() + out[1] if kind == "EP" else out.sum()
        loss.backward()
        if kind == "EP" and p > 1:  # the replicated router's gradient, summed over the ranks
            dist.all_reduce(layer.router.weight.grad)

    times = []
    with SlowNetwork(bandwidth=bandwidth, latency=latency):
        step()  # warm up
        for _ in range(steps):
            dist.barrier()
            with CommCounter() as counter:
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
    return {"times": times, "params": params, "bytes": counter.bytes_sent}


def sweep_step_times(bandwidths: list[float], **kw) -> dict[str, list[dict]]:
    """On each rank: `step_times` of EP and TP at each bandwidth (bytes/s)."""
    return {
        kind: [step_times(kind, bandwidth=b, **kw) for b in bandwidths] for kind in ("EP", "TP")
    }


def step_spread(runs: list[dict[str, list[dict]]], kind: str, i: int) -> tuple[float, ...]:
    """(median, fastest, slowest) seconds of `kind`'s steps at bandwidth number `i`, each step
    timed by its slowest rank (a step ends when every rank has finished it), from the
    `sweep_step_times` results of every rank. Other processes on the machine only add time:
    the spread says how much they did."""
    per_step = [max(steps) for steps in zip(*(r[kind][i]["times"] for r in runs), strict=True)]
    return statistics.median(per_step), min(per_step), max(per_step)


def plot_step_times(bandwidths: list[float], runs: list[dict[str, list[dict]]]):
    """Step time against bandwidth, one line per layer: the median step, timed by its slowest
    rank, with a bar from the fastest step to the slowest (`step_spread`)."""
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    mbits = [8 * b / 1e6 for b in bandwidths]
    for kind in runs[0]:
        spread = [step_spread(runs, kind, i) for i in range(len(bandwidths))]
        median = [1e3 * s[0] for s in spread]
        below = [1e3 * (s[0] - s[1]) for s in spread]
        above = [1e3 * (s[2] - s[0]) for s in spread]
        ax.errorbar(mbits, median, yerr=[below, above], fmt="o-", capsize=3, label=kind)
    ax.set_xscale("log")
    ax.set_xticks(mbits, [f"{m:g}" for m in mbits])
    ax.set_xlabel("bandwidth (Mbit/s), latency 1 ms")
    ax.set_ylabel("ms per step (median, slowest rank)")
    ax.set_title("One MoE layer (EP) against one wide MLP (TP), as many parameters")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig


# --- the exercises: expected values out of the notebook's sight ------------------------------


def check_capacity(capacity: object) -> bool | None:
    """Tokens one expert can take: 4096 tokens, 64 experts, top-2, capacity factor 1.25."""
    return check_number(
        capacity,
        expert_capacity(4096, 64, 2, 1.25),
        rtol=0,
        atol=0.5,
        hint="The even share is T * k / E choices per expert; the factor adds headroom.",
    )


def check_worst_balance_loss(worst_balance_loss: object) -> bool | None:
    """The balancing loss of 8 experts, top-1, every token sent to expert 0 with probability 1."""
    n_experts = 8  # f and P are 1 at expert 0 and 0 elsewhere: E * 1 * 1
    return check_number(
        worst_balance_loss,
        float(n_experts),
        rtol=0,
        atol=1e-6,
        hint=(
            "One expert gets every choice and all the probability: f and P are 1 there, 0 "
            "elsewhere."
        ),
    )


def check_ep_forward_bytes(ep_forward_bytes: object) -> bool | None:
    """Bytes one rank sends in a forward pass: 4096 tokens, top-2, d = 4096, bf16, 8 ranks."""
    return check_number(
        ep_forward_bytes,
        ep_bytes(4096 * 2 * 4096 * 2, 8),
        hint="N = tokens * k * d * 2 bytes; dispatch and combine each send (P-1)/P of it.",
    )


DROPPED = ("none", "under 10%", "10% to 30%", "over 30%")


def check_dropped_at_one(
    dropped_at_one: object, capacity_factors: list[float], shares: list[float]
) -> bool | None:
    """The share of the Tk choices dropped at capacity factor 1.0, in brackets, from the
    `dropped_share` measured at each of `capacity_factors`."""
    share = shares[capacity_factors.index(1.0)]
    bracket = DROPPED[(share > 0) + (share >= 0.1) + (share >= 0.3)]  # none, <10%, <30%, more
    return check_choice(
        dropped_at_one,
        bracket,
        DROPPED,
        why="Only the experts above the even share drop, and only their excess.",
    )


def check_faster_ep_or_tp(
    faster_at_10_mbit: object,
    faster_at_1_gbit: object,
    bandwidths: list[float],
    spread: dict[str, list[tuple[float, ...]]],
) -> tuple[bool | None, bool | None]:
    """Which step was faster, EP's or TP's, at 10 Mbit/s and at 1 Gbit/s, by the medians of
    `spread[kind][i]` (`step_spread` at `bandwidths[i]`, bytes/s). Medians within 20% of each
    other can swap places from run to run: then either answer counts."""
    why = (
        "The slope of time against 1/bandwidth is bytes; the time at high bandwidth is fixed costs."
    )
    verdicts = []
    for answer, bandwidth in ((faster_at_10_mbit, 1.25e6), (faster_at_1_gbit, 125e6)):
        i = bandwidths.index(bandwidth)
        winner = faster({kind: spread[kind][i][0] for kind in ("EP", "TP")}, margin=0.2)
        verdicts.append(check_choice(answer, winner, ["EP", "TP"], why=why))
    return verdicts[0], verdicts[1]
