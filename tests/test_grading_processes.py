"""Assignment 1's checks accept right implementations and reject wrong ones."""

from __future__ import annotations

import math
import multiprocessing
import time

import pytest
import torch
import torch.distributed as dist

from course_lib import rank
from course_lib.grading import (
    CheckFailed,
    check_chain,
    check_dist_ping_pong,
    check_ping_pong,
    check_round_trip_time,
    check_spread,
)
from tests.adapters import mutant, planted, solution
from tests.cheats import a01_processes as cheats

FORK = multiprocessing.get_context("fork")  # for the answers written in other styles

# --- ping and pong ------------------------------------------------------------------------


A01 = solution("processes")
ping, pong = A01.ping, A01.pong


def ping_polling(conn, rounds):
    """Right, in another style: waits with poll() before each recv."""
    out = []
    for i in range(rounds):
        conn.send(i)
        while not conn.poll(0.01):
            pass
        out.append(conn.recv())
    return out


def pong_counting(conn, rounds):
    """Right, in another style: a while loop that counts replies."""
    done = 0
    while done < rounds:
        value = conn.recv()
        conn.send(value + 1)
        done += 1
    return done


# Named mutations of the solution: a pong that echoes, and one that stops a reply short.
pong_echo = mutant(
    "processes", "ping_pong", ("conn.send(conn.recv() + 1)", "conn.send(conn.recv())")
).pong
pong_one_short = mutant(
    "processes",
    "ping_pong",
    (
        "for _ in range(rounds):\n        conn.send",
        "for _ in range(rounds - 1):\n        conn.send",
    ),
).pong


def ping_fabricates(conn, rounds):
    return list(range(1, rounds + 1))


def ping_one_extra(conn, rounds):
    return [(conn.send(i), conn.recv())[1] for i in range(rounds + 1)][:rounds]


def ping_returns_sent(conn, rounds):
    for i in range(rounds):
        conn.send(i)
        conn.recv()
    return list(range(rounds))


def not_implemented(*args):
    raise NotImplementedError()


@pytest.mark.parametrize("ping_fn, pong_fn", [(ping, pong), (ping_polling, pong_counting)])
@pytest.mark.parametrize("rounds", [1, 5])
def test_ping_pong_accepts_right_implementations(ping_fn, pong_fn, rounds, capsys):
    check_ping_pong(ping_fn, pong_fn, rounds=rounds)
    replies = list(range(1, rounds + 1))
    out = capsys.readouterr().out
    assert out.startswith("check_ping_pong: passed. Verified your ping")
    assert f"got back {replies}" in out


@pytest.mark.parametrize(
    "ping_fn, pong_fn, message",
    [
        (ping, pong_echo, "each reply should be the number received plus one"),
        (ping, pong_one_short, "your pong replied to only 2 of 3 numbers"),
        (ping_fabricates, pong, "your ping sent [] and then closed the connection"),
        (ping_one_extra, pong, "was a message sent or awaited too many?"),
        (ping_returns_sent, pong, "your ping returned [0, 1, 2], expected the replies"),
        (not_implemented, pong, "NotImplementedError"),
        (ping, not_implemented, "NotImplementedError"),
    ],
)
def test_ping_pong_rejects_wrong_implementations(ping_fn, pong_fn, message):
    start = time.monotonic()
    with pytest.raises(CheckFailed) as info:
        check_ping_pong(ping_fn, pong_fn, rounds=3, wait=2)
    assert str(info.value).startswith("check_ping_pong: ")
    assert message in str(info.value)
    assert time.monotonic() - start < 30


# --- the chain ----------------------------------------------------------------------------


relay, run_chain = A01.relay, A01.run_chain


def run_chain_backwards(n, relay_fn):
    """Right, in another style: duplex pipes, processes started last to first."""
    links = [FORK.Pipe() for _ in range(n + 1)]
    processes = [
        FORK.Process(target=relay_fn, args=(k, links[k][1], links[k + 1][0]))
        for k in reversed(range(n))
    ]
    for p in processes:
        p.start()
    links[0][0].send((0, []))
    result = links[n][1].recv()
    for p in processes:
        p.join()
    return result


# Named mutations: a relay that adds its index twice, one that never passes the message on, a
# chain whose pipes are wired backwards, and one that never reads the last pipe.
relay_adds_twice = mutant(
    "processes", "chain", ("outbox.send((total + index,", "outbox.send((total + 2 * index,")
).relay
relay_drops_message = mutant(
    "processes", "chain", ("    outbox.send((total + index, path + [index]))\n", "")
).relay
run_chain_miswired = mutant(
    "processes",
    "chain",
    ("args=(k, pipes[k][0], pipes[k + 1][1])", "args=(k, pipes[k + 1][0], pipes[k][1])"),
).run_chain
run_chain_forgets_result = mutant(
    "processes", "chain", ("result = pipes[n][0].recv()", "result = (0, [])")
).run_chain


def run_chain_in_one_process(n, relay_fn):
    pipes = [FORK.Pipe(duplex=False) for _ in range(n + 1)]
    pipes[0][1].send((0, []))
    for k in range(n):
        relay_fn(k, pipes[k][0], pipes[k + 1][1])
    return pipes[n][0].recv()


@pytest.mark.parametrize("chain_fn", [run_chain, run_chain_backwards])
@pytest.mark.parametrize("n", [1, 4])
def test_chain_accepts_right_implementations(chain_fn, n, capsys):
    check_chain(relay, chain_fn, n=n)
    expected = (sum(range(n)), list(range(n)))
    assert f"check_chain: passed. Verified {n} of your relays turned (0, []) into {expected}" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize(
    "relay_fn, chain_fn, message",
    [
        (relay_adds_twice, run_chain, "turned (0, []) into (12, [0, 1, 2, 3])"),
        (relay_drops_message, run_chain, "although relay 0 had finished: does each relay send"),
        (relay, run_chain_in_one_process, "must run each relay in its own new process"),
        (relay, run_chain_miswired, "did not finish within"),
        (relay, run_chain_forgets_result, "returned total 0 after relays []"),
        (not_implemented, run_chain, "NotImplementedError"),
    ],
)
def test_chain_rejects_wrong_implementations(relay_fn, chain_fn, message):
    with pytest.raises(CheckFailed) as info:
        check_chain(relay_fn, chain_fn, n=4, wait=2)
    assert message in str(info.value)


# --- torch.distributed ping-pong ----------------------------------------------------------


dist_ping_pong = A01.dist_ping_pong


def dist_ping_pong_async(rounds):
    """Right, in another style: isend/irecv with explicit waits."""
    out = []
    peer = 1 - rank()
    buffer = torch.zeros(1, dtype=torch.float64)
    for i in range(rounds):
        if rank() == 0:
            dist.isend(torch.tensor([float(i)], dtype=torch.float64), peer).wait()
            dist.irecv(buffer, peer).wait()
        else:
            dist.irecv(buffer, peer).wait()
            dist.isend(buffer + 1, peer).wait()
        out.append(buffer.item())
    return out


# Named mutations: rank 1 sends back what it got; both ranks send float32.
dist_no_plus_one = mutant(
    "processes", "dist_ping_pong", ("dist.send(buffer + 1, dst=0)", "dist.send(buffer, dst=0)")
).dist_ping_pong
dist_float32 = mutant(
    "processes",
    "dist_ping_pong",
    ("buffer = torch.zeros(1, dtype=torch.float64)", "buffer = torch.zeros(1)"),
    ("torch.tensor([float(i)], dtype=torch.float64)", "torch.tensor([float(i)])"),
).dist_ping_pong


def dist_broadcast(rounds):
    out = []
    for i in range(rounds):
        t = torch.tensor([float(i)], dtype=torch.float64)
        dist.broadcast(t, src=0)
        out.append(t.item() + (1 if rank() == 0 else 0))
    return out


def dist_no_reply(rounds):
    t = torch.zeros(1, dtype=torch.float64)
    if rank() == 0:
        dist.send(t, 1)
        dist.recv(t, 1)
    else:
        dist.recv(t, 0)
    return []


def dist_fabricated(rounds):
    return [float(i + 1 - rank()) for i in range(rounds)]


def dist_counters_forged(rounds):
    """No message; the rank's own counters told of a real ping-pong (the old check read them)."""
    from course_lib import comm

    for counter in comm._active:
        counter.bytes_sent += 8 * rounds
        counter.bytes_received += 8 * rounds
        counter.calls["send"] += rounds
        counter.calls["recv"] += rounds
    return [float(i + 1 - rank()) for i in range(rounds)]


def dist_inner_broadcast(rounds):
    """The values broadcast on the gloo group inside the counted one, which reports nothing."""
    values = torch.arange(rounds, dtype=torch.float64)
    dist.group.WORLD._inner.broadcast([values], dist.BroadcastOptions()).wait()
    return (values + 1).tolist() if rank() == 0 else values.tolist()


def test_dist_ping_pong_counts_what_the_launcher_saw_not_the_ranks_counters():
    with pytest.raises(CheckFailed, match="rank 0 sent 0 and received 0 bytes"):
        check_dist_ping_pong(dist_counters_forged, rounds=3)
    with pytest.raises(CheckFailed) as info:
        check_dist_ping_pong(dist_inner_broadcast, rounds=3)
    assert info.value.tampering and "none of its send/recv calls account for" in str(info.value)


@pytest.mark.parametrize("fn", [dist_ping_pong, dist_ping_pong_async])
def test_dist_ping_pong_accepts_right_implementations(fn, capsys):
    check_dist_ping_pong(fn, rounds=4)
    assert "32 bytes each way per rank; rank 0 got the replies [1.0, 2.0, 3.0, 4.0]" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize(
    "fn, message",
    [
        (dist_no_plus_one, "rank 0 returned [0.0, 1.0, 2.0], expected [1.0, 2.0, 3.0]"),
        (dist_broadcast, "rank 0 used ['broadcast']"),
        (dist_float32, "rank 0 sent 12 and received 12 bytes"),
        (dist_no_reply, "did not finish within 15 s"),
        (dist_fabricated, "rank 0 sent 0 and received 0 bytes"),
        (not_implemented, "raised NotImplementedError on rank "),
    ],
)
def test_dist_ping_pong_rejects_wrong_implementations(fn, message):
    with pytest.raises(CheckFailed) as info:
        # The deadlock is stopped after 15 s. The cases after it start on fresh ranks, which
        # first import this module (and run the solution's cells): on a busy machine that
        # alone took more than 15 s, so they get 60.
        check_dist_ping_pong(fn, rounds=3, timeout=15 if fn is dist_no_reply else 60)
    assert message in str(info.value)


# --- round-trip time ----------------------------------------------------------------------


round_trip_time = A01.round_trip_time


def rtt_constant(nbytes, repeats):
    round_trip_time(nbytes, repeats)
    return 0.001


def rtt_one_byte(nbytes, repeats):
    return round_trip_time(1, repeats)


def rtt_one_way(nbytes, repeats):
    message = torch.zeros(nbytes, dtype=torch.uint8)
    start = time.perf_counter()
    for _ in range(repeats):
        if rank() == 0:
            dist.send(message, 1)
        else:
            dist.recv(message, 0)
    return (time.perf_counter() - start) / repeats


def test_round_trip_time_accepts_a_right_implementation(capsys):
    check_round_trip_time(round_trip_time)
    assert "a 16,000,000-byte round trip took" in capsys.readouterr().out


@pytest.mark.parametrize(
    "fn, message",
    [
        (rtt_constant, "the large message should cost far more"),
        (rtt_one_byte, "rank 0 sent 5 and received 5 bytes"),
        (rtt_one_way, "rank 0 sent 5000 and received 0 bytes"),
    ],
)
def test_round_trip_time_rejects_wrong_implementations(fn, message):
    with pytest.raises(CheckFailed) as info:
        check_round_trip_time(fn)
    assert message in str(info.value)


# --- spread: rank 0's tensor to every rank, in ceil(log2 P) rounds (the open part) ---------


spread = A01.spread


# Right, another schedule: rank 0 sends to the middle first, each half then recurses (the
# alternative tests/cheats plants in the notebook).
spread_halves = planted("processes", "spread", cheats.SPREAD_BY_HALVES).spread
spread_frames_thief = planted("processes", "spread", cheats.FRAMES_SPREAD).spread


def spread_chain(tensor):
    """Part 2's chain with send/recv: P - 1 rounds."""
    me, p = rank(), dist.get_world_size()
    if me:
        dist.recv(tensor, src=me - 1)
    if me + 1 < p:
        dist.send(tensor, dst=me + 1)


def spread_star(tensor):
    """Rank 0 sends to each rank in turn (isend all at once, then wait): P - 1 rounds."""
    if rank() == 0:
        for request in [dist.isend(tensor, dst=r) for r in range(1, dist.get_world_size())]:
            request.wait()
    else:
        dist.recv(tensor, src=0)


def spread_floor(tensor):
    """A doubling tree with floor(log2 P) steps: right for powers of two only."""
    for k in range(int(math.log2(dist.get_world_size()))):
        step, me = 2**k, rank()
        if me < step:
            dist.send(tensor, dst=me + step)
        elif me < 2 * step:
            dist.recv(tensor, src=me - step)


def spread_heap(tensor):
    """The binary tree of heap numbering (children 2r+1, 2r+2): 4 rounds for P = 8."""
    me, p = rank(), dist.get_world_size()
    if me:
        dist.recv(tensor, src=(me - 1) // 2)
    for child in (2 * me + 1, 2 * me + 2):
        if child < p:
            dist.send(tensor, dst=child)


def spread_lecture(tensor):
    """The lecture's binary tree, its helpers wrapped."""
    from course_lib.collectives import tree_children, tree_parent

    parent = tree_parent(rank())
    if parent is not None:
        dist.recv(tensor, src=parent)
    for child in tree_children(rank(), dist.get_world_size()):
        dist.send(tensor, dst=child)


def spread_broadcast(tensor):
    dist.broadcast(tensor, src=0)


def spread_halves_of_it(tensor):
    """A binomial tree sending each tensor in two halves: two receives per rank."""
    me, p, step = rank(), dist.get_world_size(), 1
    while step < p:
        for part in tensor.view(-1).chunk(2):
            if me < step and me + step < p:
                dist.send(part.clone(), dst=me + step)
            elif step <= me < 2 * step:
                buffer = part.clone()
                dist.recv(buffer, src=me - step)
                part.copy_(buffer)
        step *= 2


@pytest.mark.parametrize("fn", [spread, spread_halves])
def test_spread_accepts_right_schedules(fn, capsys):
    # 120 s: check_spread starts fresh ranks for each world size, and each rank imports this
    # module (and runs the solution's cells) first: over 60 s for 8 ranks on a busy machine
    check_spread(fn, timeout=120)
    assert (
        "in 1 round(s) for P = 2, 2 round(s) for P = 3, 3 round(s) for P = 5, "
        "3 round(s) for P = 8" in capsys.readouterr().out
    )


@pytest.mark.parametrize(
    "fn, message",
    [
        # rounds: the chain and the star need P - 1 rounds, 4 for P = 5
        (spread_chain, "rank 4 got the message in round 4 (0->1 in round 1, 1->2 in round 2"),
        (spread_star, "rank 4 got the message in round 4 (0->4 in round 4)"),
        # rounds: the lecture's heap tree is fine up to P = 7, not for P = 8
        (spread_heap, "P = 8, message float64 (3, 5), seed 0: rank 6 got the message in round 4"),
        # every rank must receive: a tree built for powers of two misses rank 2 of 3
        (spread_floor, "P = 3, message float64 (3, 5), seed 0: rank 2 received 0 message(s)"),
        # one receive per rank, each message the whole tensor
        (spread_halves_of_it, "rank 1 received 2 message(s); it must receive 1"),
        (spread_broadcast, "rank 0 used ['broadcast']"),
        (spread_lecture, "your answer runs course_lib.collectives.tree_parent"),
    ],
)
def test_spread_rejects_wrong_schedules(fn, message):
    with pytest.raises(CheckFailed) as info:
        check_spread(fn, timeout=120)  # fresh ranks, as above
    assert message in str(info.value)


def test_spread_values_come_only_from_messages():
    """A thief that sends the right calls (zeros, full size) and copies rank 0's message from
    whatever frame holds one: the check once kept it on every rank; now only rank 0 has it."""
    with pytest.raises(CheckFailed, match="do not hold rank 0's message exactly"):
        check_spread(spread_frames_thief, world_sizes=(2, 5), timeout=120)
