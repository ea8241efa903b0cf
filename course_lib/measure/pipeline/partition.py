"""Checking and feeding lecture 8's partition: every cut tried by brute force, and each layer's
seconds and output bytes measured."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence

import torch
from torch import nn

from course_lib.pipeline import (
    Partition,
    Stage,
    check_partition_input,
    link_times,
    stage_time,
    sync_times,
)

# --- checking and feeding the partition ------------------------------------------------


def brute_force_partition(
    layer_times: Sequence[float],
    activation_sizes: Sequence[float],
    n_machines: int,
    bandwidth: float = 1.0,
    weight_sizes: Sequence[float] | None = None,
    replicate: bool = True,
) -> Partition:
    """Every cut into consecutive stages and every split of the machines among them, the
    fastest (exponential: small cases only; Assignment 8's `optimal_partition` finds the same
    in polynomial time)."""
    check_partition_input(layer_times, activation_sizes, n_machines, bandwidth)
    n = len(layer_times)
    sync = sync_times(weight_sizes, n, bandwidth)
    comm = link_times(activation_sizes, bandwidth)
    best: Partition | None = None
    for n_stages in range(1, min(n, n_machines) + 1):
        for cuts in itertools.combinations(range(n - 1), n_stages - 1):
            bounds = [-1, *cuts, n - 1]
            links = max((comm[c] for c in cuts), default=0.0)
            if replicate:  # every way to give each stage at least one of the machines
                splits = [
                    [b - a for a, b in zip((0, *cut), (*cut, n_machines), strict=True)]
                    for cut in itertools.combinations(range(1, n_machines), n_stages - 1)
                ]
            else:
                splits = [[1] * n_stages]
            for machines in splits:
                stages = tuple(
                    Stage(bounds[s] + 1, bounds[s + 1], machines[s]) for s in range(n_stages)
                )
                slowest = max(
                    links,
                    *(stage_time(layer_times, sync, s.first, s.last, s.machines) for s in stages),
                )
                if best is None or slowest < best.time:
                    best = Partition(slowest, stages)
    return best


def profile_layers(
    layers: Sequence[nn.Module], x: torch.Tensor, repeats: int = 5
) -> tuple[list[float], list[int]]:
    """Measure each layer's forward + backward seconds and the bytes of its output (what a
    stage boundary after it sends): the DP's T_l and a_l. Rounds go through all layers in
    turn, after one warm-up round, and each layer keeps its fastest time: on a shared
    machine, other processes only ever add time."""
    times = [math.inf] * len(layers)
    sizes = [0] * len(layers)
    for round_ in range(repeats + 1):
        inp = x
        for i, layer in enumerate(layers):
            inp = inp.detach().requires_grad_(inp.is_floating_point())
            start = time.perf_counter()
            out = layer(inp)
            out.backward(torch.ones_like(out))
            if round_ > 0:  # round 0 warms up (first calls allocate and dispatch slowly)
                times[i] = min(times[i], time.perf_counter() - start)
            sizes[i] = out.numel() * out.element_size()
            inp = out
    return times, sizes
