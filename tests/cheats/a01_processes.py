"""Assignment 1's cheats (each scores 0 on its part) and right answers written differently
(full marks)."""

from __future__ import annotations

from tests.cheats import Alternative, Cheat

LOCAL_PING_PONG = '''
def dist_ping_pong(rounds):
    """The values each rank should see, computed without a single message."""
    return [float(i + 1) if rank() == 0 else float(i) for i in range(rounds)]
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
        "ping-pong without messages",
        "dist_ping_pong",
        LOCAL_PING_PONG,
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
