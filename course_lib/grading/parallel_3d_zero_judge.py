"""check_sharded_adamw (grading/parallel_3d_zero.py) judged, in the checking process: the
single-process AdamW reference, what each rank kept and sent per step as the launcher saw it,
and the verdicts on the result and on the two budgets.

    reference_adamw(initial, batches)       torch.optim.AdamW on one process, after each step
    per_step(check, entries, world, tp, steps)    per rank and step, the bytes kept and sent
    judge_result(...), judge_budget(...)    the verdict's cases
"""

from __future__ import annotations

import torch

from course_lib import compare, models
from course_lib.grading._harness import CheckFailed, calls_by_case, fail
from course_lib.grading.parallel_3d_layout import CONFIG, _partners, tp_shards
from course_lib.grading.parallel_3d_rank import ATOL, DTYPE, RTOL
from course_lib.grading.parallel_3d_zero_budget import (
    comm_budget,
    over_budget,
    rank_sizes,
    state_budget,
)
from course_lib.grading.parallel_3d_zero_memory import observation, reckon
from course_lib.grading.parallel_3d_zero_rank import SETUP, case, cases
from course_lib.grading.training import make_optimizer, snapshot

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def reference_adamw(initial: dict[str, torch.Tensor], batches: Batches) -> list[dict]:
    """torch.optim.AdamW on one process on the whole batches, from the dense `initial`
    weights: the parameters after each step."""
    model = models.TinyGPT(CONFIG, seed=0, dtype=DTYPE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(initial[name])
    optimizer = make_optimizer("adamw", model.parameters())
    after = []
    for x, y in batches:
        optimizer.zero_grad()
        models.lm_loss(model(x), y).backward()
        optimizer.step()
        after.append(snapshot(model.named_parameters()))
    return after


# --- what the launcher saw ----------------------------------------------------------------------


def _tampered(check: str, r: int, what: str) -> CheckFailed:
    return CheckFailed(
        f"{check}: on rank {r}, {what}: code on the rank changed what the launcher records. "
        "That is tampering with the grading: this part scores 0.",
        tampering=True,
    )


def _observations(check: str, r: int, entries: list[tuple], steps: int) -> tuple[list, list]:
    """One rank's entries without the memory observations, and those observations, which
    must be exactly the check's: the baseline at the end of the set-up, then, in each
    step's step() case, its scan and the check's records of it."""
    __tracebackhide__ = True
    rest, seen, at = [], [], None
    for entry in entries:
        try:
            found = observation(entry[1]) if entry[0] == "mark" else None
        except ValueError:
            raise _tampered(check, r, "a mark that is no observation of the check's") from None
        if found is None:
            rest.append(entry)
            at = entry[1] if entry[0] == "mark" else at
        else:
            seen.append((found["kind"], found.get("step"), at, found))
    want = [("baseline", None, SETUP)]
    for s in range(steps):
        want += [("scan", s, case(s, "step")), ("own", None, case(s, "step"))]
    if [w[:3] for w in seen] != want:
        raise _tampered(check, r, "the memory observations were not the check's own")
    return rest, [w[3] for w in seen]


def per_step(
    check: str, tallies: list[list[tuple]], world: int, tp: int, steps: int
) -> list[list[dict]]:
    """Per rank and step, from the launcher's tallies: "kept", the bytes kept after step()
    (`reckon`), "largest", their largest storages, and "sent", the bytes of every call from
    zero_grad() to the end of step() but the TP group's in forward and backward (the TP group
    by the grid's rule)."""
    __tracebackhide__ = True
    split = [_observations(check, r, entries, steps) for r, entries in enumerate(tallies)]
    tallied = calls_by_case(check, [rest for rest, _ in split], cases(steps))
    out = []
    for r, (_, seen) in enumerate(split):
        tp_ranks = _partners(world, tp, r)[0]
        kept = reckon(seen)
        rows = []
        for s in range(steps):
            forward = tallied[r][case(s, "forward and backward")]
            sent = sum(c.sent for c in forward if tuple(sorted(c.group)) != tp_ranks)
            sent += sum(c.sent for p in ("zero_grad", "step") for c in tallied[r][case(s, p)])
            rows.append({**kept[s], "sent": sent})
        out.append(rows)
    return out


# --- the verdict ----------------------------------------------------------------------------------


def judge_result(
    check: str, tp: int, initial: dict, reference: list[dict], results: list[dict], where: str
) -> None:
    """Every rank's parameters right after GPT2D(...) equal its TP shard of `initial`, and
    after each step its TP shard of the reference."""
    __tracebackhide__ = True
    for r, result in enumerate(results):
        want = tp_shards(initial, r % tp, tp)
        problem = compare.find_mismatch(result["initial"], want, rtol=0.0, atol=0.0)
        if problem:
            fail(
                check,
                f"rank {r} ({where}): right after GPT2D(...), {problem}. Part 2's GPT2D must "
                "hold the TP shards first",
            )
    for s, ref in enumerate(reference):
        for r, result in enumerate(results):
            want = tp_shards(ref, r % tp, tp)
            problem = compare.find_mismatch(result["steps"][s], want, rtol=RTOL, atol=ATOL)
            if problem:
                fail(
                    check,
                    f"rank {r}, after step {s} ({where}): {problem} (its TP shard of "
                    "torch.optim.AdamW on one process on the whole batch).\nHint: every rank "
                    "of a DP group must end the step with all of its parameters updated, "
                    "those whose state another rank keeps included, from the gradient "
                    "averaged over the DP group",
                )


def judge_budget(check: str, tp: int, measured: list[list[dict]], where: str, prop: str) -> float:
    """Every rank's every step within its budget of `prop` ("memory": the bytes kept,
    "communication": the bytes sent); the largest share of its budget any rank used."""
    __tracebackhide__ = True
    key, budget = ("kept", state_budget) if prop == "memory" else ("sent", comm_budget)
    dp = len(measured) // tp
    worst = 0.0
    for r, steps in enumerate(measured):
        sizes = list(rank_sizes(r % tp, tp).values())
        allowed = budget(sizes, dp)
        for s, step in enumerate(steps):
            worst = max(worst, step[key] / allowed) if allowed else worst
            if step[key] > allowed:
                at = f"rank {r}, after step {s} ({where})"
                fail(check, over_budget(prop, at, step, allowed, sizes, dp), prop=prop)
    return worst
