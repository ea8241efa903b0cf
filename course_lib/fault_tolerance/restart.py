"""The restart: train with sharded checkpoints, resume from the newest complete one. Two
kinds of checkpoint, one training loop: DCP's blocking `save_sharded` (`train`), and the
asynchronous per-rank files with a commit marker (`train_async`)."""

from __future__ import annotations

import io
import json
import os
import signal
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from course_lib import data, models
from course_lib.fault_tolerance.checkpoints import (
    COMMITTED,
    AsyncCheckpointer,
    commit,
    load_local_state,
    local_state,
    save_file,
)
from course_lib.runtime import rank, world_size
from course_lib.zero import build, load_sharded, measured_step, save_sharded

CONFIG = models.GPTConfig()  # the tiny GPT of every lecture: a step takes milliseconds
BATCH = 8  # sequences per step, split over the ranks
LOG = "losses.jsonl"


def restart_count() -> int:
    """Which attempt this is: 0 the first time, 1 after torchrun's first restart, ..."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def latest_checkpoint(directory: str, marker: str = ".metadata") -> tuple[int, str] | None:
    """(step, path) of the newest complete checkpoint in `directory`, or None: the newest
    `step_*` folder that holds the file `marker`, written last, once every rank's shard is on
    disk. DCP's marker is its `.metadata`; the asynchronous checkpoints' is `COMMITTED`. A
    checkpoint cut short by a crash has none, and is skipped."""
    done = [
        name
        for name in os.listdir(directory)
        if name.startswith("step_") and os.path.exists(os.path.join(directory, name, marker))
    ]
    if not done:
        return None
    name = max(done)
    return int(name.removeprefix("step_")), os.path.join(directory, name)


class _Sharded:
    """DCP's blocking checkpoints: `dcp.save` itself writes `.metadata` once all shards are."""

    marker = ".metadata"

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
        load_sharded(model, optimizer, path)  # every rank reads its own shard back

    def save(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, path: str
    ) -> None:
        save_sharded(model, optimizer, path)

    def finish(self) -> None:
        pass


class _AsyncCommitted:
    """Asynchronous checkpoints, one file per rank (`AsyncCheckpointer`), and the commit
    step: when the next checkpoint starts (or training ends), every rank waits for its own
    flush, the ranks agree that all of them succeeded (an all-reduce of a flag: a rank that
    died never arrives, and no one goes past it), and only then rank 0 writes `COMMITTED`."""

    marker = COMMITTED

    def __init__(self, write: Callable[[dict, str], None] = save_file) -> None:
        self.saver = AsyncCheckpointer(write)
        self.pending: tuple[int, str] | None = None

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
        load_local_state(model, optimizer, torch.load(_rank_file(path)))

    def save(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, path: str
    ) -> None:
        self.finish()  # the previous checkpoint: flushed everywhere, then committed
        os.makedirs(path, exist_ok=True)
        self.saver.save(local_state(model, optimizer), _rank_file(path))
        self.pending = (step, path)

    def finish(self) -> None:
        if self.pending is None:
            return
        (step, path), self.pending = self.pending, None
        failed = None
        try:
            self.saver.wait()
        except RuntimeError as error:  # still agree (the others would wait), then raise
            failed = error
        everyone = torch.tensor(int(failed is None))
        dist.all_reduce(everyone, op=dist.ReduceOp.MIN)
        if everyone.item() == 1 and rank() == 0:
            commit(path, step, world_size())
        if failed is not None:
            raise failed


def _rank_file(path: str) -> str:
    return os.path.join(path, f"rank{rank()}.pt")


def train(
    directory: str,
    steps: int = 24,
    every: int = 5,
    kill_at: int | None = None,
    kill_rank: int = 1,
    kill: str = "worker",
) -> list[float]:
    """Train the tiny GPT with ZeRO-3 (FSDP2) on every rank, checkpointing after every
    `every` steps into `directory`, resuming from the newest checkpoint there. On the first
    attempt only, at step `kill_at`, rank `kill_rank` dies: `kill="worker"`, the worker
    process alone (os._exit: no exception, no clean-up, as in a segfault); `kill="node"`,
    its torchrun agent with it, as when the machine loses power (`lose_node`). Rank 0
    appends each step's loss to `LOG`."""
    if kill not in ("worker", "node"):
        raise ValueError(f"kill is 'worker' or 'node', got {kill!r}")
    return _train(directory, steps, every, _Sharded(), kill_at, kill_rank, kill)


def lose_node() -> None:
    """This worker's node fails: its torchrun agent (the worker's parent) and the worker die
    at once, SIGKILL and os._exit, no clean-up; the other nodes' agents must notice. Under
    torchrun only, one worker per node (other workers of the node would outlive it)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        raise RuntimeError("lose_node runs under torchrun only: the parent must be its agent")
    os.kill(os.getppid(), signal.SIGKILL)
    os._exit(1)


def train_async(
    directory: str,
    steps: int = 24,
    every: int = 5,
    die_in_flush_at: int | None = None,
    kill_rank: int = 1,
    pause_s: float = 1.0,
) -> list[float]:
    """`train`, checkpointing asynchronously with a commit marker, resuming from the newest
    committed checkpoint. If `die_in_flush_at` is a step, rank `kill_rank`'s flush of that
    step's checkpoint writes half its file, waits `pause_s` (training goes on meanwhile) and
    the process dies (os._exit) with the flush in flight. Returns the losses of the steps
    this call ran."""
    write = save_file
    if die_in_flush_at is not None and rank() == kill_rank:
        write = _dies_in_flush(os.path.join(directory, f"step_{die_in_flush_at:05d}"), pause_s)
    return _train(directory, steps, every, _AsyncCommitted(write))


def _dies_in_flush(folder: str, pause_s: float) -> Callable[[dict, str], None]:
    """A writer that writes as `save_file` does, except into `folder`: there it writes half
    the file, waits `pause_s` and kills its process, the file never finished."""

    def write(state: dict, path: str) -> None:
        if os.path.dirname(path) != folder:
            return save_file(state, path)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        with open(f"{path}.partial", "wb") as f:
            f.write(buffer.getbuffer()[: buffer.tell() // 2])
            f.flush()
            time.sleep(pause_s)
        os._exit(1)

    return write


def _train(
    directory: str,
    steps: int,
    every: int,
    checkpoints: _Sharded | _AsyncCommitted,
    kill_at: int | None = None,
    kill_rank: int = 1,
    kill: str = "worker",
) -> list[float]:
    """The loop both kinds of checkpoint share: resume from the newest checkpoint that holds
    `checkpoints.marker`, train, save after every `every` steps, commit what is pending."""
    os.makedirs(directory, exist_ok=True)
    model = models.TinyGPT(CONFIG, seed=0)
    model, optimizer = build("zero3", model, lr=1e-2)
    x, y = data.tokens(256, CONFIG.seq_len, CONFIG.vocab_size, seed=0)
    batches = data.batches(x, y, BATCH, steps, seed=1)  # batch i depends on i only
    start, found = 0, latest_checkpoint(directory, checkpoints.marker)
    if found:
        saved_step, path = found
        checkpoints.load(model, optimizer, path)
        start = saved_step + 1
    losses = []
    for step in range(start, steps):
        if step == kill_at and rank() == kill_rank and restart_count() == 0:
            if kill == "node":
                lose_node()
            os._exit(1)
        loss, _ = measured_step(model, optimizer, *batches[step])
        mean = torch.tensor(loss)
        dist.all_reduce(mean)  # the job's loss: the mean of the ranks' shards
        losses.append(mean.item() / world_size())
        if rank() == 0:
            row = {
                "attempt": restart_count(),
                "world_size": world_size(),
                "step": step,
                "loss": losses[-1],
            }
            with open(os.path.join(directory, LOG), "a") as log:
                log.write(json.dumps(row) + "\n")
        if (step + 1) % every == 0:
            checkpoints.save(model, optimizer, step, os.path.join(directory, f"step_{step:05d}"))
    checkpoints.finish()
    return losses


def loss_log(directory: str) -> list[dict]:
    """Rank 0's loss log: one {"attempt", "world_size", "step", "loss"} per step, in the order
    written."""
    with open(os.path.join(directory, LOG)) as log:
        return [json.loads(line) for line in log]
