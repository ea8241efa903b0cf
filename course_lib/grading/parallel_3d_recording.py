"""Recording collectives with the ranks of their groups, and marking the phase of a step.

`CollectiveLog` records every torch.distributed call with its group's global ranks, bytes
and phase; `watch_model` marks "forward" and "backward" and records each forward's input.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm


def group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """Global ranks of `group` (None: the default group, every rank)."""
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(sorted(dist.get_process_group_ranks(group)))


@dataclass
class Collective:
    """One collective call: the op, its group's global ranks, bytes sent, and when."""

    op: str
    ranks: tuple[int, ...]
    sent: int
    phase: str


@dataclass
class CollectiveLog:
    """Records every torch.distributed call made while the block runs, with its group.

    Built on `course_lib.comm`'s hooks, so it sees what `CommCounter` sees and counts bytes
    the same way. `phase` is whatever the caller set last ("forward", "backward", ...)."""

    calls: list[Collective] = field(default_factory=list)
    phase: str = "other"

    def _hook(self, op, args, sent, received, call):
        self.calls.append(Collective(op, group_ranks(args.get("group")), sent, self.phase))
        return call()

    def __enter__(self) -> CollectiveLog:
        comm.add_around_hook(self._hook)
        return self

    def __exit__(self, *exc_info: object) -> None:
        comm.remove_around_hook(self._hook)

    def take(self) -> list[Collective]:
        """The calls recorded since the last take()."""
        calls, self.calls = self.calls, []
        return calls


def watch_model(model: nn.Module, log: CollectiveLog, inputs: list) -> None:
    """Record each forward's first input in `inputs`, and mark the log's phase: "forward"
    from the model's call until its output's gradient arrives, "backward" after."""

    def before(module, args, kwargs):
        given = [*args, *kwargs.values()]
        inputs.append(given[0].detach().clone() if given else None)
        log.phase = "forward"

    def after(module, args, output):
        log.phase = "loss"
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: setattr(log, "phase", "backward"))

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after)
