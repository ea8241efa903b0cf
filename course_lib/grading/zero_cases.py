"""Part of Assignment 7's checks (grading/zero.py): the training data, drawn in the checking
process, what each rank is given of it, and the single-process reference.

Every call of a check draws a new secret (`_harness.new_secret`), and from it the seed of the
initial weights and the global batches. A rank receives the seed of the weights (every rank of
a ZeRO program starts from the whole model, which it holds before sharding it, so the seed
tells it nothing it does not hold) and, per step, only its own share of the batch (`PerRank`):
never the other ranks' shares, nor the seeds they come from. With nothing on a rank to copy or
regenerate, the full-batch gradient can only come from the messages. The reference,
`torch.optim.AdamW` on one process on the whole batches, is trained here, in the checking
process, and never on a rank.

    draw()                         a new secret draw of weights and batches
    given(run, drawn, ranks)       each rank's share of it (a `PerRank` argument)
    reference(run, drawn=drawn)    single-process AdamW on the drawn batches
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from course_lib import data
from course_lib.calls import PerRank
from course_lib.grading._harness import new_secret
from course_lib.grading.training import make_optimizer, snapshot
from course_lib.grading.zero_ranks import (
    NEW_LR,
    STATE_NAMES,
    ZeroRun,
    _set_lr,
    build_model,
    global_batches,
)
from course_lib.models import lm_loss


@dataclass(frozen=True)
class Drawn:
    """One call's draw: `weights`, the seed of the initial model (every rank's); `tokens` and
    `order`, the seeds of the global batches, which never leave the checking process."""

    weights: int
    tokens: int
    order: int


def draw() -> Drawn:
    """Weights and batches from a secret no rank ever sees (new for every call)."""
    g = torch.Generator().manual_seed(new_secret())
    return Drawn(*(int(torch.randint(2**62, (), generator=g)) for _ in range(3)))


def given(run: ZeroRun, drawn: Drawn, ranks: int) -> PerRank:
    """Per rank: the seed of the initial weights and, per step, its own share (x, y) of the
    global batch, cut as `data.shard` cuts it (rows r, r + P, ...)."""
    batches = global_batches(run, drawn)
    return PerRank(
        [
            {
                "weights": drawn.weights,
                "shares": [(data.shard(x, r, ranks), data.shard(y, r, ranks)) for x, y in batches],
            }
            for r in range(ranks)
        ]
    )


# --- the single-process reference, in the checking process --------------------------------


def reference(
    run: ZeroRun, loss_scale: float = 1.0, new_lr: bool = True, drawn: Drawn | None = None
) -> dict:
    """torch.optim.AdamW on one process on the whole batch: per step the gradients,
    parameters and optimizer state (named). The learning rate changes to NEW_LR at
    `run.new_lr_at` (unless `new_lr` is False); `loss_scale` > 1 trains on summed gradients
    instead of averaged ones (both for telling a mistake apart). Two backwards on a rank
    (`run.accumulate`) add up to the same gradients: one reference serves both. With `drawn`,
    on a check's secret draw; without, on `run.seed`'s model and batches (the notebook's)."""
    return _reference(dataclasses.replace(run, accumulate=False), loss_scale, new_lr, drawn)


@functools.lru_cache(maxsize=8)
def _reference(run: ZeroRun, loss_scale: float, new_lr: bool, drawn: Drawn | None) -> dict:
    weights = None if drawn is None else drawn.weights
    model = build_model(run, weights)
    optimizer = make_optimizer("adamw", model.parameters())
    steps = []
    for s, (x, y) in enumerate(global_batches(run, drawn)):
        optimizer.zero_grad()
        (loss_scale * lm_loss(model(x), y)).backward()
        grads = snapshot((n, p.grad) for n, p in model.named_parameters())
        if new_lr and s == run.new_lr_at:
            _set_lr(optimizer, NEW_LR)
        optimizer.step()
        state = {
            n: {k: optimizer.state[p][k].clone() for k in STATE_NAMES}
            for n, p in model.named_parameters()
        }
        steps.append({"grads": grads, "params": snapshot(model.named_parameters()), "state": state})
    return {"initial": snapshot(build_model(run, weights).named_parameters()), "steps": steps}
