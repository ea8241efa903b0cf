"""Part of Assignment 7's checks (grading/zero.py): judging ZeRO-1 and ZeRO-2, and
what every stage's judging shares.

The ranks' records (`zero_ranks._train_stage12`) against the single-process reference: the
parameters after every step (`_compare_parameters`, with `_parameter_hint` telling the usual
mistakes apart: an lr set through param_groups that did not take effect, two backwards
that did not add up), the optimizer state and gradient shards where the check can see them,
the lr in param_groups, and the bytes of optimizer state, gradients and tensors kept from
backward per rank (`_check_bytes`: at most `shard_bytes` each). Each raises the failure a
student sees; `_verified_stage12` is what a passing check says it verified. (Each
backward's memory while it runs is `zero_peak`'s.)
"""

from __future__ import annotations

from torch import nn

from course_lib import compare
from course_lib.grading._harness import fail
from course_lib.grading.training import ADAMW
from course_lib.grading.zero_cases import Drawn, reference
from course_lib.grading.zero_memory import (
    chunk_of,
    largest_parameter_bytes,
    shard_bytes,
    shard_numel,
)
from course_lib.grading.zero_ranks import NEW_LR, STATE_NAMES, ZeroRun

# float64 rounding between a split and a whole batch is ~1e-17 in the gradients and ~1e-14
# after a few AdamW steps (measured); 1e-10 leaves room and still catches any real mistake.
TOLERANCE = {"rtol": 1e-10, "atol": 1e-10}
GRAD_TOLERANCE = {"rtol": 1e-10, "atol": 1e-12}
# What ZeRO-2 may keep from backward beyond its gradient shards: one parameter's full size (a
# buffer reused from hook to hook) and a few small tensors (a loss, a count).
KEPT_SLACK = 1024


# --- before running -----------------------------------------------------------------------


def _validate(ranks: int, run: ZeroRun) -> None:
    if not 1 <= ranks <= 8:
        raise ValueError(f"world_size must be 1..8, got {ranks}")
    if run.batch_size % ranks or run.batch_size < ranks:
        raise ValueError(
            f"batch_size={run.batch_size} must be a multiple of world_size={ranks}, so each "
            "rank's mean loss averages to the full-batch mean"
        )
    if not 1 <= run.steps <= 20:
        raise ValueError(f"steps must be 1..20, got {run.steps}")


# --- comparing with the reference ---------------------------------------------------------


def _mismatch(got: dict, want: dict, tolerance: dict = TOLERANCE) -> str | None:
    return compare.find_mismatch(got, want, **tolerance)


def _parameter_hint(
    run: ZeroRun, drawn: Drawn, results: list[dict], r: int, s: int, ranks: int
) -> str:
    """Why rank r's parameters after step s are wrong, as far as the check can tell (the
    references of the usual mistakes are trained here, on the same draw)."""
    got = results[r]["steps"][s]["params"]
    for other in range(ranks):
        theirs = results[other]["steps"][s]["params"]
        problem = _mismatch(got, theirs)
        if problem:
            return (
                f"the ranks hold different parameters (rank {r} against rank {other}: "
                f"{problem}). After stepping its own shard, every rank must receive the "
                "other ranks' updated shards (all-gather or broadcast) so that all ranks "
                "hold the same full model"
            )
    if (
        s == run.new_lr_at
        and _mismatch(got, reference(run, new_lr=False, drawn=drawn)["steps"][s]["params"]) is None
    ):
        return (
            f"before step {s} the check set the learning rate to {NEW_LR:g} through your "
            "optimizer's param_groups, and your step still used the old one: param_groups "
            "must be the inner optimizer's own list (its dicts), not a copy"
        )
    summed = reference(run, ranks, drawn=drawn)["steps"][s]["params"]
    if ranks > 1 and _mismatch(got, summed) is None:
        return (
            f"your parameters are what training with gradients {ranks} (the world size) "
            "times too large gives: average the gradients (divide the sum by world_size())"
        )
    initial = reference(run, drawn=drawn)["initial"]
    want = reference(run, drawn=drawn)["steps"][s]["params"]
    for name, value in got.items():
        bad = (value - want[name]).abs() > TOLERANCE["atol"] + TOLERANCE["rtol"] * want[name].abs()
        never_moved = bad & (value == initial[name])
        if never_moved.any():
            index = int(never_moved.flatten().nonzero()[0])
            return (
                f"element {index} of {name!r} (numel {value.numel()}) was never updated: no "
                f"rank stepped it. Check the shard boundaries: with P = {ranks} each rank "
                f"owns ceil(numel / P) = {shard_numel(value.numel(), ranks)} elements, and "
                "together the shards must cover every element exactly once"
            )
    accumulated = (
        f" Step {s} ran two backwards before step(): do both add up in the gradients?"
        if run.accumulates(s)
        else ""
    )
    return (
        "is every gradient averaged over the ranks before the step, and does each rank step "
        "exactly its own elements (shard boundaries: ceil(numel / P) elements per rank)?"
        + accumulated
    )


def _compare_parameters(check: str, run: ZeroRun, drawn: Drawn, results: list[dict]) -> None:
    __tracebackhide__ = True
    ref = reference(run, drawn=drawn)
    ranks = len(results)
    where = run.describe(ranks)
    for s, ref_step in enumerate(ref["steps"]):
        for r, result in enumerate(results):
            problem = _mismatch(result["steps"][s]["params"], ref_step["params"])
            if problem:
                hint = _parameter_hint(run, drawn, results, r, s, ranks)
                fail(
                    check,
                    f"rank {r}, after step {s} ({where}): {problem} (compared with "
                    f"torch.optim.AdamW on one process).\nHint: {hint}",
                )


def _compare_state(check: str, r: int, s: int, ranks: int, got: list, ref_step: dict) -> None:
    """Rank r's AdamW state, where visible, must be its chunk of the reference state."""
    __tracebackhide__ = True
    for name, values in zip(ref_step["state"], got, strict=True):
        for key in STATE_NAMES:
            if key not in values:
                continue
            label = f"{key} of {name}"
            expected = chunk_of(ref_step["state"][name][key], r, ranks)
            problem = _mismatch({label: values[key]}, {label: expected})
            if problem:
                fail(
                    check,
                    f"rank {r}, after step {s}: the optimizer state of rank {r}'s shard "
                    f"differs from the same elements of torch.optim.AdamW's state: {problem}."
                    "\nHint: is the gradient averaged over the ranks before the step, and is "
                    "rank r's shard the r-th chunk of the flattened, zero-padded parameter?",
                )


def _compare_states(check: str, results: list[dict], ref: dict) -> None:
    """Every rank's AdamW state after every step, where the check can see it."""
    __tracebackhide__ = True
    ranks = len(results)
    for s, ref_step in enumerate(ref["steps"]):
        for r, result in enumerate(results):
            state = result["steps"][s]["state"]
            if state is not None:
                _compare_state(check, r, s, ranks, state, ref_step)


def _compare_grad_shards(
    check: str, results: list[dict], s: int, ref_step: dict, ranks: int, run: ZeroRun, where: str
) -> None:
    """Every rank's gradient shards after step s's backward(s), where the check can see them:
    its chunk of the full-batch gradient."""
    __tracebackhide__ = True
    twice = run.accumulates(s)
    at = f"step {s}{' (two backwards before it)' if twice else ''}, {where}"
    for r, result in enumerate(results):
        shards = result["steps"][s].get("grad_shards")
        if shards is None:
            continue
        for (name, full), got in zip(ref_step["grads"].items(), shards, strict=True):
            want = chunk_of(full, r, ranks)
            if got is None:
                fail(
                    check,
                    f"rank {r}, {at}: the shard of {name!r} has no .grad after backward."
                    "\nHint: reduce-scatter each gradient during backward (a "
                    "post-accumulate-grad hook), not in step()",
                )
            label = f"gradient shard of {name}"
            problem = _mismatch({label: got}, {label: want}, GRAD_TOLERANCE)
            if problem:
                summed = _mismatch({label: got}, {label: ranks * want}, GRAD_TOLERANCE) is None
                if ranks > 1 and summed:
                    hint = (
                        f"it is {ranks} (the world size) times the average: divide the "
                        "reduce-scattered sum by world_size()"
                    )
                elif twice:
                    hint = (
                        "this step ran two backwards before step(): the second must add its "
                        "chunk to the shard's .grad (as autograd adds to a .grad), not "
                        "overwrite it; zero_grad() clears the shards' .grad"
                    )
                else:
                    hint = (
                        "after backward, rank r's shard .grad must hold the r-th chunk of "
                        "the gradient averaged over the ranks; does zero_grad() clear the "
                        "shards' .grad?"
                    )
                fail(
                    check,
                    f"rank {r}, {at}: {problem} (against the same elements of the full-batch "
                    f"gradient).\nHint: {hint}",
                )


# --- bytes per rank -----------------------------------------------------------------------


def _check_bytes(
    check: str, what: str, per_rank: list[int], allowed: int, full: int, where: str, hint: str
) -> None:
    """Each rank at most `allowed` bytes; all ranks together at least `full` (else the
    check cannot see where the tensors are)."""
    __tracebackhide__ = True
    ranks = len(per_rank)
    for r, nbytes in enumerate(per_rank):
        if nbytes > allowed:
            fail(
                check,
                f"rank {r} ({where}) holds {nbytes:,} bytes of {what}; at most {allowed:,} "
                f"are allowed: ceil(numel / {ranks}) elements of each parameter"
                + (
                    f" (for the full model: {full:,} bytes, / {ranks} = {full // ranks:,})"
                    if full
                    else ""
                )
                + ".\n"
                f"Hint: {hint}",
            )
    if full and sum(per_rank) < full:
        fail(
            check,
            f"the ranks together hold only {sum(per_rank):,} bytes of {what} where the check "
            f"looks, less than the full model's {full:,} ({where}).\nHint: {hint}",
        )


# What the ranks record under each key, as `_judge_bytes_every_step` judges it: what the bytes
# are of; how many values per element the full model has of it (the ranks together must hold
# at least that much, else the check cannot see where the tensors are; None: no lower bound,
# the bytes are a delta and a shard's .grad may reuse memory); when in a step it is measured;
# and the hint when a rank holds too much.
STAGE12_BYTES = {
    "state_bytes": (
        "optimizer state",
        2,
        "after step {s}, ",
        "each rank keeps AdamW state (exp_avg, exp_avg_sq) only for its own shards: "
        "create optimizer_cls with this rank's shard tensors (clones, not views of the "
        "full parameters), never with the full parameters",
    ),
    "grad_bytes": (
        "gradients (measured after backward)",
        1,
        "step {s}, ",
        "as soon as a parameter's gradient is ready (a post-accumulate-grad hook), "
        "reduce-scatter it into this rank's shard's .grad and free the full "
        "gradient (param.grad = None)",
    ),
    "kept_bytes": (
        "tensors kept from backward (every tensor alive after backward that was "
        "not before it, wherever it is kept; one parameter's full size and 1,024 bytes "
        "are allowed on top)",
        None,
        "step {s}, ",
        "reduce-scatter each gradient in its hook and keep only the chunk: a full "
        "gradient kept anywhere until step() is what ZeRO-2 removes",
    ),
}


def _stage12_limits(model: nn.Module, ranks: int) -> dict[str, int]:
    """The most bytes one rank may hold, by the key its records keep them under."""
    largest = largest_parameter_bytes(model)
    grad_allowed = shard_bytes(model, ranks)
    return {
        "state_bytes": shard_bytes(model, ranks, values_per_element=2),
        "grad_bytes": grad_allowed,
        "kept_bytes": grad_allowed + largest + KEPT_SLACK,
    }


def _judge_bytes_every_step(
    check: str, results: list[dict], model: nn.Module, key: str, allowed: int, where: str
) -> None:
    """`_check_bytes` on the bytes each rank recorded under `key` (one of `STAGE12_BYTES`)
    at every step."""
    __tracebackhide__ = True
    what, values_per_element, when, hint = STAGE12_BYTES[key]
    full = 0 if values_per_element is None else shard_bytes(model, 1, values_per_element)
    for s in range(len(results[0]["steps"])):
        per_rank = [result["steps"][s][key] for result in results]
        _check_bytes(check, what, per_rank, allowed, full, when.format(s=s) + where, hint)


def _check_param_groups(check: str, results: list[dict]) -> None:
    __tracebackhide__ = True
    lr = results[0]["lr"]
    if lr != ADAMW["lr"]:
        fail(
            check,
            f"optimizer.param_groups[0]['lr'] is {lr!r}, expected {ADAMW['lr']} (the lr "
            "given to the constructor): a drop-in optimizer shows its settings in "
            "param_groups, as torch's do (learning-rate schedulers change them there)",
        )


# --- what a passing check says ------------------------------------------------------------


def _verified_stage12(
    stage: int,
    results: list[dict],
    limits: dict[str, int],
    where: str,
    run: ZeroRun,
    most_during: int | None = None,
) -> str:
    """What check_zero1 or check_zero2 verified, with the most bytes a rank took."""

    def most(key: str) -> int:
        return max(step[key] for result in results for step in result["steps"])

    lr = (
        f", also after the lr was set through param_groups before step {run.new_lr_at}"
        if run.new_lr_at is not None
        else ""
    )
    verified = (
        f"{len(results[0]['steps'])} steps ({where}): every rank's parameters after every "
        f"step match torch.optim.AdamW on one process (rtol {TOLERANCE['rtol']:g}, atol "
        f"{TOLERANCE['atol']:g}){lr}, param_groups holds the lr, and a rank's optimizer "
        f"state took at most {most('state_bytes'):,} of the {limits['state_bytes']:,} bytes "
        "of its shards"
    )
    if stage == 2:
        twice = [s for s in range(run.steps) if run.accumulates(s)]
        verified += (
            f"; after backward, gradients at most {most('grad_bytes'):,} of "
            f"{limits['grad_bytes']:,} bytes per rank and tensors kept from backward at most "
            f"{most('kept_bytes'):,} of {limits['kept_bytes']:,}, the gradient shards right"
            + (
                f" (also after two backwards, step{'s' if len(twice) > 1 else ''} "
                f"{', '.join(map(str, twice))})"
                if twice
                else ""
            )
            + (
                f"; during backward, each time a gradient was ready, at most {most_during:,} "
                f"of {limits['kept_bytes']:,} bytes alive beyond the unsharded backward's"
                if most_during is not None
                else ""
            )
        )
    return verified
