"""One tensor between two ranks, its shape and dtype with it: what a hand-written pipeline
step sends between neighbouring stages (lecture 10's 3-D step, lecture 8's zero-bubble run).
Plumbing, not a pipeline: the schedules are in `schedules.py`, torch runs the lecture's."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from course_lib.runtime import device

# A tensor travels as a small header (dtype code, number of dimensions, the dimensions) and
# then its data, so a stage need not know its neighbour's output shape in advance.
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64]
_MAX_DIMS = 7
HEADER_BYTES = 8 * (_MAX_DIMS + 2)  # float64 values: 72 bytes before each tensor's data


def send_shaped(tensor: torch.Tensor, dst: int) -> list[Any]:
    """Start sending `tensor` to rank `dst`; returns the handles to wait on, with the buffers
    they must keep alive until the message has left."""
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"can send tensors of at most {_MAX_DIMS} dimensions, got {tensor.dim()}")
    header = torch.zeros(_MAX_DIMS + 2, dtype=torch.float64)
    header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.float64)
    data = tensor.detach().contiguous()
    return [dist.isend(header, dst), dist.isend(data, dst), header, data]


def recv_shaped(src: int) -> torch.Tensor:
    """Receive the next tensor rank `src` sends with `send_shaped` (blocks until it arrives)."""
    header = torch.empty(_MAX_DIMS + 2, dtype=torch.float64)
    dist.recv(header, src)
    shape = [int(d) for d in header[2 : 2 + int(header[1])].tolist()]
    tensor = torch.empty(shape, dtype=_DTYPES[int(header[0])], device=device())
    dist.recv(tensor, src)
    return tensor


def wait_all(pending: list[Any]) -> None:
    """Wait for every send `send_shaped` started (the buffers in the list are skipped)."""
    for work in pending:
        if isinstance(work, dist.Work):
            work.wait()
