"""What runs on each rank in check_2d_training: the run, and
training with the student's make_groups, GPT2D and train_step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from course_lib import counted_group, data, models
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

    def describe(self, world: int, secret: bool = False) -> str:
        """The run in a verdict; `secret` when weights and batches are a check's own draw."""
        dp = world // self.tp_size
        model = "TinyGPT of secret weights" if secret else f"TinyGPT seed {self.seed}"
        return f"DP x TP = {dp} x {self.tp_size}, {model}, float64, SGD, batch of {self.batch_size}"

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


def dense_model(weights: dict[str, torch.Tensor]) -> models.TinyGPT:
    """The dense float64 TinyGPT a rank's GPT2D is built from, holding `weights` (what the
    rank is given: its TP shard, the rest zeroed)."""
    dense = models.TinyGPT(CONFIG, seed=0, dtype=DTYPE)
    with torch.no_grad():
        for name, p in dense.named_parameters():
            p.copy_(weights[name])
    return dense


def _train_on_rank(make_groups, model_2d, train_step, run: Run2D, mine: dict) -> dict:
    """Train with the student's code on this rank, on what it is given (`mine`, from
    parallel_3d_cases.given: its TP shard of the weights, the rest zeroed, and per step a
    global batch whose only real rows are its DP group's); record groups, inputs, calls and
    parameters. Nothing here is secret: the weights and batches are drawn, and the reference
    trained, in the checking process."""
    dense = dense_model(mine["weights"])
    # Everything the student's code runs is watched: lecture 10's own 3-D step would do the
    # whole part from train_step.
    # The launcher tallies every call of every group (run_on_ranks(..., traffic=True)); the
    # marks split them into the set-up (case 0) and each step (case s + 1).
    counted_group.mark(0)
    with Provenance(PLANNER) as origin:
        tp_group, dp_group = make_groups(run.tp_size)
        groups = {"tp": group_ranks(tp_group), "dp": group_ranks(dp_group)}
        model = model_2d(dense, tp_group, dp_group)
        initial = snapshot(model.named_parameters())
        optimizer = make_optimizer("sgd", model.parameters())
        steps, inputs = [], []
        with CollectiveLog() as log:
            watch_model(model, log, inputs)
            for s, (x, y) in enumerate(mine["batches"]):
                counted_group.mark(s + 1)
                log.phase = "step"
                train_step(model, optimizer, x, y, dp_group)
                seen, inputs[:] = list(inputs), []
                calls = [vars(call) for call in log.take()]  # plain data for the trip back
                steps.append(
                    {"params": snapshot(model.named_parameters()), "seen": seen, "calls": calls}
                )
    counted_group.mark(len(mine["batches"]) + 1)
    return {
        "groups": groups,
        "initial": initial,
        "steps": steps,
        "copied": origin.complaint(),
    }
