"""The naive host (parameter-server) scheme: rank 0 scatters the batch, gathers every rank's
gradients, steps, and sends the parameters back (`host_step`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from course_lib.data_parallel.loops import LossFn, _check_divisible
from course_lib.data_parallel.sync import (
    _unflatten_into,
    flat_gradients,
    flat_parameters,
    gradients,
)
from course_lib.runtime import rank, world_size

HOST = 0  # the rank that plays the host (parameter server) in the naive scheme


# --- the naive host (parameter-server) scheme ----------------------------------------------


# The host talks to every worker in turn with point-to-point messages, as a parameter server
# does; CommCounter counts point-to-point bytes exactly, so its numbers are measurements.


def _workers() -> list[int]:
    return [k for k in range(world_size()) if k != HOST]


def _scatter_from_host(batch: torch.Tensor) -> torch.Tensor:
    """Rank k receives the k-th equal shard of the host's `batch`."""
    if rank() != HOST:
        shard_shape = (batch.shape[0] // world_size(), *batch.shape[1:])
        out = torch.empty(shard_shape, dtype=batch.dtype)
        dist.recv(out, src=HOST)
        return out
    pieces = [piece.contiguous() for piece in batch.tensor_split(world_size())]
    for work in [dist.isend(pieces[k], dst=k) for k in _workers()]:
        work.wait()
    return pieces[HOST]


def _gather_to_host(tensor: torch.Tensor) -> list[torch.Tensor] | None:
    """The host receives every rank's `tensor` (its own included); the others get None."""
    if rank() != HOST:
        dist.send(tensor, dst=HOST)
        return None
    received = [torch.empty_like(tensor) for _ in _workers()]
    for work in [dist.irecv(buf, src=k) for k, buf in zip(_workers(), received, strict=True)]:
        work.wait()
    return [tensor, *received]


def _broadcast_from_host(tensor: torch.Tensor) -> None:
    """Every rank's `tensor` becomes a copy of the host's."""
    if rank() != HOST:
        dist.recv(tensor, src=HOST)
        return
    for work in [dist.isend(tensor, dst=k) for k in _workers()]:
        work.wait()


def host_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
) -> float:
    """One step of the naive host scheme; returns this rank's loss on its shard.

    The host (rank 0) scatters the batch `x, y`; every rank computes gradients on its shard;
    the host gathers them, averages, steps its `optimizer` and broadcasts the parameters. On the
    other ranks `x, y` only give the batch's shape and dtype (their values are never read) and
    `optimizer` may be None: only the host keeps optimizer state.
    """
    p = world_size()
    _check_divisible(x, p)
    if rank() == HOST and optimizer is None:
        raise ValueError("the host (rank 0) needs an optimizer: it is the rank that steps")
    x_shard, y_shard = _scatter_from_host(x), _scatter_from_host(y)

    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(x_shard), y_shard)
    loss.backward()

    # Every rank sends its whole gradient to the host: (P - 1) model sizes arrive there.
    grads = flat_gradients(model)
    gathered = _gather_to_host(grads)
    if rank() == HOST:
        average = torch.stack(gathered).sum(dim=0) / p
        _unflatten_into(average, gradients(model))
        optimizer.step()

    # ... and the host sends the new parameters back to every rank: (P - 1) model sizes out.
    params = flat_parameters(model)
    _broadcast_from_host(params)
    _unflatten_into(params, model.parameters())
    return loss.item()
