"""A watchdog: heartbeats through the store the ranks met through, an all-reduce with a
deadline that names the ranks that never arrived, and the straggler found from compute times."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from course_lib.runtime import rank, world_size


def _store() -> dist.Store:
    # The store the ranks met through (torchrun's or launch's): a small key-value server that
    # still answers when a collective hangs.
    return dist.distributed_c10d._get_default_store()


def heartbeat(step: int, compute_s: float = 0.0) -> None:
    """Tell the store: this rank reached step `step`'s collective after `compute_s` seconds
    of its own work."""
    _store().set(f"heartbeat/{rank()}", json.dumps([step, compute_s, time.time()]))


def heartbeats() -> dict[int, tuple[int, float, float]]:
    """rank -> (step, compute seconds, time) of its last heartbeat (ranks that never sent
    one are missing)."""
    keys = [f"heartbeat/{r}" for r in range(world_size())]
    seen = [r for r, key in enumerate(keys) if _store().check([key])]
    return {r: tuple(json.loads(_store().get(keys[r]))) for r in seen}


def missing_ranks(beats: dict[int, tuple], step: int, world: int) -> list[int]:
    """The ranks whose last heartbeat is older than `step`: those not at its collective."""
    return [r for r in range(world) if r not in beats or beats[r][0] < step]


class HungRank(RuntimeError):
    """A collective did not complete in time; `ranks` never arrived at it."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


def guarded_all_reduce(
    tensor: torch.Tensor, step: int, timeout_s: float = 5.0, compute_s: float = 0.0
) -> None:
    """Send this rank's heartbeat (step `step`, `compute_s` seconds of work), then all-reduce
    `tensor` (sum), but give up after `timeout_s` seconds and raise `HungRank` naming the ranks
    that never reached step `step` (from their heartbeats). A production job would then exit,
    and torchrun would restart it without the bad node."""
    heartbeat(step, compute_s)
    work = dist.all_reduce(tensor, async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError:
        beats = heartbeats()
        missing = missing_ranks(beats, step, world_size())
        seen = {r: f"step {beats[r][0]}" if r in beats else "never" for r in missing}
        raise HungRank(
            f"rank {rank()}, step {step}: the all-reduce did not complete in {timeout_s:g} s; "
            + ", ".join(f"rank {r} never arrived (last heartbeat: {s})" for r, s in seen.items()),
            missing,
        ) from None


def slowest_rank(compute_seconds: list[list[float]], factor: float = 1.5) -> int | None:
    """The straggler: the rank whose median compute time per step (compute_seconds[rank] is
    one time per step) exceeds `factor` times the median of all ranks' medians, or None. A
    median, so that one slow step (a page fault, a log write) does not brand a rank."""
    medians = [torch.tensor(times).median().item() for times in compute_seconds]
    typical = torch.tensor(medians).median().item()
    worst = max(range(len(medians)), key=medians.__getitem__)
    return worst if medians[worst] > factor * typical else None
