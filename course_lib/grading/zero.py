"""Checks for Assignment 7, ZeRO stages 1-3.

    check_zero1(ShardedOptimizer)      optimizer state sharded; gradients reduced, parameters
                                       all-gathered in step, within a budget of bytes
    check_zero2(ShardedGradOptimizer)  gradients reduce-scattered during backward as well
    check_zero3(shard_module)          parameters sharded, gathered per layer just in time
    check_zero3_peak(shard_module)     ZeRO-3's forward and backward, measured at their peak

The sharding rule, the same for every stage (as in FSDP): each parameter is flattened and
padded with zeros to a multiple of P; rank r owns the r-th of P equal chunks, which holds
c = ceil(numel / P) elements (`chunk_range`).

Each check trains `TinyGPT(SMALL)` (tensor sizes not divisible by 2, 3 or 4, so shards are
uneven) for a few AdamW steps in float64, with every global batch split across the ranks and
each rank's loss the mean over its own share, and compares every rank after every step with
`torch.optim.AdamW` on one process on the whole batch: parameters, and where visible the
gradient shards and the optimizer state, to `TOLERANCE`. The checks of stages 1 and 2 change
the learning rate through `param_groups` before step `NEW_LR_AT`; stage 2's runs two
backwards before every odd-numbered step (gradient accumulation); their communication is
held, step by step, to what the algorithm needs (`zero_comm`). Memory is measured on every
rank: the bytes of optimizer state (stage 1), of gradients after backward (stage 2) and of the
tensors the model holds at rest (stage 3) may not exceed `shard_bytes`: per tensor, at most
one element more than numel / P (c elements), summed over the tensors. Bytes are counted per
storage, so a view that keeps a whole tensor alive counts as the whole tensor. Memory is
also measured while the work runs (`zero_peak`): in stage 2 each time a gradient is ready
during backward, in stage 3 at the peak of forward and backward.

What a check trusts is computed or kept outside the ranks (docs/architecture.md, "What a grade
may trust"): the weights and batches are drawn in the checking process from a secret new for
every call (`zero_cases`), each rank receives the seed of the initial weights (which it holds
anyway) and only its own share of each batch, the reference is trained in the checking
process, and what stages 1 and 2 move in each step and stage 3 all-gathers during backward
is read from the launcher's tallies of the ranks' calls. The bytes of memory are measured on
the ranks by the grader's scans and meter, as only a rank can.

The checks stand on eight parts: `zero_memory` (the sharding rule, how bytes are counted),
`zero_cases` (the secret draw, each rank's share of it, the single-process reference),
`zero_ranks` (what runs on each rank, `measure_memory`),
`zero_judge` (judging stages 1 and 2, `TOLERANCE`), `zero_comm` (their bytes per step, from
the tallies), `zero_judge3` (judging stage 3),
`zero_meter` (the memory meter) and `zero_peak` (memory while the work runs, against what
the unsharded model needs for the same work, measured in the checking process).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from course_lib.grading._harness import Verdict, judge_unreported, passed, run_on_ranks
from course_lib.grading.training import ADAMW
from course_lib.grading.zero_cases import draw, given, reference
from course_lib.grading.zero_comm import (
    judge_inputs_not_moved,
    judge_step_bytes,
    stage12_calls,
    verified_communication,
)
from course_lib.grading.zero_judge import (
    _check_param_groups,
    _compare_grad_shards,
    _compare_parameters,
    _compare_states,
    _judge_bytes_every_step,
    _stage12_limits,
    _validate,
    _verified_stage12,
)
from course_lib.grading.zero_judge3 import (
    HELD_MOMENTS,
    _compare_initial_shards,
    _compare_stage3_step,
    _judge_held_bytes,
    _judge_private_copies,
    _judge_regathering,
    _verified_stage3,
    gathered_in_backward,
)
from course_lib.grading.zero_memory import (
    chunk_of,
    chunk_range,
    gradient_bytes,
    held_bytes,
    optimizer_state_bytes,
    shard_bytes,
    shard_numel,
)
from course_lib.grading.zero_peak import (
    LAYERS_ALLOWED,
    _judge_backward_samples,
    _judge_peak,
    _peak_stage3,
)
from course_lib.grading.zero_ranks import (
    NEW_LR,
    SMALL,
    ZeroRun,
    _train_stage3,
    _train_stage12,
    build_model,
    global_batches,
    measure_memory,
)

# The step before which check_zero1 and check_zero2 set the learning rate to NEW_LR through
# the optimizer's param_groups, as a learning-rate scheduler would.
NEW_LR_AT = 2


def check_zero1(
    sharded_optimizer: Callable,
    *,
    world_size: int = 4,
    seed: int = 0,
    steps: int = 3,
    batch_size: int = 12,
    timeout: float = 60.0,
) -> None:
    """ZeRO-1. `sharded_optimizer(params, optimizer_cls, **kwargs)` is used as a torch
    optimizer (`zero_grad()`, `step()`, `param_groups`) after a plain backward on each rank's
    share of the batch. Its step averages the gradients over the ranks, steps each rank's
    shards with optimizer_cls, and leaves the full updated parameters on every rank.
    Checked: parameters on every rank after every step (the lr set to NEW_LR through
    param_groups before step NEW_LR_AT); optimizer state bytes per rank; each step's bytes
    from the launcher's tallies, at least the model's received and at most one all-reduce of
    the gradients and one all-gather of the parameters, no call moving the inputs
    (`zero_comm`)."""
    __tracebackhide__ = True
    run = _stage12_run(1, seed, steps, batch_size)
    _check_stage12("check_zero1", sharded_optimizer, 1, world_size, run, timeout)


def check_zero2(
    sharded_grad_optimizer: Callable,
    *,
    world_size: int = 4,
    seed: int = 0,
    steps: int = 3,
    batch_size: int = 12,
    timeout: float = 60.0,
) -> None:
    """ZeRO-2. As check_zero1, and each gradient is reduce-scattered during backward: checked
    are the gradient shards' values after backward (where the optimizer's tensors are the
    shards), also after two backwards (every odd-numbered step: they must add up), the
    gradient bytes per rank after backward, and during each backward, each time a gradient
    is ready, the bytes alive beyond the unsharded backward's (`zero_peak`); communication as
    in check_zero1, one all-reduce of the gradients allowed per backward."""
    __tracebackhide__ = True
    run = _stage12_run(2, seed, steps, batch_size)
    _check_stage12("check_zero2", sharded_grad_optimizer, 2, world_size, run, timeout)


def _stage12_run(stage: int, seed: int, steps: int, batch_size: int) -> ZeroRun:
    """From step 2 on, the learning rate is changed through param_groups; in stage 2, every
    odd-numbered step runs two backwards before it."""
    return ZeroRun(
        seed=seed,
        steps=steps,
        batch_size=batch_size,
        accumulate=stage == 2,
        new_lr_at=NEW_LR_AT if steps > NEW_LR_AT else None,
    )


def _check_stage12(
    check: str, impl: Callable, stage: int, ranks: int, run: ZeroRun, timeout: float
):
    """Each property a case of its own, over every step: a failing check lists each
    property's first problem."""
    __tracebackhide__ = True
    _validate(ranks, run)
    name = "ShardedOptimizer" if stage == 1 else "ShardedGradOptimizer"
    drawn = draw()
    results, traffic = run_on_ranks(
        check, _train_stage12, impl, stage, run, given(run, drawn, ranks), world_size=ranks,
        timeout=timeout, what=f"your {name}", traffic=True,
    )  # fmt: skip
    # Marks not the check's own, or bytes on the wire that no send/recv call accounts for,
    # fail the part as tampering, before anything is judged.
    calls = stage12_calls(check, traffic, run.steps)
    judge_unreported(check, traffic)
    ref = reference(run, drawn=drawn)
    model = build_model(run, drawn.weights)
    where = run.describe(ranks)
    verdict = Verdict(check)
    with verdict.case():
        _check_param_groups(check, results)
    with verdict.case():
        _compare_parameters(check, run, drawn, results)
    with verdict.case():
        _compare_states(check, results, ref)
    with verdict.case():
        judge_inputs_not_moved(check, calls, run, where)
    moved = []
    with verdict.case():
        moved = judge_step_bytes(check, calls, model, run, where)
    limits = _stage12_limits(model, ranks)
    keys = ("state_bytes", "grad_bytes", "kept_bytes") if stage == 2 else ("state_bytes",)
    for key in keys:
        with verdict.case():
            _judge_bytes_every_step(check, results, model, key, limits[key], where)
    worst = None
    if stage == 2:
        with verdict.case():
            for s, ref_step in enumerate(ref["steps"]):
                _compare_grad_shards(check, results, s, ref_step, ranks, run, where)
        with verdict.case():
            worst = _judge_backward_samples(check, results, run, model, limits["kept_bytes"], where)
    verdict.conclude(
        _verified_stage12(stage, results, limits, where, run, worst)
        + verified_communication(moved, model, ranks)
    )


def check_zero3(
    shard_module: Callable[[nn.Module], nn.Module | None],
    *,
    world_size: int = 4,
    seed: int = 0,
    steps: int = 3,
    batch_size: int = 12,
    timeout: float = 60.0,
) -> None:
    """ZeRO-3. `shard_module(model)` replaces each parameter by this rank's 1-D shard (same
    names) and adds hooks that all-gather a layer's full parameters just before its forward
    and again for its backward, free them after, and leave in each shard's .grad its chunk of
    the gradient averaged over the ranks. The check trains it with AdamW on the shards.
    Checked: shards, gradient shards and optimizer state against single-process AdamW; the
    bytes the model holds after forward and after each step; all-gathers during backward."""
    __tracebackhide__ = True
    check = "check_zero3"
    run = ZeroRun(seed=seed, steps=steps, batch_size=batch_size)
    _validate(world_size, run)
    ranks, drawn = world_size, draw()
    results, traffic = run_on_ranks(
        check, _train_stage3, shard_module, run, given(run, drawn, ranks), world_size=ranks,
        timeout=timeout, what="your shard_module", traffic=True,
    )  # fmt: skip
    # Marks not the check's own fail the part as tampering, before anything is judged.
    gathered = gathered_in_backward(check, traffic, run.steps)
    ref = reference(run, drawn=drawn)
    model = build_model(run, drawn.weights)
    where = run.describe(ranks)
    verdict = Verdict(check)
    with verdict.case():
        _compare_initial_shards(check, ref["initial"], results, ranks, where)
    verdict.settle()  # the rest compares shards of these names and shapes
    with verdict.case():
        for s, ref_step in enumerate(ref["steps"]):
            for r, result in enumerate(results):
                _compare_stage3_step(
                    check, r, result["steps"][s], ref_step, ranks, f"step {s}, {where}"
                )
    for moment, key, hint in HELD_MOMENTS:
        with verdict.case():
            _judge_held_bytes(check, results, model, moment, key, hint, where)
    with verdict.case():
        _judge_private_copies(check, results, model, where)
    with verdict.case():
        _judge_regathering(check, gathered, model, where)
    verdict.conclude(_verified_stage3(results, shard_bytes(model, ranks), where))


def check_zero3_peak(
    shard_module: Callable[[nn.Module], nn.Module | None],
    *,
    world_size: int = 4,
    seed: int = 0,
    steps: int = 2,
    batch_size: int = 12,
    timeout: float = 60.0,
) -> None:
    """ZeRO-3 at its peak. On each rank and step, forward and backward of the model sharded by
    `shard_module` may peak at most at what the unsharded step needs on the same share of the
    batch (its peak without its full gradients), plus this rank's gradient shards, plus
    LAYERS_ALLOWED times the largest layer's full parameters. Measured: the bytes of the
    tensors the step creates and of Python's allocations meanwhile."""
    __tracebackhide__ = True
    check = "check_zero3_peak"
    run = ZeroRun(seed=seed, steps=steps, batch_size=batch_size)
    _validate(world_size, run)
    drawn = draw()
    results = run_on_ranks(
        check, _peak_stage3, shard_module, run, given(run, drawn, world_size),
        world_size=world_size, timeout=timeout, what="your shard_module",
    )  # fmt: skip
    model = build_model(run, drawn.weights)
    passed(check, _judge_peak(check, results, run, model, run.describe(world_size)))


__all__ = [
    "ADAMW",
    "SMALL",
    "ZeroRun",
    "check_zero1",
    "check_zero2",
    "check_zero3",
    "check_zero3_peak",
    "LAYERS_ALLOWED",
    "NEW_LR",
    "chunk_of",
    "global_batches",
    "gradient_bytes",
    "held_bytes",
    "measure_memory",
    "optimizer_state_bytes",
    "reference",
    "shard_bytes",
    "shard_numel",
    "chunk_range",
]
