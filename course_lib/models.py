"""Small seeded models shared by lectures, assignments and graders.

The same seed gives bit-identical weights in every process, without touching the caller's
random state, so a single-process reference and every rank of a distributed run can build
"the same model" independently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """Linear layers with ReLU between them: sizes=(8, 32, 32, 4) is 8 -> 32 -> 32 -> 4."""

    def __init__(
        self,
        sizes: tuple[int, ...] = (8, 32, 32, 4),
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            layers: list[nn.Module] = []
            for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
                layers.append(nn.Linear(fan_in, fan_out, dtype=dtype))
                if i < len(sizes) - 2:
                    layers.append(nn.ReLU())
            self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


@dataclass
class GPTConfig:
    """Sizes of the tiny GPT; the defaults train in seconds on a CPU."""

    vocab_size: int = 32
    seq_len: int = 16
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 128


class CausalSelfAttention(nn.Module):
    """Multi-head attention where position t only sees positions <= t."""

    def __init__(self, config: GPTConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, dtype=dtype)
        self.proj = nn.Linear(config.d_model, config.d_model, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(x.shape[-1], dim=-1)
        return self.proj(causal_attention(q, k, v, self.n_heads))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_heads: int):
    """Each of `n_heads` heads attends to the past: q, k and v are (batch, time, width), width
    = n_heads * head_dim (all heads of the model, or one tensor-parallel rank's share)."""
    batch, time, width = q.shape
    head_dim = width // n_heads
    # (batch, time, width) -> (batch, heads, time, head_dim): heads attend independently
    q, k, v = (t.view(batch, time, n_heads, head_dim).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
    future = torch.ones(time, time, dtype=torch.bool, device=q.device).triu(1)
    weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return (weights @ v).transpose(1, 2).reshape(batch, time, width)


class MLPBlock(nn.Module):
    """The transformer's feed-forward part: d_model -> d_ff -> d_model with GELU."""

    def __init__(self, config: GPTConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.d_ff, dtype=dtype)
        self.proj = nn.Linear(config.d_ff, config.d_model, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """One pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model, dtype=dtype)
        self.attn = CausalSelfAttention(config, dtype)
        self.ln2 = nn.LayerNorm(config.d_model, dtype=dtype)
        self.mlp = MLPBlock(config, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """Token embedding plus learned position embedding."""

    def __init__(self, config: GPTConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.d_model, dtype=dtype)
        self.positions = nn.Embedding(config.seq_len, config.d_model, dtype=dtype)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tokens(idx) + self.positions(positions)


class LMHead(nn.Module):
    """Final layer norm and the projection to vocabulary logits."""

    def __init__(self, config: GPTConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(config.d_model, dtype=dtype)
        self.out = nn.Linear(config.d_model, config.vocab_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


class TinyGPT(nn.Module):
    """A GPT-style language model small enough to train on a laptop CPU in seconds.

    It is a chain `head(blocks(embed(idx)))`; `layers()` returns that chain as a list, so
    pipeline parallelism can cut it into stages with `pipeline_stages(n)`.
    """

    def __init__(
        self, config: GPTConfig | None = None, seed: int = 0, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.config = config = config or GPTConfig()
        if config.d_model % config.n_heads:
            raise ValueError(
                f"d_model={config.d_model} must be divisible by n_heads={config.n_heads}"
            )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = Embedding(config, dtype)
            self.blocks = nn.ModuleList(Block(config, dtype) for _ in range(config.n_layers))
            self.head = LMHead(config, dtype)

    def layers(self) -> list[nn.Module]:
        """The model as a chain of layers: embedding, each block, the head."""
        return [self.embed, *self.blocks, self.head]

    def pipeline_stages(self, n_stages: int) -> list[nn.Sequential]:
        """Cut `layers()` into `n_stages` contiguous stages of near-equal layer counts."""
        layers = self.layers()
        if not 1 <= n_stages <= len(layers):
            raise ValueError(f"cannot cut {len(layers)} layers into {n_stages} stages")
        bounds = [round(i * len(layers) / n_stages) for i in range(n_stages + 1)]
        return [nn.Sequential(*layers[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of next-token predictions."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def count_parameters(model: nn.Module) -> int:
    """Number of scalar parameters in `model`."""
    return sum(p.numel() for p in model.parameters())
