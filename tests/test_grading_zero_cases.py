"""Assignment 7's checks trust nothing computed or counted on the ranks: the weights and
batches are drawn in the checking process, each rank is given only its own shares, the
reference is trained there, and ZeRO-3's gathers during backward come from the launcher's
tallies. The cheats are those of tests/cheats/a07_zero.py that scored on the old checks."""

from __future__ import annotations

import pytest
import torch

from course_lib import data
from course_lib.calls import PerRank
from course_lib.grading import CheckFailed, check_zero1, check_zero3
from course_lib.grading.traffic import Traffic
from course_lib.grading.zero_cases import draw, given, reference
from course_lib.grading.zero_judge3 import gathered_in_backward
from course_lib.grading.zero_ranks import ZeroRun, global_batches, stage3_cases
from tests.adapters import planted
from tests.cheats.a07_zero import ZERO1_WHOLE_BATCH_IN_SIGHT, ZERO3_COUNTER_FORGED


def test_every_call_of_a_check_draws_new_weights_and_batches():
    run = ZeroRun(steps=2)
    first, second = draw(), draw()
    assert first != second
    assert {first.weights, first.tokens, first.order}.isdisjoint({run.seed, run.seed + 1})
    x, _ = global_batches(run, first)[0]
    assert not torch.equal(x, global_batches(run, second)[0][0])
    assert not torch.equal(x, global_batches(run)[0][0])  # the notebook's seeded batches
    ours = reference(run, drawn=first)["steps"][0]["params"]
    theirs = reference(run)["steps"][0]["params"]
    assert any(not torch.equal(ours[name], theirs[name]) for name in ours)


def test_each_rank_is_given_its_own_shares_and_no_seed_of_the_batches():
    run, ranks = ZeroRun(steps=3, batch_size=12), 4
    drawn = draw()
    mine = given(run, drawn, ranks)
    assert isinstance(mine, PerRank) and len(mine.values) == ranks
    for r, value in enumerate(mine.values):
        assert set(value) == {"weights", "shares"}  # nothing else reaches the rank
        assert value["weights"] == drawn.weights  # the model it holds before sharding
        for (x, y), (xs, ys) in zip(global_batches(run, drawn), value["shares"], strict=True):
            assert torch.equal(xs, data.shard(x, r, ranks))
            assert torch.equal(ys, data.shard(y, r, ranks))
            assert len(xs) == len(x) // ranks


def _tallies(per_step_backward: list[list[tuple]], steps: int) -> list[tuple]:
    """One rank's launcher entries: stage 3's marks, with `per_step_backward[s]`'s calls in
    step s's backward and a reduce-scatter in each step's forward, for contrast."""
    gather = ("call", "all_gather_into_tensor", None, 8, 24, (0, 1, 2, 3))
    entries: list[tuple] = [("mark", 0), gather]  # shard_module's own gathers: not backward's
    for s in range(steps):
        entries += [("mark", 1 + 3 * s), gather, ("mark", 2 + 3 * s)]
        entries += per_step_backward[s]
        entries += [("mark", 3 + 3 * s)]
    return entries + [("mark", stage3_cases(steps))]


def test_gathers_in_backward_are_read_from_the_launchers_tallies_case_by_case():
    def call(op: str, received: int) -> tuple:
        return ("call", op, None, 8, received, (0, 1))

    backward = [
        [call("all_gather_into_tensor", 8), call("broadcast", 5)],
        [call("reduce_scatter_tensor", 8), call("all_gather", 4)],
    ]
    traffic = Traffic([_tallies(backward, 2), _tallies([[], []], 2)], None)
    assert gathered_in_backward("check_zero3", traffic, 2) == [[13, 4], [0, 0]]


def test_marks_that_are_not_the_checks_own_are_tampering():
    entries = _tallies([[("mark", 2)], []], 2)  # a second mark 2: code on the rank added it
    with pytest.raises(CheckFailed) as info:
        gathered_in_backward("check_zero3", Traffic([entries], None), 2)
    assert info.value.tampering and "reported out of order" in str(info.value)


def test_check_zero1_refuses_a_whole_batch_found_on_the_heap_or_regenerated_from_the_seed():
    cheat = planted("zero", "zero1", ZERO1_WHOLE_BATCH_IN_SIGHT).ShardedOptimizer
    with pytest.raises(CheckFailed) as info:
        check_zero1(cheat, world_size=2, steps=2)
    assert "rank 0, after step 0" in str(info.value)
    assert "compared with torch.optim.AdamW on one process" in str(info.value)


def test_check_zero3_counts_backward_gathers_outside_the_ranks():
    cheat = planted("zero", "zero3", ZERO3_COUNTER_FORGED).shard_module
    with pytest.raises(CheckFailed) as info:
        check_zero3(cheat, world_size=2, steps=1)
    assert "during backward it all-gathered 0 bytes of parameters" in str(info.value)
