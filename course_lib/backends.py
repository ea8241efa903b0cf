"""Which backend a launch runs on, and which network interface its ranks talk over.

    resolve_backend("auto", 4)   # "nccl" with a GPU for each of 4 ranks, else "gloo"

Checked before any process starts, so that a wrong world size or a missing GPU is an error
with a sentence, not a rank that dies.
"""

from __future__ import annotations

import socket
import sys

import psutil
import torch


def resolve_backend(backend: str, world_size: int) -> str:
    """Check the arguments and pick "gloo" or "nccl"; raise before any process starts."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        chosen = "nccl" if gpus >= world_size else "gloo"
        if gpus:  # with GPUs the choice depends on the world size: say which and why, once
            _say_once(world_size, gpus, chosen)
        return chosen
    if backend == "gloo":
        return backend
    if backend == "nccl":
        if gpus < world_size:
            raise ValueError(
                f"backend='nccl' needs one GPU per rank: {world_size} ranks asked for, but "
                f"{gpus} GPU{'s' if gpus != 1 else ''} visible. Use backend='gloo' (CPU) or "
                f"world_size<={gpus}."
            )
        return backend
    raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")


_said: set[tuple[int, str]] = set()


def _say_once(world_size: int, gpus: int, chosen: str) -> None:
    if (world_size, chosen) in _said:
        return
    _said.add((world_size, chosen))
    if chosen == "nccl":
        why = f"one GPU for each of the {world_size} ranks ({gpus} visible)"
    else:
        why = f"{world_size} ranks but {gpus} GPU{'s' if gpus != 1 else ''}: every rank on the CPU"
    print(
        f"course_lib: backend='auto' chose {chosen}, {why}. Pass backend='gloo' or "
        "backend='nccl' to choose yourself.",
        file=sys.stderr,
    )


def loopback_interface() -> str | None:
    """Name of the network interface that carries 127.0.0.1 ('lo' on Linux, 'lo0' on macOS)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addresses):
            return name
    return None
