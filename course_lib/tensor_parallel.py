"""Tensor parallelism, Megatron style: every weight matrix split across ranks (lecture 9).

    fc = ColumnParallelLinear(dense.fc)         # this rank's slice of the output columns
    proj = RowParallelLinear(dense.proj)        # this rank's slice of the input rows
    mlp = ParallelMLP(dense_mlp)                # column -> GeLU -> row: one all-reduce
    attn = ParallelSelfAttention(dense_attn)    # heads split across ranks
    emb = VocabParallelEmbedding(dense_emb)     # vocabulary rows split across ranks
    loss = vocab_parallel_cross_entropy(local_logits, targets)   # softmax over a split vocabulary

Everything rests on two autograd functions of the Megatron paper (Shoeybi et al., 2019):

- f (`copy_to_tp`): identity in forward, all-reduce of the gradient in backward. It stands
  where a replicated input enters the ranks' separate computations;
- g (`reduce_from_tp`): all-reduce in forward, identity in backward. It stands where the
  ranks' partial results are summed back into one replicated tensor.

Each layer is built from the dense layer it replaces (`ColumnParallelLinear(dense.fc)`), with
this rank's share of its weights, so it computes exactly what the dense layer computes, and
tests and lectures can compare the two. (Megatron creates each rank's shard directly and never
holds the dense model; the slicing is the same.) Assignment 9's layers take the same
arguments. All layers take an optional `group` (default: every rank), the tensor-parallel
group of a 2-D layout.

The lecture's measurements (each layer against its dense original, with the bytes it sent;
torch's own tensor parallelism; activation memory; TP against PP traffic) are in
`course_lib.measure.tensor_parallel`, the formulas in `course_lib.costs`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib import models

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


def column_shard(weight: torch.Tensor, rank: int, size: int, parts: int = 1) -> torch.Tensor:
    """Rank `rank` of `size`'s share of a dense nn.Linear weight (out, in), or of its bias, in
    a column-parallel layer: its rows, i.e. its slice of the output features (a column of A
    is a row of `weight`); with `parts` stacked blocks (q, k, v), its slice of each block."""
    blocks = weight.chunk(parts, dim=0)
    start, end = shard_range(blocks[0].shape[0], rank, size, "block")
    return torch.cat([block[start:end] for block in blocks], dim=0)


def row_shard(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank` of `size`'s share of a dense nn.Linear weight (out, in) in a row-parallel
    layer: its columns, the slice of the input features it multiplies."""
    start, end = shard_range(weight.shape[1], rank, size)
    return weight[:, start:end]


def _take_share(layer: nn.Module, dense: nn.Module) -> None:
    """Give `layer` parameters holding its share of `dense`'s weights (`layer.shard_dense`
    says which), as copies on `dense`'s device: the dense layer is left as it was."""
    for name, value in layer.shard_dense(dense.state_dict()).items():
        setattr(layer, name, nn.Parameter(value.clone()))


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
        linear: nn.Linear,
        *,
        gather_output: bool = False,
        group: dist.ProcessGroup | None = None,
        parts: int = 1,
    ) -> None:
        super().__init__()
        self.group, self.gather_output, self.parts = group, gather_output, parts
        if linear.out_features % parts:
            raise ValueError(f"out_features={linear.out_features} is not {parts} equal blocks")
        self.bias = None
        _take_share(self, linear)

    def shard_dense(self, dense: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's rows of the dense weight (and bias): a slice of each of `parts` blocks."""
        size, rank = tp_size(self.group), tp_rank(self.group)
        return {
            name: column_shard(t, rank, size, self.parts)
            for name, t in dense.items()
            if name in ("weight", "bias")
        }

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
        linear: nn.Linear,
        *,
        input_is_parallel: bool = True,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        self.bias = None
        _take_share(self, linear)

    def shard_dense(self, dense: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's columns of the dense (out, in) weight; the bias whole (replicated)."""
        out = {"weight": row_shard(dense["weight"], tp_rank(self.group), tp_size(self.group))}
        if "bias" in dense:
            out["bias"] = dense["bias"]
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


# --- transformer pieces -----------------------------------------------------------------------


class ParallelMLP(nn.Module):
    """The transformer MLP, d -> d_ff -> d: column-parallel, GeLU on the local slice,
    row-parallel. One all-reduce in forward (g) and one in backward (f)."""

    def __init__(self, mlp: models.MLPBlock, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.fc = ColumnParallelLinear(mlp.fc, group=group)
        self.proj = RowParallelLinear(mlp.proj, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GeLU acts on each element, so GeLU of a column slice is a slice of GeLU: no talk here
        return self.proj(F.gelu(self.fc(x)))


class ParallelSelfAttention(nn.Module):
    """Causal multi-head attention with the heads split across ranks: each rank projects
    q, k, v for its heads only (column-parallel), attends, and the output projection
    (row-parallel) sums the heads' contributions. One all-reduce each way, as in the MLP."""

    def __init__(
        self, attn: models.CausalSelfAttention, group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__()
        start, end = shard_range(attn.n_heads, tp_rank(group), tp_size(group), "n_heads")
        self.n_heads = end - start  # heads on this rank
        # heads are contiguous within each of q, k and v: slice the three blocks alike
        self.qkv = ColumnParallelLinear(attn.qkv, group=group, parts=3)
        self.proj = RowParallelLinear(attn.proj, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = self.qkv.weight.shape[0] // 3  # this rank's heads * head_dim
        q, k, v = self.qkv(x).split(width, dim=-1)
        return self.proj(models.causal_attention(q, k, v, self.n_heads))


class ParallelBlock(nn.Module):
    """A transformer block with tensor-parallel attention and MLP; the layer norms are
    replicated (every rank computes them on the same full activations)."""

    def __init__(self, block: models.Block, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        self.attn = ParallelSelfAttention(block.attn, group)
        self.mlp = ParallelMLP(block.mlp, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary's rows split across ranks. A rank looks up the
    tokens in its range and writes zeros for the others; g sums the ranks' lookups, and
    exactly one rank contributed each token's row."""

    def __init__(self, embedding: nn.Embedding, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = group
        vocab = embedding.num_embeddings
        self.start, self.end = shard_range(vocab, tp_rank(group), tp_size(group), "vocab")
        _take_share(self, embedding)

    def shard_dense(self, dense: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's rows (its vocabulary range) of the dense embedding table."""
        return {"weight": dense["weight"][self.start : self.end]}

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
