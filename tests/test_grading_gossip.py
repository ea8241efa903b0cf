"""Assignment 4's push-sum check accepts right implementations and rejects wrong ones."""

from __future__ import annotations

import re
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from course_lib.grading import CheckFailed, check_push_sum
from course_lib.grading.gossip import in_neighbors, out_neighbors, push_sum_reference
from tests.adapters import planted, solution
from tests.cheats.a04_gossip import PUSH_SUM_ALL_GATHER

push_sum_step = solution("gossip").push_sum_step
cloudpickle.register_pickle_by_value(sys.modules[__name__])


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


@pytest.mark.parametrize("fn", [push_sum_step, push_sum_two_messages], ids=["solution", "two"])
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
    """The lecture's step, called."""
    from course_lib import gossip

    return gossip.push_sum_step(x, w, out_neighbors, in_neighbors)


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
        (push_sum_lecture, "runs course_lib.gossip.push_sum_step"),
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
