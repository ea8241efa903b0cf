"""Asynchronous checkpoints of each rank's own shard: stage a copy, write it in a background
thread, make the file durable (write, fsync, rename)."""

from __future__ import annotations

import os
import threading

import torch
from torch import nn

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


class AsyncCheckpointer:
    """Saves a state dict in a background thread. `save` only copies the tensors (the copy
    must be taken now: the next optimizer step changes the tensors in place) and returns;
    the thread writes the copy while training goes on. One save is in flight at a time: the
    next `save` first waits for the previous one."""

    def __init__(self) -> None:
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
            save_file(staged, path)
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
    partial = f"{path}.partial"
    with open(partial, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
