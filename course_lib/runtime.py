"""Who am I? Rank, world size and device of the calling process.

The same calls work inside a function run by `course_lib.launch`, under `torchrun`, and in a
plain single process (rank 0 of 1, on the CPU), so course code never reads env vars itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in the default process group (0 when not distributed)."""
    return dist.get_rank() if _initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    """Number of processes in the default process group (1 when not distributed)."""
    return dist.get_world_size() if _initialized() else int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    """This process's index on its own machine: it picks the GPU under NCCL."""
    return int(os.environ.get("LOCAL_RANK", rank()))


def device() -> torch.device:
    """The device this rank should compute on: its own GPU under NCCL, else the CPU.

    The same from every thread: under NCCL it is the GPU the process group was bound to at
    start-up (`launch` and `course_lib.torchrun` bind rank r of a machine to cuda:r), never
    torch.cuda.current_device(), which is per thread and says cuda:0 in a thread the rank
    started itself (the emulated network's, say)."""
    if _initialized() and "nccl" in str(dist.get_backend()):
        bound = dist.distributed_c10d._get_default_group().bound_device_id
        return bound if bound is not None else torch.device("cuda", local_rank())
    return torch.device("cpu")


def on_this_device(tensor: torch.Tensor, is_parameter: bool, requires_grad: bool) -> torch.Tensor:
    """A GPU tensor the launching process sent, rebuilt on this rank's device (see
    `calls._CallPickler`)."""
    tensor = tensor.to(device())
    if is_parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)


def is_worker() -> bool:
    """True inside a process started by `course_lib.launch` (not under torchrun)."""
    return os.environ.get("COURSE_LIB_WORKER") == "1"


# Functions that course_lib modules register to undo their global changes (patched
# torch.distributed calls, say) when a launched call ends, so the next call on a warm
# worker starts clean.
_call_end_callbacks: list[Callable[[], None]] = []


def at_call_end(callback: Callable[[], None]) -> None:
    """Register `callback` to run in a warm worker after every launched call."""
    if callback not in _call_end_callbacks:
        _call_end_callbacks.append(callback)


def run_call_end_callbacks() -> None:
    for callback in _call_end_callbacks:
        callback()
