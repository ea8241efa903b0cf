"""Assignment 4's cheats (each scores 0 on its part) and right answers written differently
(full marks). More are proven in tests/test_grading_gossip.py (the lecture's functions called,
other schedules)."""

from __future__ import annotations

from tests.cheats import Alternative, Cheat

PUSH_SUM_ALL_GATHER = '''
def push_sum_step(x, w, out_neighbors, in_neighbors):
    """Right numbers from an all-gather of every rank's x, w and out-degree."""
    p = world_size()
    mine = torch.cat([x.double(), w.double().reshape(1), torch.tensor([len(out_neighbors)])])
    everyone = [torch.empty_like(mine) for _ in range(p)]
    dist.all_gather(everyone, mine)
    new = mine[:-1] / (len(out_neighbors) + 1)
    for j in in_neighbors:
        new = new + everyone[j][:-1] / (everyone[j][-1] + 1)
    return new[:-1].to(x.dtype), new[-1].to(w.dtype).reshape(w.shape)
'''

LECTURE_SCHEDULE = """
def peer(rank, world_size, round):
    \"\"\"The lecture's exponential graph, asked for its one peer.\"\"\"
    from course_lib.gossip import ExponentialGraph

    return ExponentialGraph(world_size).out_neighbors(rank, round)[0]
"""

GRADER_SCHEDULE = """
def peer(rank, world_size, round):
    \"\"\"The grader's one-peer exponential graph of Part 1 (imported by the set-up cell).\"\"\"
    return out_neighbors("one-peer exponential", rank, world_size, round)[0]
"""


CHEATS = [
    Cheat(
        "push-sum by all-gather", "push_sum_step", PUSH_SUM_ALL_GATHER, frozenset({"test_push_sum"})
    ),
    Cheat(
        "the lecture's exponential graph as the schedule",
        "schedule",
        LECTURE_SCHEDULE,
        frozenset({"test_schedule"}),
    ),
    Cheat(
        "the grader's one-peer graph as the schedule",
        "schedule",
        GRADER_SCHEDULE,
        frozenset({"test_schedule"}),
    ),
]

ALTERNATIVES = [
    Alternative(
        "push-sum with x and w in two messages and batch_isend_irecv",
        "push_sum_step",
        """
def push_sum_step(x, w, out_neighbors, in_neighbors):
    share = 1.0 / (len(out_neighbors) + 1)
    sx, sw = x * share, (w * share).reshape(1)
    xs = [torch.empty_like(sx) for _ in in_neighbors]
    ws = [torch.empty_like(sw) for _ in in_neighbors]
    ops = [dist.P2POp(dist.isend, t, dst) for dst in out_neighbors for t in (sx, sw)]
    for src, bx, bw in zip(in_neighbors, xs, ws):
        ops += [dist.P2POp(dist.irecv, bx, src), dist.P2POp(dist.irecv, bw, src)]
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()
    return sx + sum(xs), (sw + sum(ws)).reshape(())
""",
    ),
    Alternative(
        "a hypercube schedule: rank XOR 2^(round mod log2 P)",
        "schedule",
        """
def peer(rank, world_size, round):
    dimension = round % (world_size.bit_length() - 1)
    return rank ^ (1 << dimension)
""",
    ),
]
