"""Assignment 2's cheats (each scores 0 on its part) and right answers written differently
(full marks), among them the ways to take what a check trusts from the rank's process (its
frames, its heap, its counters, its operators). More are proven in
tests/test_grading_collectives.py (a ring talking to far ranks through pre-bound names, a ring
that sends everything one way), which also runs the checks on LECTURE_RINGS_BOTH_WAYS,
BIDIRECTIONAL_PADDED, RINGS_ONE_AFTER_THE_OTHER, LECTURE_HALVING_DOUBLING_WRAPPED,
LECTURE_SCHEDULE_FOLDED, FAST_RING_OFF_POWERS and FAST_PAIRED_FOLD, and in
tests/test_grading_judge.py (patching the checks' helpers on a rank)."""

from __future__ import annotations

from tests.cheats import Alternative, Cheat

PREBOUND_ALL_REDUCE = '''
from torch.distributed import all_reduce as early_all_reduce


def bidirectional_ring_all_reduce(tensor):
    """A few messages to the neighbours for show; the sum from torch's own all-reduce,
    through a name bound before the check could wrap it."""
    p, me = world_size(), rank()
    if p > 1:
        token = torch.zeros(1)
        send = dist.isend(token, (me + 1) % p)
        dist.recv(torch.zeros(1), (me - 1) % p)
        send.wait()
    early_all_reduce(tensor)
'''

GROUP_OBJECT_REDUCE = '''
def all_reduce_naive(tensor):
    """torch's all-reduce through the process-group object."""
    dist.group.WORLD.allreduce([tensor]).wait()
'''

TORCH_OPS_BROADCAST = '''
def broadcast(tensor, src):
    """torch's broadcast through its C++ operator, below torch.distributed."""
    group = dist.distributed_c10d._get_default_group()
    torch.ops.c10d.broadcast_([tensor], group, src, 0, False, -1)[1].wait()
'''

# Part 6: lecture 2's ring (its `_ring`, which takes the ranks in any order) on each half,
# the second with the ranks listed backwards: the right neighbours and bytes each way, and
# not the student's code.
LECTURE_RINGS_BOTH_WAYS = '''
from course_lib import collectives as lecture


def bidirectional_ring_all_reduce(tensor):
    """The lecture's ring, run once each way."""
    first, second = torch.tensor_split(tensor.view(-1), 2)
    ranks = list(range(world_size()))
    lecture._ring(first, ranks)
    lecture._ring(second, ranks[::-1])
'''

REBIND_CHECK = '''
def broadcast(tensor, src):
    """Nothing, and the check switched off."""


check_broadcast = lambda *args, **kwargs: None  # noqa: E731
'''

# Right, another way: 2P zero-padded chunks of ceil(N/(2P)) elements, the first P on the ring
# to rank - 1 and the other P on the ring to rank + 1, each step's four messages posted at
# once with batch_isend_irecv. At N = 1 on 3 ranks it sends 4 one-element chunks each way,
# more than (P-1)/P * N, yet within the check's budget for padded chunks.
BIDIRECTIONAL_PADDED = """
def bidirectional_ring_all_reduce(tensor):
    p, me = world_size(), rank()
    size = -(-tensor.numel() // (2 * p))  # ceil(N / 2P): every chunk the same size
    padded = torch.zeros(2 * p * size, dtype=tensor.dtype)
    padded[: tensor.numel()] = tensor.reshape(-1)
    # (chunks, this rank's place on the ring, where it sends, where it receives from)
    rings = [
        (padded[: p * size].view(p, size), (p - me) % p, (me - 1) % p, (me + 1) % p),
        (padded[p * size :].view(p, size), me, (me + 1) % p, (me - 1) % p),
    ]
    for step in range(2 * (p - 1)):
        reducing, s = step < p - 1, step % (p - 1)
        ops, landing = [], []
        for chunks, place, to, source in rings:
            shift = 0 if reducing else 1
            buffer = torch.empty(size, dtype=tensor.dtype)
            ops.append(dist.P2POp(dist.isend, chunks[(place + shift - s) % p].clone(), to))
            ops.append(dist.P2POp(dist.irecv, buffer, source))
            landing.append((chunks[(place + shift - s - 1) % p], buffer))
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        for chunk, buffer in landing:
            if reducing:
                chunk += buffer
            else:
                chunk.copy_(buffer)
    tensor.copy_(padded[: tensor.numel()].view_as(tensor))
"""

# Right, another way, as Part 6's text allows: the two rings one after the other (the larger
# half first, on the ring to rank - 1), each a plain one-way ring: right on neighbours and on
# bytes each way, though the two directions of a link are never busy at once.
RINGS_ONE_AFTER_THE_OTHER = '''
def _one_way(flat, hop):
    """The ring all-reduce of `flat`, each step passing a chunk to rank + hop (+1 or -1)."""
    p, me = world_size(), rank()
    place, to, source = me * hop % p, (me + hop) % p, (me - hop) % p
    chunks = torch.tensor_split(flat, p)
    for step in range(2 * (p - 1)):
        reducing, s = step < p - 1, step % (p - 1)
        if reducing:
            outgoing, incoming = chunks[(place - s) % p], chunks[(place - s - 1) % p]
        else:
            outgoing, incoming = chunks[(place + 1 - s) % p], chunks[(place - s) % p]
        buffer = torch.empty_like(incoming)
        request = dist.isend(outgoing, to)
        dist.recv(buffer, source)
        request.wait()
        if reducing:
            incoming += buffer
        else:
            incoming.copy_(buffer)


def bidirectional_ring_all_reduce(tensor):
    flat = tensor.view(-1)
    middle = flat.numel() // 2
    _one_way(flat[middle:], -1)
    _one_way(flat[:middle], +1)
'''

# Part 7 (all_reduce_fast): the lecture's halving-doubling, called, scores 0 ...
LECTURE_HALVING_DOUBLING_WRAPPED = '''
from course_lib.collectives import halving_doubling_all_reduce


def all_reduce_fast(tensor):
    """Lecture 2's halving-doubling, called."""
    halving_doubling_all_reduce(tensor)
'''

# ... and so does a fold written by hand around the lecture's schedule for Q ranks
# (`halving_doubling_rounds(Q, rank)`, a pure function that takes any power of two): right
# sums, right bounds, and the rounds are the lecture's.
LECTURE_SCHEDULE_FOLDED = """
from course_lib.collectives import REDUCE_SCATTER, halving_doubling_rounds


def all_reduce_fast(tensor):
    p, me = world_size(), rank()
    q = 1 << (p.bit_length() - 1)
    flat = tensor.view(-1)
    if me >= q:
        dist.send(flat, me - q)
        dist.recv(flat, me - q)
        return
    if me + q < p:
        theirs = torch.empty_like(flat)
        dist.recv(theirs, me + q)
        flat += theirs
    starts = [0]
    for chunk in torch.tensor_split(flat, q):
        starts.append(starts[-1] + chunk.numel())
    for step in halving_doubling_rounds(q, me):
        target = flat[starts[step.recv[0]] : starts[step.recv[1]]]
        incoming = torch.empty_like(target)
        request = dist.isend(flat[starts[step.send[0]] : starts[step.send[1]]], step.partner)
        dist.recv(incoming, step.partner)
        request.wait()
        if step.phase == REDUCE_SCATTER:
            target += incoming
        else:
            target.copy_(incoming)
    if me + q < p:
        dist.send(flat, me + q)
"""

# Halving-doubling with partners 1, 2, 4 apart (rank v ends the halving with chunk "v with its
# bits reversed"), on zero-padded chunks of ceil(N/Q) elements, among the ranks `members`.
_HALVING_DOUBLING_PADDED = """
def _halving_doubling(flat, members):
    q, me = len(members), members.index(rank())
    size = -(-flat.numel() // q)
    padded = torch.zeros(size * q, dtype=flat.dtype)
    padded[: flat.numel()] = flat
    rounds, low, high, distance = [], 0, q, 1
    while distance < q:
        middle = (low + high) // 2
        lower = not me & distance
        keep, give = ((low, middle), (middle, high)) if lower else ((middle, high), (low, middle))
        partner = members[me ^ distance]
        theirs = torch.empty((keep[1] - keep[0]) * size, dtype=flat.dtype)
        request = dist.isend(padded[give[0] * size : give[1] * size].clone(), partner)
        dist.recv(theirs, partner)
        request.wait()
        padded[keep[0] * size : keep[1] * size] += theirs
        rounds.append((partner, keep, give))
        (low, high), distance = keep, 2 * distance
    for partner, keep, give in reversed(rounds):
        incoming = torch.empty((give[1] - give[0]) * size, dtype=flat.dtype)
        request = dist.isend(padded[keep[0] * size : keep[1] * size].clone(), partner)
        dist.recv(incoming, partner)
        request.wait()
        padded[give[0] * size : give[1] * size] = incoming
    flat.copy_(padded[: flat.numel()])
"""

# A right halving-doubling where P is a power of two, and the ring elsewhere: 2(P-1) messages,
# over the limit on 5 and 6 ranks (8 and 10 > 6): all or nothing, 0.
FAST_RING_OFF_POWERS = (
    _HALVING_DOUBLING_PADDED
    + """

def all_reduce_fast(tensor):
    p, me = world_size(), rank()
    flat = tensor.view(-1)
    if p & (p - 1) == 0:
        _halving_doubling(flat, list(range(p)))
        return
    chunks = torch.tensor_split(flat, p)
    for step in range(2 * (p - 1)):
        reducing, s = step < p - 1, step % (p - 1)
        shift = 0 if reducing else 1
        incoming = chunks[(me + shift - s - 1) % p]
        buffer = torch.empty_like(incoming)
        request = dist.isend(chunks[(me + shift - s) % p], (me + 1) % p)
        dist.recv(buffer, (me - 1) % p)
        request.wait()
        if reducing:
            incoming += buffer
        else:
            incoming.copy_(buffer)
"""
)

# Right, another way: Rabenseifner's fold in pairs. Among the first 2(P - Q) ranks each odd
# rank hands its tensor to the even rank below it; the Q ranks left (the even ones among the
# first 2(P - Q), then all the others) run halving-doubling with partners 1, 2, 4 apart on
# padded chunks, and each even rank hands the sum back.
FAST_PAIRED_FOLD = (
    _HALVING_DOUBLING_PADDED
    + """

def all_reduce_fast(tensor):
    p, me = world_size(), rank()
    q = 1 << (p.bit_length() - 1)
    paired = 2 * (p - q)  # ranks 0 .. paired - 1 fold in pairs
    flat = tensor.view(-1)
    if me < paired and me % 2:
        dist.send(flat, me - 1)
        dist.recv(flat, me - 1)
        return
    if me < paired:
        theirs = torch.empty_like(flat)
        dist.recv(theirs, me + 1)
        flat += theirs
    _halving_doubling(flat, [r for r in range(p) if r >= paired or r % 2 == 0])
    if me < paired:
        dist.send(flat, me + 1)
"""
)

# (1) The check's secrets, looked for in the process: a function that
# walks its callers' frames and the heap for the reference ("expected") or the other ranks'
# inputs, and sends one element to its neighbour so that some traffic is seen. On a rank
# there is nothing to find: it holds its own inputs only, and the reference is computed by
# the judge.
THIEF = """
import gc
import sys


def _loot(like):
    \"\"\"Tensors shaped like `like` that this process holds: first any the callers keep
    under a name or key with "expect" in it, then every other one on the heap.\"\"\"
    named, frame = [], sys._getframe(1)
    while frame is not None:
        stack = list(frame.f_locals.items())
        while stack:
            key, value = stack.pop()
            if isinstance(value, dict):
                stack += [(f"{key}.{k}", v) for k, v in value.items()]
            elif isinstance(value, (list, tuple)):
                stack += [(key, v) for v in value]
            elif isinstance(value, torch.Tensor) and "expect" in str(key):
                named.append(value)
        frame = frame.f_back
    heap = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o is not like]
    return [t for t in named + heap if t.shape == like.shape and t.dtype == like.dtype]


def _token():
    p, me = world_size(), rank()
    if p > 1:
        request = dist.isend(torch.zeros(1), (me + 1) % p)
        dist.recv(torch.zeros(1), (me - 1) % p)
        request.wait()
"""

FRAMES_BROADCAST = (
    THIEF
    + """

def broadcast(tensor, src):
    _token()
    loot = [t for t in _loot(tensor) if not torch.equal(t, tensor)]
    if loot:
        tensor.copy_(loot[0])
"""
)

FRAMES_ALL_GATHER = (
    THIEF
    + """

def all_gather(tensor_list, tensor):
    _token()
    loot = iter(t for t in _loot(tensor) if all(t is not s for s in tensor_list))
    for i, slot in enumerate(tensor_list):
        slot.copy_(tensor if i == rank() else next(loot, slot))
"""
)

FRAMES_RING = (
    THIEF
    + """

def bidirectional_ring_all_reduce(tensor):
    _token()
    loot = [t for t in _loot(tensor) if not torch.equal(t, tensor)]
    if loot:
        tensor.copy_(loot[0])
"""
)

# (2) The tallies, emptied around a built-in collective and put back: the counters on the rank
# miss the call, but the launcher was told of it as it happened.
COUNTERS_EMPTIED = """
import course_lib.comm as comm


def reduce_scatter(output, input_list):
    counters, hooks = list(comm._active), list(comm._around)
    comm._active.clear()
    comm._around.clear()
    try:
        dist.reduce_scatter(output, [t.clone() for t in input_list])
    finally:
        comm._active.extend(counters)
        comm._around.extend(hooks)
"""

# ... and a built-in reduce-scatter made where no counter on the rank can see it, on the
# counted group's inner gloo group, with a ring of one-element messages for show: the kernel
# counts the bytes on the rank's sockets, and the calls reported do not account for them.
INNER_GROUP = """
def reduce_scatter(output, input_list):
    p, me = world_size(), rank()
    if p > 1:
        request = dist.isend(torch.zeros(1), (me + 1) % p)
        dist.recv(torch.zeros(1), (me - 1) % p)
        request.wait()
    inner = dist.group.WORLD._inner
    inner.reduce_scatter([output], [[t.clone() for t in input_list]]).wait()
"""

# (4) A right broadcast, with the operators and torch.testing the checks compare with made
# to agree with anything: the fingerprint of the rank's libraries changes, and since the
# answer cells run on every rank before every part, every part scores 0 as tampering.
EVERY_PART = frozenset(
    {
        "test_broadcast",
        "test_all_reduce_naive",
        "test_reduce",
        "test_all_gather",
        "test_reduce_scatter",
        "test_bidirectional_ring_all_reduce",
        "test_all_reduce_fast",
    }
)
OPERATORS_PATCHED = """
import torch.testing


def broadcast(tensor, src):
    if rank() == src:
        for peer in range(world_size()):
            if peer != src:
                dist.send(tensor, peer)
    else:
        dist.recv(tensor, src)


torch.Tensor.__eq__ = lambda a, b: torch.ones_like(a, dtype=torch.bool)
torch.Tensor.__ne__ = lambda a, b: torch.zeros_like(a, dtype=torch.bool)
torch.testing.assert_close = lambda *args, **kwargs: None
"""

CHEATS = [
    Cheat(
        "the reference looked for in the callers' frames and the heap",
        "broadcast",
        FRAMES_BROADCAST,
        frozenset({"test_broadcast", "test_all_reduce_naive"}),  # naive uses broadcast
    ),
    Cheat(
        "the other ranks' tensors looked for in the frames and the heap",
        "all_gather",
        FRAMES_ALL_GATHER,
        frozenset({"test_all_gather"}),
    ),
    Cheat(
        "the sum looked for in the frames and the heap, one element to the neighbour",
        "bidirectional_ring_all_reduce",
        FRAMES_RING,
        frozenset({"test_bidirectional_ring_all_reduce"}),
    ),
    Cheat(
        "the counters emptied around a built-in reduce-scatter",
        "reduce_scatter",
        COUNTERS_EMPTIED,
        frozenset({"test_reduce_scatter"}),
    ),
    Cheat(
        "a built-in reduce-scatter on the counted group's inner group, a token ring for show",
        "reduce_scatter",
        INNER_GROUP,
        frozenset({"test_reduce_scatter"}),
    ),
    Cheat(
        "Tensor.__eq__, __ne__ and torch.testing patched beside a right broadcast",
        "broadcast",
        OPERATORS_PATCHED,
        EVERY_PART,
        alone=True,
    ),
    Cheat(
        "built-in all-reduce through a pre-bound name",
        "bidirectional_ring_all_reduce",
        PREBOUND_ALL_REDUCE,
        frozenset({"test_bidirectional_ring_all_reduce"}),
    ),
    Cheat(
        "built-in all-reduce through the group object",
        "all_reduce_naive",
        GROUP_OBJECT_REDUCE,
        frozenset({"test_all_reduce_naive"}),
    ),
    Cheat(
        "built-in broadcast through torch.ops.c10d",
        "broadcast",
        TORCH_OPS_BROADCAST,
        frozenset({"test_broadcast", "test_all_reduce_naive"}),  # naive uses broadcast
    ),
    Cheat(
        "the lecture's ring run once each way",
        "bidirectional_ring_all_reduce",
        LECTURE_RINGS_BOTH_WAYS,
        frozenset({"test_bidirectional_ring_all_reduce"}),
    ),
    Cheat(
        "the lecture's halving-doubling wrapped",
        "all_reduce_fast",
        LECTURE_HALVING_DOUBLING_WRAPPED,
        frozenset({"test_all_reduce_fast"}),
    ),
    Cheat(
        "a fold by hand around the lecture's halving-doubling schedule",
        "all_reduce_fast",
        LECTURE_SCHEDULE_FOLDED,
        frozenset({"test_all_reduce_fast"}),
    ),
    Cheat(
        "halving-doubling on powers of two, the ring elsewhere",
        "all_reduce_fast",
        FAST_RING_OFF_POWERS,
        frozenset({"test_all_reduce_fast"}),
    ),
    Cheat(
        "rebinding the check",
        "broadcast",
        REBIND_CHECK,
        frozenset({"test_broadcast", "test_all_reduce_naive"}),
        alone=True,
    ),
]

ALTERNATIVES = [
    Alternative(
        "both rings on zero-padded equal chunks, batch_isend_irecv",
        "bidirectional_ring_all_reduce",
        BIDIRECTIONAL_PADDED,
    ),
    Alternative(
        "the two rings one after the other",
        "bidirectional_ring_all_reduce",
        RINGS_ONE_AFTER_THE_OTHER,
    ),
    Alternative(
        "a fold in pairs, halving-doubling with partners 1, 2, 4 apart, padded chunks",
        "all_reduce_fast",
        FAST_PAIRED_FOLD,
    ),
    Alternative(
        "broadcast along a binary tree",
        "broadcast",
        """
def broadcast(tensor, src):
    p, me = world_size(), rank()
    virtual = (me - src) % p  # src becomes 0
    if virtual > 0:
        dist.recv(tensor, ((virtual - 1) // 2 + src) % p)
    for child in (2 * virtual + 1, 2 * virtual + 2):
        if child < p:
            dist.send(tensor, (child + src) % p)
""",
    ),
]
