"""ZeRO and FSDP, measured with torch's own tools (lecture 7).

    run = train_stage("zero3", batches, lr=1e-2)        # on every rank, inside `launch`
    run.memory, run.comm_received, run.params           # bytes this rank held, moved, result
    zero_bytes("zero2", n_params, world_size)           # the ZeRO paper's bytes per rank
    save_sharded(model, optimizer, path)                # each rank writes its own shard
    consolidate(path)                                   # the full state, in one process

The four stages, as torch runs them on CPU/gloo (Assignment 7 builds ZeRO-1/2/3 from
scratch; this module only sets up and measures torch's versions):

- "ddp": DistributedDataParallel + AdamW. Every rank holds parameters, gradients and state.
- "zero1": DDP + ZeroRedundancyOptimizer(AdamW). Optimizer state is sharded, by *whole
  parameters* (a greedy split by size, so ranks hold near, not exactly, 1/P of it).
- "zero2": fully_shard(reshard_after_forward=False). Gradients are reduce-scattered and
  optimizer state is sharded; the full parameters gathered for forward are *kept* through
  backward (no second all-gather) and freed after backward. So during forward and backward a
  rank holds what ZeRO-2 holds (full parameters, 1/P of gradients and state); between steps
  it holds only its parameter shard, which ZeRO-2 proper does not do.
- "zero3": fully_shard(reshard_after_forward=True). Everything is sharded; each unit's
  parameters are gathered just before its forward, freed after it, and gathered again for
  its backward.

Bytes "held" are the bytes of the storages behind this rank's tensors
(`course_lib.memory.storage_bytes`), counted on the local shard of a sharded tensor
(`DTensor.to_local()`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed.checkpoint as dcp
from matplotlib.patches import Rectangle
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from course_lib import models
from course_lib.comm import CommCounter
from course_lib.costs import ZERO_SHARDED, zero_bytes
from course_lib.data import shard
from course_lib.memory import storage_bytes
from course_lib.runtime import device, rank, world_size

STAGES = ("ddp", "zero1", "zero2", "zero3")
SHORT_NAMES = {  # for plot labels
    "ddp": "DDP",
    "zero1": "ZeroRedundancyOptimizer",
    "zero2": "FSDP2, no reshard",
    "zero3": "FSDP2, reshard",
}
STAGE_TITLES = {  # the textbook's stages, for the picture
    "ddp": "DDP: all replicated",
    "zero1": "ZeRO-1: state sharded",
    "zero2": "ZeRO-2: + gradients sharded",
    "zero3": "ZeRO-3: + parameters sharded",
}
TOOLS = {
    "ddp": "DistributedDataParallel + AdamW",
    "zero1": "DDP + ZeroRedundancyOptimizer(AdamW)",
    "zero2": "fully_shard(reshard_after_forward=False) + AdamW",
    "zero3": "fully_shard(reshard_after_forward=True) + AdamW",
}
KINDS = ("params", "grads", "optimizer_state")


def _check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; use one of {', '.join(STAGES)}")


# --- counting what a rank holds -----------------------------------------------------------


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `tensor`: the local shard of a DTensor, else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind this rank's pieces of `tensors` (a storage once)."""
    return storage_bytes(local(t) for t in tensors)


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds now (a shard, or full parameters)."""
    return held_bytes(model.parameters())


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of gradients this rank holds now."""
    return held_bytes(p.grad for p in model.parameters() if p.grad is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds: AdamW's moments. The per-tensor step
    counters (0-d tensors, one per parameter tensor, not per parameter) are left out."""
    # ZeroRedundancyOptimizer keeps the state of the parameters it owns in a local optimizer.
    inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    return held_bytes(
        value
        for state in inner.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The pieces FSDP gathers one at a time: TinyGPT's `layers()` method, else every
    submodule with parameters of its own (the Linear layers of an MLP, whose `layers` is an
    nn.Sequential attribute, not a method)."""
    if isinstance(model, DistributedDataParallel):
        model = model.module
    layers = getattr(model, "layers", None)
    if callable(layers) and not isinstance(layers, nn.Module):
        return list(layers())
    return [
        m
        for m in model.modules()
        if m is not model and next(m.parameters(recurse=False), None) is not None
    ]


# --- setting up a stage with torch's tools ------------------------------------------------


def build(stage: str, model: nn.Module, *, lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Wrap `model` (on every rank) the way torch runs `stage`; return the module to call
    and its optimizer (AdamW with learning rate `lr`)."""
    _check_stage(stage)
    if stage in ("ddp", "zero1"):
        # Gradients live in DDP's buckets (no second copy), and torch's own Python all-reduce
        # hook does DDP's averaging through dist.all_reduce, where CommCounter sees it.
        wrapped = DistributedDataParallel(model, gradient_as_bucket_view=True)
        wrapped.register_comm_hook(None, allreduce_hook)
        if stage == "ddp":
            return wrapped, torch.optim.AdamW(model.parameters(), lr=lr)
        optimizer = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, lr=lr
        )
        return wrapped, optimizer
    mesh = init_device_mesh(device().type, (world_size(),))
    reshard = stage == "zero3"
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


class ParameterWatch:
    """Records the most parameter bytes the rank holds as each unit's forward starts (with
    ZeRO-3: its shards plus the units gathered at that moment)."""

    def __init__(self, model: nn.Module) -> None:
        self.peak = 0
        # Registered after fully_shard, so each hook runs after FSDP has gathered the unit.
        self._handles = [
            unit.register_forward_pre_hook(lambda *_: self._look(model))
            for unit in shard_units(model)
        ]

    def _look(self, model: nn.Module) -> None:
        self.peak = max(self.peak, parameter_bytes(model))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass
class StageMemory:
    """Bytes one rank held in the last step of a run."""

    params_at_rest: int  # after the optimizer step
    params_in_step: int  # after forward, kept until backward
    params_peak: int  # most seen when a unit's forward starts
    grads: int  # after backward, before the step
    optimizer_state: int  # after the step

    @property
    def total(self) -> int:
        """Parameters kept through the step + gradients + optimizer state."""
        return self.params_in_step + self.grads + self.optimizer_state

    def kinds(self) -> dict[str, int]:
        """Bytes per kind, with the parameters kept through the step."""
        return {
            "params": self.params_in_step,
            "grads": self.grads,
            "optimizer_state": self.optimizer_state,
        }


@dataclass
class StageRun:
    """What one rank measured while training under a stage."""

    stage: str
    world_size: int
    n_params: int
    memory: StageMemory
    comm_received: int  # bytes received by this rank in the last step (CommCounter)
    comm_sent: int
    comm_calls: dict[str, int]
    losses: list[float]
    params: dict[str, torch.Tensor] = field(repr=False)  # full parameters after training


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter in full (gathers sharded ones: call on every rank)."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def measured_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> tuple[float, StageMemory]:
    """One AdamW step of TinyGPT on this rank's shard of `x, y`; measures what it holds."""
    watch = ParameterWatch(model)
    try:
        x, y = (shard(t, rank(), world_size()).to(device()) for t in (x, y))
        logits = model(x)
        params_in_step = parameter_bytes(model)
        loss = models.lm_loss(logits, y)
        loss.backward()
    finally:
        watch.remove()
    grads = gradient_bytes(model)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    memory = StageMemory(
        params_at_rest=parameter_bytes(model),
        params_in_step=params_in_step,
        params_peak=max(watch.peak, params_in_step),
        grads=grads,
        optimizer_state=optimizer_state_bytes(optimizer),
    )
    return loss.item(), memory


def train_stage(
    stage: str,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    lr: float = 1e-2,
    config: models.GPTConfig | None = None,
    dtype: torch.dtype = torch.float32,
) -> StageRun:
    """Train the seeded TinyGPT under `stage` on this rank (call on every rank), one step per
    full batch (each rank takes its shard); measure memory and traffic of the last step."""
    _check_stage(stage)
    for x, _ in batches:
        if x.shape[0] % world_size():
            raise ValueError(
                f"a batch of {x.shape[0]} sequences does not split into {world_size()} equal "
                "shards; use a batch size divisible by the number of ranks"
            )
    model = models.TinyGPT(config, seed=0, dtype=dtype).to(device())  # DDP wants it there
    n_params = models.count_parameters(model)
    wrapped, optimizer = build(stage, model, lr=lr)
    losses = []
    for x, y in batches:
        with CommCounter() as counter:  # the last step's counter is the one reported
            loss, memory = measured_step(wrapped, optimizer, x, y)
        losses.append(loss)
    return StageRun(
        stage=stage,
        world_size=world_size(),
        n_params=n_params,
        memory=memory,
        comm_received=counter.bytes_received,
        comm_sent=counter.bytes_sent,
        comm_calls=dict(counter.calls),
        losses=losses,
        params=full_parameters(model),
    )


# --- sharded checkpoints -------------------------------------------------------------------


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Each rank writes its own shards of the parameters and optimizer state to `path`
    (a directory shared by the ranks); call on every rank."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Each rank reads the pieces of `path` that its own shards need; call on every rank
    with a model and optimizer set up as when saving (the world size may differ)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=path)  # fills the tensors in place, shard by shard
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )


def checkpoint_files(path: str) -> dict[str, int]:
    """File name -> size in bytes of a checkpoint directory."""
    return {name: os.path.getsize(os.path.join(path, name)) for name in sorted(os.listdir(path))}


def consolidate(path: str) -> dict:
    """The full checkpoint rebuilt from the shards, in one process with no process group:
    {"model": {name: tensor}, "optimizer": {...}}."""
    with tempfile.TemporaryDirectory() as tmp:
        full = os.path.join(tmp, "full.pt")
        dcp_to_torch_save(path, full)
        return torch.load(full, weights_only=False)


# --- tables and plots ----------------------------------------------------------------------


def memory_table(
    runs: Mapping[tuple[str, int], StageMemory], n_params: int, unit: int = 1024
) -> str:
    """Measured per-rank KiB of each (stage, P) next to the fp32 formula's."""
    head = f"{'stage':<7}{'P':>3}{'params':>9}{'grads':>9}{'state':>9}{'total':>9}"
    lines = [head + f"{'formula':>9}{'measured/formula':>18}   (KiB per rank)"]
    for (stage, ranks), memory in runs.items():
        kinds = memory.kinds()
        formula = sum(zero_bytes(stage, n_params, ranks).values())
        cells = "".join(f"{kinds[k] / unit:>9.1f}" for k in KINDS)
        lines.append(
            f"{stage:<7}{ranks:>3}{cells}{memory.total / unit:>9.1f}{formula / unit:>9.1f}"
            f"{memory.total / formula:>18.3f}"
        )
    return "\n".join(lines)


def plot_memory(runs: Mapping[tuple[str, int], StageMemory], n_params: int):
    """Stacked bars of measured per-rank bytes (params, grads, state) for each stage and
    world size, with the formula's total as a black tick above each bar."""
    from course_lib.plots import NotebookFigure

    fig = NotebookFigure(figsize=(9, 3.8), layout="constrained")
    ax = fig.add_subplot()
    sizes = sorted({ranks for _, ranks in runs})
    width = 0.8 / len(sizes)
    colours = {"params": "tab:blue", "grads": "tab:orange", "optimizer_state": "tab:green"}
    for (stage, ranks), memory in runs.items():
        x = STAGES.index(stage) + (sizes.index(ranks) - (len(sizes) - 1) / 2) * width
        bottom = 0.0
        for kind, value in memory.kinds().items():
            label = kind if (stage, ranks) == next(iter(runs)) else None
            ax.bar(x, value / 1024, width * 0.9, bottom=bottom, color=colours[kind], label=label)
            bottom += value / 1024
        formula = sum(zero_bytes(stage, n_params, ranks).values()) / 1024
        ax.plot([x - width * 0.45, x + width * 0.45], [formula] * 2, "k-", lw=2)
        ax.text(x, bottom, f"P={ranks}", ha="center", va="bottom", fontsize=7)
    ax.plot([], [], "k-", lw=2, label="formula (fp32 AdamW)")
    ax.set_xticks(range(len(STAGES)), [f"{s}\n{SHORT_NAMES[s]}" for s in STAGES])
    ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # room for the legend above the bars
    ax.set_ylabel("KiB per rank")
    ax.set_title("What one rank holds: parameters kept through the step, gradients, AdamW state")
    ax.legend(fontsize=8, ncol=4, loc="upper center")
    return fig


def plot_stages(world_size: int = 4):
    """Who holds what between steps: for each stage, a rank x (params | grads | optimizer
    state) grid of P chunks each, filled where the rank keeps that chunk."""
    from course_lib.plots import NotebookFigure

    fig = NotebookFigure(figsize=(11, 2.6), layout="constrained")
    colours = {"params": "tab:blue", "grads": "tab:orange", "optimizer_state": "tab:green"}
    for i, stage in enumerate(STAGES):
        ax = fig.add_subplot(1, len(STAGES), i + 1)
        for r in range(world_size):
            for k, kind in enumerate(KINDS):
                for c in range(world_size):
                    held = kind not in ZERO_SHARDED[stage] or c == r
                    x = k * (world_size + 1) + c
                    ax.add_patch(
                        Rectangle(
                            (x, world_size - 1 - r),
                            0.9,
                            0.8,
                            color=colours[kind],
                            alpha=0.9 if held else 0.08,
                        )
                    )
        ax.set_xlim(-0.2, len(KINDS) * (world_size + 1) - 0.8)
        ax.set_ylim(-0.2, world_size)
        ax.set_xticks([k * (world_size + 1) + world_size / 2 for k in range(len(KINDS))])
        ax.set_xticklabels(["params", "grads", "state"], fontsize=8)
        ax.set_yticks([world_size - 1 - r + 0.4 for r in range(world_size)])
        ax.set_yticklabels([f"rank {r}" for r in range(world_size)], fontsize=8)
        ax.set_title(STAGE_TITLES[stage], fontsize=9)
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
    return fig
