"""What runs on each rank in check_2d_training: the run, the secret batches, and
training with the student's make_groups, GPT2D and train_step.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch
import torch.distributed as dist

from course_lib import data, models
from course_lib.grading.parallel_3d_grid import PLANNER
from course_lib.grading.parallel_3d_layout import CONFIG
from course_lib.grading.parallel_3d_recording import CollectiveLog, group_ranks, watch_model
from course_lib.grading.provenance import Provenance
from course_lib.grading.training import make_optimizer, snapshot

DTYPE = torch.float64
RTOL, ATOL = 1e-10, 1e-10  # float64: split sums differ from whole ones by ~1e-15, measured


@dataclass(frozen=True)
class Run2D:
    """One 2-D training run: the grid, the model and the data."""

    tp_size: int = 2
    seed: int = 0
    steps: int = 3
    batch_size: int = 8

    def describe(self, world: int) -> str:
        dp = world // self.tp_size
        return (
            f"DP x TP = {dp} x {self.tp_size}, TinyGPT seed {self.seed}, float64, SGD, "
            f"batch of {self.batch_size}"
        )

    def validate(self, world: int) -> None:
        """Refuse a grid that cannot be built before any rank starts."""
        if world < 1 or self.tp_size < 1 or world % self.tp_size:
            raise ValueError(f"tp_size={self.tp_size} must divide world_size={world}")
        if CONFIG.n_heads % self.tp_size:
            raise ValueError(f"tp_size={self.tp_size} must divide TinyGPT's {CONFIG.n_heads} heads")
        if self.batch_size % (world // self.tp_size):
            raise ValueError(f"batch_size={self.batch_size} must divide evenly over the DP groups")

    def batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The same global batches on every rank and in the reference."""
        c = CONFIG
        x, y = data.tokens(4 * self.batch_size, c.seq_len, c.vocab_size, seed=self.seed + 1)
        return data.batches(x, y, self.batch_size, self.steps, seed=self.seed)


def _secret_batches(run: Run2D) -> list[dict]:
    """This rank's global batches: its DP replica's shard is real, drawn from a secret that
    only its TP partners share; the other replicas' rows are noise drawn by this rank alone.
    Right code trains on its shard only and never notices; code that trains every rank on
    the whole batch, to skip the DP all-reduce, trains on noise."""
    world, me, tp = dist.get_world_size(), dist.get_rank(), run.tp_size
    dp, first = world // tp, me - me % tp
    mine = None
    for start in range(0, world, tp):  # the check's own TP groups; every rank makes each one
        group = dist.new_group(list(range(start, start + tp)))
        mine = group if start == first else mine
    seed = torch.tensor([secrets.randbits(62)])
    dist.broadcast(seed, src=first, group=mine)
    n, c = run.batch_size // dp, CONFIG
    rows = slice((me // tp) * n, (me // tp + 1) * n)
    out = []
    for s in range(run.steps):
        xs, ys = data.tokens(n, c.seq_len, c.vocab_size, seed=int(seed) + s)
        x, y = data.tokens(run.batch_size, c.seq_len, c.vocab_size, seed=secrets.randbits(62))
        x[rows], y[rows] = xs, ys
        out.append({"x": x, "y": y, "shard": (xs, ys)})
    return out


def _train_on_rank(make_groups, model_2d, train_step, run: Run2D) -> dict:
    """Train with the student's code on this rank; record groups, inputs, calls, params."""
    batches = _secret_batches(run)
    # Everything the student's code runs is watched: lecture 10's own 3-D step would do the
    # whole part from train_step.
    with Provenance(PLANNER) as origin:
        tp_group, dp_group = make_groups(run.tp_size)
        groups = {"tp": group_ranks(tp_group), "dp": group_ranks(dp_group)}
        model = model_2d(models.TinyGPT(CONFIG, seed=run.seed, dtype=DTYPE), tp_group, dp_group)
        initial = snapshot(model.named_parameters())
        optimizer = make_optimizer("sgd", model.parameters())
        steps, inputs = [], []
        with CollectiveLog() as log:
            watch_model(model, log, inputs)
            for batch in batches:
                log.phase = "step"
                train_step(model, optimizer, batch["x"], batch["y"], dp_group)
                seen, inputs[:] = list(inputs), []
                calls = [vars(call) for call in log.take()]  # plain data for the trip back
                steps.append(
                    {"params": snapshot(model.named_parameters()), "seen": seen, "calls": calls}
                )
    return {
        "groups": groups,
        "initial": initial,
        "steps": steps,
        "shards": [batch["shard"] for batch in batches],
        "copied": origin.complaint(),
    }
