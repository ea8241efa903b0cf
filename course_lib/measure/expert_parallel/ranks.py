"""What lecture 12 runs on ranks: expert parallelism against one process, the bytes its
all-to-alls send, and its step time on an emulated slow network against tensor parallelism
with as many parameters. Every function with "on each rank" in its docstring runs inside
`launch`; the others run in the notebook."""

from __future__ import annotations

import statistics
import time

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

from course_lib import models
from course_lib.comm import CommCounter, WireCounter
from course_lib.costs import all_to_all_bytes
from course_lib.expert_parallel import ExpertParallelMoE, MoE, route
from course_lib.measure.expert_parallel.routing import D_MODEL, K, balanced, batch, small_moe
from course_lib.network import SlowNetwork
from course_lib.runtime import rank, world_size
from course_lib.tensor_parallel import ParallelMLP

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
