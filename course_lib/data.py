"""Synthetic, seeded data sets generated on the spot (nothing is downloaded).

Every function takes a seed and uses its own generator, so the same call gives the same
tensors in every process and never disturbs the caller's random state.
"""

from __future__ import annotations

import torch


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def regression(
    n: int,
    in_dim: int = 8,
    out_dim: int = 4,
    noise: float = 0.1,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs x and targets y = x @ W + noise for a fixed random W."""
    g = _generator(seed)
    x = torch.randn(n, in_dim, generator=g, dtype=dtype)
    w = torch.randn(in_dim, out_dim, generator=g, dtype=dtype) / in_dim**0.5
    y = x @ w + noise * torch.randn(n, out_dim, generator=g, dtype=dtype)
    return x, y


def classification(
    n: int,
    dim: int = 8,
    classes: int = 4,
    spread: float = 1.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Points x around one random centre per class, and their labels y."""
    g = _generator(seed)
    centres = 2.0 * torch.randn(classes, dim, generator=g, dtype=dtype)
    y = torch.randint(classes, (n,), generator=g)
    x = centres[y] + spread * torch.randn(n, dim, generator=g, dtype=dtype)
    return x, y


def tokens(
    n_seqs: int, seq_len: int = 16, vocab_size: int = 32, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences from a fixed random Markov chain (each token has few likely successors),
    as inputs x and next-token targets y. A language model can learn it, so losses fall."""
    g = _generator(seed)
    # A sparse-ish transition table: 3 likely successors per token, the rest rare.
    logits = torch.randn(vocab_size, vocab_size, generator=g)
    top = logits.topk(3, dim=1).indices
    transition = torch.full((vocab_size, vocab_size), 0.02)
    transition.scatter_(1, top, 1.0)
    transition /= transition.sum(dim=1, keepdim=True)
    seqs = torch.empty(n_seqs, seq_len + 1, dtype=torch.long)
    seqs[:, 0] = torch.randint(vocab_size, (n_seqs,), generator=g)
    for t in range(seq_len):
        seqs[:, t + 1] = torch.multinomial(transition[seqs[:, t]], 1, generator=g).squeeze(1)
    return seqs[:, :-1], seqs[:, 1:]


def batches(
    x: torch.Tensor, y: torch.Tensor, batch_size: int, steps: int, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` mini-batches drawn without replacement (reshuffling when the data runs out)."""
    g = _generator(seed)
    out, order = [], torch.empty(0, dtype=torch.long)
    for _ in range(steps):
        if len(order) < batch_size:
            order = torch.cat([order, torch.randperm(len(x), generator=g)])
        idx, order = order[:batch_size], order[batch_size:]
        out.append((x[idx], y[idx]))
    return out


def shard(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s contiguous share of a batch split along dim 0 (sizes differ by at most
    one when the batch does not divide evenly)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    return torch.tensor_split(batch, world_size)[rank]
