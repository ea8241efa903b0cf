"""Assignment 4's cheats (each scores 0 on its part) and right answers written differently
(full marks), among them the ways to take what a check trusts from the rank's process (the
seed in its callers' frames, its counters, its process group's inner group). More are proven
in tests/test_grading_gossip.py (the lecture's functions called, other schedules), which also
runs the checks on SEED_THIEF, COUNTERS_EMPTIED and INNER_GROUP."""

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

# Tokens to every out-neighbour and from every in-neighbour: the messages the checks look for,
# one element each, for show.
TOKENS = """
def _tokens(x, out_neighbors, in_neighbors):
    token = torch.zeros(1, dtype=x.dtype)
    requests = [dist.isend(token, dst) for dst in out_neighbors]
    requests += [dist.irecv(torch.empty_like(token), src) for src in in_neighbors]
    for request in requests:
        request.wait()
"""

# (1) Every rank's inputs, regenerated on the rank: the check leaves its case (graph, seed,
# size, dtype) and its round in the callers' frames, and when the starting x came from a seed
# a rank knows (Part 1: 1009 seed + 31 r + 3; Part 2: 7919 seed + P), a rank can redo every
# rank's rounds itself and send tokens. Now the starting x are drawn from a secret in the
# checking process and each rank gets only its own: what it regenerates is wrong.
SEED_THIEF = (
    TOKENS
    + """
import sys


def _mixed(xs, ws, outs):
    \"\"\"One round of push-sum for every rank, outs[j] the ranks j sends to.\"\"\"
    new_x, new_w = [torch.zeros_like(x) for x in xs], [torch.zeros_like(w) for w in ws]
    for j, targets in enumerate(outs):
        for i in [j, *targets]:
            new_x[i] = new_x[i] + xs[j] / (len(targets) + 1)
            new_w[i] = new_w[i] + ws[j] / (len(targets) + 1)
    return new_x, new_w


def _everyone():
    \"\"\"Every rank's (x, w) after this round, from the seed in the callers' frames.\"\"\"
    frame = sys._getframe(2)
    while frame is not None:
        seen = frame.f_locals
        case = seen.get("case")
        if hasattr(case, "graph") and "t" in seen:  # check_push_sum
            p, xs = case.world_size, []
            for r in range(p):
                g = torch.Generator().manual_seed(1_009 * case.seed + 31 * r + 3)
                xs.append((torch.randn(case.size, generator=g) * 3 + r).to(case.dtype).double())
            ws = [torch.ones((), dtype=torch.float64) for _ in range(p)]
            for t in range(seen["t"] + 1):
                outs = [out_neighbors(case.graph, j, p, t) for j in range(p)]
                xs, ws = _mixed(xs, ws, outs)
            return xs, ws
        if "table" in seen and "seed" in seen and "records" in seen:  # check_one_peer_schedule
            p, table, done = seen["world_size"], seen["table"], len(seen["records"])
            g = torch.Generator().manual_seed(7_919 * seen["seed"] + p)
            xs = list(torch.randn(p, 5, generator=g, dtype=torch.float64) * 3)
            ws = [torch.ones((), dtype=torch.float64) for _ in range(p)]
            for peers in table[: done + 1]:
                xs, ws = _mixed(xs, ws, [[q] for q in peers])
            return xs, ws
        frame = frame.f_back
    return None


def push_sum_step(x, w, out_neighbors, in_neighbors):
    _tokens(x, out_neighbors, in_neighbors)
    found = _everyone()
    if found is None:
        return x, w
    xs, ws = found
    return xs[rank()].to(x.dtype), ws[rank()].to(w.dtype).reshape(w.shape)
"""
)

# (2) A built-in all-gather of every rank's x, w and out-degree, with the counters and hooks
# on the rank emptied around it and put back, tokens for show: the counters on the rank miss
# the call, but the launcher was told of it as it happened.
COUNTERS_EMPTIED = (
    TOKENS
    + """
import course_lib.comm as comm


def push_sum_step(x, w, out_neighbors, in_neighbors):
    _tokens(x, out_neighbors, in_neighbors)
    degree = torch.tensor([float(len(out_neighbors))], dtype=torch.float64)
    mine = torch.cat([x.double(), w.double().reshape(1), degree])
    everyone = [torch.empty_like(mine) for _ in range(world_size())]
    counters, hooks = list(comm._active), list(comm._around)
    comm._active.clear()
    comm._around.clear()
    try:
        dist.all_gather(everyone, mine)
    finally:
        comm._active.extend(counters)
        comm._around.extend(hooks)
    new = mine[:-1] / (len(out_neighbors) + 1)
    for j in in_neighbors:
        new = new + everyone[j][:-1] / (everyone[j][-1] + 1)
    return new[:-1].to(x.dtype), new[-1].to(w.dtype).reshape(w.shape)
"""
)

# (3) The same all-gather on the counted group's inner gloo group, where nothing on the rank
# reports it: the kernel counts its bytes on the rank's sockets, and the tokens do not account
# for them. Tampering: the part scores 0.
INNER_GROUP = (
    TOKENS
    + """
def push_sum_step(x, w, out_neighbors, in_neighbors):
    _tokens(x, out_neighbors, in_neighbors)
    degree = torch.tensor([float(len(out_neighbors))], dtype=torch.float64)
    mine = torch.cat([x.double(), w.double().reshape(1), degree])
    everyone = [torch.empty_like(mine) for _ in range(world_size())]
    dist.group.WORLD._inner.allgather([everyone], [mine]).wait()
    new = mine[:-1] / (len(out_neighbors) + 1)
    for j in in_neighbors:
        new = new + everyone[j][:-1] / (everyone[j][-1] + 1)
    return new[:-1].to(x.dtype), new[-1].to(w.dtype).reshape(w.shape)
"""
)

# A push_sum_step that cheats scores 0 on Part 2 as well: that part runs it.
BOTH_PARTS = frozenset({"test_push_sum", "test_schedule"})

# ... and right, another way: isend to every out-neighbour, then a blocking recv from each
# in-neighbour in turn, then wait for the sends (the wire then carries isends and recvs).
BLOCKING_RECV = """
def push_sum_step(x, w, out_neighbors, in_neighbors):
    message = torch.cat([x, w.reshape(1)]) / (len(out_neighbors) + 1)
    sends = [dist.isend(message, dst) for dst in out_neighbors]
    total = message.clone()
    for src in in_neighbors:
        incoming = torch.empty_like(message)
        dist.recv(incoming, src)
        total += incoming
    for request in sends:
        request.wait()
    return total[:-1], total[-1]
"""


CHEATS = [
    Cheat(
        "push-sum by all-gather", "push_sum_step", PUSH_SUM_ALL_GATHER, frozenset({"test_push_sum"})
    ),
    Cheat(
        "every rank's x regenerated from the seed in the callers' frames, tokens sent",
        "push_sum_step",
        SEED_THIEF,
        BOTH_PARTS,
    ),
    Cheat(
        "the counters emptied around a built-in all-gather, tokens sent",
        "push_sum_step",
        COUNTERS_EMPTIED,
        BOTH_PARTS,
    ),
    Cheat(
        "a built-in all-gather on the counted group's inner group, tokens sent",
        "push_sum_step",
        INNER_GROUP,
        BOTH_PARTS,
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
        "push-sum with isends and blocking recvs from each in-neighbour in turn",
        "push_sum_step",
        BLOCKING_RECV,
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
