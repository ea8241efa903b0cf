"""Cutting a model into stages: the time of a stage and of the link after it, what a cut is
(`Stage`, `Partition`), and the modules of each stage, one per rank of a pipeline (lecture 8).
The cut that minimises the slowest of them is found by trying every one
(`measure.pipeline.brute_force_partition`); PipeDream's dynamic program, which finds it in
polynomial time, is Assignment 8's Part 3."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from course_lib.costs import pp_boundary_bytes

# --- cutting a model into stages --------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """Layers first..last (inclusive, 0-based) replicated on `machines` machines."""

    first: int
    last: int
    machines: int


@dataclass(frozen=True)
class Partition:
    """A cut of the layers into consecutive stages, and the time of its slowest part."""

    time: float
    stages: tuple[Stage, ...]

    @property
    def noam(self) -> int:
        """NUM_OPT_ACTIVE_MINIBATCHES: micro-batches to admit at once to keep every machine
        busy in the steady state, ceil(machines / machines of the input stage)."""
        return math.ceil(sum(s.machines for s in self.stages) / self.stages[0].machines)


def stage_time(
    layer_times: Sequence[float], sync_times: Sequence[float], first: int, last: int, machines: int
) -> float:
    """T(first -> last, m): the stage's compute split over m replicas, or its weight
    synchronisation if that is slower (the two overlap): max(sum T_l, sum W_l) / m."""
    compute = sum(layer_times[first : last + 1])
    sync = sum(sync_times[first : last + 1]) if machines > 1 else 0.0
    return max(compute, sync) / machines


def sync_times(weight_sizes: Sequence[float] | None, n: int, bandwidth: float) -> list[float]:
    # Ring all-reduce of a layer's weights among replicas: about 2 * size / bandwidth.
    sizes = weight_sizes if weight_sizes is not None else [0.0] * n
    if len(sizes) != n:
        raise ValueError(f"weight_sizes has {len(sizes)} entries for {n} layers")
    return [2.0 * w / bandwidth for w in sizes]


def link_times(activation_sizes: Sequence[float], bandwidth: float) -> list[float]:
    # The link after layer i carries its activations forward and their gradients back.
    return [pp_boundary_bytes(a) / bandwidth for a in activation_sizes]


def check_partition_input(layer_times, activation_sizes, n_machines, bandwidth) -> None:
    if not layer_times or len(layer_times) != len(activation_sizes):
        raise ValueError(
            f"need one time and one activation size per layer: got {len(layer_times)} "
            f"times and {len(activation_sizes)} sizes"
        )
    if isinstance(n_machines, bool) or not isinstance(n_machines, int) or n_machines < 1:
        raise ValueError(f"n_machines must be a whole number >= 1, got {n_machines!r}")
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be > 0, got {bandwidth}")


def partition_stages(layers: Sequence[nn.Module], partition: Partition) -> list[nn.Sequential]:
    """The modules of each stage of `partition`, one per rank of a pipeline."""
    return [nn.Sequential(*layers[s.first : s.last + 1]) for s in partition.stages]
