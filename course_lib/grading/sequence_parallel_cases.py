"""Assignment 11's cases, drawn and solved in the checking process: the whole sequence's
q, k, v and the gradient of the output, from a secret seed new for each call of a check;
the forward's output and row log-sum-exp; the gradients torch's autograd gives on one process,
in float64; each rank's share of them; and the bounds the checks hold the ranks to.

The ranks that run the student's code receive only their own rows (`PerRank`), never the
other ranks' nor the answer: a right answer must come from the messages.

    Case                      one run: world size, heads, tokens, head size, causal, layout
    draw(case, secret)        the whole sequence's q, k, v, grad_out
    solve(case, drawn)        out, lse, dq, dk, dv on one process (torch autograd, float64)
    given(case, solved, r)    what rank r's function is called with: its own rows
    ring_budget, ulysses_budget    the bounds on bytes sent
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from course_lib.costs import all_to_all_bytes, ring_attention_bytes

ITEMSIZE = 8  # float64
HOP_BYTES = 64  # per message round (ring) or per peer (Ulysses): lengths and the like
# What a rank holds may not grow with the world size: on P ranks, the busiest rank's peak may
# exceed the busiest's on MEMORY_BASELINE ranks (with the same shards) by GROWTH_BLOCKS blocks.
MEMORY_BASELINE, GROWTH_BLOCKS = 3, 1


@dataclass(frozen=True)
class Case:
    """One run: P ranks, `heads` heads of `head_dim`, `tokens` in all, which rank holds which
    positions (`positions[r]`, in the order rank r holds them; None: contiguous shards cut
    as torch.tensor_split cuts them), and `seed`, which tells cases apart."""

    world_size: int
    heads: int
    tokens: int
    head_dim: int
    causal: bool
    seed: int = 0
    positions: tuple[tuple[int, ...], ...] | None = None

    def __str__(self) -> str:
        mask = "causal" if self.causal else "not causal"
        held = "" if self.positions is None else ", your layout"
        return (
            f"world size {self.world_size}, {self.heads} heads, {self.tokens} tokens, "
            f"head_dim {self.head_dim}, {mask}{held}"
        )

    def held(self, r: int) -> list[int]:
        """The positions rank r holds, in its order."""
        if self.positions is not None:
            return list(self.positions[r])
        return torch.arange(self.tokens).tensor_split(self.world_size)[r].tolist()

    def lengths(self) -> list[int]:
        return [len(self.held(r)) for r in range(self.world_size)]

    def block_bytes(self) -> int:
        """One block: a (heads, longest shard, head_dim) float64 tensor."""
        return self.heads * max(self.lengths()) * self.head_dim * ITEMSIZE


def draw(case: Case, secret: int) -> dict[str, torch.Tensor]:
    """The whole sequence's q, k, v and grad_out, (heads, tokens, head_dim) float64. Scores
    spread over several units, so that a softmax gone wrong shows."""
    g = torch.Generator().manual_seed(secret ^ (1_000_003 * case.seed + 101 * case.tokens))
    shape = (case.heads, case.tokens, case.head_dim)
    q, k, v, grad_out = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(4))
    return {"q": 1.5 * q, "k": 1.5 * k, "v": v, "grad_out": grad_out}


def solve(case: Case, drawn: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Attention on one process over the whole sequence, in position order, and its gradients
    by torch's autograd: out = softmax(q k^T / sqrt(d)) v (a query at position i seeing the
    keys at positions <= i when causal), lse = the log of each row's sum of exp(scores), and
    dq, dk, dv, the gradient of sum(out * grad_out)."""
    q, k, v = (drawn[name].clone().requires_grad_() for name in "qkv")
    scores = q @ k.transpose(-2, -1) / math.sqrt(case.head_dim)
    if case.causal:
        future = torch.ones(case.tokens, case.tokens, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    out.backward(drawn["grad_out"])
    return {
        **drawn,
        "out": out.detach(),
        "lse": torch.logsumexp(scores, dim=-1).detach(),
        "dq": q.grad,
        "dk": k.grad,
        "dv": v.grad,
    }


ARGUMENTS = ("grad_out", "q", "k", "v", "out", "lse")  # what the student's function is given
GRADIENTS = ("dq", "dk", "dv")


def rows(case: Case, x: torch.Tensor, r: int) -> torch.Tensor:
    """Rank r's rows of a whole-sequence tensor (dim 1, the tokens), in rank r's order."""
    return x[:, case.held(r)].contiguous()


def given(case: Case, solved: dict[str, torch.Tensor], r: int) -> tuple[torch.Tensor, ...]:
    """Rank r's arguments: its rows of grad_out, q, k, v, out and lse."""
    return tuple(rows(case, solved[name], r) for name in ARGUMENTS)


def expected(case: Case, solved: dict[str, torch.Tensor], r: int) -> dict[str, torch.Tensor]:
    """Rank r's rows of dq, dk and dv."""
    return {name: rows(case, solved[name], r) for name in GRADIENTS}


def ring_budget(case: Case) -> int:
    """Bytes a rank may send in ring attention's backward: 4(P-1) + 2 blocks (the backward
    ring's volume, twice `costs.ring_attention_bytes` of the whole K and V as
    `costs.cp_layer_bytes` counts it, and one more round of two blocks), plus, per message
    round (P of them), 16 bytes per token of a block per head (two numbers per row) and
    `HOP_BYTES`. Shards that differ in length count as the longest."""
    P = case.world_size
    if P == 1:
        return 0
    longest = max(case.lengths())
    kv = 2 * case.heads * P * longest * case.head_dim * ITEMSIZE  # K and V, padded shards
    rows_ = 2 * case.heads * longest * ITEMSIZE
    return int(2 * ring_attention_bytes(kv, P)) + 2 * case.block_bytes() + P * (rows_ + HOP_BYTES)


def ulysses_budget(case: Case) -> int:
    """Bytes a rank may send in Ulysses' backward: seven all-to-alls of its q-sized block
    (q, k, v and grad_out to head shards, dq, dk, dv back) and one of two numbers per row
    (`costs.all_to_all_bytes`), plus `HOP_BYTES` per peer."""
    local = case.block_bytes() * 7 + 2 * case.heads * max(case.lengths()) * ITEMSIZE
    return int(all_to_all_bytes(local, case.world_size)) + HOP_BYTES * (case.world_size - 1)


__all__ = [
    "ARGUMENTS",
    "GRADIENTS",
    "HOP_BYTES",
    "ITEMSIZE",
    "GROWTH_BLOCKS",
    "MEMORY_BASELINE",
    "Case",
    "draw",
    "expected",
    "given",
    "ring_budget",
    "rows",
    "solve",
    "ulysses_budget",
]
