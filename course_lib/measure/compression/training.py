"""Lecture 5's training with compressed gradients: the 8-bit all-reduce measured on its own,
every method of `course_lib.compression` as a DDP comm hook (`build_ddp`) in one training loop
(`train_compressed`), loss curves against steps or seconds, and the quantization error as a
histogram."""

from __future__ import annotations

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
    dgc_hook,
    feedback_hook,
    int8_chunks,
    int8_hook,
    majority_vote_hook,
)
from course_lib.data import shard
from course_lib.network import SlowNetwork
from course_lib.plots import NotebookFigure
from course_lib.progress import progress
from course_lib.runtime import device, rank, world_size

# --- the 8-bit all-reduce on its own --------------------------------------------------------


class _Gradient(nn.Module):
    """One parameter whose gradient after `backward` is the input: (w * x).sum()."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


def measure_int8_all_reduce(n: int, seed: int = 0) -> dict[str, float]:
    """Run on every rank in `launch`: the "int8" hook (`int8_hook`, in DDP) averages a random
    tensor of `n` values (seeded by seed + rank); its largest error against the exact mean and
    the bound, the mean over ranks of each one's s/2 (`Int8Chunks.error_bound`); the bytes this
    rank sent by `CommCounter` (the all-gathers by their formula) and written to its sockets
    (`WireCounter`); and the bytes written by an fp32 all-reduce of the same tensor."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed + rank()))
    model = build_ddp(_Gradient(n), "int8")
    with CommCounter() as counter, WireCounter() as wire:
        model(x).backward()  # DDP's hook turns w's gradient x into the mean over ranks
    with WireCounter() as fp32_wire:
        torch.distributed.all_reduce(x.clone())
    everyone = [torch.empty(n) for _ in range(world_size())]
    torch.distributed.all_gather(everyone, x)  # for checking only, outside the counters
    bound = sum(int8_chunks(t).error_bound() for t in everyone) / world_size()
    return {
        "max error": (model.module.w.grad - torch.stack(everyone).mean(dim=0)).abs().max().item(),
        "bound": bound.max().item(),
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
        ddp.register_comm_hook(QuantizeState(chunk_size), int8_hook)
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
    """Histograms of |restored - x| over all elements of torch's int8 quantization
    (`int8_chunks`), one per chunk size (None: one scale for the whole tensor), on log axes,
    each with a dashed line at the bound s/2 of a typical element's chunk (the median over
    elements): each element's error is below its own chunk's s/2, so most of a histogram sits
    left of its line."""
    fig = NotebookFigure(figsize=(6.5, 3.6), layout="constrained")
    ax = fig.add_subplot()
    payloads = {c: int8_chunks(tensor, chunk_size=c) for c in chunk_sizes}
    errors = {c: (q.restored() - tensor).abs() for c, q in payloads.items()}
    smallest = min(e[e > 0].min().item() for e in errors.values())
    largest = max(e.max().item() for e in errors.values())
    bins = np.geomspace(smallest / 1.01, largest * 1.01, 60)  # a margin: no error falls outside
    for i, (chunk, error) in enumerate(errors.items()):
        label = "one scale" if chunk is None else f"a scale per {chunk} elements"
        ax.hist(error[error > 0].numpy(), bins=bins, alpha=0.6, color=f"C{i}", label=label)
        bound = payloads[chunk].error_bound().median().item()
        ax.axvline(bound, color=f"C{i}", ls="--", lw=1, label=f"{label}: typical s/2")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("|quantized - exact| per element")
    ax.set_ylabel("elements")
    ax.set_title(f"8-bit quantization error of {tensor.numel():,} elements", fontsize=10)
    ax.legend(fontsize=8)
    return fig
