"""Assignment 9's layers and where each rank's shard of them sits.

A `Case` is one layer to check (column- or row-parallel linear, MLP block or attention) with
its sizes and seed. `dense_layer` builds the seeded float64 dense layer that every rank builds
its parallel layer from; `shard_index` says which rows or columns of each dense parameter rank
r holds ("block r of n" = r*n/P .. (r+1)*n/P - 1; attention heads' q, k and v rows), and
`expected_shards` / `assemble` take a dense layer apart into shards and put it back.
`dense_reference` is the dense layer run forward and backward in the checking process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from course_lib.models import CausalSelfAttention, GPTConfig, MLPBlock

DTYPE = torch.float64


@dataclass(frozen=True)
class Case:
    """One layer to check: which kind, its sizes and the seed of its weights and data."""

    kind: str  # "column", "row", "mlp" or "attention"
    seed: int = 0
    in_features: int = 8  # d_model for "mlp" and "attention"
    out_features: int = 12  # d_ff for "mlp"; unused for "attention"
    n_heads: int = 4
    bias: bool = True
    gather_output: bool = False
    batch: tuple[int, ...] = (3, 5)  # leading dimensions of the input

    def describe(self, ranks: int) -> str:
        if self.kind in ("column", "row"):
            extra = ", gather_output=True" if self.gather_output else ""
            extra += "" if self.bias else ", bias=False"
            what = f"nn.Linear({self.in_features}, {self.out_features}{extra})"
        elif self.kind == "mlp":
            what = f"MLPBlock(d_model={self.in_features}, d_ff={self.out_features})"
        else:
            what = f"CausalSelfAttention(d_model={self.in_features}, n_heads={self.n_heads})"
        return f"{what}, seed {self.seed}, input {self.input_shape()}, on {ranks} rank(s)"

    def input_shape(self) -> tuple[int, ...]:
        return (*self.batch, self.in_features)

    def output_features(self) -> int:
        return self.out_features if self.kind in ("column", "row") else self.in_features


def dense_layer(case: Case) -> nn.Module:
    """The seeded float64 dense layer that the parallel one is built from."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(case.seed)
        if case.kind in ("column", "row"):
            return nn.Linear(case.in_features, case.out_features, bias=case.bias, dtype=DTYPE)
        config = GPTConfig(d_model=case.in_features, d_ff=case.out_features, n_heads=case.n_heads)
        if case.kind == "mlp":
            return MLPBlock(config, DTYPE)
        return CausalSelfAttention(config, DTYPE)


def layer_data(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The input x and the upstream gradient of the whole output (same on every rank)."""
    g = torch.Generator().manual_seed(10_000 + case.seed)
    x = torch.randn(case.input_shape(), generator=g, dtype=DTYPE)
    grad = torch.randn((*case.batch, case.output_features()), generator=g, dtype=DTYPE)
    return x, grad


def block(n: int, r: int, ranks: int) -> slice:
    """Rank r's contiguous block of n rows or columns."""
    return slice(r * n // ranks, (r + 1) * n // ranks)


def head_rows(d_model: int, r: int, ranks: int) -> torch.Tensor:
    """Rows of the dense qkv weight that rank r holds: its heads' q rows, then k, then v."""
    rows = torch.arange(d_model)[block(d_model, r, ranks)]
    return torch.cat([rows, rows + d_model, rows + 2 * d_model])


def shard_index(case: Case, name: str, r: int, ranks: int) -> tuple | None:
    """Where rank r's share of dense parameter `name` sits in it (`dense[index]`), or None
    for a parameter every rank holds whole (a row-parallel bias)."""
    if case.kind == "column":
        return (block(case.out_features, r, ranks),)
    if case.kind == "row":
        return (slice(None), block(case.in_features, r, ranks)) if name == "weight" else None
    if name == "proj.bias":
        return None
    inner = case.out_features if case.kind == "mlp" else case.in_features
    if name == "proj.weight":
        return (slice(None), block(inner, r, ranks))
    if case.kind == "mlp":  # fc: a block of rows
        return (torch.arange(case.out_features)[block(case.out_features, r, ranks)],)
    return (head_rows(case.in_features, r, ranks),)  # qkv: this rank's heads' q, k, v rows


def expected_shards(case: Case, dense: dict[str, torch.Tensor], r: int, ranks: int) -> dict:
    """Rank r's share of each dense tensor (weights, or their gradients), by name."""
    out = {}
    for name, t in dense.items():
        index = shard_index(case, name, r, ranks)
        out[name] = t if index is None else t[index]
    return out


def assemble(case: Case, dense: dict[str, torch.Tensor], shards: list[dict]) -> dict:
    """The dense parameters with every rank's shard written back in its place (shared
    tensors from rank 0): the layer the ranks compute together."""
    out = {name: t.clone() for name, t in dense.items()}
    for r, held in enumerate(shards):
        for name in out:
            index = shard_index(case, name, r, len(shards))
            if index is not None:
                out[name][index] = held[name]
            elif r == 0:
                out[name] = held[name].clone()
    return out


# --- the dense reference, in the checking process -----------------------------------------


def dense_reference(case: Case, params: dict | None = None) -> dict:
    dense = dense_layer(case)
    if params is not None:
        dense.load_state_dict(params)
    x, grad = layer_data(case)
    x.requires_grad_(True)
    out = dense(x)
    out.backward(grad)
    return {
        "params": {n: p.detach() for n, p in dense.named_parameters()},
        "out": out.detach(),
        "x_grad": x.grad,
        "grads": {n: p.grad for n, p in dense.named_parameters()},
        "upstream": grad,
    }
