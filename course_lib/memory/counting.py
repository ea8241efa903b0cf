"""Counting bytes: each tensor storage once (a view shares its base's), and what training
keeps per parameter (`training_memory`: weights, gradients, optimizer state) against the
formula."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

GB = 1e9  # memory budgets are quoted in decimal gigabytes, as GPU data sheets do (80 GB)

# --- counting bytes ------------------------------------------------------------------------


def storage_key(t: torch.Tensor) -> tuple[int, str]:
    storage = t.untyped_storage()
    return storage.data_ptr(), str(storage.device)


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors`, each storage counted once (views are free)."""
    seen: dict[tuple[int, str], int] = {}
    for t in tensors:
        seen[storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


@dataclass(frozen=True)
class Row:
    """One category of training memory: its name, the dtypes of its tensors, its bytes."""

    category: str
    dtype: str
    bytes: int


@dataclass
class MemoryBreakdown:
    """Bytes per category of what training keeps, for a model of `n_params` parameters."""

    rows: list[Row]
    n_params: int

    @property
    def total(self) -> int:
        return sum(row.bytes for row in self.rows)

    def bytes_of(self, category: str) -> int:
        """Bytes of one category (0 if training holds none of it)."""
        return sum(row.bytes for row in self.rows if row.category == category)

    def per_parameter(self) -> dict[str, float]:
        """Bytes per parameter of each category."""
        return {row.category: row.bytes / self.n_params for row in self.rows}

    def table(self, formula: Mapping[str, float] | None = None) -> str:
        """A text table: bytes and bytes/parameter per category, next to `formula`'s."""
        header = f"{'category':<24}{'dtype':<18}{'bytes':>12}{'bytes/param':>13}"
        lines = [header + ("" if formula is None else f"{'formula':>9}")]
        for row in self.rows:
            line = f"{row.category:<24}{row.dtype:<18}{row.bytes:>12,}"
            line += f"{row.bytes / self.n_params:>13.3f}"
            if formula is not None:
                line += f"{formula.get(row.category, 0):>9}"
            lines.append(line)
        total = f"{'total':<42}{self.total:>12,}{self.total / self.n_params:>13.3f}"
        if formula is not None:
            total += f"{sum(formula.values()):>9}"
        return "\n".join([*lines, total, f"({self.n_params:,} parameters)"])

    def __str__(self) -> str:
        return self.table()


def training_memory(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> MemoryBreakdown:
    """Count the bytes of `model`'s weights and gradients and of `optimizer`'s parameters,
    gradients and state. A storage already counted in an earlier category is not counted
    again, so an optimizer stepping the model's own parameters adds no "master weights"."""
    seen: set[tuple[int, str]] = set()
    rows: list[Row] = []

    def add(category: str, tensors: Iterable[torch.Tensor]) -> None:
        fresh: dict[tuple[int, str], torch.Tensor] = {}
        for t in tensors:
            key = storage_key(t)
            if key not in seen:
                fresh[key] = t
        if fresh:
            seen.update(fresh)
            dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in fresh.values()})
            nbytes = storage_bytes(fresh.values())
            rows.append(Row(category, "/".join(dtypes), nbytes))

    params = list(model.parameters())
    add("weights", params)
    add("gradients", [p.grad for p in params if p.grad is not None])
    if optimizer is not None:
        stepped = [p for group in optimizer.param_groups for p in group["params"]]
        add("master weights", stepped)
        add("master gradients", [p.grad for p in stepped if p.grad is not None])
        names = sorted({name for state in optimizer.state.values() for name in state})
        for name in names:
            values = [s[name] for s in optimizer.state.values() if name in s]
            add(f"optimizer: {name}", [v for v in values if isinstance(v, torch.Tensor)])
    return MemoryBreakdown(rows, sum(p.numel() for p in params))
