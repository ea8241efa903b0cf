"""Lecture 7's ZeRO in mixed precision, kind by kind: bf16 weights and gradients, an fp32
master copy and AdamW's two fp32 moments, measured on each rank beside the formula's
(2 + 2 + 12)N split by ZeRO.

Mixed precision here is *explicit bf16 parameter copies with fp32 master weights*, as in
lecture 6, not autocast: autocast keeps the parameters and gradients in fp32 (its bf16 weight
copies, cached for the step, come on top), so it never holds the 2 + 2 bytes per parameter the
ZeRO formula counts. DDP and ZeRO-1 run lecture 6's `MixedPrecisionAdamW` (a bf16 model, an fp32
master copy); ZeRO-2 and ZeRO-3 run FSDP2 with `MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)`, where the fp32 shards *are* the master weights, each unit is cast to
bf16 as it is gathered, and gradients are reduce-scattered in fp32.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from course_lib import models
from course_lib.costs import BYTES_PER_PARAMETER, zero_mixed_bytes
from course_lib.data import shard
from course_lib.memory import MixedPrecisionAdamW
from course_lib.plots import NotebookFigure
from course_lib.runtime import device, rank, world_size
from course_lib.zero import (
    STAGES,
    gradient_bytes,
    held_bytes,
    optimizer_state_bytes,
    shard_units,
)

MIXED_KINDS = tuple(BYTES_PER_PARAMETER)  # weights, gradients, master weights, two moments
MIXED_TOOLS = {
    "ddp": "DDP on the bf16 model + MixedPrecisionAdamW (fp32 master, AdamW)",
    "zero1": "DDP on the bf16 model + ZeroRedundancyOptimizer(AdamW) over the fp32 master",
    "zero2": "fully_shard(reshard_after_forward=False, MixedPrecisionPolicy(bf16, reduce fp32))",
    "zero3": "fully_shard(reshard_after_forward=True, MixedPrecisionPolicy(bf16, reduce fp32))",
}


@dataclass
class MixedRun:
    """What one rank held in the last step of a mixed-precision run, kind by kind."""

    stage: str
    world_size: int
    n_params: int
    kinds: dict[str, int]  # keys of costs.BYTES_PER_PARAMETER
    losses: list[float]
    params: dict[str, torch.Tensor] = field(repr=False)  # fp32 master parameters, full

    @property
    def total(self) -> int:
        return sum(self.kinds.values())


def _bf16_bytes(model: nn.Module) -> int:
    """Bytes of the bf16 parameters the model computes with right now."""
    return held_bytes(p for p in model.parameters() if p.dtype == torch.bfloat16)


def _build_mixed(stage: str, model: nn.Module, lr: float):
    """(module to call, master parameters, optimizer holding the moments, step function)."""
    if stage in ("ddp", "zero1"):
        mixed = MixedPrecisionAdamW(model, lr=lr)  # casts the model to bf16 in place
        if stage == "zero1":
            mixed.optimizer = ZeroRedundancyOptimizer(
                mixed.master, optimizer_class=torch.optim.AdamW, lr=lr
            )
        wrapped = DistributedDataParallel(mixed.model, gradient_as_bucket_view=True)
        wrapped.register_comm_hook(None, allreduce_hook)
        return wrapped, mixed.master, mixed.optimizer, mixed.step, mixed.zero_grad
    mesh = init_device_mesh(device().type, (world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=stage == "zero3", mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=stage == "zero3", mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    master = list(model.parameters())  # the fp32 shards: FSDP2's master weights

    def zero_grad() -> None:
        optimizer.zero_grad(set_to_none=True)

    return model, master, optimizer, optimizer.step, zero_grad


def train_mixed(
    stage: str, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *, lr: float = 1e-2
) -> MixedRun:
    """Train the seeded TinyGPT in bf16 with fp32 master weights under `stage` (call on every
    rank), one AdamW step per batch (each rank its shard); count what the last step held:
    bf16 weights after forward, gradients after backward, master and moments after the step."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; use one of {', '.join(STAGES)}")
    model = models.TinyGPT(seed=0).to(device())
    n_params = models.count_parameters(model)
    wrapped, master, optimizer, step, zero_grad = _build_mixed(stage, model, lr)
    losses = []
    for x, y in batches:
        x, y = (shard(t, rank(), world_size()).to(device()) for t in (x, y))
        logits = wrapped(x)
        weights = _bf16_bytes(model)
        loss = models.lm_loss(logits.float(), y)
        loss.backward()
        grads = gradient_bytes(model)
        step()
        zero_grad()
        losses.append(loss.item())
    moments = optimizer_state_bytes(optimizer)
    kinds = {
        "weights": weights,
        "gradients": grads,
        "master weights": held_bytes(master),
        "optimizer: exp_avg": moments // 2,  # AdamW's two moments have the same shapes
        "optimizer: exp_avg_sq": moments - moments // 2,
    }
    named = dict(zip((n for n, _ in model.named_parameters()), master, strict=True))
    params = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
        for n, p in named.items()
    }
    return MixedRun(stage, world_size(), n_params, kinds, losses, params)


def mixed_table(runs: Mapping[str, MixedRun], n_params: int) -> str:
    """Measured bytes per parameter of each kind on one rank, next to the mixed formula's."""
    short = {"weights": "bf16 w", "gradients": "grads", "master weights": "master"}
    head = f"{'stage':<7}" + "".join(f"{short.get(k, k[-7:]):>16}" for k in MIXED_KINDS)
    lines = [head + f"{'total':>16}   (bytes per parameter: measured / formula)"]
    for stage, run in runs.items():
        formula = zero_mixed_bytes(stage, n_params, run.world_size)
        cells = "".join(
            f"{run.kinds[k] / n_params:>7.2f} /{formula[k] / n_params:>6.2f} " for k in MIXED_KINDS
        )
        total = sum(formula.values()) / n_params
        lines.append(f"{stage:<7}{cells}{run.total / n_params:>7.2f} /{total:>6.2f}")
    return "\n".join(lines)


def plot_mixed(runs: Mapping[str, MixedRun], n_params: int):
    """Stacked bars of measured bytes per parameter per rank (bf16 weights, gradients, master,
    moments) for each stage, with the (2 + 2 + 12)N formula's total as a black line."""
    fig = NotebookFigure(figsize=(9, 3.6), layout="constrained")
    ax = fig.add_subplot()
    colours = ["tab:blue", "tab:orange", "tab:purple", "tab:green", "tab:olive"]
    for i, (stage, run) in enumerate(runs.items()):
        bottom = 0.0
        for kind, colour in zip(MIXED_KINDS, colours, strict=True):
            value = run.kinds[kind] / n_params
            ax.bar(i, value, 0.6, bottom=bottom, color=colour, label=kind if i == 0 else None)
            bottom += value
        total = sum(zero_mixed_bytes(stage, n_params, run.world_size).values()) / n_params
        ax.plot([i - 0.33, i + 0.33], [total] * 2, "k-", lw=2)
    ax.plot([], [], "k-", lw=2, label="formula (2 + 2 + 12)N, ZeRO split")
    ax.set_xticks(range(len(runs)), [f"{s}\nP={r.world_size}" for s, r in runs.items()])
    ax.set_ylim(0, ax.get_ylim()[1] * 1.35)
    ax.set_ylabel("bytes per parameter, one rank")
    ax.set_title("Mixed precision (bf16 compute, fp32 master + AdamW), measured on one rank")
    ax.legend(fontsize=8, ncol=3, loc="upper center")
    return fig
