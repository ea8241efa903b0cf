"""How lecture 5 trains and shows training with compressed gradients: every method of
`course_lib.compression` as a DDP comm hook (`build_ddp`) in one training loop
(`train_compressed`), loss curves against steps or seconds; the quantization error as a
histogram; a slow-network run as a table, and step time swept over bandwidths; and the check
of section 3's PowerSGD exercise (`check_powersgd_ratio`), its expected value off the page.

    run = train_compressed("powersgd", batches, sizes=(8, 4))   # on every rank, in `launch`

    plot_loss_curves(loss_curves(runs, against="time"), "seconds")
    plot_quantization_error(gradient, [None, 256])
    times = sweep_bandwidth(("fp32", "int8"), [12.5e6, 125e6], batches, 5e-3, sizes=(8, 4))
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
    allreduce_hook,
    fp16_compress_hook,
)
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    powerSGD_hook,
)
from torch.nn.parallel import DistributedDataParallel

from course_lib import models, plots
from course_lib.comm import CommCounter, WireCounter
from course_lib.compression import (
    CHUNK,
    METHODS,
    ONE_BUCKET_MB,
    DGCState,
    EFMomentumSGD,
    FeedbackState,
    QuantizeState,
    Sign,
    TopK,
    bf16_hook,
    bytes_per_step,
    comm_seconds,
    dequantize,
    dgc_hook,
    error_bound,
    feedback_hook,
    latency_steps,
    majority_vote_hook,
    powersgd_ratio,
    quantize,
    quantized_all_reduce,
    quantized_hook,
    quantized_sum_bound,
)
from course_lib.data import shard
from course_lib.exercises import check_number
from course_lib.network import SlowNetwork
from course_lib.plots import NotebookFigure
from course_lib.progress import progress
from course_lib.runtime import device, rank, world_size

# --- the quantized all-reduce on its own ----------------------------------------------------


def measure_quantized_all_reduce(n: int, seed: int = 0) -> dict[str, float]:
    """Run on every rank in `launch`: `quantized_all_reduce` of a random tensor of `n` values
    (seeded by seed + rank), its largest error against the exact sum and the bound of
    `quantized_sum_bound`; the bytes this rank sent by `CommCounter` (the all-to-all's tensors,
    the all-gather by its formula) and written to its sockets (`WireCounter`); and the bytes
    written by an fp32 all-reduce of the same tensor."""
    generator = torch.Generator().manual_seed(seed + rank())
    x = torch.randn(n, generator=generator)
    with CommCounter() as counter, WireCounter() as wire:
        total = quantized_all_reduce(x)
    with WireCounter() as fp32_wire:
        torch.distributed.all_reduce(x.clone())
    everyone = [torch.empty(n) for _ in range(world_size())]
    torch.distributed.all_gather(everyone, x)  # for checking only, outside the counters
    return {
        "max error": (total - torch.stack(everyone).sum(dim=0)).abs().max().item(),
        "bound": quantized_sum_bound(everyone).max().item(),
        "counted": counter.bytes_sent,
        "written": wire.bytes_written,
        "fp32 written": fp32_wire.bytes_written,
    }


# --- one training loop for every method ----------------------------------------------------


def build_ddp(
    model: nn.Module,
    method: str,
    *,
    chunk_size: int = CHUNK,
    topk_fraction: float = 0.01,
    powersgd_rank: int = 4,
    start_powersgd_iter: int = 10,
    dgc_momentum: float = 0.9,
) -> nn.Module:
    """Wrap `model` in DDP with the comm hook of `method` (one of `METHODS`)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
    # One bucket for all gradients: one hook call per step, so each step sends the payloads
    # the formulas count (and no two hook chains issue collectives at once from two threads).
    ddp = DistributedDataParallel(model, bucket_cap_mb=ONE_BUCKET_MB)
    if method == "fp32":
        # torch's Python all-reduce hook: DDP's own averaging, where CommCounter sees it
        ddp.register_comm_hook(None, allreduce_hook)
    elif method == "fp16":
        ddp.register_comm_hook(None, fp16_compress_hook)  # torch's: cast, all-reduce, cast back
    elif method == "bf16":
        ddp.register_comm_hook(None, bf16_hook)  # torch's bf16_compress_hook
    elif method == "vote":
        ddp.register_comm_hook(None, majority_vote_hook)
    elif method == "dgc":
        ddp.register_comm_hook(DGCState(TopK(topk_fraction), dgc_momentum), dgc_hook)
    elif method == "int8":
        ddp.register_comm_hook(QuantizeState(chunk_size), quantized_hook)
    elif method == "powersgd":
        state = PowerSGDState(
            process_group=None,
            matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=start_powersgd_iter,
            use_error_feedback=True,
            warm_start=True,
        )
        ddp.register_comm_hook(state, powerSGD_hook)
    else:
        compressor = TopK(topk_fraction) if method.startswith("topk") else Sign()
        state = FeedbackState(compressor, error_feedback=method.endswith("+ef"))
        ddp.register_comm_hook(state, feedback_hook)
    return ddp


@dataclass
class CompressionLog:
    """What one rank measured in `train_compressed`: one entry per step."""

    method: str
    losses: list[float] = field(default_factory=list)  # loss on this rank's shard
    bytes_sent: list[int] = field(default_factory=list)  # by this rank, per CommCounter
    bytes_written: list[int] = field(default_factory=list)  # to the sockets, per the OS
    step_s: list[float] = field(default_factory=list)  # wall-clock time of the step
    wait_s: list[float] = field(default_factory=list)  # of step_s, waiting for the network
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # after the last step


def train_compressed(
    method: str,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    sizes: tuple[int, ...],
    lr: float = 0.1,
    momentum: float = 0.0,
    network: dict | None = None,
    **options,
) -> CompressionLog:
    """Train the seeded MLP(sizes) under `method` (run on every rank in `launch`), each rank
    on its shard of every batch, with SGD (`EFMomentumSGD` when `momentum` is given); record
    loss, bytes sent and time per step.

    `network`: keyword arguments of `SlowNetwork` (bandwidth, latency) to emulate a slow link
    while training; `wait_s` then records the part of each step spent waiting for it (the
    emulated network time beyond the real transfer); `options` go to `build_ddp`."""
    model = build_ddp(models.MLP(sizes).to(device()), method, **options)
    if momentum:
        optimizer = EFMomentumSGD(model.parameters(), lr=lr, momentum=momentum)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    run = CompressionLog(method)
    p, r = world_size(), rank()
    net = SlowNetwork(**network) if network is not None else None
    with net if net is not None else nullcontext():
        for x, y in progress(batches, f"{method} steps"):
            x, y = shard(x, r, p).to(device()), shard(y, r, p).to(device())
            waited = net.waited if net is not None else 0.0
            start = time.perf_counter()
            with CommCounter() as counter, WireCounter() as wire:
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x), y)
                loss.backward()  # the comm hook runs in here
                optimizer.step()
            run.step_s.append(time.perf_counter() - start)
            run.wait_s.append(net.waited - waited if net is not None else 0.0)
            run.losses.append(loss.item())
            run.bytes_sent.append(counter.bytes_sent)
            run.bytes_written.append(wire.bytes_written)
    run.params = {n: t.detach().cpu().clone() for n, t in model.module.named_parameters()}
    return run


def mean_losses(per_rank: Sequence[CompressionLog]) -> list[float]:
    """Loss per step averaged over the ranks' shards: the loss of the whole batch."""
    return [sum(losses) / len(losses) for losses in zip(*(r.losses for r in per_rank), strict=True)]


def plot_loss_curves(
    curves: dict[str, tuple[Sequence[float], Sequence[float]]],
    xlabel: str,
    ylabel: str = "training loss",
    title: str = "",
    log_y: bool = True,
) -> Figure:
    """One line per label from {label: (x, y)}, as `loss_curves` gives them."""
    return plots.plot_curves(
        {label: y for label, (_, y) in curves.items()},
        xlabel,
        ylabel,
        title,
        log_y=log_y,
        x_values={label: x for label, (x, _) in curves.items()},
    )


def loss_curves(runs: dict[str, Sequence[CompressionLog]], against: str = "step") -> dict:
    """Curves for `plot_loss_curves` from {label: per-rank runs}: mean loss against the step
    number, or against rank 0's cumulative wall-clock seconds (`against="time"`)."""
    curves = {}
    for label, per_rank in runs.items():
        losses = mean_losses(per_rank)
        if against == "time":
            x = list(torch.tensor(per_rank[0].step_s).cumsum(0).tolist())
        else:
            x = list(range(len(losses)))
        curves[label] = (x, losses)
    return curves


# --- the quantization error, seen whole ------------------------------------------------------


def plot_quantization_error(tensor: torch.Tensor, chunk_sizes: Sequence[int | None]) -> Figure:
    """Histograms of |dequantize(quantize(x)) - x| over all elements, one per chunk size
    (None: one scale for the whole tensor), on log axes, each with a dashed line at the bound
    s/2 of a typical element's chunk (the median over elements): each element's error is
    below its own chunk's s/2, so most of a histogram sits left of its line."""
    fig = NotebookFigure(figsize=(6.5, 3.6), layout="constrained")
    ax = fig.add_subplot()
    errors = {c: (dequantize(quantize(tensor, chunk_size=c)) - tensor).abs() for c in chunk_sizes}
    smallest = min(e[e > 0].min().item() for e in errors.values())
    largest = max(e.max().item() for e in errors.values())
    bins = np.geomspace(smallest / 1.01, largest * 1.01, 60)  # a margin: no error falls outside
    for i, (chunk, error) in enumerate(errors.items()):
        label = "one scale" if chunk is None else f"a scale per {chunk} elements"
        ax.hist(error[error > 0].numpy(), bins=bins, alpha=0.6, color=f"C{i}", label=label)
        bound = error_bound(quantize(tensor, chunk_size=chunk)).median().item()
        ax.axvline(bound, color=f"C{i}", ls="--", lw=1, label=f"{label}: typical s/2")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("|quantized - exact| per element")
    ax.set_ylabel("elements")
    ax.set_title(f"8-bit quantization error of {tensor.numel():,} elements", fontsize=10)
    ax.legend(fontsize=8)
    return fig


# --- the slow network: a table of one run, and a sweep over bandwidths -----------------------


def network_table(
    methods: Sequence[str],
    shapes: Sequence[torch.Size],
    world_size: int,
    links: dict[str, float],
    latency: float,
    **options,
) -> tuple[dict[tuple[str, str], float], str]:
    """The alpha-beta model's network time per step of each method at each of `links` ({name:
    bytes/s}), as {(method, link): seconds}, and a table of it: bytes and messages per step,
    the time at every link, and what each method saves against fp32 per parameter. All by
    the formulas (`bytes_per_step`, `comm_seconds`); `options` go to them (powersgd_rank)."""
    n_params = sum(math.prod(s) for s in shapes)
    network_s = {
        (m, link): comm_seconds(m, shapes, world_size, bw, latency, **options)
        for m in methods
        for link, bw in links.items()
    }
    lines = [f"{n_params:,} parameters, {4 * n_params / 1e6:.1f} MB of fp32 gradients"]
    for m in methods:
        sent = bytes_per_step(m, shapes, world_size, **options)
        times = ", ".join(f"{1e3 * network_s[m, link]:5.1f} ms at {link}" for link in links)
        lines.append(
            f"{m:<8} {sent:>9,} bytes/step, {latency_steps(m, world_size)} messages: "
            f"network {times}"
        )
    for m in [m for m in methods if m != "fp32"]:
        saved = ", ".join(
            f"{1e9 * (network_s['fp32', link] - network_s[m, link]) / n_params:3.0f} ns at {link}"
            for link in links
        )
        lines.append(f"{m:<8} saves per parameter: {saved}")
    return network_s, "\n".join(lines)


def slow_network_table(
    rank_runs: Sequence[dict[str, CompressionLog]],
    network_s: dict[tuple[str, str], float],
    link: str,
    n_params: int,
    start: int,
) -> str:
    """Lecture 5's table of a run on the emulated `link`, from every rank's {method: log}
    (rank 0's times): per step (after `start`) compute, network wait, total, the predicted
    network time `network_s[method, link]` and the speed-up over fp32; for the whole run its
    time, speed-up and largest loss gap to fp32; then each method's extra compute per
    parameter next to the network time it saves at every link of `network_s`."""
    runs = rank_runs[0]
    if "fp32" not in runs:
        raise ValueError(f"the table compares with fp32: run it too (got {', '.join(runs)})")
    links = list(dict.fromkeys(name for _, name in network_s))
    links.sort(key=lambda name: name != link)  # the run's link first
    losses = {m: mean_losses([per_rank[m] for per_rank in rank_runs]) for m in runs}
    split = {}
    for m, run in runs.items():  # mean compute, network wait and total per step, in ms
        total, wait = run.step_s[start:], run.wait_s[start:]
        split[m] = (1e3 * (sum(total) - sum(wait)) / len(total), 1e3 * sum(wait) / len(total))
        split[m] += (1e3 * sum(total) / len(total),)
    lines = [
        f"{'per step (ms)':<14}{'compute':>8}{'net wait':>10}{'total':>8}{'predicted net':>15}"
        f"{'speed-up':>10}"
    ]
    for m, (compute, wait, total) in split.items():
        speed_up = split["fp32"][2] / total
        lines.append(
            f"{m:<14}{compute:8.1f}{wait:10.1f}{total:8.1f}{1e3 * network_s[m, link]:15.1f}"
            f"{speed_up:9.2f}x"
        )
    lines.append(
        f"\n{'whole run':<14}{'time':>8}{'speed-up':>10}{'max |loss - fp32|':>19}{'final loss':>12}"
    )
    for m, run in runs.items():
        gap = max(abs(a - b) for a, b in zip(losses[m], losses["fp32"], strict=True))
        speed_up = sum(runs["fp32"].step_s) / sum(run.step_s)
        lines.append(
            f"{m:<14}{sum(run.step_s):7.2f}s{speed_up:9.2f}x{gap:19.1e}{losses[m][-1]:12.4f}"
        )
    lines.append("")
    for m in [m for m in runs if m != "fp32"]:
        extra = 1e6 * (split[m][0] - split["fp32"][0]) / n_params  # ms -> ns
        saved = [1e9 * (network_s["fp32", n] - network_s[m, n]) / n_params for n in links]
        lines.append(
            f"{m}: extra compute {extra:.0f} ns per parameter; network saved {saved[0]:.0f} ns "
            f"at {links[0]}"
            + "".join(f" ({v:.0f} ns at {n})" for v, n in zip(saved[1:], links[1:], strict=True))
        )
    return "\n".join(lines)


def sweep_bandwidth(
    methods: Sequence[str],
    bandwidths: Sequence[float],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    latency: float,
    *,
    skip: int = 2,
    **options,
) -> dict[str, list[float]]:
    """Median step seconds of each method (after the first `skip` steps) on `SlowNetwork` at
    each bandwidth in bytes/s, run on every rank in `launch`; `options` go to
    `train_compressed` (sizes, lr, powersgd_rank, start_powersgd_iter)."""
    if len(batches) <= skip:
        raise ValueError(f"need more than skip={skip} batches to time a step, got {len(batches)}")
    times: dict[str, list[float]] = {m: [] for m in methods}
    for bandwidth in bandwidths:
        network = {"bandwidth": bandwidth, "latency": latency}
        for m in methods:
            run = train_compressed(m, batches, network=network, **options)
            times[m].append(statistics.median(run.step_s[skip:]))
    return times


def plot_step_time_vs_bandwidth(
    bandwidths: Sequence[float],
    measured: dict[str, Sequence[float]],
    predicted: dict[str, Sequence[float]],
) -> Figure:
    """Measured step time (dots) and the alpha-beta network time alone (lines) of each method
    against the bandwidth, log-log: the gap between a dot and its line is the compute. One
    legend entry per method (methods with the same bytes share a line)."""
    fig = NotebookFigure(figsize=(7.5, 3.8), layout="constrained")
    ax = fig.add_subplot()
    gbits = [8 * b / 1e9 for b in bandwidths]
    for i, m in enumerate(measured):
        ax.plot(gbits, [1e3 * s for s in predicted[m]], "-", color=f"C{i}", alpha=0.4, lw=2)
        ax.plot(gbits, [1e3 * s for s in measured[m]], "o", color=f"C{i}", label=m)
    ax.plot([], [], "-", color="black", alpha=0.4, lw=2, label="lines: network time (model)")
    ax.plot([], [], "o", color="black", label="dots: measured step")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bandwidth (Gbit/s)")
    ax.set_ylabel("time per step (ms)")
    ax.set_title("step time against bandwidth, emulated network", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


# --- section 3's exercise, checked off the page ------------------------------------------------


def check_powersgd_ratio(fewer_numbers_1024: object) -> bool | None:
    """Lecture 5: how many times fewer numbers PowerSGD sends for 1024 x 1024 at rank r = 4."""
    return check_number(
        fewer_numbers_1024,
        powersgd_ratio(1024, 1024, 4),
        rtol=0.01,
        hint="P is n x r and Q is m x r: compare (n + m) r numbers with n m.",
    )
