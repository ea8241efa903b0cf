"""The restart: train with sharded checkpoints, resume from the newest complete one."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from course_lib import data, models
from course_lib.runtime import rank, world_size
from course_lib.zero import build, load_sharded, measured_step, save_sharded

CONFIG = models.GPTConfig()  # the tiny GPT of every lecture: a step takes milliseconds
BATCH = 8  # sequences per step, split over the ranks
LOG = "losses.jsonl"


def restart_count() -> int:
    """Which attempt this is: 0 the first time, 1 after torchrun's first restart, ..."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def latest_checkpoint(directory: str) -> tuple[int, str] | None:
    """(step, path) of the newest complete checkpoint in `directory`, or None. DCP writes a
    checkpoint's `.metadata` last, once every rank's shard is on disk: a checkpoint cut
    short by a crash has none, and is skipped."""
    done = [
        name
        for name in os.listdir(directory)
        if name.startswith("step_") and os.path.exists(os.path.join(directory, name, ".metadata"))
    ]
    if not done:
        return None
    name = max(done)
    return int(name.removeprefix("step_")), os.path.join(directory, name)


def train(
    directory: str, steps: int = 24, every: int = 5, kill_at: int | None = None, kill_rank: int = 1
) -> list[float]:
    """Train the tiny GPT with ZeRO-3 (FSDP2) on every rank, checkpointing after every
    `every` steps into `directory`, resuming from the newest checkpoint there. On the first
    attempt only, rank `kill_rank` dies at step `kill_at` (os._exit: no exception, no
    clean-up, as when a node loses power). Rank 0 appends each step's loss to `LOG`."""
    os.makedirs(directory, exist_ok=True)
    model = models.TinyGPT(CONFIG, seed=0)
    model, optimizer = build("zero3", model, lr=1e-2)
    x, y = data.tokens(256, CONFIG.seq_len, CONFIG.vocab_size, seed=0)
    batches = data.batches(x, y, BATCH, steps, seed=1)  # batch i depends on i only
    start, found = 0, latest_checkpoint(directory)
    if found:
        saved_step, path = found
        load_sharded(model, optimizer, path)  # every rank reads its own shard back
        start = saved_step + 1
    losses = []
    for step in range(start, steps):
        if step == kill_at and rank() == kill_rank and restart_count() == 0:
            os._exit(1)
        loss, _ = measured_step(model, optimizer, *batches[step])
        mean = torch.tensor(loss)
        dist.all_reduce(mean)  # the job's loss: the mean of the ranks' shards
        losses.append(mean.item() / world_size())
        if rank() == 0:
            row = {"attempt": restart_count(), "step": step, "loss": losses[-1]}
            with open(os.path.join(directory, LOG), "a") as log:
                log.write(json.dumps(row) + "\n")
        if (step + 1) % every == 0:
            save_sharded(model, optimizer, os.path.join(directory, f"step_{step:05d}"))
    return losses


def loss_log(directory: str) -> list[dict]:
    """Rank 0's loss log: one {"attempt", "step", "loss"} per step, in the order written."""
    with open(os.path.join(directory, LOG)) as log:
        return [json.loads(line) for line in log]
