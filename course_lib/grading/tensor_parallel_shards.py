"""Assignment 9's layers and where each rank's shard of them sits.

A `Case` is one layer to check (column- or row-parallel linear, MLP block or attention) with
its sizes. `draw` draws, in the checking process and from a secret new for every call of a
check, the dense layer's weights, the input, the upstream gradient and each rank's nudge;
`shard_index` says which rows or columns of each dense parameter rank r holds ("block r of
n" = r*n/P .. (r+1)*n/P - 1; attention heads' q, k and v rows), `expected_shards` /
`assemble` take a dense layer apart into shards and put it back, and `given` is what one rank
is sent: the dense layer with everything outside its shard zeroed, and its view of the input
and the gradient. `dense_reference` is the dense layer run forward and backward in the
checking process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from course_lib.models import CausalSelfAttention, GPTConfig, MLPBlock

DTYPE = torch.float64


@dataclass(frozen=True)
class Case:
    """One layer to check: which kind and its sizes (`seed` picks them, and names the case;
    the weights and data come from a secret, `draw`)."""

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


def dense_layer(case: Case, params: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """The float64 dense layer of the case, with `params` if given (else a fixed seeded
    initialisation: the checks never use it, they draw the weights from a secret)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if case.kind in ("column", "row"):
            layer = nn.Linear(case.in_features, case.out_features, bias=case.bias, dtype=DTYPE)
        else:
            config = GPTConfig(
                d_model=case.in_features, d_ff=case.out_features, n_heads=case.n_heads
            )
            make = MLPBlock if case.kind == "mlp" else CausalSelfAttention
            layer = make(config, DTYPE)
    if params is not None:
        with torch.no_grad():
            for name, p in layer.named_parameters():
                p.copy_(params[name])
    return layer


@dataclass(frozen=True)
class Drawn:
    """One case's secret draw: the dense weights, the input x, the upstream gradient of the
    whole output, and per rank the amount added to each of its shards (`nudges[r]`)."""

    params: dict[str, torch.Tensor]
    x: torch.Tensor
    grad: torch.Tensor
    nudges: list[dict[str, torch.Tensor]]


def draw(case: Case, secret: int, ranks: int) -> Drawn:
    """Weights as nn.Linear's initialisation would spread them (uniform, 1/sqrt(fan_in)),
    biases likewise, data N(0, 1); each rank's nudge N(0, 0.1^2), for its shards only."""
    g = torch.Generator().manual_seed(secret)
    params = {}
    for name, p in dense_layer(case).named_parameters():
        weight = params.get(name.removesuffix("bias") + "weight", p)  # a bias: its weight's
        bound = weight.shape[-1] ** -0.5
        params[name] = (2 * torch.rand(p.shape, generator=g, dtype=DTYPE) - 1) * bound
    x = torch.randn(case.input_shape(), generator=g, dtype=DTYPE)
    grad = torch.randn((*case.batch, case.output_features()), generator=g, dtype=DTYPE)
    nudges = []
    for r in range(ranks):
        mine = expected_shards(case, params, r, ranks)
        nudges.append(
            {
                name: 0.1 * torch.randn(t.shape, generator=g, dtype=DTYPE)
                for name, t in mine.items()
                if shard_index(case, name, r, ranks) is not None
            }
        )
    return Drawn(params, x, grad, nudges)


def given(case: Case, drawn: Drawn, r: int, ranks: int) -> tuple:
    """What rank r is sent: the dense parameters with every entry outside its shard zeroed
    (a rank of a tensor-parallel layer holds only its shard; the layer's constructor takes
    the dense layer, so it gets one, holding nothing of the other ranks'), its input (block
    r of the features for a row-parallel layer), the upstream gradient (block r of the output
    features where the output stays split) and its nudges."""
    x, grad = drawn.x, drawn.grad
    if case.kind == "row":  # the input arrives split by features
        x = x[..., block(case.in_features, r, ranks)]
    if case.kind == "column" and not case.gather_output:  # the output stays split
        grad = grad[..., block(case.out_features, r, ranks)]
    return rank_params(case, drawn.params, r, ranks), x.clone(), grad.clone(), drawn.nudges[r]


def rank_params(case: Case, params: dict[str, torch.Tensor], r: int, ranks: int) -> dict:
    """The dense parameters as rank r is given them: its shards in place, zeros elsewhere."""
    out = {}
    for name, t in params.items():
        index = shard_index(case, name, r, ranks)
        if index is None:
            out[name] = t.clone()
        else:
            out[name] = torch.zeros_like(t)
            out[name][index] = t[index]
    return out


def nudged_params(case: Case, drawn: Drawn) -> dict[str, torch.Tensor]:
    """The dense parameters that the ranks' shards form after each rank's nudge."""
    ranks = len(drawn.nudges)
    shards = []
    for r, nudge in enumerate(drawn.nudges):
        mine = expected_shards(case, drawn.params, r, ranks)
        shards.append({name: t + nudge[name] if name in nudge else t for name, t in mine.items()})
    return assemble(case, drawn.params, shards)


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


def dense_reference(case: Case, drawn: Drawn, params: dict | None = None) -> dict:
    """The dense layer of the draw (or with `params`) run forward on x and backward with the
    upstream gradient."""
    dense = dense_layer(case, drawn.params if params is None else params)
    x = drawn.x.clone().requires_grad_(True)
    out = dense(x)
    out.backward(drawn.grad)
    return {
        "params": {n: p.detach() for n, p in dense.named_parameters()},
        "out": out.detach(),
        "x_grad": x.grad,
        "grads": {n: p.grad for n, p in dense.named_parameters()},
        "upstream": drawn.grad,
    }
