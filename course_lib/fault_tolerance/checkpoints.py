"""Asynchronous checkpoints of each rank's own shard: stage a copy, write it in a background
thread, make the file durable (write, fsync, rename), and mark the whole checkpoint complete
with a commit marker once every rank's file is."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from typing import BinaryIO

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from course_lib.runtime import rank
from course_lib.zero import local


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's shard of the parameters and optimizer state, as plain tensors: what it
    writes to its own file."""
    state = {f"model.{k}": local(v) for k, v in model.state_dict().items()}
    for i, per_param in optimizer.state_dict()["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                state[f"optimizer.{i}.{key}"] = local(value)
    return state


def load_local_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, torch.Tensor]
) -> None:
    """Copy `state` (what `local_state` gave on this rank, read back from its file) into
    `model` and `optimizer`, bit for bit. Call on every rank, at the world size it was saved
    at: each file holds one rank's shard, so another world size needs DCP's resharding."""
    # A fresh optimizer has no state to copy into until its first step; torch's get_state_dict
    # creates it (zero moments, a step taken with lr 0). Every tensor is overwritten below.
    get_state_dict(model, optimizer)
    targets = local_state(model, optimizer)
    if set(targets) != set(state):
        raise ValueError(
            f"rank {rank()}: the checkpoint holds {sorted(set(state) - set(targets))[:3]} that "
            f"this model lacks, and lacks {sorted(set(targets) - set(state))[:3]}; was it "
            "saved from the same model and optimizer, at the same world size?"
        )
    with torch.no_grad():
        for name, tensor in state.items():
            targets[name].copy_(tensor)  # into the shard's own storage, in place


class AsyncCheckpointer:
    """Saves a state dict in a background thread. `save` only copies the tensors (the copy
    must be taken now: the next optimizer step changes the tensors in place) and returns;
    the thread writes the copy while training goes on. One save is in flight at a time: the
    next `save` first waits for the previous one. `write(state, path)` writes one file
    (`save_file`; the lecture plants a slower one to catch a flush in flight)."""

    def __init__(self, write: Callable[[dict, str], None] | None = None) -> None:
        self._write_file = write or save_file
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, state: dict[str, torch.Tensor], path: str) -> None:
        self.wait()
        # On a GPU this is the device-to-host copy into pinned memory; on the CPU a clone.
        staged = {name: tensor.detach().clone() for name, tensor in state.items()}
        self._thread = threading.Thread(target=self._write, args=(staged, path), daemon=True)
        self._thread.start()

    def _write(self, staged: dict[str, torch.Tensor], path: str) -> None:
        try:
            self._write_file(staged, path)
        except BaseException as error:  # reported by the next wait(), in the training thread
            self._error = error

    def wait(self) -> None:
        """Block until the save in flight is on disk; raise if writing it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"rank {rank()}: writing a checkpoint failed: {error}") from error


def save_file(state: dict[str, torch.Tensor], path: str) -> None:
    """Write `state` to `path` and make it durable: write a temporary file, fsync it, then
    rename, so that a crash leaves the old file or the new one, never half of one."""
    durable_write(path, lambda f: torch.save(state, f))


def durable_write(path: str, write: Callable[[BinaryIO], object]) -> None:
    """Write a file by `write(f)` into `path.partial`, fsync it, rename it to `path`, then
    fsync the folder: the rename itself is an entry in the folder, and only that fsync makes
    it survive a power loss."""
    partial = f"{path}.partial"
    with open(partial, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    folder = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


COMMITTED = "COMMITTED"  # the commit marker's file name in a checkpoint's folder


def commit(path: str, step: int, world: int) -> None:
    """Mark the checkpoint in folder `path` complete. Call on one rank, and only once every
    rank's file of it is durable (the ranks must have agreed on that first): a loader takes
    a checkpoint whose folder holds this marker, and no other."""
    record = json.dumps({"step": step, "world_size": world}).encode()
    durable_write(os.path.join(path, COMMITTED), lambda f: f.write(record))
