"""Assignment 2's cheats (each scores 0 on its part) and right answers written differently
(full marks), among them the ways to take what a check trusts from the rank's process (its
frames, its heap, its counters, its operators). More are proven in
tests/test_grading_collectives.py (a ring talking to far ranks through pre-bound names), which
also runs the checks on LECTURE_RING_WRAPPED, RING_PADDED, LECTURE_HALVING_DOUBLING_WRAPPED
and FAST_REVERSED_PADDED, and in tests/test_grading_judge.py (patching the checks' helpers on
a rank)."""

from __future__ import annotations

from tests.cheats import Alternative, Cheat

PREBOUND_ALL_REDUCE = '''
from torch.distributed import all_reduce as early_all_reduce


def ring_all_reduce(tensor):
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

LECTURE_RING_WRAPPED = '''
import course_lib.collectives as lecture


def ring_all_reduce(tensor):
    """The lecture's ring, called."""
    lecture.ring_all_reduce(tensor)
'''

REBIND_CHECK = '''
def broadcast(tensor, src):
    """Nothing, and the check switched off."""


check_broadcast = lambda *args, **kwargs: None  # noqa: E731
'''

# Chunks of ceil(N/P) elements, all equal: at N = 1 on 3 ranks it sends 4 chunks of one
# element, more than 2(P-1)/P * N, yet within the check's budget for padded chunks.
RING_PADDED = """
def ring_all_reduce(tensor):
    p, me = world_size(), rank()
    size = -(-tensor.numel() // p)  # ceil(N / P): every chunk the same size
    padded = torch.zeros(size * p, dtype=tensor.dtype)
    padded[: tensor.numel()] = tensor.reshape(-1)
    chunks = padded.view(p, size)
    right, left = (me + 1) % p, (me - 1) % p
    buffer = torch.empty(size, dtype=tensor.dtype)
    for step in range(2 * (p - 1)):
        send = dist.isend(chunks[(me - step) % p].clone(), right)
        dist.recv(buffer, left)
        send.wait()
        incoming = chunks[(me - step - 1) % p]
        if step < p - 1:
            incoming += buffer
        else:
            incoming.copy_(buffer)
    tensor.copy_(padded[: tensor.numel()].view_as(tensor))
"""

# Part 7 (all_reduce_fast): the lecture's halving-doubling, called, scores 0 ...
LECTURE_HALVING_DOUBLING_WRAPPED = '''
from course_lib.collectives import halving_doubling_all_reduce


def all_reduce_fast(tensor):
    """Lecture 2's halving-doubling, called."""
    halving_doubling_all_reduce(tensor)
'''

# ... and halving-doubling the other way round is right: partners 1, 2, ..., P/2 apart while
# halving (rank r ends with chunk "r with its bits reversed"), P/2, ..., 1 while doubling, on
# chunks padded with zeros to ceil(N/P) elements each.
FAST_REVERSED_PADDED = """
def all_reduce_fast(tensor):
    p, me = world_size(), rank()
    size = -(-tensor.numel() // p)
    padded = torch.zeros(size * p, dtype=tensor.dtype)
    padded[: tensor.numel()] = tensor.reshape(-1)
    rounds, low, high, distance = [], 0, p, 1
    while distance < p:
        middle = (low + high) // 2
        lower = not me & distance
        keep, give = ((low, middle), (middle, high)) if lower else ((middle, high), (low, middle))
        theirs = torch.empty((keep[1] - keep[0]) * size, dtype=tensor.dtype)
        request = dist.isend(padded[give[0] * size : give[1] * size].clone(), me ^ distance)
        dist.recv(theirs, me ^ distance)
        request.wait()
        padded[keep[0] * size : keep[1] * size] += theirs
        rounds.append((me ^ distance, keep, give))
        (low, high), distance = keep, 2 * distance
    for partner, keep, give in reversed(rounds):
        incoming = torch.empty((give[1] - give[0]) * size, dtype=tensor.dtype)
        request = dist.isend(padded[keep[0] * size : keep[1] * size].clone(), partner)
        dist.recv(incoming, partner)
        request.wait()
        padded[give[0] * size : give[1] * size] = incoming
    tensor.copy_(padded[: tensor.numel()].view_as(tensor))
"""

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

def ring_all_reduce(tensor):
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
        "test_ring_all_reduce",
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
        "ring_all_reduce",
        FRAMES_RING,
        frozenset({"test_ring_all_reduce"}),
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
        "ring_all_reduce",
        PREBOUND_ALL_REDUCE,
        frozenset({"test_ring_all_reduce"}),
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
        "the lecture's ring wrapped",
        "ring_all_reduce",
        LECTURE_RING_WRAPPED,
        frozenset({"test_ring_all_reduce"}),
    ),
    Cheat(
        "the lecture's halving-doubling wrapped",
        "all_reduce_fast",
        LECTURE_HALVING_DOUBLING_WRAPPED,
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
    Alternative("ring on zero-padded equal chunks", "ring_all_reduce", RING_PADDED),
    Alternative(
        "halving-doubling, partners 1, 2, 4 apart, padded chunks",
        "all_reduce_fast",
        FAST_REVERSED_PADDED,
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
