"""Judging check_2d_training, in the checking process.

The single-process reference on the real global batches (drawn here, parallel_3d_cases),
then every rank's groups, the batches its model saw, the groups of its collectives, and its
parameters after every step against its shard of the reference, with a hint for each
mistake the numbers reveal.
"""

from __future__ import annotations

import torch

from course_lib import compare, data, models
from course_lib.grading._harness import fail
from course_lib.grading.parallel_3d_layout import CONFIG, _partners, tp_shard, tp_shards
from course_lib.grading.parallel_3d_rank import ATOL, DTYPE, RTOL, Run2D
from course_lib.grading.parallel_3d_recording import Collective
from course_lib.grading.training import SGD_LR, make_optimizer, snapshot


def _revive_calls(results: list[dict]) -> None:
    """The ranks send their calls back as plain data: make each a Collective again."""
    for result in results:
        for step in result["steps"]:
            step["calls"] = [Collective(**{**c, "ranks": tuple(c["ranks"])}) for c in step["calls"]]


def _reference(start: dict, batches: list) -> dict:
    """Single-process training on whole batches from the dense state `start` (the check's
    secret draw, parallel_3d_cases): parameters before and after each step."""
    model = models.TinyGPT(CONFIG, seed=0, dtype=DTYPE)
    model.load_state_dict(start, strict=False)
    optimizer = make_optimizer("sgd", model.parameters())
    steps = []
    for x, y in batches:
        before = snapshot(model.named_parameters())
        optimizer.zero_grad()
        models.lm_loss(model(x), y).backward()
        optimizer.step()
        steps.append(
            {"before": before, "after": snapshot(model.named_parameters()), "batch": (x, y)}
        )
    return {"initial": dict(start), "steps": steps}


def _check_groups(check: str, run: Run2D, results: list[dict], where: str) -> None:
    __tracebackhide__ = True
    world = len(results)
    for r, result in enumerate(results):
        want_tp, want_dp = _partners(world, run.tp_size, r)
        got = {kind: tuple(ranks) for kind, ranks in result["groups"].items()}
        if (got["tp"], got["dp"]) == (want_dp, want_tp) and want_tp != want_dp:
            fail(
                check,
                f"rank {r} ({where}): make_groups returned TP group {list(got['tp'])} and DP "
                f"group {list(got['dp'])}: they are swapped. TP groups are blocks of tp_size "
                "consecutive ranks (one node, where the links are fast)",
            )
        for kind, want in (("TP", want_tp), ("DP", want_dp)):
            if got[kind.lower()] != want:
                fail(
                    check,
                    f"rank {r} ({where}): make_groups returned a {kind} group of ranks "
                    f"{list(got[kind.lower()])}, expected {list(want)} (as process_grid)",
                )


def _check_batches(check: str, run: Run2D, results: list[dict], where: str, batches) -> None:
    """TP partners see the same batch shard; DP rank d sees shard d of the global batch."""
    __tracebackhide__ = True
    world, tp = len(results), run.tp_size
    dp = world // tp
    for s, (x, _) in enumerate(batches):
        seen = []
        for r, result in enumerate(results):
            inputs = result["steps"][s]["seen"]
            if not inputs or any(i is None for i in inputs):
                fail(
                    check,
                    f"rank {r}, step {s} ({where}): train_step never called the model with "
                    "the token ids: call it as model(x_shard)",
                )
            seen.append(torch.cat(inputs))
        if dp > 1 and all(len(seen[r]) == len(x) for r in range(world)):
            fail(
                check,
                f"step {s} ({where}): every rank's model saw the whole batch "
                f"({tuple(seen[0].shape)} token ids). Each DP group must train on its own "
                "shard: data.shard(x, dist.get_rank(dp_group), dist.get_world_size(dp_group))",
            )
        for r in range(world):
            partner = r - r % tp  # the first rank of r's TP group
            if not torch.equal(seen[r], seen[partner]):
                fail(
                    check,
                    f"step {s} ({where}): ranks {partner} and {r} form a TP group but their "
                    "models saw different batches. The ranks of a TP group compute one model "
                    "together on the same data: shard the batch by the rank in the DP group "
                    "(dist.get_rank(dp_group)), not by the global rank",
                )
        for r in range(world):
            want = data.shard(x, r // tp, dp)
            if not torch.equal(seen[r], want):
                fail(
                    check,
                    f"rank {r}, step {s} ({where}): the model saw token ids of shape "
                    f"{tuple(seen[r].shape)}, not shard {r // tp} of {dp} of the global batch "
                    f"{tuple(x.shape)} (data.shard(x, dp_rank, dp_size))",
                )


def _check_collectives(
    check: str, run: Run2D, results: list[dict], where: str, tallied: list[list[list]]
) -> None:
    """Nothing talks outside the rank's TP and DP groups, by the launcher's tallies of every
    call (`tallied[r][case]`: case 0 the set-up, case s + 1 step s); forward talks only in
    the TP group, by the phases the rank's hooks recorded (only the rank can tell when in a
    step a call came, so that rule rests on the rank; the groups do not)."""
    __tracebackhide__ = True
    world = len(results)
    for r, result in enumerate(results):
        want_tp, want_dp = _partners(world, run.tp_size, r)
        for s, step in enumerate(result["steps"]):
            at = f"rank {r}, step {s} ({where})"
            for call in step["calls"]:
                if call.phase == "forward" and call.ranks != want_tp:
                    fail(
                        check,
                        f"{at}: {call.op} in forward went over ranks {list(call.ranks)}; "
                        f"forward only talks inside the TP group {list(want_tp)} (the "
                        "row-parallel outputs): build the TP layers with group=tp_group",
                    )
        for case, calls in enumerate(tallied[r]):
            at = f"rank {r}, step {case - 1} ({where})" if case else f"rank {r} ({where})"
            when = "" if case else " (in make_groups or GPT2D)"
            for call in calls:
                ranks = tuple(sorted(call.group))
                if ranks in (want_tp, want_dp):
                    continue
                everyone = len(ranks) == world and world > max(len(want_tp), len(want_dp))
                extra = (
                    " (the default group, every rank): the gradients of TP shards "
                    "must be averaged only over the DP group, pass group=dp_group"
                    if everyone
                    else ""
                )
                fail(
                    check,
                    f"{at}: {call.op}{when} went over ranks {list(ranks)}{extra}; rank {r}'s "
                    f"TP group is {list(want_tp)} and its DP group {list(want_dp)}",
                )


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Loosely equal: for telling which mistake was made, not for grading."""
    scale = max(1e-12, want.abs().max().item())
    return compare.find_mismatch({"t": got}, {"t": want}, rtol=1e-6, atol=1e-9 * scale) is None


def _local_delta(run: Run2D, step: dict, name: str, dp_rank: int, dp: int) -> torch.Tensor:
    """The SGD update of dense parameter `name` from DP shard `dp_rank`'s gradient alone."""
    model = models.TinyGPT(CONFIG, seed=0, dtype=DTYPE)
    model.load_state_dict(step["before"])
    x, y = (data.shard(t, dp_rank, dp) for t in step["batch"])
    models.lm_loss(model(x), y).backward()
    return -SGD_LR * dict(model.named_parameters())[name].grad


def _training_hint(run: Run2D, ref_step: dict, name: str, r: int, world: int, got, step) -> str:
    tp = run.tp_size
    dp = world // tp
    t = r % tp
    before = tp_shard(name, ref_step["before"][name], t, tp)
    want = tp_shard(name, ref_step["after"][name], t, tp) - before
    moved = got - before
    forward_tp = sum(c.phase == "forward" for c in step["calls"])
    if tp > 1 and forward_tp < 2 * CONFIG.n_layers:
        return (
            f"forward made {forward_tp} collective calls in the TP group; each block needs "
            "at least 2, the all-reduces that sum the row-parallel outputs of attention and "
            "of the MLP (Megatron's g)"
        )
    if dp > 1 and _close(moved, dp * want):
        return (
            f"the update is {dp} (the DP size) times the full-batch one: after the all-reduce "
            "in the DP group, divide the gradients by the DP group's size"
        )
    local = tp_shard(name, _local_delta(run, ref_step, name, r // tp, dp), t, tp)
    if dp > 1 and _close(moved, local):
        return (
            "the update uses this DP rank's own gradient: average every gradient over the DP "
            "group (dist.all_reduce(p.grad, group=dp_group), then divide by its size)"
        )
    return "the 2-D model must compute the dense TinyGPT's loss and gradients exactly"


def _check_training(
    check: str, run: Run2D, results: list[dict], where: str, batches, start: dict
) -> None:
    """Every rank's parameters against its shard of the reference, trained here from the
    drawn `start` on the drawn `batches`."""
    __tracebackhide__ = True
    world, tp = len(results), run.tp_size
    ref = _reference(start, batches)
    for r, result in enumerate(results):
        want = tp_shards(ref["initial"], r % tp, tp)
        problem = compare.find_mismatch(result["initial"], want, rtol=0.0, atol=0.0)
        if problem:
            fail(
                check,
                f"rank {r} ({where}): right after GPT2D(...), {problem}.\nHint: keep "
                "TinyGPT's parameter names; rank r of the TP group holds block r of the "
                "column-parallel rows (q, k and v each split by heads) and of the "
                "row-parallel columns; everything else whole",
            )
    for s, ref_step in enumerate(ref["steps"]):
        for r, result in enumerate(results):
            step = result["steps"][s]
            want = tp_shards(ref_step["after"], r % tp, tp)
            problem = compare.find_mismatch(step["params"], want, rtol=RTOL, atol=ATOL)
            if problem:
                name = next(
                    n
                    for n in want
                    if compare.find_mismatch(
                        {n: step["params"][n]}, {n: want[n]}, rtol=RTOL, atol=ATOL
                    )
                )
                hint = _training_hint(run, ref_step, name, r, world, step["params"][name], step)
                fail(
                    check,
                    f"rank {r}, step {s} ({where}): after train_step, {problem} (its shard "
                    f"of single-process training on the whole batch).\nHint: {hint}",
                )
