"""Part of Assignment 7's checks (grading/zero.py): judging ZeRO-3.

The ranks' records (`zero_ranks._train_stage3`) against the single-process reference: the
shards right after `shard_module` (`_compare_initial_shards`), the gradient shards and shards
after every step (`_compare_stage3_step`), the bytes the model holds after forward and after
the step (`_judge_held_bytes`), full parameters kept outside the model
(`_judge_private_copies`) and the weights all-gathered again in backward
(`_judge_regathering`, on the bytes the launcher's tallies show each rank received during
backward: `gathered_in_backward`). Each raises the failure a student sees; `_verified_stage3`
is what a passing check says it verified.
"""

from __future__ import annotations

import torch
from torch import nn

from course_lib.grading._harness import calls_by_case, fail
from course_lib.grading.traffic import Traffic
from course_lib.grading.zero_judge import GRAD_TOLERANCE, _check_bytes, _mismatch
from course_lib.grading.zero_memory import (
    chunk_of,
    largest_parameter_bytes,
    shard_bytes,
    shard_numel,
)
from course_lib.grading.zero_ranks import STAGE3_PHASES, stage3_cases

# When the model's holdings are measured (the key of the ranks' records), and what to do when
# it holds more than its shards.
HELD_MOMENTS = (
    (
        "after forward",
        "held_after_forward",
        "free each layer's gathered parameters in a forward hook once the layer has run "
        "(the ranks held: {holders}). A shard must be a copy (.clone()): a view keeps the "
        "full tensor alive",
    ),
    ("after the step", "held_after_step", "between steps the model may hold only its shards"),
)


# --- the shards ---------------------------------------------------------------------------


def _compare_initial_shards(check: str, initial: dict, results: list, ranks: int, where: str):
    __tracebackhide__ = True
    for r, result in enumerate(results):
        if result["names"] != list(initial):
            fail(
                check,
                f"rank {r}: after shard_module, named_parameters() gives {result['names']}; "
                f"expected the same names as before, {list(initial)}",
            )
        for name, full in initial.items():
            got = result["initial"][name]
            c = shard_numel(full.numel(), ranks)
            if tuple(got.shape) != (c,):
                fail(
                    check,
                    f"rank {r}: after shard_module, {name!r} has shape {tuple(got.shape)}; "
                    f"expected a 1-D shard of ceil({full.numel()} / {ranks}) = {c} elements "
                    "(the flattened parameter, zero-padded to a multiple of the world size, "
                    "cut into equal chunks)",
                )
            problem = _mismatch(
                {name: got}, {name: chunk_of(full, r, ranks)}, {"rtol": 0, "atol": 0}
            )
            if problem:
                fail(
                    check,
                    f"rank {r}, right after shard_module ({where}): {problem}.\nHint: rank r's "
                    "shard is elements [r*c, (r+1)*c) of the flattened parameter padded with "
                    "zeros, c = ceil(numel / world_size)",
                )


def _compare_stage3_step(check: str, r: int, step: dict, ref_step: dict, ranks: int, at: str):
    """Rank r's gradient shards after backward, then its shards after the step."""
    __tracebackhide__ = True
    for name, full in ref_step["grads"].items():
        got, want = step["grads"][name], chunk_of(full, r, ranks)
        label = f"gradient shard of {name}"
        if got is None:
            fail(
                check,
                f"rank {r}, {at}: the shard of {name!r} has no .grad after backward."
                "\nHint: the backward of your all-gather should reduce-scatter the "
                "full gradient into the shard (an autograd.Function's backward)",
            )
        problem = _mismatch({label: got}, {label: want}, GRAD_TOLERANCE)
        if problem:
            summed = (
                ranks > 1 and _mismatch({label: got}, {label: ranks * want}, GRAD_TOLERANCE) is None
            )
            hint = (
                f"it is {ranks} (the world size) times the average: divide the "
                "reduce-scattered sum by world_size()"
                if summed
                else "in backward, reduce-scatter each full gradient (padded like "
                "the parameter) so that rank r's shard .grad holds the r-th chunk of "
                "the average over the ranks"
            )
            fail(check, f"rank {r}, {at}: {problem}.\nHint: {hint}")
    want = {n: chunk_of(p, r, ranks) for n, p in ref_step["params"].items()}
    problem = _mismatch(step["shards"], want)
    if problem:
        fail(
            check,
            f"rank {r}, after {at}: {problem} (against the same elements of "
            "torch.optim.AdamW's parameters on one process).\nHint: the gradient "
            "shards were right; does your code change the shards anywhere else?",
        )


# --- memory -------------------------------------------------------------------------------


def _judge_held_bytes(
    check: str, results: list[dict], model: nn.Module, moment: str, key: str, hint: str, where: str
) -> None:
    """At every step, the bytes each rank's model held at `moment` (recorded under `key`):
    at most its shards."""
    __tracebackhide__ = True
    ranks = len(results)
    for s in range(len(results[0]["steps"])):
        _check_bytes(
            check,
            f"parameters (held by the model {moment})",
            [result["steps"][s][key] for result in results],
            shard_bytes(model, ranks),
            shard_bytes(model, 1),
            f"step {s}, {where}",
            hint.format(holders=_largest(results[0]["steps"][s]["holders"])),
        )


def _largest(holders: dict[str, int], n: int = 3) -> str:
    top = sorted(holders.items(), key=lambda item: -item[1])[:n]
    return ", ".join(f"{name} {nbytes:,} bytes" for name, nbytes in top)


def _full_parameters(results: list[dict], model: nn.Module, s: int) -> dict[str, torch.Tensor]:
    """The full parameters (flat) every rank gathers in step s's forward: the ranks' shards
    after the previous step (or right after sharding), put together."""
    out = {}
    for name, p in model.named_parameters():
        shards = [
            (result["steps"][s - 1]["shards"] if s else result["initial"])[name]
            for result in results
        ]
        out[name] = torch.cat([t.reshape(-1) for t in shards])[: p.numel()]
    return out


def _contains(flat: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether `values` appears in `flat` as a run of consecutive elements."""
    n = values.numel()
    if flat.numel() < n:
        return False
    starts = (flat[: flat.numel() - n + 1] == values[0]).nonzero().flatten().tolist()
    return any(torch.equal(flat[i : i + n], values) for i in starts)


def _judge_private_copies(check: str, results: list[dict], model: nn.Module, where: str):
    """No full parameter kept outside the model's shards, on any rank after forward or after
    the step, beyond one parameter's size (room for one reused gathering buffer)."""
    __tracebackhide__ = True
    ranks = len(results)
    largest = largest_parameter_bytes(model)
    for s in range(len(results[0]["steps"])):
        full = _full_parameters(results, model, s)
        for r in range(ranks):
            for moment in ("forward", "step"):
                elsewhere = results[r]["steps"][s][f"elsewhere_after_{moment}"]
                kept = {
                    name: values.numel() * values.element_size()
                    for name, values in full.items()
                    if shard_numel(values.numel(), ranks) < values.numel()
                    and any(_contains(t, values) for t in elsewhere)
                }
                if sum(kept.values()) > largest:
                    fail(check, _private_copies_message(r, s, where, moment, kept, largest))


def _private_copies_message(
    r: int, s: int, where: str, moment: str, kept: dict[str, int], largest: int
) -> str:
    names = ", ".join(repr(n) for n in list(kept)[:4]) + (" ..." if len(kept) > 4 else "")
    return (
        f"rank {r}, step {s}, {where}: after {moment}, full copies of {len(kept)} "
        f"parameters ({names}; {sum(kept.values()):,} bytes) are alive outside the "
        "model's shards, in tensors Python can reach (an attribute, a dict, a "
        f"closure); at most one parameter's size ({largest:,} bytes) may be.\nHint: "
        "ZeRO-3 keeps only the shards between a layer's forward and its backward: "
        "drop every reference to the gathered parameters once the layer has run, and "
        "gather again in backward"
    )


def _judge_regathering(check: str, gathered: list[list[int]], model: nn.Module, where: str) -> None:
    """Backward needs every Linear layer's full weight again: each rank, at every step, must
    all-gather at least the other ranks' shards of them during backward. `gathered[r][s]` is
    what rank r received by all-gather or broadcast in step s's backward, from the
    launcher's tallies (`gathered_in_backward`)."""
    __tracebackhide__ = True
    ranks = len(gathered)
    linear_weights = sum(
        shard_numel(m.weight.numel(), ranks) * m.weight.element_size()
        for m in model.modules()
        if isinstance(m, nn.Linear)
    )
    needed = (ranks - 1) * linear_weights
    for s in range(len(gathered[0])):
        for r, per_step in enumerate(gathered):
            if ranks > 1 and per_step[s] < needed:
                fail(
                    check,
                    f"rank {r}, step {s}, {where}: during backward it all-gathered "
                    f"{per_step[s]:,} bytes of parameters; computing the input gradients "
                    "needs every Linear layer's full weight again: at least "
                    f"{needed:,} bytes for {ranks} ranks.\nHint: autograd keeps the "
                    "tensors forward saved until backward, so full weights saved in "
                    "forward stay in memory; save the shard instead and gather again "
                    "when backward needs the weight "
                    "(torch.autograd.graph.saved_tensors_hooks)",
                )


# The calls that bring parameters in, as the launcher's tallies name them
# (`course_lib.counted_group`: all_gather_single is reported as all_gather_into_tensor).
GATHERING = ("all_gather", "all_gather_into_tensor", "broadcast")


def gathered_in_backward(check: str, traffic: Traffic, steps: int) -> list[list[int]]:
    """Per rank, per step, the bytes it received by the calls of `GATHERING` during
    backward, as the launcher received its calls (marked by `zero_ranks._train_stage3`).
    Marks that are not the check's own fail the part as tampering (`calls_by_case`)."""
    __tracebackhide__ = True
    per_case = calls_by_case(check, traffic.tallies, stage3_cases(steps))
    backward = 1 + STAGE3_PHASES.index("backward")
    return [
        [
            sum(c.received for c in cases[backward + len(STAGE3_PHASES) * s] if c.op in GATHERING)
            for s in range(steps)
        ]
        for cases in per_case
    ]


# --- what a passing check says ------------------------------------------------------------


def _verified_stage3(results: list[dict], allowed: int, where: str) -> str:
    """What check_zero3 verified, with the most bytes a rank's model held."""
    held = max(
        step[key]
        for result in results
        for step in result["steps"]
        for key in ("held_after_forward", "held_after_step")
    )
    return (
        f"{len(results[0]['steps'])} steps ({where}): every rank's gradient shards and shards "
        "after every step match torch.optim.AdamW on one process; the model held at most "
        f"{held:,} of the {allowed:,} bytes of its shards after forward and after each "
        "step"
        + (
            ", and each rank all-gathered the Linear weights again in backward"
            if len(results) > 1
            else ""
        )
    )
