"""Part of Assignment 7's checks (grading/zero.py): what runs on each rank.

Each check trains `TinyGPT(SMALL)` for a few AdamW steps in float64 (`ZeroRun`), every global
batch split across the ranks and each rank's loss the mean over its own share:
`_train_stage12` with a student's ZeRO-1/2 optimizer, `_train_stage3` with a student's
`shard_module`, each on what its rank is given (`zero_cases.given`: the seed of the initial
weights and its own shares, never the other ranks' nor the batches' seeds), recording what the
judging compares and the bytes it measured. Communication is not counted here: each run marks
its cases (`counted_group.mark`) so that the launcher's tallies tell the optimizer's set-up,
each step (stages 1 and 2) and backward's calls (stage 3) apart.
`measure_memory` is the notebook's per-rank table of bytes for one step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from course_lib import data
from course_lib.grading.traffic import CaseMarks
from course_lib.grading.training import ADAMW, make_optimizer, snapshot
from course_lib.grading.zero_memory import (
    _storage_bytes,
    gradient_bytes,
    held_bytes,
    held_tensors,
    live_tensor_bytes,
    optimizer_state_bytes,
    optimizers_in,
    shard_numel,
    storages_elsewhere,
)
from course_lib.grading.zero_meter import GradientMeter
from course_lib.launch import launch
from course_lib.models import GPTConfig, TinyGPT, lm_loss
from course_lib.runtime import rank, world_size

# Every tensor of this model has a size that 2, 3 or 4 do not all divide (d_model 22,
# d_ff 37, vocab 29, 7 positions), so shards come out uneven.
SMALL = GPTConfig(vocab_size=29, seq_len=7, d_model=22, n_heads=2, n_layers=2, d_ff=37)
STATE_NAMES = ("exp_avg", "exp_avg_sq")


# --- one training run ---------------------------------------------------------------------


@dataclass(frozen=True)
class ZeroRun:
    """Which model, data and steps a check trains. With `accumulate`, every odd-numbered step
    runs two backwards before it (gradient accumulation); from step `new_lr_at` on, the
    learning rate is `NEW_LR`, set through the optimizer's param_groups."""

    seed: int = 0
    steps: int = 3
    batch_size: int = 12
    accumulate: bool = False
    new_lr_at: int | None = None

    def describe(self, ranks: int) -> str:
        return (
            f"TinyGPT(SMALL), AdamW, float64, seed {self.seed}, batches of {self.batch_size} "
            f"sequences split over {ranks} rank{'s' if ranks > 1 else ''}"
        )

    def backwards(
        self, s: int, x: torch.Tensor, y: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
        """The backwards of step s on a rank's share (x, y), as (inputs, targets, weight of
        the loss): one, or with `accumulate` on an odd step two, on the two halves of the
        share, each loss weighted by its share of the rows, so that the two gradients add up
        to the gradient of the mean over the whole share."""
        if not (self.accumulate and s % 2 and len(x) >= 2):
            return [(x, y, 1.0)]
        halves = zip(torch.tensor_split(x, 2), torch.tensor_split(y, 2), strict=True)
        return [(xs, ys, len(xs) / len(x)) for xs, ys in halves]

    def accumulates(self, s: int) -> bool:
        return self.accumulate and s % 2 == 1


# The learning rate the checks of ZeRO-1 and ZeRO-2 set through param_groups at `new_lr_at`.
NEW_LR = ADAMW["lr"] / 2


def build_model(run: ZeroRun, weights: int | None = None) -> TinyGPT:
    """The model every rank starts from: seeded by `weights` (a check's draw), else by
    `run.seed` (the notebook's)."""
    return TinyGPT(SMALL, seed=run.seed if weights is None else weights, dtype=torch.float64)


def global_batches(run: ZeroRun, drawn=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches: of a check's secret draw (`zero_cases.Drawn`, in the checking
    process only), else of `run.seed` (the notebook's, the same on every rank)."""
    tokens, order = (run.seed + 1, run.seed) if drawn is None else (drawn.tokens, drawn.order)
    x, y = data.tokens(4 * run.batch_size, SMALL.seq_len, SMALL.vocab_size, seed=tokens)
    return data.batches(x, y, run.batch_size, run.steps, seed=order)


def _visible_shards(optimizer: object, model: nn.Module, ranks: int) -> list | None:
    """The tensors an optimizer steps, if they are exactly the model's shards in order
    (one 1-D tensor of ceil(numel / P) elements per parameter); else None."""
    sizes = [shard_numel(p.numel(), ranks) for p in model.parameters()]
    for inner in optimizers_in(optimizer):
        stepped = [p for g in inner.param_groups for p in g["params"]]
        if [tuple(p.shape) for p in stepped] == [(n,) for n in sizes]:
            return [(inner, p) for p in stepped]
    return None


def _state_values(shards: list | None) -> list | None:
    if shards is None:
        return None
    out = []
    for inner, p in shards:
        state = inner.state.get(p, {})
        out.append({k: state[k].detach().clone() for k in STATE_NAMES if k in state})
    return out


def _weighted_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, weight: float):
    loss = lm_loss(model(x), y)
    return loss if weight == 1.0 else loss * weight


def _set_lr(optimizer: object, lr: float) -> None:
    """Set the learning rate through `optimizer.param_groups`, as a scheduler does."""
    for group in getattr(optimizer, "param_groups", None) or []:
        if isinstance(group, dict):
            group["lr"] = lr


def _train_stage12(impl: Callable, stage: int, run: ZeroRun, mine: dict) -> dict:
    """On each rank: train with the student's optimizer on this rank's shares (`mine`);
    record what the check compares. In stage 2, each backward runs under
    `zero_meter.GradientMeter`, whose hooks are made before the student's optimizer: the bytes
    alive each time a gradient is ready."""
    ranks = world_size()
    marks = CaseMarks()
    marks.next()  # the optimizer's set-up
    model = build_model(run, mine["weights"])
    sampler = GradientMeter(model) if stage == 2 else None
    # optimizer_cls is torch.optim.AdamW itself: on the CPU it runs its single-tensor code
    # (foreach=False), as the reference does.
    optimizer = impl(model.parameters(), torch.optim.AdamW, **ADAMW)
    groups = getattr(optimizer, "param_groups", None)
    lr = groups[0].get("lr") if isinstance(groups, list) and groups else None
    steps = []
    for s, (x, y) in enumerate(mine["shares"]):
        marks.next()  # step s: zero_grad, its backward(s), step()
        optimizer.zero_grad()
        before = live_tensor_bytes() if sampler else 0
        backwards = []
        for xs, ys, weight in run.backwards(s, x, y):
            loss = _weighted_loss(model, xs, ys, weight)
            if sampler:
                with sampler.backward():
                    loss.backward()
                backwards.append(sampler.record())
            else:
                loss.backward()
            del loss
        record = {"grad_bytes": gradient_bytes(model, optimizer), "backwards": backwards}
        if sampler:  # what backward left alive, wherever the student's code keeps it
            record["kept_bytes"] = live_tensor_bytes() - before
        shards = _visible_shards(optimizer, model, ranks)
        if stage == 2 and shards is not None:
            record["grad_shards"] = [None if p.grad is None else p.grad.clone() for _, p in shards]
        if s == run.new_lr_at:
            _set_lr(optimizer, NEW_LR)
        optimizer.step()
        record["params"] = snapshot(model.named_parameters())
        record["state_bytes"] = optimizer_state_bytes(optimizer)
        record["state"] = _state_values(_visible_shards(optimizer, model, ranks))
        steps.append(record)
    marks.finish(stage12_cases(run.steps))
    return {"lr": lr, "steps": steps}


def stage12_cases(steps: int) -> int:
    """How many cases the ranks of stages 1 and 2 mark: the optimizer's set-up (case 0), then
    each step (case 1 + s: zero_grad, backward, step)."""
    return 1 + steps


# Stage 3's cases, as its ranks mark them: shard_module, then per step its forward (with
# zero_grad), its backward and its optimizer step.
STAGE3_PHASES = ("forward", "backward", "step")


def stage3_cases(steps: int) -> int:
    """How many cases stage 3's ranks mark (the case of step s's phase k is 1 + 3 s + k)."""
    return 1 + len(STAGE3_PHASES) * steps


def _train_stage3(shard_module: Callable, run: ZeroRun, mine: dict) -> dict:
    """On each rank: shard the model with the student's shard_module, train it with AdamW
    on the shards on this rank's shares (`mine`), and record shards, gradients and bytes
    held. Each phase is a case marked for the launcher: what was gathered during backward is
    read from its tallies, never counted here."""
    marks = CaseMarks()
    marks.next()  # shard_module
    model = build_model(run, mine["weights"])
    model = shard_module(model) or model
    names = [name for name, _ in model.named_parameters()]
    result = {"names": names, "initial": snapshot(model.named_parameters()), "steps": []}
    if any(p.dim() != 1 for p in model.parameters()):
        marks.finish(stage3_cases(run.steps))
        return result  # the check explains what a shard should look like
    optimizer = make_optimizer("adamw", model.parameters())
    for x, y in mine["shares"]:
        marks.next()  # forward
        optimizer.zero_grad()
        logits = model(x)
        after_forward = held_bytes(model)
        holders = {n: _storage_bytes([t]) for n, t in held_tensors(model).items()}
        # The check's own records are not the student's: without `records`, each scan would
        # also copy every earlier record, and the scans would grow step after step.
        elsewhere = storages_elsewhere(model, optimizer, records=result)
        marks.next()  # backward
        lm_loss(logits, y).backward()
        del logits
        marks.next()  # the step
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        result["steps"].append(
            {
                "held_after_forward": after_forward,
                "holders": holders,
                "elsewhere_after_forward": elsewhere,
                "elsewhere_after_step": storages_elsewhere(
                    model, optimizer, records=[result, elsewhere, grads]
                ),
                "held_after_step": held_bytes(model),
                "grads": grads,
                "shards": snapshot(model.named_parameters()),
            }
        )
    marks.finish(stage3_cases(run.steps))
    return result


# --- for the notebook: measured bytes per rank --------------------------------------------


def _measure_on_rank(impl: Callable, stage: int, run: ZeroRun) -> dict[str, int]:
    """One step of training with a stage's implementation; this rank's bytes of
    parameters, gradients (after backward) and optimizer state (after the step)."""
    ranks, me = world_size(), rank()
    model = build_model(run)
    if stage == 3:
        model = impl(model) or model
        optimizer = make_optimizer("adamw", model.parameters())
    elif stage == 0:
        optimizer = make_optimizer("adamw", model.parameters())
    else:
        optimizer = impl(model.parameters(), torch.optim.AdamW, **ADAMW)
    x, y = global_batches(run)[0]
    x, y = data.shard(x, me, ranks), data.shard(y, me, ranks)
    optimizer.zero_grad()
    lm_loss(model(x), y).backward()
    grads = gradient_bytes(model, optimizer)
    optimizer.step()
    return {
        "parameters": held_bytes(model),
        "gradients": grads,
        "optimizer state": optimizer_state_bytes(optimizer),
    }


def measure_memory(
    impl: Callable | None, stage: int, world_size: int, seed: int = 0, timeout: float = 60.0
) -> list[dict[str, int]]:
    """Per-rank bytes of parameters (at rest), gradients (after backward) and optimizer
    state for one training step of `TinyGPT(SMALL)` in float64 on `world_size` ranks.
    stage 0 is plain data parallelism without communication (impl None): the baseline."""
    return launch(_measure_on_rank, impl, stage, ZeroRun(seed=seed, steps=1), world_size=world_size,
                  timeout=timeout)  # fmt: skip
