"""Activation checkpointing on a chain of layers: k segments, only their inputs kept in
forward, each segment recomputed in backward; measured (`measure_chain`, `time_chain`) and
modelled (`checkpoint_units`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from course_lib.memory.activations import SavedTensors


def chain(n_layers: int, width: int, seed: int = 0) -> nn.Sequential:
    """`n_layers` identical layers Linear(width, width) + ReLU: each saves one activation of
    batch x width values for backward (ReLU's output is the next Linear's input)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(
            *(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(n_layers))
        )


def segments(layers: nn.Sequential, k: int) -> list[nn.Sequential]:
    """Cut `layers` into `k` contiguous segments of near-equal length."""
    n = len(layers)
    if not 1 <= k <= n:
        raise ValueError(f"cannot cut {n} layers into {k} segments; use 1 <= k <= {n}")
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [layers[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def checkpointed_forward(layers: nn.Sequential, x: torch.Tensor, k: int | None) -> torch.Tensor:
    """Forward through `layers`; with `k` segments, keep only each segment's input and
    recompute the segment's activations during backward (k=None: plain forward)."""
    if k is None:
        return layers(x)
    for segment in segments(layers, k):
        # Reentrant checkpointing recomputes under our saved-tensor hooks, so SavedTensors
        # sees the recomputed activations; the non-reentrant mode hides them in its own hooks.
        x = checkpoint(segment, x, use_reentrant=True)
    return x


@dataclass
class ChainRun:
    """One forward and backward of a chain: saved bytes after forward, peak, gradients."""

    forward_bytes: int
    peak_bytes: int
    grads: list[torch.Tensor]


def _chain_loss(layers: nn.Sequential, x: torch.Tensor, k: int | None) -> torch.Tensor:
    return checkpointed_forward(layers, x, k).square().mean()


def measure_chain(layers: nn.Sequential, x: torch.Tensor, k: int | None = None) -> ChainRun:
    """Forward and backward through `layers` with `k` checkpointed segments (None: none),
    counting saved bytes live after forward and at the peak over forward and backward."""
    layers.zero_grad(set_to_none=True)
    # Reentrant checkpointing needs an input that requires grad, or no gradient flows back.
    x = x.detach().requires_grad_(True)
    with SavedTensors(exclude=layers.parameters()) as saved:
        loss = _chain_loss(layers, x, k)
        forward_bytes = saved.live_bytes
        loss.backward()
    grads = [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()]
    return ChainRun(forward_bytes, saved.peak_bytes, grads)


def time_chain(
    layers: nn.Sequential, x: torch.Tensor, ks: Sequence[int | None], rounds: int = 7
) -> dict[int | None, float]:
    """Median seconds of one forward and backward for each number of segments in `ks`
    (None: no checkpointing). The runs take turns, so a busy moment slows all of them."""
    x = x.detach().requires_grad_(True)
    times: dict[int | None, list[float]] = {k: [] for k in ks}
    for _ in range(rounds):
        for k in ks:
            layers.zero_grad(set_to_none=True)
            start = time.perf_counter()
            _chain_loss(layers, x, k).backward()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(t) for k, t in times.items()}


def time_forward(layers: nn.Sequential, x: torch.Tensor, rounds: int = 7) -> float:
    """Median seconds of one plain forward (with autograd recording, as in training)."""
    x = x.detach().requires_grad_(True)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        _chain_loss(layers, x, None)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def checkpoint_units(n_layers: int, k: int) -> float:
    """The formula n/k + k: peak activations, in one layer's activations, with k segments
    (the k segment inputs kept through forward, plus one segment recomputed in backward)."""
    return n_layers / k + k


def divisors(n: int) -> list[int]:
    """The k that cut n layers into equal segments."""
    return [k for k in range(1, n + 1) if n % k == 0]
