"""Assignment 11's cheats (each scores 0 on its part) and right answers written differently
(full marks), among them the ways to take what a check trusts from the rank's process (its
frames and heap, its counters, the grader's own helpers, the meter) and a cheat for each rule
of the ring (no collective, neighbours only, bytes) and of the memory (what a rank keeps).
tests/test_grading_sequence_parallel.py holds the checks against the same texts and against
named wrong implementations (a gradient left on the wrong rank, a block missed, a local causal
mask, Ulysses without its ValueError, the causal backward unbalanced, wasteful or hidden from
the meter). KEEPS_EVERY_BLOCK is held there only: RELAY_EVERYTHING breaks the same rule here."""

from __future__ import annotations

from tests.cheats import Alternative, Cheat

RING_TESTS = frozenset({"test_ring_backward", "test_ring_causal", "test_ring_memory"})
RULE_TESTS = frozenset({"test_ring_backward", "test_ring_causal"})
MEMORY_TESTS = frozenset({"test_ring_memory"})
ULYSSES_TESTS = frozenset({"test_ulysses"})
BALANCED_TESTS = frozenset({"test_balanced"})
EVERY_TEST = RING_TESTS | ULYSSES_TESTS | BALANCED_TESTS

# What several answers below share: every rank's rows of everything, by a ring of
# neighbours, and the gradients computed from them on one process (`autograd_backward`).
GATHER_BY_RING = '''
def gather_by_ring(*mine):
    """Every rank's rows of each tensor in `mine`, in rank order, passed neighbour to
    neighbour: the sizes first, then the rows, P - 1 times."""
    P, r = world_size(), rank()
    right, left = (r + 1) % P, (r - 1) % P
    held = {r: [t.contiguous() for t in mine]}
    current = held[r]
    for step in range(1, P):
        sizes = torch.tensor([t.numel() for t in current])
        theirs = torch.empty_like(sizes)
        for work in [dist.isend(sizes, right), dist.irecv(theirs, left)]:
            work.wait()
        flat = torch.cat([t.flatten() for t in current])
        into = torch.empty(int(theirs.sum()), dtype=flat.dtype)
        for work in [dist.isend(flat, right), dist.irecv(into, left)]:
            work.wait()
        n = current[0].shape[1] * int(theirs[0]) // current[0].numel()
        current = [
            part.view(mine[i].shape[0], n, *mine[i].shape[2:])
            for i, part in enumerate(into.split(theirs.tolist()))
        ]
        held[(r - step) % P] = current
    return [torch.cat([held[s][i] for s in range(P)], dim=1) for i in range(len(mine))]


def my_rows(whole, lengths):
    start = sum(lengths[: rank()])
    return whole[:, start : start + lengths[rank()]]
'''

# (1) The check's secrets, looked for in the process: the reference gradients ("expected",
# "dk") or the other ranks' rows, in the callers' frames and on the heap, with one element to
# the neighbour so that some traffic is seen. A rank holds its own rows only, and the
# reference is computed by the judge: what it finds is not the answer.
FRAMES_AND_HEAP = '''
import gc
import sys


def _loot(like, exclude):
    """Tensors shaped like `like` this process holds: first any the callers keep under a name
    with "expect" or "dk" in it, then every other one on the heap."""
    named, frame = [], sys._getframe(1)
    while frame is not None:
        stack = list(frame.f_locals.items())
        while stack:
            key, value = stack.pop()
            if isinstance(value, dict):
                stack += [(f"{key}.{k}", v) for k, v in value.items()]
            elif isinstance(value, (list, tuple)):
                stack += [(key, v) for v in value]
            elif isinstance(value, torch.Tensor) and ("expect" in str(key) or "dk" in str(key)):
                named.append(value)
        frame = frame.f_back
    heap = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    found = [t for t in named + heap if t.shape == like.shape and t.dtype == like.dtype]
    return [t for t in found if all(t is not x for x in exclude)]


def ring_attention_backward(grad_out, q, k, v, out, lse, causal=False):
    P, r = world_size(), rank()
    if P > 1:
        request = dist.isend(torch.zeros(1), (r + 1) % P)
        dist.recv(torch.zeros(1), (r - 1) % P)
        request.wait()
    given = (grad_out, q, k, v, out)
    loot = iter(_loot(q, given))
    return tuple(next(loot, torch.zeros_like(q)).clone() for _ in range(3))
'''

# (2) The tallies, emptied around a built-in all-gather the part forbids, and put back: the
# counters on the rank miss it, but the launcher was told of the call as it happened.
COUNTERS_EMPTIED = """
import course_lib.comm as comm


def ring_attention_backward(grad_out, q, k, v, out, lse, causal=False):
    P, r = world_size(), rank()
    counters, hooks = list(comm._active), list(comm._around)
    comm._active.clear()
    comm._around.clear()
    try:
        n = [torch.zeros(1, dtype=torch.long) for _ in range(P)]
        dist.all_gather(n, torch.tensor([q.shape[1]]))
        lengths, longest = [int(x) for x in n], max(int(x) for x in n)

        def gather(x):
            padded = torch.zeros(x.shape[0], longest, x.shape[2], dtype=x.dtype)
            padded[:, : x.shape[1]] = x
            parts = [torch.empty_like(padded) for _ in range(P)]
            dist.all_gather(parts, padded)
            return torch.cat([p[:, :m] for p, m in zip(parts, lengths)], dim=1)

        whole = [gather(x) for x in (grad_out, q, k, v)]
    finally:
        comm._active.extend(counters)
        comm._around.extend(hooks)
    start = sum(lengths[:r])
    return tuple(
        g[:, start : start + lengths[r]] for g in autograd_backward(*whole, causal=causal)
    )
"""

# ... and a right ring that sends more than its budget (q, grad_out and out with every block,
# for nothing), with the counters emptied around its messages: the launcher counted them.
OVER_BUDGET_COUNTERS_EMPTIED = """
import course_lib.comm as comm


def ring_attention_backward(grad_out, q, k, v, out, lse, causal=False):
    P, r = world_size(), rank()
    right, left = (r + 1) % P, (r - 1) % P
    scale = 1 / math.sqrt(q.shape[-1])
    row_dot = (grad_out * out).sum(-1, keepdim=True)
    dq = torch.zeros_like(q)
    pack = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v), q, grad_out, out])
    for step in range(P):
        source = (r - step) % P
        bk, bv, bdk, bdv = pack[0], pack[1], pack[2], pack[3]
        if not (causal and source > r):
            s = q @ bk.transpose(-2, -1) * scale
            if causal and source == r:
                s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
            p = torch.exp(s - lse[..., None])
            bdv += p.transpose(-2, -1) @ grad_out
            ds = p * (grad_out @ bv.transpose(-2, -1) - row_dot) * scale
            dq += ds @ bk
            bdk += ds.transpose(-2, -1) @ q
        if step < P - 1:
            counters, hooks = list(comm._active), list(comm._around)
            comm._active.clear()
            comm._around.clear()
            n_in = torch.empty(1, dtype=torch.long)
            for work in [dist.isend(torch.tensor([pack.shape[2]]), right), dist.irecv(n_in, left)]:
                work.wait()
            into = torch.empty(7, q.shape[0], int(n_in), q.shape[2], dtype=q.dtype)
            for work in [dist.isend(pack, right), dist.irecv(into, left)]:
                work.wait()
            comm._active.extend(counters)
            comm._around.extend(hooks)
            pack = into
    grads = pack[2:4].contiguous()
    if P > 1:
        mine = torch.empty(2, *k.shape, dtype=k.dtype)
        for work in [dist.isend(grads, right), dist.irecv(mine, left)]:
            work.wait()
        grads = mine
    return dq, grads[0], grads[1]
"""

# (3) The grader's own reference, imported and run: every rank's rows gathered by a ring of
# neighbours (within the budget, were it not for the rest), then the check's `solve`.
GRADER_SOLVE = (
    GATHER_BY_RING
    + """

from course_lib.grading.sequence_parallel_cases import Case, solve


def ring_attention_backward(grad_out, q, k, v, out, lse, causal=False):
    g, qq, kk, vv = gather_by_ring(grad_out, q, k, v)
    lengths = [len(c) for c in torch.arange(qq.shape[1]).tensor_split(world_size())]
    case = Case(world_size(), q.shape[0], qq.shape[1], q.shape[2], causal)
    solved = solve(case, {"q": qq, "k": kk, "v": vv, "grad_out": g})
    return tuple(my_rows(solved[name], lengths) for name in ("dq", "dk", "dv"))
"""
)

# The ring's rules, one by one (the counters emptied above break the first): every rank's
# rows sent straight to every other rank (on 4 ranks, not only neighbours) ...
TO_EVERY_RANK = """
def ring_attention_backward(grad_out, q, k, v, out, lse, causal=False):
    P, r = world_size(), rank()
    mine = torch.stack([grad_out, q, k, v])
    sizes, works = {}, []
    for other in range(P):
        if other != r:
            sizes[other] = torch.empty(1, dtype=torch.long)
            works.append(dist.isend(torch.tensor([q.shape[1]]), other))
            works.append(dist.irecv(sizes[other], other))
    for work in works:
        work.wait()
    held, works = {r: mine}, []
    for other, size in sizes.items():
        held[other] = torch.empty(4, q.shape[0], int(size), q.shape[2], dtype=q.dtype)
        works += [dist.isend(mine, other), dist.irecv(held[other], other)]
    for work in works:
        work.wait()
    whole = torch.cat([held[s] for s in range(P)], dim=2)
    start = sum(held[s].shape[2] for s in range(r))
    grads = autograd_backward(*whole, causal=causal)
    return tuple(g[:, start : start + q.shape[1]] for g in grads)
"""

# The memory: a ring of neighbours that passes every rank's rows on, within the ring's bytes
# (4(P-1) blocks), keeps them all and runs autograd on the whole sequence ...
RELAY_EVERYTHING = (
    GATHER_BY_RING
    + """

def ring_attention_backward(grad_out, q, k, v, out, lse, causal=False):
    whole = gather_by_ring(grad_out, q, k, v)
    lengths = [len(c) for c in torch.arange(whole[1].shape[1]).tensor_split(world_size())]
    return tuple(my_rows(g, lengths) for g in autograd_backward(*whole, causal=causal))
"""
)

# ... a right ring, within its bytes, that keeps every K/V block it receives ...
KEEPS_EVERY_BLOCK = """
def ring_attention_backward(grad_out, q, k, v, out, lse, causal=False):
    P, r = world_size(), rank()
    right, left = (r + 1) % P, (r - 1) % P
    scale = 1 / math.sqrt(q.shape[-1])
    row_dot = (grad_out * out).sum(-1, keepdim=True)
    dq = torch.zeros_like(q)
    kept = []
    pack = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])
    for step in range(P):
        source = (r - step) % P
        bk, bv, bdk, bdv = pack
        kept.append(pack[:2].clone())  # every K/V block, kept "for later"
        if not (causal and source > r):
            s = q @ bk.transpose(-2, -1) * scale
            if causal and source == r:
                s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
            p = torch.exp(s - lse[..., None])
            bdv += p.transpose(-2, -1) @ grad_out
            ds = p * (grad_out @ bv.transpose(-2, -1) - row_dot) * scale
            dq += ds @ bk
            bdk += ds.transpose(-2, -1) @ q
        if step < P - 1:
            n_in = torch.empty(1, dtype=torch.long)
            for work in [dist.isend(torch.tensor([pack.shape[2]]), right), dist.irecv(n_in, left)]:
                work.wait()
            into = torch.empty(4, q.shape[0], int(n_in), q.shape[2], dtype=q.dtype)
            for work in [dist.isend(pack, right), dist.irecv(into, left)]:
                work.wait()
            pack = into
    grads = pack[2:].contiguous()
    if P > 1:
        mine = torch.empty(2, *k.shape, dtype=k.dtype)
        for work in [dist.isend(grads, right), dist.irecv(mine, left)]:
            work.wait()
        grads = mine
    return dq, grads[0], grads[1]
"""

# ... the same, keeping them in a buffer made ahead, at the top of the cell, where the meter
# does not see it made: it counts from the moment the call writes into it.
KEEPS_IN_A_BUFFER_MADE_AHEAD = (
    KEEPS_EVERY_BLOCK.replace("    kept = []\n", "    kept = STASH\n").replace(
        '        kept.append(pack[:2].clone())  # every K/V block, kept "for later"\n',
        "        n, d = pack.shape[2], pack.shape[3]\n"
        "        STASH[step, :, :, :n, :d].copy_(pack[:2])  # in a buffer made ahead\n",
    )
    + """

STASH = torch.empty(8, 2, 2, 8, 16, dtype=torch.float64)  # room for 8 blocks of K and V
"""
)

# ... and the same with the meter taken off torch's dispatch stack while it keeps them.
KEEPS_WITH_METER_OFF = KEEPS_EVERY_BLOCK.replace(
    '        kept.append(pack[:2].clone())  # every K/V block, kept "for later"\n',
    "        with torch.utils._python_dispatch._disable_current_modes():\n"
    "            kept.append(pack[:2].clone())  # unseen\n",
)

# (4) The meter itself, patched at the top of the cell (it runs on every rank before every
# part) so that nothing is ever counted as held, beside a ring that keeps every block: the
# fingerprint of the rank's libraries changes, and every part scores 0 as tampering.
PATCHED_METER = (
    """
Meter._grow = lambda self, nbytes: None  # nothing is ever held
"""
    + KEEPS_EVERY_BLOCK
)

# The lecture's code: its all-to-all, pasted into Ulysses' backward (a copy is the lecture's).
PASTED_ALL_TO_ALL = """
def _all_to_all(pieces, receive_shapes, group):
    me = dist.get_rank(group)
    received = [torch.empty(shape, dtype=pieces[0].dtype) for shape in receive_shapes]
    works = []
    for j, (piece, into) in enumerate(zip(pieces, received, strict=True)):
        if j == me:
            into.copy_(piece)
            continue
        peer = dist.get_global_rank(group, j) if group is not None else j
        if piece.numel():
            works.append(dist.isend(piece.contiguous(), peer, group=group))
        if into.numel():
            works.append(dist.irecv(into, peer, group=group))
    for work in works:
        work.wait()
    return received


def ulysses_attention_backward(grad_out, q, k, v, out, lse, causal=False):
    P = world_size()
    if q.shape[0] % P:
        raise ValueError(f"{q.shape[0]} heads do not split over {P} ranks")
    h, n = q.shape[0] // P, q.shape[1]

    def to_heads(x):
        shapes = [(h, n, x.shape[2])] * P
        return torch.cat(_all_to_all(list(x.split(h)), shapes, None), dim=1)

    def to_tokens(x):
        shapes = [(h, n, x.shape[2])] * P
        return torch.cat(_all_to_all(list(x.split(n, dim=1)), shapes, None), dim=0)

    grads = autograd_backward(*(to_heads(x) for x in (grad_out, q, k, v)), causal=causal)
    return tuple(to_tokens(g) for g in grads)
"""

# Ulysses by all-gathering everything: right, and the ValueError, but not by all-to-alls.
ULYSSES_ALL_GATHERED = """
def ulysses_attention_backward(grad_out, q, k, v, out, lse, causal=False):
    P, r = world_size(), rank()
    if q.shape[0] % P:
        raise ValueError(f"{q.shape[0]} heads do not split over {P} ranks")
    whole = []
    for x in (grad_out, q, k, v):
        parts = [torch.empty_like(x) for _ in range(P)]
        dist.all_gather(parts, x.contiguous())
        whole.append(torch.cat(parts, dim=1))
    return tuple(g.tensor_split(P, dim=1)[r] for g in autograd_backward(*whole, causal=causal))
"""

# Part 5 by the lecture's zigzag (its `sequence_positions`), with a ring backward of one's own.
PART5_RING = """

def balanced_attention_backward(grad_out, q, k, v, out, lse):
    P, r, n = world_size(), rank(), q.shape[1]
    right, left = (r + 1) % P, (r - 1) % P
    held = [torch.as_tensor(x) for x in layout(n * P, P)]
    halves = (slice(0, n // 2), slice(n // 2, n))
    scale = 1 / math.sqrt(q.shape[-1])
    row_dot = (grad_out * out).sum(-1, keepdim=True)
    dq = torch.zeros_like(q)
    pack = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])
    for step in range(P):
        source = held[(r - step) % P]
        bk, bv, bdk, bdv = pack
        for a in halves:
            for b in halves:
                queries, keys = held[r][a], source[b]
                if keys[0] > queries[-1]:
                    continue
                s = q[:, a] @ bk[:, b].transpose(-2, -1) * scale
                s = s.masked_fill(keys[None, :] > queries[:, None], -math.inf)
                p = torch.exp(s - lse[:, a, None])
                bdv[:, b] += p.transpose(-2, -1) @ grad_out[:, a]
                ds = p * (grad_out[:, a] @ bv[:, b].transpose(-2, -1) - row_dot[:, a]) * scale
                dq[:, a] += ds @ bk[:, b]
                bdk[:, b] += ds.transpose(-2, -1) @ q[:, a]
        KEEP
        if step < P - 1:
            into = torch.empty_like(pack)
            for work in [dist.isend(pack, right), dist.irecv(into, left)]:
                work.wait()
            pack = into
    grads = pack[2:].contiguous()
    if P > 1:
        mine = torch.empty_like(grads)
        for work in [dist.isend(grads, right), dist.irecv(mine, left)]:
            work.wait()
        grads = mine
    return dq, grads[0], grads[1]
"""

LECTURE_ZIGZAG = """
from course_lib.sequence_parallel import sequence_positions


def layout(tokens, world_size):
    return [sequence_positions(tokens, r, world_size, "zigzag") for r in range(world_size)]
""" + PART5_RING.replace("        KEEP\n", "")

# Part 5 on contiguous shards with the ring of Part 2: right, economical, unbalanced.
CONTIGUOUS_RING = """
def layout(tokens, world_size):
    return list(torch.arange(tokens).tensor_split(world_size))


def balanced_attention_backward(grad_out, q, k, v, out, lse):
    return ring_attention_backward(grad_out, q, k, v, out, lse, causal=True)
"""

# Part 5: a zigzag of one's own, that keeps every K/V block it receives (the memory).
ZIGZAG_KEEPER = """
def layout(tokens, world_size):
    chunks = torch.arange(tokens).chunk(2 * world_size)
    return [torch.cat([chunks[r], chunks[2 * world_size - 1 - r]]) for r in range(world_size)]
""" + PART5_RING.replace("        KEEP\n", "        kept.append(pack[:2].clone())\n").replace(
    "    dq = torch.zeros_like(q)\n", "    dq = torch.zeros_like(q)\n    kept = []\n"
)

CHEATS = [
    Cheat(
        "the reference and the other ranks' rows looked for in the frames and on the heap",
        "ring_backward",
        FRAMES_AND_HEAP,
        RING_TESTS,
    ),
    Cheat(
        "the counters emptied around a built-in all-gather",
        "ring_backward",
        COUNTERS_EMPTIED,
        RING_TESTS,
    ),
    Cheat(
        "more bytes than the ring's, with the counters emptied around the messages",
        "ring_backward",
        OVER_BUDGET_COUNTERS_EMPTIED,
        RULE_TESTS,
    ),
    Cheat("the grader's own solve, imported and run", "ring_backward", GRADER_SOLVE, RING_TESTS),
    Cheat("every rank's rows sent to every rank", "ring_backward", TO_EVERY_RANK, RING_TESTS),
    Cheat(
        "everything relayed around the ring and kept",
        "ring_backward",
        RELAY_EVERYTHING,
        MEMORY_TESTS,
    ),
    Cheat(
        "every K/V block kept in a buffer made ahead",
        "ring_backward",
        KEEPS_IN_A_BUFFER_MADE_AHEAD,
        MEMORY_TESTS,
    ),
    Cheat(
        "every K/V block kept with the meter off",
        "ring_backward",
        KEEPS_WITH_METER_OFF,
        MEMORY_TESTS,
    ),
    Cheat("the meter patched", "ring_backward", PATCHED_METER, EVERY_TEST, alone=True),
    Cheat("the lecture's all-to-all, pasted", "ulysses_backward", PASTED_ALL_TO_ALL, ULYSSES_TESTS),
    Cheat(
        "Ulysses by all-gathering everything",
        "ulysses_backward",
        ULYSSES_ALL_GATHERED,
        ULYSSES_TESTS,
    ),
    Cheat("the lecture's zigzag layout", "balanced_backward", LECTURE_ZIGZAG, BALANCED_TESTS),
    Cheat(
        "contiguous shards: right, unbalanced", "balanced_backward", CONTIGUOUS_RING, BALANCED_TESTS
    ),
    Cheat(
        "a zigzag that keeps every K/V block", "balanced_backward", ZIGZAG_KEEPER, BALANCED_TESTS
    ),
]

# The queries' side travels instead (q, grad_out, the per-row numbers and dq, to the left, in
# two messages a hop); K, V and their gradients stay on their rank.
QUERIES_TRAVEL = """
def ring_attention_backward(grad_out, q, k, v, out, lse, causal=False):
    P, r = world_size(), rank()
    left, right = (r - 1) % P, (r + 1) % P
    scale = q.shape[-1] ** -0.5
    rows = torch.stack([lse, (grad_out * out).sum(-1)])  # (2, heads, n): lse and D
    pack = torch.stack([q, grad_out, torch.zeros_like(q)])  # q, grad_out, dq
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for step in range(P):
        owner = (r + step) % P  # whose queries this rank holds
        if not causal or owner >= r:  # an earlier rank's queries see none of my keys
            bq, bg, bdq = pack
            s = torch.einsum("hqd,hkd->hqk", bq, k) * scale
            if causal and owner == r:
                s = s + torch.full_like(s, -math.inf).triu(1)
            p = torch.exp(s - rows[0][..., None])
            dv += torch.einsum("hqk,hqd->hkd", p, bg)
            ds = p * (torch.einsum("hqd,hkd->hqk", bg, v) - rows[1][..., None]) * scale
            bdq += torch.einsum("hqk,hkd->hqd", ds, k)
            dk += torch.einsum("hqk,hqd->hkd", ds, bq)
        if step < P - 1:
            pack, rows = shift_left(pack, rows, left, right)
    dq = pack[2].contiguous()  # rank r - 1's dq, done: home it goes
    if P > 1:
        mine = torch.empty_like(q)
        request = dist.isend(dq, left)
        dist.recv(mine, right)
        request.wait()
        dq = mine
    return dq, dk, dv


def shift_left(pack, rows, left, right):
    n_in = torch.empty(1, dtype=torch.long)
    requests = [dist.isend(torch.tensor([pack.shape[2]]), left), dist.irecv(n_in, right)]
    for request in requests:
        request.wait()
    new_pack = torch.empty(3, pack.shape[1], int(n_in), pack.shape[3], dtype=pack.dtype)
    new_rows = torch.empty(2, rows.shape[1], int(n_in), dtype=rows.dtype)
    requests = [dist.isend(pack, left), dist.irecv(new_pack, right)]
    requests += [dist.isend(rows, left), dist.irecv(new_rows, right)]
    for request in requests:
        request.wait()
    return new_pack, new_rows
"""

# K and V in one message, dK and dV in another, blocking sends ordered by parity, leftwards;
# the softmax's gradient through torch's autograd on each block.
TWO_MESSAGES_BLOCKING = '''
def ring_attention_backward(grad_out, q, k, v, out, lse, causal=False):
    P, r = world_size(), rank()
    kv, dkv = torch.stack([k, v]), torch.zeros(2, *k.shape, dtype=k.dtype)
    dq = torch.zeros_like(q)
    for step in range(P):
        source = (r + step) % P  # blocks come from the right
        if not causal or source <= r:
            bk, bv = kv[0].detach().requires_grad_(), kv[1].detach().requires_grad_()
            qq = q.detach().requires_grad_()
            s = qq @ bk.transpose(-2, -1) / math.sqrt(q.shape[-1])
            if causal and source == r:
                s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
            o = torch.exp(s - lse[..., None]) @ bv  # this block's share of the output
            gq, gk, gv = torch.autograd.grad(o, (qq, bk, bv), grad_out)
            # the softmax's normaliser: its gradient is -D p, the same for every block
            row_dot = (grad_out * out).sum(-1, keepdim=True)
            p = torch.exp(s.detach() - lse[..., None])
            fix = -(p * row_dot) / math.sqrt(q.shape[-1])
            dq += gq + fix @ kv[0]
            dkv[0] += gk + fix.transpose(-2, -1) @ q
            dkv[1] += gv
        if step < P - 1:
            kv, dkv = shift(kv), shift(dkv)
    if P > 1:
        dkv = shift(dkv)
    return dq, dkv[0], dkv[1]


def shift(x):
    """x to rank - 1, rank + 1's x back: its length first, blocking, even ranks sending first."""
    P, r = world_size(), rank()
    left, right = (r - 1) % P, (r + 1) % P
    n_in = torch.zeros(1, dtype=torch.long)
    into = None
    for outgoing in (torch.tensor([x.shape[2]]), x.contiguous()):
        if into is None:
            into = n_in
        else:
            into = torch.empty(x.shape[0], x.shape[1], int(n_in), x.shape[3], dtype=x.dtype)
        if r % 2 == 0:
            dist.send(outgoing, left)
            dist.recv(into, right)
        else:
            dist.recv(into, right)
            dist.send(outgoing, left)
    return into
'''

# Ulysses from isend/irecv, the gradients by the formula rather than autograd.
ULYSSES_P2P_FORMULA = '''
def exchange(pieces):
    """All-to-all from isend/irecv: pieces[j] to rank j, what rank j sent me in place j."""
    received = [torch.empty_like(p) for p in pieces]
    works = []
    for j, piece in enumerate(pieces):
        if j == rank():
            received[j].copy_(piece)
        else:
            works += [dist.isend(piece.contiguous(), j), dist.irecv(received[j], j)]
    for work in works:
        work.wait()
    return received


def ulysses_attention_backward(grad_out, q, k, v, out, lse, causal=False):
    P = world_size()
    if q.shape[0] % P != 0:
        raise ValueError(f"{q.shape[0]} heads do not split over {P} ranks")
    h = q.shape[0] // P
    g, q, k, v = (torch.cat(exchange(list(x.split(h))), dim=1) for x in (grad_out, q, k, v))
    rows = torch.stack([lse, (grad_out * out).sum(-1)])  # lse and D, one all-to-all
    rows = torch.cat(exchange(list(rows.split(h, dim=1))), dim=2)
    scale = q.shape[-1] ** -0.5
    s = q @ k.transpose(-2, -1) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    p = torch.exp(s - rows[0][..., None])
    ds = p * (g @ v.transpose(-2, -1) - rows[1][..., None]) * scale
    grads = (ds @ k, ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ g)
    return tuple(torch.cat(exchange(list(x.chunk(P, dim=1))), dim=0) for x in grads)
'''

# Part 5 striped (round robin: rank r holds positions r, r + P, r + 2P, ...), each query row
# against only the keys of the block it sees.
STRIPED_ROWS = """
def layout(tokens, world_size):
    return [torch.arange(r, tokens, world_size) for r in range(world_size)]


def balanced_attention_backward(grad_out, q, k, v, out, lse):
    P, r, n = world_size(), rank(), q.shape[1]
    right, left = (r + 1) % P, (r - 1) % P
    scale = q.shape[-1] ** -0.5
    row_dot = (grad_out * out).sum(-1)
    dq = torch.zeros_like(q)
    pack = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])
    for step in range(P):
        source = (r - step) % P
        bk, bv, bdk, bdv = pack
        for i in range(n):
            seen = i + 1 if source <= r else i  # keys source + jP <= r + iP
            if not seen:
                continue
            s = torch.einsum("hd,hkd->hk", q[:, i], bk[:, :seen]) * scale
            p = torch.exp(s - lse[:, i, None])
            bdv[:, :seen] += torch.einsum("hk,hd->hkd", p, grad_out[:, i])
            dp = torch.einsum("hd,hkd->hk", grad_out[:, i], bv[:, :seen])
            ds = p * (dp - row_dot[:, i, None]) * scale
            dq[:, i] += torch.einsum("hk,hkd->hd", ds, bk[:, :seen])
            bdk[:, :seen] += torch.einsum("hk,hd->hkd", ds, q[:, i])
        if step < P - 1:
            into = torch.empty_like(pack)
            for work in [dist.isend(pack, right), dist.irecv(into, left)]:
                work.wait()
            pack = into
    grads = pack[2:].contiguous()
    if P > 1:
        mine = torch.empty_like(grads)
        for work in [dist.isend(grads, right), dist.irecv(mine, left)]:
            work.wait()
        grads = mine
    return dq, grads[0], grads[1]
"""

ALTERNATIVES = [
    Alternative("the queries' side travels, leftwards", "ring_backward", QUERIES_TRAVEL),
    Alternative(
        "K/V and dK/dV in two messages, blocking by parity, autograd per block",
        "ring_backward",
        TWO_MESSAGES_BLOCKING,
    ),
    Alternative(
        "Ulysses from isend/irecv, the gradients by formula",
        "ulysses_backward",
        ULYSSES_P2P_FORMULA,
    ),
    Alternative("striped layout, one query row at a time", "balanced_backward", STRIPED_ROWS),
]
