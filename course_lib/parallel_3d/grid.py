"""The grid of ranks (lecture 10, section 2): tp x pp x dp ranks laid out as one (dp, pp, tp)
array, every TP, PP and DP group a line of it, and the same groups created for real with
`dist.new_group`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist

DIMENSIONS = ("tp", "pp", "dp")  # innermost (neighbouring ranks) first, as in picotron


@dataclass(frozen=True)
class ProcessGrid:
    """tp x pp x dp ranks laid out as a (dp, pp, tp) array: rank = (d * pp + p) * tp + t.

    Tensor-parallel partners are neighbouring ranks, so with TP no larger than a node they
    share a node (ranks are numbered node by node). The pipeline comes next, data parallelism
    is outermost."""

    tp: int
    pp: int
    dp: int

    def __post_init__(self) -> None:
        for name in DIMENSIONS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def _array(self) -> np.ndarray:
        return np.arange(self.world_size).reshape(self.dp, self.pp, self.tp)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's position on each axis: {"tp": t, "pp": p, "dp": d}."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a grid of {self.world_size} ranks")
        d, p, t = np.unravel_index(rank, (self.dp, self.pp, self.tp))
        return {"tp": int(t), "pp": int(p), "dp": int(d)}

    def groups(self, kind: str) -> list[list[int]]:
        """Every group of `kind` ("tp", "pp" or "dp"): the ranks that differ only in that
        coordinate, in the order of that coordinate (a pipeline group lists stages 0, 1, ...)."""
        if kind not in DIMENSIONS:
            raise ValueError(f"unknown group kind {kind!r}; use one of {DIMENSIONS}")
        axis = {"dp": 0, "pp": 1, "tp": 2}[kind]
        # Move the axis last: each row is then one group.
        rows = np.moveaxis(self._array(), axis, -1).reshape(-1, getattr(self, kind))
        return sorted(row.tolist() for row in rows)

    def group_of(self, rank: int, kind: str) -> list[int]:
        """The `kind` group that `rank` belongs to."""
        self.coords(rank)  # validates the rank
        return next(g for g in self.groups(kind) if rank in g)


def spans_nodes(ranks: Sequence[int], gpus_per_node: int) -> bool:
    """True if `ranks` sit on more than one node (ranks are numbered node by node)."""
    return len({r // gpus_per_node for r in ranks}) > 1


def new_groups(grid: ProcessGrid) -> dict[str, dist.ProcessGroup]:
    """Create every group of the grid with `dist.new_group` and return this rank's three.
    Call it on every rank: each rank must take part in creating every group, in one order."""
    if dist.get_world_size() != grid.world_size:
        raise ValueError(
            f"the grid has {grid.world_size} ranks but the process group {dist.get_world_size()}; "
            f"launch with world_size={grid.world_size}"
        )
    mine = {}
    for kind in DIMENSIONS:
        for ranks in grid.groups(kind):
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine[kind] = group
    return mine
