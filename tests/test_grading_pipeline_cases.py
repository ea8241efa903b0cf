"""Assignment 8's trainer check trusts nothing computed or counted on the ranks that run the
student's code: each rank gets only its share of a secret draw, the reference is trained in
the checking process, and the calls come from the launcher's tallies and the wire."""

from __future__ import annotations

import pytest
import torch

from course_lib import rank, world_size
from course_lib.grading import CheckFailed, check_pipeline_trainer
from course_lib.grading.pipeline_cases import (
    build_model,
    pipeline_runs,
    reference_steps,
    share,
    stages,
)
from tests.adapters import planted, solution
from tests.cheats.a08_pipeline import COUNTERS_EMPTIED, FORGED_FIRST, INNER_GROUP

pipeline_step = solution("pipeline").pipeline_step


def test_each_rank_is_given_its_own_stage_and_only_the_data_it_needs():
    (run,) = pipeline_runs(("mlp",), (4,), steps=2)
    P = 3
    whole = stages(build_model(run), P)
    for r in range(P):
        given = share(run, P, r)
        assert [p.shape for p in given["stage"].parameters()] == [
            p.shape for p in whole[r].parameters()
        ]
        for got, want in zip(given["stage"].parameters(), whole[r].parameters(), strict=True):
            assert torch.equal(got, want)
        for step in given["steps"]:
            assert torch.count_nonzero(step["inputs"]) == 0 or r == 0
            assert torch.count_nonzero(step["targets"]) == 0 or r == P - 1
    # The reference's first stage input is the batch the first rank was given.
    first = reference_steps(run, P)[0]["inputs"][0]
    assert torch.equal(torch.cat(first), share(run, P, 0)["steps"][0]["inputs"])


def test_every_call_draws_new_weights():
    one, two = (pipeline_runs(("mlp",), (4,), steps=1)[0] for _ in range(2))
    assert one.secret != two.secret
    w1, w2 = (next(build_model(run).parameters()) for run in (one, two))
    assert not torch.equal(w1, w2)


def step_sees_its_share(stage, inputs, targets, loss_fn, n_micro, schedule):
    """The solution, failing if a rank holds rows of the batch its stage does not need."""
    r, P = rank(), world_size()
    if r > 0 and torch.count_nonzero(inputs):
        raise AssertionError(f"stage {r} was given the batch's inputs")
    if r < P - 1 and torch.count_nonzero(targets):
        raise AssertionError(f"stage {r} was given the batch's targets")
    return pipeline_step(stage, inputs, targets, loss_fn, n_micro, schedule)


def test_a_stage_gets_only_the_rows_it_needs():
    # On main every rank was given the whole batch.
    check_pipeline_trainer(step_sees_its_share, "1f1b", world_sizes=(3,), n_micro=(4,))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_counters_emptied_around_an_all_gather_fail(schedule):
    # On main the counter on the rank missed the all-gather and the cheat passed.
    step = planted("pipeline", "pipeline_step", COUNTERS_EMPTIED).pipeline_step
    with pytest.raises(CheckFailed) as info:
        check_pipeline_trainer(step, schedule, world_sizes=(2,), n_micro=(4,))
    assert "stage 0, step 0" in str(info.value)
    assert "used ['all_gather']; a pipeline only passes activations" in str(info.value)


def test_an_all_gather_on_the_inner_group_is_tampering():
    # On main nothing on the rank saw the inner group's calls and the cheat passed.
    step = planted("pipeline", "pipeline_step", INNER_GROUP).pipeline_step
    with pytest.raises(CheckFailed) as info:
        check_pipeline_trainer(step, "gpipe", world_sizes=(2,), n_micro=(4,))
    assert info.value.tampering
    assert "that none of its send/recv calls account for" in str(info.value)


def test_first_weights_forged_in_the_checks_frame_fail():
    # On main the judge trained its reference from the first weights each rank sent back,
    # which the cheat rewrote in the check's frame: it passed with no message.
    step = planted("pipeline", "pipeline_step", FORGED_FIRST).pipeline_step
    with pytest.raises(CheckFailed) as info:
        check_pipeline_trainer(step, "gpipe", world_sizes=(2,), n_micro=(4,))
    assert "stage 0, step 0" in str(info.value)
    assert "sent stage 1 0 bytes, fewer than the" in str(info.value)
