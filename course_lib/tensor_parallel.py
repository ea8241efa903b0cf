"""Tensor parallelism, Megatron style: every weight matrix split across ranks (lecture 9).

    fc = ColumnParallelLinear.from_dense(dense.fc)      # this rank's slice of the output columns
    proj = RowParallelLinear.from_dense(dense.proj)     # this rank's slice of the input rows
    mlp = ParallelMLP.from_dense(dense_mlp)             # column -> GeLU -> row: one all-reduce
    attn = ParallelSelfAttention.from_dense(dense_attn) # heads split across ranks
    emb = VocabParallelEmbedding.from_dense(dense_emb)  # vocabulary rows split across ranks
    loss = vocab_parallel_cross_entropy(local_logits, targets)   # softmax over a split vocabulary
    activation_table(GPT3_175B)                         # GB of activations per GPU, by TP degree

Everything rests on two autograd functions of the Megatron paper (Shoeybi et al., 2019):

- f (`copy_to_tp`): identity in forward, all-reduce of the gradient in backward. It stands
  where a replicated input enters the ranks' separate computations;
- g (`reduce_from_tp`): all-reduce in forward, identity in backward. It stands where the
  ranks' partial results are summed back into one replicated tensor.

Each layer is built from the dense layer's weights (`from_dense`), so it computes exactly
what the dense layer computes, and tests and lectures can compare the two. All layers take
an optional `group` (default: every rank), the tensor-parallel group of a 2-D layout.

Below the layers, the lecture's measurements and formulas: `run_against_dense` (one layer
against its dense original, with the bytes `CommCounter` saw) and `comm_formula`; torch's
`parallelize_module` version of the MLP (`run_torch_mlp`); activation memory per layer
(`activation_table`, from `course_lib.costs.activation_memory`); and TP against PP traffic
per micro-batch (`traffic_per_microbatch`, `link_table`). The formulas live in
`course_lib.costs`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib import models
from course_lib.comm import CommCounter
from course_lib.costs import activation_memory, all_reduce_bytes, pp_boundary_bytes, tp_layer_bytes
from course_lib.memory import SavedTensors

if TYPE_CHECKING:  # matplotlib is imported only where a figure is drawn
    import matplotlib.figure

# --- the tensor-parallel group ---------------------------------------------------------------


def tp_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in the tensor-parallel group (1 without torch.distributed)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def tp_rank(group: dist.ProcessGroup | None = None) -> int:
    """This rank's index in the tensor-parallel group (0 without torch.distributed)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def shard_range(n: int, rank: int, size: int, what: str = "dimension") -> tuple[int, int]:
    """[start, end) of rank `rank`'s equal share of `n` items; an even split is required."""
    if n % size:
        raise ValueError(f"{what} of size {n} cannot be split evenly over {size} ranks")
    width = n // size
    return rank * width, (rank + 1) * width


# --- f and g, and the two ways to enter or leave a split last dimension ----------------------


class CopyToParallel(torch.autograd.Function):
    """Megatron's f: forward passes the input through; backward sums the ranks' gradients,
    because every rank used the same input for a different part of the computation."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()  # autograd may hand the same tensor to others
        if tp_size(ctx.group) > 1:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromParallel(torch.autograd.Function):
    """Megatron's g: forward sums the ranks' partial results; backward passes the gradient
    through, because every rank holds the same (replicated) output and its gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        x = x.contiguous().clone()
        if tp_size(group) > 1:
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class GatherFromParallel(torch.autograd.Function):
    """Forward: all-gather the ranks' slices of the last dimension into the whole tensor.
    Backward: keep this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        size = tp_size(group)
        if size == 1:
            return x.view_as(x)
        pieces = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        start, end = shard_range(grad.shape[-1], tp_rank(ctx.group), tp_size(ctx.group))
        return grad[..., start:end].contiguous(), None


class ScatterToParallel(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dimension. Backward: all-gather the
    slices' gradients into the gradient of the whole tensor."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        start, end = shard_range(x.shape[-1], tp_rank(group), tp_size(group))
        return x[..., start:end].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return GatherFromParallel.apply(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """f: identity forward, all-reduce backward."""
    return CopyToParallel.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """g: all-reduce forward, identity backward."""
    return ReduceFromParallel.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-gather the last dimension forward, keep this rank's slice backward."""
    return GatherFromParallel.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Keep this rank's slice of the last dimension forward, all-gather backward."""
    return ScatterToParallel.apply(x, group)


# --- linear layers ----------------------------------------------------------------------------


def _load(layer: nn.Module, dense: nn.Module) -> nn.Module:
    """Give `layer` its share of `dense`'s weights, on `dense`'s device."""
    layer.to(next(dense.parameters()).device)
    layer.load_state_dict(local_view(layer, dense.state_dict()))
    return layer


def local_view(module: nn.Module, dense: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's piece of each tensor of the dense model (its weights, or its gradients),
    named as `module`'s parameters. Parallel layers say how they slice (`shard_dense`);
    anything else (a LayerNorm) is replicated whole."""
    if hasattr(module, "shard_dense"):
        return module.shard_dense(dense)
    out = {name: dense[name] for name, _ in module.named_parameters(recurse=False)}
    for child_name, child in module.named_children():
        prefix = child_name + "."
        sub = {k[len(prefix) :]: v for k, v in dense.items() if k.startswith(prefix)}
        out.update({prefix + k: v for k, v in local_view(child, sub).items()})
    return out


class ColumnParallelLinear(nn.Module):
    """Y = XA with A split by columns: each rank computes its slice of the output features.

    (nn.Linear stores A transposed, as weight = A^T of shape (out, in), so a column of A is
    a row of `weight`.) The input is replicated, so it enters through f. With
    `gather_output` the slices are all-gathered into the full output; Megatron leaves them
    split, for a row-parallel layer to consume. `parts=3` is for a fused q, k, v projection:
    the output is three stacked blocks, and each rank takes its slice of every block.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        gather_output: bool = False,
        group: dist.ProcessGroup | None = None,
        parts: int = 1,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.group, self.gather_output, self.parts = group, gather_output, parts
        if out_features % parts:
            raise ValueError(f"out_features={out_features} is not {parts} equal blocks")
        start, end = shard_range(out_features // parts, tp_rank(group), tp_size(group), "block")
        local = parts * (end - start)
        self.weight = nn.Parameter(torch.empty(local, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(local, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's initialisation

    def shard_dense(self, dense: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's rows of the dense weight (and bias): a slice of each of `parts` blocks."""
        size, rank = tp_size(self.group), tp_rank(self.group)

        def rows(t: torch.Tensor) -> torch.Tensor:
            blocks = t.chunk(self.parts, dim=0)
            start, end = shard_range(blocks[0].shape[0], rank, size, "block")
            return torch.cat([block[start:end] for block in blocks], dim=0)

        return {name: rows(t) for name, t in dense.items() if name in ("weight", "bias")}

    @classmethod
    def from_dense(
        cls,
        linear: nn.Linear,
        *,
        gather_output: bool = False,
        group: dist.ProcessGroup | None = None,
        parts: int = 1,
    ) -> ColumnParallelLinear:
        """This rank's share of `linear`, with the same weights."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            gather_output=gather_output,
            group=group,
            parts=parts,
            dtype=linear.weight.dtype,
        )
        return _load(layer, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tp(x, self.group), self.weight, self.bias)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = XA with A split by rows: each rank multiplies its slice of the input features by
    its rows of A, and g sums the partial products. The bias is added once, after the sum.

    `input_is_parallel=True` (Megatron's default after a column-parallel layer): the input is
    already this rank's slice. Otherwise the full input is sliced here.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        input_is_parallel: bool = True,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        start, end = shard_range(in_features, tp_rank(group), tp_size(group), "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, end - start, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def shard_dense(self, dense: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's columns of the dense (out, in) weight; the bias whole (replicated)."""
        w = dense["weight"]
        start, end = shard_range(w.shape[1], tp_rank(self.group), tp_size(self.group))
        out = {"weight": w[:, start:end]}
        if "bias" in dense:
            out["bias"] = dense["bias"]
        return out

    @classmethod
    def from_dense(
        cls,
        linear: nn.Linear,
        *,
        input_is_parallel: bool = True,
        group: dist.ProcessGroup | None = None,
    ) -> RowParallelLinear:
        """This rank's share of `linear`, with the same weights."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            input_is_parallel=input_is_parallel,
            group=group,
            dtype=linear.weight.dtype,
        )
        return _load(layer, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


# --- transformer pieces -----------------------------------------------------------------------


class ParallelMLP(nn.Module):
    """The transformer MLP, d -> d_ff -> d: column-parallel, GeLU on the local slice,
    row-parallel. One all-reduce in forward (g) and one in backward (f)."""

    def __init__(self, fc: ColumnParallelLinear, proj: RowParallelLinear) -> None:
        super().__init__()
        self.fc, self.proj = fc, proj

    @classmethod
    def from_dense(
        cls, mlp: models.MLPBlock, group: dist.ProcessGroup | None = None
    ) -> ParallelMLP:
        """This rank's share of the course's `MLPBlock`, with the same weights."""
        return cls(
            ColumnParallelLinear.from_dense(mlp.fc, group=group),
            RowParallelLinear.from_dense(mlp.proj, group=group),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GeLU acts on each element, so GeLU of a column slice is a slice of GeLU: no talk here
        return self.proj(F.gelu(self.fc(x)))


class ParallelSelfAttention(nn.Module):
    """Causal multi-head attention with the heads split across ranks: each rank projects
    q, k, v for its heads only (column-parallel), attends, and the output projection
    (row-parallel) sums the heads' contributions. One all-reduce each way, as in the MLP."""

    def __init__(self, qkv: ColumnParallelLinear, proj: RowParallelLinear, n_heads: int) -> None:
        super().__init__()
        self.qkv, self.proj = qkv, proj
        self.n_heads = n_heads  # heads on this rank

    @classmethod
    def from_dense(
        cls, attn: models.CausalSelfAttention, group: dist.ProcessGroup | None = None
    ) -> ParallelSelfAttention:
        """This rank's heads of the course's `CausalSelfAttention`, with the same weights."""
        start, end = shard_range(attn.n_heads, tp_rank(group), tp_size(group), "n_heads")
        return cls(
            # heads are contiguous within each of q, k and v: slice the three blocks alike
            ColumnParallelLinear.from_dense(attn.qkv, group=group, parts=3),
            RowParallelLinear.from_dense(attn.proj, group=group),
            n_heads=end - start,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        width = self.qkv.weight.shape[0] // 3  # this rank's heads * head_dim
        head_dim = width // self.n_heads
        q, k, v = self.qkv(x).split(width, dim=-1)
        q, k, v = (t.view(batch, time, self.n_heads, head_dim).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
        future = torch.ones(time, time, dtype=torch.bool, device=x.device).triu(1)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(batch, time, width)
        return self.proj(out)


class ParallelBlock(nn.Module):
    """A transformer block with tensor-parallel attention and MLP; the layer norms are
    replicated (every rank computes them on the same full activations)."""

    def __init__(self, block: models.Block, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        self.attn = ParallelSelfAttention.from_dense(block.attn, group)
        self.mlp = ParallelMLP.from_dense(block.mlp, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary's rows split across ranks. A rank looks up the
    tokens in its range and writes zeros for the others; g sums the ranks' lookups, and
    exactly one rank contributed each token's row."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        *,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.group = group
        self.start, self.end = shard_range(vocab_size, tp_rank(group), tp_size(group), "vocab")
        self.weight = nn.Parameter(torch.randn(self.end - self.start, dim, dtype=dtype))

    def shard_dense(self, dense: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's rows (its vocabulary range) of the dense embedding table."""
        return {"weight": dense["weight"][self.start : self.end]}

    @classmethod
    def from_dense(
        cls, embedding: nn.Embedding, group: dist.ProcessGroup | None = None
    ) -> VocabParallelEmbedding:
        """This rank's rows of `embedding`, with the same weights."""
        vocab, dim = embedding.weight.shape
        return _load(cls(vocab, dim, group=group, dtype=embedding.weight.dtype), embedding)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)  # any valid row; zeroed below
        rows = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(rows, self.group)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of logits whose vocabulary is split across ranks, never gathering them:
    only three numbers per token cross the network (the max, the sum of exponentials and the
    target's logit)."""

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup | None
    ) -> torch.Tensor:
        start, end = tp_rank(group) * logits.shape[-1], (tp_rank(group) + 1) * logits.shape[-1]
        # Subtract the global max so exp() cannot overflow; any shared constant works.
        biggest = logits.detach().max(dim=-1).values
        dist.all_reduce(biggest, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - biggest.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=group)
        # The target's logit lives on one rank; the others contribute 0 to the sum.
        outside = (targets < start) | (targets >= end)
        local = (targets - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        dist.all_reduce(target_logit, group=group)
        ctx.save_for_backward(exp / total.unsqueeze(-1), local, outside)
        return total.log() - target_logit

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # d loss / d logit = softmax - one_hot(target): both already local, no communication
        softmax, local, outside = ctx.saved_tensors
        one_hot = F.one_hot(local, softmax.shape[-1]).to(softmax.dtype)
        one_hot = one_hot.masked_fill(outside.unsqueeze(-1), 0.0)
        return (softmax - one_hot) * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Per-token cross-entropy (no reduction) when this rank holds its slice of the vocabulary
    (the last dimension) of the logits, as a column-parallel LM head leaves them."""
    if tp_size(group) == 1:
        flat = F.cross_entropy(local_logits.flatten(0, -2), targets.flatten(), reduction="none")
        return flat.view(targets.shape)
    return VocabParallelCrossEntropy.apply(local_logits, targets, group)


def gelu_split_errors(x: torch.Tensor, a: torch.Tensor, parts: int = 2) -> dict[str, float]:
    """Why Megatron splits A by columns: max |difference| from GeLU(XA) of the column split
    [GeLU(XA_1), ...], of the row split GeLU(X_1A_1) + ..., and of the row split with the
    partial products summed (all-reduced) before GeLU."""
    exact = F.gelu(x @ a)
    error = lambda approx: (approx - exact).abs().max().item()
    columns = torch.cat([F.gelu(x @ a_i) for a_i in a.chunk(parts, dim=1)], dim=-1)
    products = [x_i @ a_i for x_i, a_i in zip(x.chunk(parts, -1), a.chunk(parts, 0), strict=True)]
    return {
        "columns: [GeLU(XA_1), GeLU(XA_2), ...]": error(columns),
        "rows: GeLU(X_1A_1) + GeLU(X_2A_2) + ...": error(sum(F.gelu(p) for p in products)),
        "rows, summed first: GeLU(X_1A_1 + X_2A_2 + ...)": error(F.gelu(sum(products))),
    }


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
    layer: str, tokens: int, hidden: int, world: int, element_size: int = 4
) -> tuple[float, float]:
    """Bytes one rank sends in forward and in backward through `layer` with `world` ranks."""
    if layer not in ALL_REDUCES:
        raise ValueError(f"unknown layer {layer!r}; expected one of {LAYERS}")
    # Floats: the formula's exact share, not the whole bytes CommCounter rounds down to.
    activation = float(tokens * hidden * element_size)
    forward, backward = (all_reduce_bytes(n * activation, world) for n in ALL_REDUCES[layer])
    if layer == "head + cross-entropy":  # max, sum of exponentials, target logit per token
        forward += 3 * all_reduce_bytes(float(tokens * element_size), world)
    return forward, backward


@dataclass
class LayerRun:
    """One layer run forward and backward on a rank: its errors against the dense layer and
    the bytes and calls CommCounter saw in each pass."""

    layer: str
    output_error: float
    input_grad_error: float
    weight_grad_error: float
    forward_bytes: int
    backward_bytes: int
    forward_calls: dict[str, int]
    backward_calls: dict[str, int]


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
            "column": lambda: ColumnParallelLinear.from_dense(dense, group=group),
            "row": lambda: RowParallelLinear.from_dense(dense, group=group),
            "mlp": lambda: ParallelMLP.from_dense(dense, group),
            "attention": lambda: ParallelSelfAttention.from_dense(dense, group),
            "block": lambda: ParallelBlock(dense, group),
            "embedding": lambda: VocabParallelEmbedding.from_dense(dense, group),
        }[layer]()
        return dense, parallel, dense, parallel
    if layer == "head + cross-entropy":
        dense = model.head.out
        parallel = ColumnParallelLinear.from_dense(dense, group=group)
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
    with CommCounter() as forward:
        yp = parallel_fn(xp)
    with CommCounter() as backward:
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
    )


def run_all_layers(config: models.GPTConfig | None = None, batch: int = 2) -> list[LayerRun]:
    """`run_against_dense` for every layer in `LAYERS` (on every rank, inside `launch`)."""
    return [run_against_dense(layer, config, batch) for layer in LAYERS]


def layer_table(runs: list[LayerRun], tokens: int, hidden: int, world: int) -> str:
    """One row per layer: worst error, and bytes sent per pass against `comm_formula`."""
    rows = [
        f"{'layer':<22}{'max error':>11}{'fwd sent':>10}{'formula':>10}"
        f"{'bwd sent':>10}{'formula':>10}  all-reduces (fwd, bwd)"
    ]
    for run in runs:
        fwd, bwd = comm_formula(run.layer, tokens, hidden, world, element_size=8)
        error = max(run.output_error, run.input_grad_error, run.weight_grad_error)
        calls = (run.forward_calls.get("all_reduce", 0), run.backward_calls.get("all_reduce", 0))
        rows.append(
            f"{run.layer:<22}{error:>11.1e}{run.forward_bytes:>10,}{fwd:>10,.0f}"
            f"{run.backward_bytes:>10,}{bwd:>10,.0f}  {calls}"
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
    ours = ParallelMLP.from_dense(dense)
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


# --- activation memory (the formula: `course_lib.costs.activation_memory`) ---------------------

VARIANTS = {  # label: keyword arguments of activation_memory
    "TP": {},
    "TP + SP": {"sequence_parallel": True},
    "TP + SP + selective recompute": {"sequence_parallel": True, "recompute_attention": True},
}


@dataclass(frozen=True)
class TransformerShape:
    """The sizes the formulas need: layers L, hidden h, heads a, sequence s, micro-batch b."""

    layers: int
    hidden: int
    heads: int
    seq: int
    batch: int = 1


GPT3_175B = TransformerShape(layers=96, hidden=12288, heads=96, seq=2048, batch=1)


def activation_table(shape: TransformerShape, tps: tuple[int, ...] = (1, 2, 4, 8)) -> str:
    """GB of activations per GPU for the whole model (all layers, one micro-batch) under each
    variant and tensor-parallel degree t."""
    s, b, h, a = shape.seq, shape.batch, shape.hidden, shape.heads
    rows = [f"{'':<32}" + "".join(f"{f't={t}':>10}" for t in tps)]
    for label, kwargs in VARIANTS.items():
        cells = [shape.layers * activation_memory(s, b, h, a, t, **kwargs) / 1e9 for t in tps]
        rows.append(f"{label:<32}" + "".join(f"{gb:>10.1f}" for gb in cells))
    return "\n".join(rows)


def plot_activation_memory(
    shape: TransformerShape, tps: tuple[int, ...] = (1, 2, 4, 8)
) -> matplotlib.figure.Figure:
    """GB of activations per GPU against t, one line per variant, with the 80 GB of a GPU."""
    from course_lib.plots import NotebookFigure

    fig = NotebookFigure(figsize=(6, 3.6), layout="constrained")
    ax = fig.add_subplot()
    s, b, h, a = shape.seq, shape.batch, shape.hidden, shape.heads
    for label, kwargs in VARIANTS.items():
        gb = [shape.layers * activation_memory(s, b, h, a, t, **kwargs) / 1e9 for t in tps]
        ax.plot(tps, gb, "o-", label=label)
    ax.axhline(80, color="black", ls="--", lw=1, label="one 80 GB GPU")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(tps), [str(t) for t in tps])
    ax.set_xlabel("tensor-parallel ranks t")
    ax.set_ylabel("activations per GPU (GB)")
    ax.set_title(f"{shape.layers} layers, h={h}, a={a}, s={s}, b={b}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def mlp_saved_formula(tokens: int, hidden: int, d_ff: int, t: int, element_size: int) -> int:
    """Bytes the course's (dropout-free) MLP saves for backward on one of t ranks: its input
    (replicated), and GeLU's input and output (d_ff/t wide each: split)."""
    return tokens * (hidden + 2 * d_ff // t) * element_size


def measure_mlp_saved(config: models.GPTConfig | None = None, batch: int = 2) -> int:
    """Bytes autograd saves in this rank's ParallelMLP forward (fp32), weights excluded."""
    config = config or models.GPTConfig()
    mlp = ParallelMLP.from_dense(models.TinyGPT(config).blocks[0].mlp)
    x = torch.randn(batch, config.seq_len, config.d_model)
    with SavedTensors(exclude=mlp.parameters()) as saved:
        y = mlp(x)
    del y
    return saved.peak_bytes


# --- why TP stays inside a node and PP crosses nodes ---------------------------------------------


def traffic_per_microbatch(
    shape: TransformerShape, t: int, p: int, element_size: int = 2
) -> dict[str, float]:
    """Bytes one GPU sends per micro-batch (forward and backward) under tensor parallelism
    over t ranks (4 all-reduces of an sbh activation per layer it holds) and at one
    pipeline-stage boundary (the activation forward, its gradient back)."""
    activation = shape.seq * shape.batch * shape.hidden * element_size
    layers_per_stage = shape.layers / p
    return {
        "TP": layers_per_stage * tp_layer_bytes(float(activation), t),
        "PP": pp_boundary_bytes(activation),
    }


def compute_seconds(shape: TransformerShape, t: int, p: int, flops_per_s: float) -> float:
    """Seconds one GPU computes per micro-batch: forward + backward = 3 x forward FLOPs,
    forward = 24bsh^2 + 4bs^2h per layer (the matmuls), split over t ranks and p stages."""
    s, b, h = shape.seq, shape.batch, shape.hidden
    per_layer = 3 * (24 * b * s * h * h + 4 * b * s * s * h)
    return shape.layers / p * per_layer / t / flops_per_s


def link_table(
    shape: TransformerShape,
    t: int,
    p: int,
    links: Mapping[str, float],
    flops_per_s: float,
) -> str:
    """Per micro-batch and GPU: bytes of TP and PP traffic, and their seconds on each link,
    next to the compute time."""
    traffic = traffic_per_microbatch(shape, t, p)
    compute = compute_seconds(shape, t, p, flops_per_s)
    rows = [f"compute per micro-batch per GPU: {compute * 1e3:.0f} ms"]
    for kind, nbytes in traffic.items():
        times = ", ".join(f"{name} {nbytes / bw * 1e3:.1f} ms" for name, bw in links.items())
        rows.append(f"{kind}: {nbytes / 1e9:.2f} GB sent per micro-batch -> {times}")
    return "\n".join(rows)
