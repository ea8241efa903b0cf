"""Part of Assignment 7's checks (grading/zero.py): the sharding rule, and how a
rank's bytes are counted.

The sharding rule, the same for every stage (as in FSDP): each parameter is flattened and
padded with zeros to a multiple of P; rank r owns the r-th of P equal chunks, which holds
c = ceil(numel / P) elements (`chunk_range`, `chunk_of`); `shard_bytes` is the most one
rank may hold.

Bytes are counted per storage, so a view that keeps a whole tensor alive counts as the whole
tensor: the optimizer state (`optimizer_state_bytes`), the gradients (`gradient_bytes`), what
the model's modules hold (`held_bytes`), every tensor Python can reach (`live_tensor_bytes`),
and the float64 storages outside the model where a private full copy would be
(`storages_elsewhere`).
"""

from __future__ import annotations

import gc
import math
import warnings
from collections.abc import Iterable

import torch
from torch import nn

from course_lib import _worker

# --- the sharding rule --------------------------------------------------------------------


def chunk_range(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of the flattened elements rank `rank` owns; chunks hold
    ceil(numel / world_size) elements, the last one(s) fewer (padding makes up the rest)."""
    chunk = shard_numel(numel, world_size)
    return min(rank * chunk, numel), min((rank + 1) * chunk, numel)


def shard_numel(numel: int, world_size: int) -> int:
    """Elements of one padded shard: ceil(numel / world_size)."""
    return math.ceil(numel / world_size)


def shard_bytes(model: nn.Module, world_size: int, values_per_element: int = 1) -> int:
    """The most bytes one rank may hold: ceil(numel / P) elements of each parameter, times
    `values_per_element` (2 for AdamW's state), summed over the parameters."""
    return sum(
        shard_numel(p.numel(), world_size) * p.element_size() * values_per_element
        for p in model.parameters()
    )


def largest_parameter_bytes(model: nn.Module) -> int:
    """Bytes of the model's largest parameter, full (the room one full gradient or one
    gathered parameter takes)."""
    return max(p.numel() * p.element_size() for p in model.parameters())


def chunk_of(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s padded shard of `full`, as the sharding rule defines it (a copy)."""
    chunk = shard_numel(full.numel(), world_size)
    flat = torch.zeros(chunk * world_size, dtype=full.dtype)
    flat[: full.numel()] = full.detach().reshape(-1)
    return flat[rank * chunk : (rank + 1) * chunk].clone()


# --- measuring memory ---------------------------------------------------------------------


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (a view counts as its whole base)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizers_in(obj: object, depth: int = 4) -> list:
    """Every optimizer reachable from `obj` through attributes, lists and dicts: anything
    with a `state` dict and a `param_groups` list (torch.optim's optimizers, for one)."""
    found: dict[int, object] = {}

    def visit(item: object, level: int) -> None:
        if level < 0 or isinstance(item, torch.Tensor | nn.Module | str | int | float):
            return
        if isinstance(getattr(item, "state", None), dict) and isinstance(
            getattr(item, "param_groups", None), list
        ):
            found.setdefault(id(item), item)
        if isinstance(item, dict):
            children = list(item.values())
        elif isinstance(item, list | tuple | set):
            children = list(item)
        elif hasattr(item, "__dict__"):
            children = list(vars(item).values())
        else:
            return
        for child in children:
            visit(child, level - 1)

    visit(obj, depth)
    return list(found.values())


def optimizer_state_bytes(optimizer: object) -> int:
    """Bytes of optimizer state (exp_avg, ...; not the 0-d step counters) in every
    optimizer reachable from `optimizer`."""
    tensors = [
        value
        for inner in optimizers_in(optimizer)
        for per_param in inner.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    ]
    return _storage_bytes(tensors)


def _stepped_tensors(optimizer: object) -> list[torch.Tensor]:
    return [
        p for inner in optimizers_in(optimizer) for g in inner.param_groups for p in g["params"]
    ]


def gradient_bytes(model: nn.Module, optimizer: object) -> int:
    """Bytes of the .grad of the model's parameters and of every tensor an optimizer
    reachable from `optimizer` steps (the gradient shards)."""
    tensors = [*model.parameters(), *_stepped_tensors(optimizer)]
    return _storage_bytes(t.grad for t in tensors if t.grad is not None)


def held_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the model's modules hold: parameters, buffers and tensor attributes
    (also inside lists and dicts), by name."""
    out: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        items = [*module._parameters.items(), *module._buffers.items()]
        for key, value in vars(module).items():
            if key in ("_parameters", "_buffers", "_modules"):
                continue  # counted above (or modules, visited on their own)
            if isinstance(value, torch.Tensor):
                items.append((key, value))
            elif isinstance(value, list | tuple):
                items += [(f"{key}[{i}]", v) for i, v in enumerate(value)]
            elif isinstance(value, dict):
                items += [(f"{key}[{k!r}]", v) for k, v in value.items()]
        for key, value in items:
            if isinstance(value, torch.Tensor):
                out[f"{prefix}.{key}" if prefix else key] = value
    return out


def reachable_tensors() -> list[torch.Tensor]:
    """Every tensor the garbage collector knows in this process, after a collection (garbage
    not yet collected is not kept), except what the fork server froze before this worker
    started: objects frozen since, by code calling gc.freeze() to hide them from this scan,
    are unfrozen first."""
    if _worker.frozen_by_a_call():
        gc.unfreeze()
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on torch's deprecated aliases warns
        warnings.simplefilter("ignore", FutureWarning)
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages behind every tensor Python can reach in this process,
    and behind their .grad: wherever a tensor is kept (an attribute, a closure, a module-level
    dict), the garbage collector knows it. (A gradient autograd holds only in C++, such as a
    parameter's .grad never read from Python, is `gradient_bytes`' to count.)"""
    tensors = reachable_tensors()
    grads = [t.grad for t in tensors if t.requires_grad and t.grad is not None]
    return _storage_bytes([*tensors, *grads])


def storages_elsewhere(
    model: nn.Module, optimizer: torch.optim.Optimizer, records: object = ()
) -> list[torch.Tensor]:
    """Every float64 storage Python can reach on this rank, flat, except those of the model's
    parameters, their gradients, the optimizer's state and the check's own `records` (nested
    dicts and lists): where a full parameter kept privately (an attribute, a dict, a closure)
    would be. Its values are compared with the full parameters in the checking process
    (`_judge_private_copies`)."""
    own = {t.untyped_storage().data_ptr() for t in _tensors_in(records)}
    own |= {p.untyped_storage().data_ptr() for p in model.parameters()}
    own |= {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    own |= {
        t.untyped_storage().data_ptr()
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    }
    found: dict[int, torch.Tensor] = {}
    for t in reachable_tensors():
        if t.dtype != torch.float64 or t.device.type != "cpu" or t.is_sparse:
            continue
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr in own or ptr in found or not nbytes or nbytes % t.element_size():
            continue
        found[ptr] = torch.empty(0, dtype=torch.float64).set_(storage).clone()
    return list(found.values())


def _tensors_in(records: object) -> list[torch.Tensor]:
    if isinstance(records, torch.Tensor):
        return [records]
    if isinstance(records, dict):
        records = list(records.values())
    if isinstance(records, (list, tuple)):
        return [t for item in records for t in _tensors_in(item)]
    return []


def held_bytes(model: nn.Module) -> int:
    """Bytes of the distinct storages behind `held_tensors(model)`."""
    return _storage_bytes(held_tensors(model).values())
