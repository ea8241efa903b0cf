"""Lecture 9's layers on ranks: each tensor-parallel layer against its dense original, with
the all-reduces it runs and the bytes it sends against the formula; torch's own tensor
parallelism beside ours; and the all-reduces f and g run in each pass."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib import models
from course_lib.comm import CommCounter, WireCounter
from course_lib.costs import (
    all_reduce_bytes,
)
from course_lib.tensor_parallel import (
    ColumnParallelLinear,
    ParallelBlock,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    local_view,
    reduce_from_tp,
    shard_range,
    tp_rank,
    tp_size,
    vocab_parallel_cross_entropy,
)

# --- communication per layer ------------------------------------------------------------------

# All-reduces of a (tokens x hidden) activation per layer, in (forward, backward). The column
# layer's is f's (its input gradient), the row layer's g's (its output); the MLP and attention
# have one of each; a block has an attention and an MLP; the embedding only g.
ALL_REDUCES = {
    "column": (0, 1),
    "row": (1, 0),
    "mlp": (1, 1),
    "attention": (1, 1),
    "block": (2, 2),
    "embedding": (1, 0),
    "head + cross-entropy": (0, 1),  # plus three per-token scalars in forward, below
}
LAYERS = tuple(ALL_REDUCES)


def comm_formula(
    layer: str, tokens: int, hidden: int, world_size: int, element_size: int = 4
) -> tuple[float, float]:
    """Bytes one rank sends in forward and in backward through `layer` with `world_size` ranks."""
    if layer not in ALL_REDUCES:
        raise ValueError(f"unknown layer {layer!r}; expected one of {LAYERS}")
    # Floats: the formula's exact share, not the whole bytes CommCounter rounds down to.
    activation = float(tokens * hidden * element_size)
    forward, backward = (all_reduce_bytes(n * activation, world_size) for n in ALL_REDUCES[layer])
    if layer == "head + cross-entropy":  # max, sum of exponentials, target logit per token
        forward += 3 * all_reduce_bytes(float(tokens * element_size), world_size)
    return forward, backward


@dataclass
class LayerRun:
    """One layer run forward and backward on a rank: its errors against the dense layer, the
    bytes and calls CommCounter counted in each pass (per call, by the ring model: a formula),
    and the bytes the process really wrote to its sockets meanwhile (WireCounter: measured)."""

    layer: str
    output_error: float
    input_grad_error: float
    weight_grad_error: float
    forward_bytes: int
    backward_bytes: int
    forward_calls: dict[str, int]
    backward_calls: dict[str, int]
    forward_wire: int = 0
    backward_wire: int = 0


def _pair(
    layer: str, model: models.TinyGPT, group: dist.ProcessGroup | None
) -> tuple[nn.Module, nn.Module, Callable, Callable]:
    """(dense module, parallel module, dense forward, parallel forward) for `layer`."""
    block = model.blocks[0]
    if layer in ("column", "row", "mlp", "attention", "block", "embedding"):
        dense = {
            "column": block.mlp.fc,
            "row": block.mlp.proj,
            "mlp": block.mlp,
            "attention": block.attn,
            "block": block,
            "embedding": model.embed.tokens,
        }[layer]
        parallel = {
            "column": lambda: ColumnParallelLinear(dense, group=group),
            "row": lambda: RowParallelLinear(dense, group=group),
            "mlp": lambda: ParallelMLP(dense, group),
            "attention": lambda: ParallelSelfAttention(dense, group),
            "block": lambda: ParallelBlock(dense, group),
            "embedding": lambda: VocabParallelEmbedding(dense, group),
        }[layer]()
        return dense, parallel, dense, parallel
    if layer == "head + cross-entropy":
        dense = model.head.out
        parallel = ColumnParallelLinear(dense, group=group)
        targets = torch.arange(model.config.seq_len) % model.config.vocab_size

        def dense_loss(h: torch.Tensor) -> torch.Tensor:
            logits = dense(h)
            flat = F.cross_entropy(
                logits.flatten(0, 1), targets.repeat(h.shape[0]), reduction="none"
            )
            return flat.view(h.shape[:2])

        def parallel_loss(h: torch.Tensor) -> torch.Tensor:
            return vocab_parallel_cross_entropy(parallel(h), targets.expand(h.shape[:2]), group)

        return dense, parallel, dense_loss, parallel_loss
    raise ValueError(f"unknown layer {layer!r}; expected one of {LAYERS}")


def run_against_dense(
    layer: str,
    config: models.GPTConfig | None = None,
    batch: int = 2,
    dtype: torch.dtype = torch.float64,
    group: dist.ProcessGroup | None = None,
    seed: int = 0,
) -> LayerRun:
    """Run one tensor-parallel layer of TinyGPT and its dense original on the same input and
    upstream gradient; compare this rank's output and gradients with its share of the
    dense ones, and count the bytes each pass sends. Call it on every rank of `group`."""
    config = config or models.GPTConfig()
    model = models.TinyGPT(config, seed=seed, dtype=dtype)
    dense, parallel, dense_fn, parallel_fn = _pair(layer, model, group)
    g = torch.Generator().manual_seed(seed + 1)
    size, rank = tp_size(group), tp_rank(group)

    def my_slice(t: torch.Tensor) -> torch.Tensor:  # this rank's share of the last dimension
        start, end = shard_range(t.shape[-1], rank, size)
        return t[..., start:end]

    if layer == "embedding":
        x = torch.randint(config.vocab_size, (batch, config.seq_len), generator=g)
    else:
        width = dense.in_features if isinstance(dense, nn.Linear) else config.d_model
        x = torch.randn(batch, config.seq_len, width, generator=g, dtype=dtype)
        x.requires_grad_()
    y = dense_fn(x)
    upstream = torch.randn(y.shape, generator=g, dtype=dtype)
    y.backward(upstream)

    local_in = my_slice if layer == "row" else (lambda t: t)  # row takes a sliced input
    local_out = my_slice if layer == "column" else (lambda t: t)  # column leaves it sliced
    xp = local_in(x.detach())
    if xp.is_floating_point():
        xp = xp.clone().requires_grad_()
    with CommCounter() as forward, WireCounter() as forward_wire:
        yp = parallel_fn(xp)
    with CommCounter() as backward, WireCounter() as backward_wire:
        yp.backward(local_out(upstream))

    dense_grads = local_view(parallel, {n: p.grad for n, p in dense.named_parameters()})
    weight_error = max(
        (p.grad - dense_grads[n]).abs().max().item() for n, p in parallel.named_parameters()
    )
    input_error = 0.0 if xp.grad is None else (xp.grad - local_in(x.grad)).abs().max().item()
    return LayerRun(
        layer=layer,
        output_error=(yp - local_out(y)).abs().max().item(),
        input_grad_error=input_error,
        weight_grad_error=weight_error,
        forward_bytes=forward.bytes_sent,
        backward_bytes=backward.bytes_sent,
        forward_calls=dict(forward.calls),
        backward_calls=dict(backward.calls),
        forward_wire=forward_wire.bytes_written,
        backward_wire=backward_wire.bytes_written,
    )


def run_all_layers(config: models.GPTConfig | None = None, batch: int = 2) -> list[LayerRun]:
    """`run_against_dense` for every layer in `LAYERS` (on every rank, inside `launch`)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(torch.zeros(1))  # gloo's first call sets up its connections: not counted
    return [run_against_dense(layer, config, batch) for layer in LAYERS]


def layer_table(runs: list[LayerRun], tokens: int, hidden: int, world_size: int) -> str:
    """One row per layer: worst error; per pass, the bytes CommCounter counted (ring model),
    `comm_formula`'s, and the bytes written to the sockets (WireCounter); the all-reduces."""
    rows = [
        f"{'':<33}{'-------- forward --------':>27}{'------- backward --------':>27}",
        f"{'layer':<22}{'max error':>11}"
        + f"{'counted':>9}{'formula':>9}{'wire':>9}" * 2
        + "  all-reduces (fwd, bwd)",
    ]
    for run in runs:
        fwd, bwd = comm_formula(run.layer, tokens, hidden, world_size, element_size=8)
        error = max(run.output_error, run.input_grad_error, run.weight_grad_error)
        calls = (run.forward_calls.get("all_reduce", 0), run.backward_calls.get("all_reduce", 0))
        rows.append(
            f"{run.layer:<22}{error:>11.1e}"
            f"{run.forward_bytes:>9,}{fwd:>9,.0f}{run.forward_wire:>9,}"
            f"{run.backward_bytes:>9,}{bwd:>9,.0f}{run.backward_wire:>9,}  {calls}"
        )
    return "\n".join(rows)


# --- torch's tensor parallelism, for comparison -------------------------------------------------


def torch_parallel_mlp(mlp: models.MLPBlock) -> nn.Module:
    """torch's own version of `ParallelMLP`: `parallelize_module` turns `fc` and `proj` into
    DTensor layers (column-wise, row-wise) over a 1-D device mesh of every rank. In place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh(str(next(mlp.parameters()).device.type), (tp_size(),))
    return parallelize_module(mlp, mesh, {"fc": ColwiseParallel(), "proj": RowwiseParallel()})


def run_torch_mlp(config: models.GPTConfig | None = None, batch: int = 2) -> dict:
    """Our ParallelMLP and torch's side by side on this rank, against the dense MLP (fp64):
    errors of output and input gradient, the local weight shapes, and the collectives each
    pass ran (torch's DTensor calls functional collectives, which `CommDebugMode` counts)."""
    from torch.distributed.tensor.debug import CommDebugMode

    config = config or models.GPTConfig()
    dense = models.TinyGPT(config, dtype=torch.float64).blocks[0].mlp
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, config.seq_len, config.d_model, generator=g, dtype=torch.float64)
    x.requires_grad_()
    dense(x).sum().backward()
    result = {}
    ours = ParallelMLP(dense)
    theirs = torch_parallel_mlp(copy.deepcopy(dense))
    for name, module in (("ours", ours), ("torch", theirs)):
        xi = x.detach().clone().requires_grad_()
        with CommDebugMode() as forward:
            y = module(xi)
        with CommDebugMode() as backward:
            y.sum().backward()
        result[name] = {
            "output error": (y - dense(x)).abs().max().item(),
            "input grad error": (xi.grad - x.grad).abs().max().item(),
            "fc weight on this rank": tuple(_local(module.fc.weight).shape),
            "forward collectives": {str(k): v for k, v in forward.get_comm_counts().items()},
            "backward collectives": {str(k): v for k, v in backward.get_comm_counts().items()},
        }
    return result


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


# --- f and g: which pass talks ---------------------------------------------------------------


def f_and_g_all_reduces(numel: int = 8) -> dict[str, tuple[int, int]]:
    """The all-reduces f (`copy_to_tp`) and g (`reduce_from_tp`) run on this rank, as
    (forward, backward), counted by CommCounter around each pass (inside `launch`)."""
    counts = {}
    for name, fn in (("f", copy_to_tp), ("g", reduce_from_tp)):
        x = torch.ones(numel, dtype=torch.float64, requires_grad=True)
        with CommCounter() as forward:
            y = fn(x)
        with CommCounter() as backward:
            y.backward(torch.ones_like(y))
        counts[name] = (forward.calls["all_reduce"], backward.calls["all_reduce"])
    return counts
