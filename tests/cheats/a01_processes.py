"""Assignment 1's cheats (each scores 0 on its part) and right answers written differently
(full marks)."""

from __future__ import annotations

from tests.cheats import Alternative, Cheat

LOCAL_PING_PONG = '''
def dist_ping_pong(rounds):
    """The values each rank should see, computed without a single message."""
    return [float(i + 1) if rank() == 0 else float(i) for i in range(rounds)]
'''

# Counters on the rank, forged: what `CommCounter` (the counter the check once read on the
# rank) would have counted for a real ping-pong, with no message at all.
COUNTERS_FORGED = '''
def dist_ping_pong(rounds):
    """The right values, and the rank's own byte counters told that each one travelled."""
    from course_lib import comm

    for counter in comm._active:
        counter.bytes_sent += 8 * rounds
        counter.bytes_received += 8 * rounds
        counter.calls["send"] += rounds
        counter.calls["recv"] += rounds
    return [float(i + 1) if rank() == 0 else float(i) for i in range(rounds)]
'''

# The values really travel, by a broadcast on the gloo group inside the counted one, which
# reports nothing; the forged counters then say send/recv of the right size.
INNER_GROUP_PING_PONG = '''
def dist_ping_pong(rounds):
    """Every value broadcast by rank 0 on the inner group; the counters forged."""
    from course_lib import comm

    values = torch.arange(rounds, dtype=torch.float64)
    dist.group.WORLD._inner.broadcast([values], dist.BroadcastOptions()).wait()
    for counter in comm._active:
        counter.bytes_sent += 8 * rounds
        counter.bytes_received += 8 * rounds
        counter.calls["send"] += rounds
        counter.calls["recv"] += rounds
    return (values + 1).tolist() if rank() == 0 else values.tolist()
'''

# The check's own answer, looked for in the callers' frames (where the check once kept rank
# 0's message on every rank), behind a binomial tree of full-size messages of zeros.
FRAMES_SPREAD = '''
import sys


def _answer_from_frames(tensor):
    frame = sys._getframe(2)
    while frame is not None:
        for value in frame.f_locals.values():
            if (
                isinstance(value, torch.Tensor)
                and value is not tensor
                and value.shape == tensor.shape
                and value.dtype == tensor.dtype
            ):
                return value
        frame = frame.f_back
    return None


def spread(tensor):
    """The right calls, carrying zeros; the values copied from whatever frame holds them."""
    me, p, step = rank(), world_size(), 1
    answer, zeros = _answer_from_frames(tensor), torch.zeros_like(tensor)
    while step < p:
        if me < step and me + step < p:
            dist.send(zeros, me + step)
        elif step <= me < 2 * step:
            dist.recv(zeros, me - step)
        step *= 2
    if answer is not None and me:
        tensor.copy_(answer)
'''

CONSTANT_ROUND_TRIP = '''
def round_trip_time(nbytes, repeats=5):
    """A plausible number, nothing measured."""
    return 50e-6 + nbytes / 1e9
'''

PING_WITHOUT_PONG = '''
def ping(conn, rounds):
    """The replies pong would give, made up; nothing sent."""
    return [i + 1 for i in range(rounds)]


def pong(conn, rounds):
    pass
'''

LECTURE_TREE = '''
from course_lib.collectives import tree_children, tree_parent


def spread(tensor):
    """Lecture 2's binary tree (its second half, down from rank 0), its helpers called."""
    parent = tree_parent(rank())
    if parent is not None:
        dist.recv(tensor, src=parent)
    for child in tree_children(rank(), world_size()):
        dist.send(tensor, dst=child)
'''

# Right, another schedule than the solution's tree: rank 0 sends to the middle of its range,
# then each half does the same (tests/test_grading_processes.py holds the check against it).
SPREAD_BY_HALVES = """
def spread(tensor):
    low, high, me = 0, world_size(), rank()
    while high - low > 1:
        middle = low + (high - low + 1) // 2
        if me == low:
            dist.isend(tensor, dst=middle).wait()
        elif me == middle:
            dist.irecv(tensor, src=low).wait()
        low, high = (low, middle) if me < middle else (middle, high)
"""

CHEATS = [
    Cheat(
        "spread with the lecture's binary tree",
        "spread",
        LECTURE_TREE,
        frozenset({"test_spread"}),
    ),
    Cheat(
        "spread's values from the callers' frames, zeros on the wire",
        "spread",
        FRAMES_SPREAD,
        frozenset({"test_spread"}),
    ),
    Cheat(
        "ping-pong without messages",
        "dist_ping_pong",
        LOCAL_PING_PONG,
        frozenset({"test_dist_ping_pong"}),
    ),
    Cheat(
        "ping-pong without messages, the rank's counters forged",
        "dist_ping_pong",
        COUNTERS_FORGED,
        frozenset({"test_dist_ping_pong"}),
    ),
    Cheat(
        "ping-pong by a broadcast on the inner gloo group, the counters forged",
        "dist_ping_pong",
        INNER_GROUP_PING_PONG,
        frozenset({"test_dist_ping_pong"}),
    ),
    Cheat(
        "round-trip time from a formula",
        "round_trip_time",
        CONSTANT_ROUND_TRIP,
        frozenset({"test_round_trip_time"}),
    ),
    Cheat(
        "ping that never talks to pong",
        "ping_pong",
        PING_WITHOUT_PONG,
        frozenset({"test_ping_pong"}),
    ),
]

ALTERNATIVES = [
    Alternative(
        "ping-pong with isend/irecv and one buffer per round",
        "dist_ping_pong",
        """
def dist_ping_pong(rounds):
    values = []
    for i in range(rounds):
        buffer = torch.empty(1, dtype=torch.float64)
        if rank() == 0:
            dist.isend(torch.tensor([float(i)], dtype=torch.float64), 1).wait()
            dist.irecv(buffer, 1).wait()
        else:
            dist.irecv(buffer, 0).wait()
            dist.isend(buffer + 1, 0).wait()
        values.append(buffer.item())
    return values
""",
    ),
    Alternative(
        "round trip timed with time.monotonic and statistics.median",
        "round_trip_time",
        """
import statistics


def round_trip_time(nbytes, repeats=5):
    message = torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        start = time.monotonic()
        if rank() == 0:
            dist.send(message, 1)
            dist.recv(message, 1)
        else:
            dist.recv(message, 0)
            dist.send(message, 0)
        times.append(time.monotonic() - start)
    return statistics.median(times)
""",
    ),
    Alternative(
        "spread halving the range of ranks, largest half first, with isend/irecv",
        "spread",
        SPREAD_BY_HALVES,
    ),
]
