"""Assignment 4's checks (push-sum, and the one-peer schedule of the open part) accept right
answers and reject wrong ones."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from course_lib.grading import CheckFailed, check_push_sum
from course_lib.grading.gossip import in_neighbors, out_neighbors, push_sum_reference
from course_lib.grading.gossip_schedule import (
    THRESHOLD,
    check_one_peer_schedule,
    rounds_for,
    simulate,
)
from tests.adapters import planted, solution
from tests.cheats.a04_gossip import BLOCKING_RECV, PUSH_SUM_ALL_GATHER

push_sum_step = solution("gossip").push_sum_step


def exchange(message, send_to, receive_from):
    """Send `message` to every rank in send_to; return one received tensor per receive_from."""
    inbox = [torch.empty_like(message) for _ in receive_from]
    requests = [dist.isend(message, dst) for dst in send_to]
    requests += [dist.irecv(buffer, src) for buffer, src in zip(inbox, receive_from, strict=True)]
    for request in requests:
        request.wait()
    return inbox


def push_sum_two_messages(x, w, out_neighbors, in_neighbors):
    """Right, another way: x and w in separate messages, batch_isend_irecv."""
    share = 1.0 / (len(out_neighbors) + 1)
    sx, sw = x * share, (w * share).reshape(1)
    xs = [torch.empty_like(sx) for _ in in_neighbors]
    ws = [torch.empty_like(sw) for _ in in_neighbors]
    ops = [dist.P2POp(dist.isend, t, dst) for dst in out_neighbors for t in (sx, sw)]
    ops += [
        dist.P2POp(dist.irecv, t, src)
        for src, pair in zip(in_neighbors, zip(xs, ws, strict=True), strict=True)
        for t in pair
    ]
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()
    return sx + sum(xs), (sw + sum(ws)).reshape(())


# isends, then a blocking recv from each in-neighbour: what the wire carries differs, and every
# byte of it is still accounted for by the calls reported.
push_sum_blocking_recv = planted("gossip", "push_sum_step", BLOCKING_RECV).push_sum_step


@pytest.mark.parametrize(
    "fn",
    [push_sum_step, push_sum_two_messages, push_sum_blocking_recv],
    ids=["solution", "two", "blocking-recv"],
)
def test_push_sum_accepts_right_implementations(fn, capsys):
    check_push_sum(fn, rounds=20)
    check_push_sum(fn, dtype=torch.float32, world_sizes=(4,), seeds=(1,))
    out = capsys.readouterr().out
    assert out.count("check_push_sum: passed. Verified ") == 2
    assert "rounds, float32): every round equals push-sum on every rank" in out


def test_a_failing_push_sum_lists_several_failing_cases():
    with pytest.raises(CheckFailed) as info:
        check_push_sum(push_sum_no_own_share, world_sizes=(2, 3), rounds=3)
    text = str(info.value)
    assert re.search(r"\[result\] failed in ([4-9]|\d\d) case\(s\):", text), text
    assert text.count("\n  - ") == 3


def push_sum_no_own_share(x, w, out_neighbors, in_neighbors):
    """Keeps all of x and w and also sends a full share away: totals grow."""
    share = 1.0 / max(len(out_neighbors), 1)
    message = torch.cat([x, w.reshape(1)]) * share
    total = torch.cat([x, w.reshape(1)]) + sum(exchange(message, out_neighbors, in_neighbors))
    return total[:-1], total[-1]


def push_sum_reversed(x, w, out_neighbors, in_neighbors):
    """Sends to the in-neighbours and receives from the out-neighbours."""
    message = torch.cat([x, w.reshape(1)]) / (len(in_neighbors) + 1)
    total = message + sum(exchange(message, in_neighbors, out_neighbors))
    return total[:-1], total[-1]


def push_sum_no_weights(x, w, out_neighbors, in_neighbors):
    """Mixes x but leaves w at 1."""
    message = x / (len(out_neighbors) + 1)
    return message + sum(exchange(message, out_neighbors, in_neighbors)), w


def push_sum_recv_first(x, w, out_neighbors, in_neighbors):
    """Every rank waits for its in-neighbours before sending: nobody ever sends."""
    message = torch.cat([x, w.reshape(1)]) / (len(out_neighbors) + 1)
    inbox = [torch.empty_like(message) for _ in in_neighbors]
    for buffer, src in zip(inbox, in_neighbors, strict=True):
        dist.recv(buffer, src)
    for dst in out_neighbors:
        dist.send(message, dst)
    total = message + sum(inbox)
    return total[:-1], total[-1]


def push_sum_returns_z(x, w, out_neighbors, in_neighbors):
    new_x, new_w = push_sum_step(x, w, out_neighbors, in_neighbors)
    return new_x / new_w


def not_implemented(*args):
    raise NotImplementedError()


# The cheat the grading course plants, as its notebook would run it.
push_sum_all_gather = planted("gossip", "push_sum_step", PUSH_SUM_ALL_GATHER).push_sum_step


def push_sum_lecture(x, w, out_neighbors, in_neighbors):
    """Right numbers, with the messages exchanged by the lecture's gossip code (the library
    has no push-sum step of its own: this is the closest a student can come to calling one)."""
    from course_lib import gossip

    message = torch.cat([x.reshape(-1), w.reshape(1)]) / (len(out_neighbors) + 1)
    received = gossip._exchange(message, out_neighbors, in_neighbors)
    total = message + sum(received, torch.zeros_like(message))
    return total[:-1].view_as(x), total[-1]


@pytest.mark.parametrize(
    "fn, message",
    [
        (push_sum_no_own_share, "push-sum conserves them"),
        (push_sum_reversed, "send to out_neighbors and receive from in_neighbors"),
        (push_sum_no_weights, "Every w is still 1"),
        (push_sum_returns_z, "expected a pair (x_new, w_new)"),
        (not_implemented, "raised NotImplementedError"),
        (push_sum_recv_first, "did not finish within 5 s"),
        (push_sum_all_gather, "called all_gather; push-sum uses point-to-point messages only"),
        (push_sum_lecture, "runs course_lib.gossip._exchange"),
    ],
    ids=[
        "no-own-share",
        "reversed",
        "no-weights",
        "returns-z",
        "not-implemented",
        "deadlock",
        "all-gather",
        "lecture",
    ],
)
def test_push_sum_rejects_wrong_implementations(fn, message):
    with pytest.raises(CheckFailed) as info:
        check_push_sum(fn, rounds=10, timeout=5)
    text = str(info.value)
    assert text.startswith("check_push_sum: ") and message in text, text


def test_graphs_are_consistent_and_the_reference_conserves_totals():
    for p in (1, 2, 3, 4, 5, 8):
        for graph in ("exponential", "one-peer exponential", "irregular"):
            for t in range(3):
                for r in range(p):
                    for j in out_neighbors(graph, r, p, t):
                        assert r in in_neighbors(graph, j, p, t) and j != r
    assert out_neighbors("exponential", 0, 8) == [1, 2, 4]
    assert [out_neighbors("one-peer exponential", 0, 8, t) for t in range(4)] == [
        [1],
        [2],
        [4],
        [1],
    ]
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    ws = [torch.ones((), dtype=torch.float64) for _ in range(4)]
    new_x, new_w = push_sum_reference(xs, ws, "irregular", 0)
    torch.testing.assert_close(sum(new_x), sum(xs), rtol=0, atol=1e-14)
    # rank 0 keeps 1/4 and gets half of rank 3's; ranks 2 and 3 get more than they give
    assert [w.item() for w in new_w] == [0.75, 0.75, 1.25, 1.25]


# --- Part 2 (open): a one-peer schedule that mixes fast -------------------------------------

peer = solution("gossip").peer


def ring(rank, world_size, round):
    """Too slow: a value needs P - 1 rounds to reach every rank."""
    return (rank + 1) % world_size


def exponential_reversed(rank, world_size, round):
    """Right, another way: the hops 4, 2, 1 (largest first)."""
    doublings = world_size.bit_length() - 1
    return (rank + 2 ** (doublings - 1 - round % doublings)) % world_size


def hypercube(rank, world_size, round):
    """Right, another way: pairs across one dimension of the hypercube per round."""
    return rank ^ (1 << (round % (world_size.bit_length() - 1)))


def random_derangement(rank, world_size, round):
    """Right, another way: a random permutation without fixed points per round, seeded."""
    import random

    draw, order = random.Random(round), list(range(world_size))
    while any(order[i] == i for i in range(world_size)):
        draw.shuffle(order)
    return order[rank]


def all_to_zero(rank, world_size, round):
    """Everybody sends to rank 0 (rank 0 to rank 1): sums kept, but nothing mixes."""
    return 0 if rank else 1


def two_peers(rank, world_size, round):
    """Two messages per round: to rank + 1 and rank + 2."""
    return [(rank + 1) % world_size, (rank + 2) % world_size]


def unseeded(rank, world_size, round):
    """A random schedule drawn from the global generator: differs from rank to rank."""
    import random

    return (rank + random.randrange(1, world_size)) % world_size


def lecture_graph(rank, world_size, round):
    from course_lib.gossip import ExponentialGraph

    return ExponentialGraph(world_size).out_neighbors(rank, round)[0]


def push_sum_also_to_next(x, w, out_neighbors, in_neighbors):
    """Right numbers, but a second message, to rank + 3, every round."""
    me, p = dist.get_rank(), dist.get_world_size()
    extra = dist.isend(torch.zeros(1, dtype=x.dtype), (me + 3) % p)
    dist.irecv(torch.empty(1, dtype=x.dtype), (me - 3) % p).wait()
    extra.wait()
    return push_sum_step(x, w, out_neighbors, in_neighbors)


def test_the_bound_lies_between_the_ring_and_the_exponential_graph():
    """The numbers the notebook states, measured in one process on the check's own data."""
    for p, ring_error in ((4, 0.036), (8, 0.16)):
        assert rounds_for(p) == 4 * (p.bit_length() - 1)
        measured = [simulate(ring, p, seed) for seed in (0, 1, 2)]
        assert min(measured) > 3 * THRESHOLD, measured
        assert simulate(ring, p, 0) == pytest.approx(ring_error, abs=0.005)
        for right in (peer, exponential_reversed, hypercube):
            assert simulate(right, p, 0) < 1e-12  # exact after log2 P rounds
        assert all(simulate(random_derangement, p, seed) < 0.6 * THRESHOLD for seed in (0, 1, 2))
        assert simulate(all_to_zero, p, 0) > 0.5


@pytest.mark.parametrize(
    "schedule",
    [peer, exponential_reversed, hypercube, random_derangement],
    ids=["solution", "reversed-hops", "hypercube", "random-derangement"],
)
def test_check_one_peer_schedule_accepts_fast_schedules(schedule, capsys):
    check_one_peer_schedule(schedule, push_sum_step, world_sizes=(4, 8))
    out = capsys.readouterr().out
    assert out.startswith("check_one_peer_schedule: passed. Verified world size(s) 4, 8"), out
    assert "(allowed 0.01)" in out


@pytest.mark.parametrize(
    "schedule, step, message",
    [
        (ring, push_sum_step, "the consensus error"),  # measured: mixes too slowly
        (all_to_zero, push_sum_step, "the consensus error"),  # measured: never mixes
        (two_peers, push_sum_step, "expected one rank (an int)"),  # rule: one peer
        (peer, push_sum_also_to_next, "one peer per round"),  # rule: counted messages
        (unseeded, push_sum_step, "gave different answers on different ranks"),
        (lecture_graph, push_sum_step, "runs course_lib.gossip."),
    ],
    ids=["ring", "all-to-zero", "two-peers", "extra-message", "unseeded", "lecture"],
)
def test_check_one_peer_schedule_rejects(schedule, step, message):
    with pytest.raises(CheckFailed) as info:
        check_one_peer_schedule(schedule, step, timeout=10)
    text = str(info.value)
    assert text.startswith("check_one_peer_schedule: ") and message in text, text
