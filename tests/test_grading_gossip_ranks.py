"""What a rank holds while Assignment 4's checks run, and what the checks take from it: its own
starting x only (drawn in the checking process from a secret seed, new for each call), no
reference, and no say in the counting of its messages. Each cheat here got full marks when the
starts came from a seed the rank knew and the messages were counted on the rank."""

from __future__ import annotations

import re

import pytest
import torch.distributed as dist

from course_lib.grading import CheckFailed, check_one_peer_schedule, check_push_sum
from tests.adapters import planted, solution
from tests.cheats.a04_gossip import COUNTERS_EMPTIED, INNER_GROUP, SEED_THIEF

peer = solution("gossip").peer
thief = planted("gossip", "push_sum_step", SEED_THIEF).push_sum_step
counters_emptied = planted("gossip", "push_sum_step", COUNTERS_EMPTIED).push_sum_step
inner_group = planted("gossip", "push_sum_step", INNER_GROUP).push_sum_step

PART_1 = {"world_sizes": (3, 4), "rounds": 4, "timeout": 20}
PART_2 = {"world_sizes": (4,), "timeout": 20}


def test_a_rank_that_regenerates_every_start_from_the_seed_gets_no_credit():
    """The case and round are in the callers' frames, but not the secret the x came from."""
    with pytest.raises(CheckFailed) as info:
        check_push_sum(thief, **PART_1)
    text = str(info.value)
    assert text.startswith("check_push_sum: ") and "push-sum conserves the total" in text, text
    with pytest.raises(CheckFailed) as info:
        check_one_peer_schedule(peer, thief, **PART_2)
    text = str(info.value)
    assert "push-sum on this schedule gives" in text, text


def test_counters_emptied_on_the_rank_hide_no_call():
    with pytest.raises(CheckFailed) as info:
        check_push_sum(counters_emptied, **PART_1)
    assert "called all_gather; push-sum uses point-to-point messages only" in str(info.value)
    with pytest.raises(CheckFailed) as info:
        check_one_peer_schedule(peer, counters_emptied, **PART_2)
    assert "called all_gather; only point-to-point messages count" in str(info.value)


@pytest.mark.parametrize("part", [1, 2])
def test_a_collective_on_the_inner_group_is_tampering(part):
    """No call reported, but its bytes are on the rank's sockets."""
    with pytest.raises(CheckFailed) as info:
        if part == 1:
            check_push_sum(inner_group, **PART_1)
        else:
            check_one_peer_schedule(peer, inner_group, **PART_2)
    assert info.value.tampering and info.value.score == 0
    assert "that none of its send/recv calls account for" in str(info.value)


def shows_x(x, w, out_neighbors, in_neighbors):
    """Fails at once on rank 0, saying what x it was given (the other ranks go on alone)."""
    if dist.get_rank() == 0:
        raise ValueError("given " + ",".join(f"{v:.12g}" for v in x.tolist()))
    return x, w


def given(check, *args, **options) -> set[str]:
    with pytest.raises(CheckFailed) as info:
        check(*args, **options)
    return set(re.findall(r"ValueError: given ([-\d.e,]+)", str(info.value)))


def test_the_starts_are_new_for_every_call_of_a_check():
    """Same seed, same case: another x on the ranks each time, so nothing a rank saw in one
    call (or a student's notebook printed) tells the next call's answer."""
    one = dict(world_sizes=(1,), graphs=("exponential",), rounds=1, timeout=20)
    first, second = given(check_push_sum, shows_x, **one), given(check_push_sum, shows_x, **one)
    assert first and second and not first & second
    first = given(check_one_peer_schedule, peer, shows_x, world_sizes=(2,), timeout=20)
    second = given(check_one_peer_schedule, peer, shows_x, world_sizes=(2,), timeout=20)
    assert first and second and not first & second
