"""What runs on each rank in check_sharded_adamw (grading/parallel_3d_zero.py): training with
the student's make_groups, GPT2D and ShardedAdamW on what the rank is given, the phases of
every step marked for the launcher, and the memory observed and sent as it is seen.

The rank is given (`parallel_3d_cases.given`) only its TP shard of the secret initial weights,
the rest zeroed, and per step a global batch whose only real rows are its DP group's: the
reference is trained, and every byte judged, in the checking process. Nothing returned from
here but the parameters after each step decides a verdict.

The cases the rank marks (`counted_group.mark`), so that the launcher's tallies tell which
calls came when: 0 make_groups and GPT2D, 1 ShardedAdamW(...), then for each step its
zero_grad(), its forward and backward, and its step() (`case`), and a last mark after them.
"""

from __future__ import annotations

import torch.distributed as dist

from course_lib import counted_group, data, models
from course_lib.grading.parallel_3d_grid import PLANNER
from course_lib.grading.parallel_3d_rank import Run2D, dense_model
from course_lib.grading.parallel_3d_recording import CollectiveLog, group_ranks
from course_lib.grading.parallel_3d_zero_memory import baseline, own, reachable, scan
from course_lib.grading.provenance import Provenance
from course_lib.grading.training import ADAMW, snapshot

# Lecture 7's ZeRO runs torch's ZeroRedundancyOptimizer and FSDP (course_lib.zero), lecture 10
# the grid and a whole 3-D step (PLANNER): an answer that runs them, or a copy, is not its own.
FORBIDDEN = (
    *PLANNER,
    "course_lib.zero",
    "course_lib.measure.zero",
    "torch.distributed.optim.ZeroRedundancyOptimizer",
    "torch.distributed.fsdp.fully_shard",
    "torch.distributed.fsdp.FullyShardedDataParallel",
)

SETUP, BUILD = 0, 1  # make_groups and GPT2D; ShardedAdamW(...)
PHASES = ("zero_grad", "forward and backward", "step")


def case(step: int, phase: str) -> int:
    """The case a phase of a step is marked as."""
    return 2 + len(PHASES) * step + PHASES.index(phase)


def cases(steps: int) -> int:
    """How many cases a run of `steps` steps marks (the last mark is this number)."""
    return 2 + len(PHASES) * steps


class _Record:
    """Marks and observations, sent to the launcher as they happen. Under `launch` (the
    notebook's report), where nothing is tallied, `local` also keeps them here, in the
    tallies' form, with the calls a CollectiveLog saw: for a table, never for a grade."""

    def __init__(self, local: bool) -> None:
        self.local: list[tuple] | None = [] if local else None
        self.log = CollectiveLog()

    def __enter__(self) -> _Record:
        if self.local is not None:
            self.log.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.local is not None:
            self.log.__exit__(*exc_info)

    def mark(self, label: int | str) -> None:
        counted_group.mark(label)
        if self.local is not None:
            self.local += [("call", c.op, None, c.sent, 0, c.ranks, ()) for c in self.log.take()]
            self.local.append(("mark", label))


def _train_sharded_on_rank(
    make_groups, model_2d, sharded_adamw, run: Run2D, mine: dict, local: bool = False
) -> dict:
    """Train with the student's groups, model and optimizer on what this rank is given
    (`mine`); the parameters after every step. This rank's DP shard of each batch follows
    the grid's rule (`r // tp_size` of `world / tp_size`), where `given` put its real rows."""
    me, world = dist.get_rank(), dist.get_world_size()
    dp_rank, dp = me // run.tp_size, world // run.tp_size
    with _Record(local) as record, Provenance(FORBIDDEN) as origin:
        record.mark(SETUP)
        tp_group, dp_group = make_groups(run.tp_size)
        model = model_2d(dense_model(mine["weights"]), tp_group, dp_group)
        groups = {"tp": group_ranks(tp_group), "dp": group_ranks(dp_group)}
        initial = snapshot(model.named_parameters())
        # Held to the end, as the check's records are (`held`), and immutable: no new storage
        # can take the place of one the judge skips.
        alive = tuple(reachable())
        record.mark(baseline(alive))
        record.mark(BUILD)
        optimizer = sharded_adamw(model, dp_group, **ADAMW)
        steps, held = [], ()
        for s, (x, y) in enumerate(mine["batches"]):
            x, y = data.shard(x, dp_rank, dp), data.shard(y, dp_rank, dp)
            record.mark(case(s, "zero_grad"))
            optimizer.zero_grad()
            record.mark(case(s, "forward and backward"))
            models.lm_loss(model(x), y).backward()
            record.mark(case(s, "step"))
            optimizer.step()
            record.mark(scan(model, s))
            params = snapshot(model.named_parameters())
            held += tuple(params.values())
            record.mark(own(params.values()))
            steps.append(params)
        record.mark(cases(len(mine["batches"])))
    del alive, held
    return {
        "groups": groups,
        "initial": initial,
        "steps": steps,
        "copied": origin.complaint(),
        "local": record.local,
    }
