"""Assignment 11's cheats (each scores 0 on its part) and right answers written differently
(full marks). tests/test_grading_sequence_parallel.py holds the checks against the same texts
and against named wrong implementations (block order, softmax rescale, local causal mask,
K/V sent to every rank, Ulysses without its ValueError, causal attention unbalanced or
computed in full)."""

from __future__ import annotations

from tests.cheats import Alternative, Cheat

RING_TESTS = frozenset({"test_ring_attention", "test_ring_causal", "test_ring_traffic"})
BALANCED_TESTS = frozenset({"test_balanced"})

LECTURE_RING = '''
import course_lib.sequence_parallel as sp


def ring_attention(q, k, v, causal=False):
    """The lecture's ring attention, with the positions it needs."""
    sizes = [torch.zeros((), dtype=torch.long) for _ in range(world_size())]
    dist.all_gather(sizes, torch.tensor(q.shape[-2]))
    start = sum(int(n) for n in sizes[: rank()])
    positions = torch.arange(start, start + q.shape[-2])
    return sp.ring_attention(q, k, v, positions, causal=causal)
'''

LECTURE_ULYSSES = """
from course_lib.sequence_parallel import ulysses_attention as _lecture_ulysses

ulysses_attention = _lecture_ulysses
"""

# The lecture's online-softmax merge, pasted under another name: a copy is the lecture's code.
PASTED_MERGE = """
def fold(state, scores, v):
    row_max, row_sum, acc = state
    new_max = torch.maximum(row_max, scores.amax(dim=-1, keepdim=True))
    shift = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
    weights = torch.exp(scores - shift)
    rescale = torch.exp(row_max - shift)
    return new_max, row_sum * rescale + weights.sum(-1, keepdim=True), acc * rescale + weights @ v


def ring_attention(q, k, v, causal=False):
    P, r = world_size(), rank()
    right, left = (r + 1) % P, (r - 1) % P
    state = (
        torch.full((*q.shape[:-1], 1), float("-inf"), dtype=q.dtype),
        torch.zeros((*q.shape[:-1], 1), dtype=q.dtype),
        torch.zeros(q.shape, dtype=q.dtype),
    )
    bk, bv = k, v
    for step in range(P):
        source = (r - step) % P
        if not (causal and source > r):
            scores = q @ bk.transpose(-2, -1) / math.sqrt(q.shape[-1])
            if causal and source == r:
                scores = scores.masked_fill(
                    torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf")
                )
            state = fold(state, scores, bv)
        if step < P - 1:
            n_out, n_in = torch.tensor([bk.shape[-2]]), torch.empty(1, dtype=torch.long)
            for work in [dist.isend(n_out, right), dist.irecv(n_in, left)]:
                work.wait()
            out = torch.stack([bk, bv])
            into = torch.empty(2, bk.shape[0], int(n_in), bk.shape[-1], dtype=bk.dtype)
            for work in [dist.isend(out, right), dist.irecv(into, left)]:
                work.wait()
            bk, bv = into[0], into[1]
    return state[2] / state[1]
"""

# Every rank all-gathers the whole sequence's K and V, then torch's attention: right numbers,
# but the traffic (and memory) ring attention exists to avoid.
SDPA_ALL_GATHERED = """
import torch.nn.functional as F


def ring_attention(q, k, v, causal=False):
    sizes = [torch.zeros((), dtype=torch.long) for _ in range(world_size())]
    dist.all_gather(sizes, torch.tensor(q.shape[-2]))
    sizes = [int(n) for n in sizes]
    longest = max(sizes)

    def gather(x):
        padded = torch.zeros(x.shape[0], longest, x.shape[-1], dtype=x.dtype)
        padded[:, : x.shape[-2]] = x
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded)
        return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=-2)

    whole_k, whole_v = gather(k), gather(v)
    start = sum(sizes[: rank()])
    positions = torch.arange(start, start + q.shape[-2])
    visible = torch.arange(whole_k.shape[-2])[None, :] <= positions[:, None]
    mask = visible if causal else None
    return F.scaled_dot_product_attention(q, whole_k, whole_v, attn_mask=mask)
"""

# Part 5 by the lecture's zigzag positions and its ring attention, which skips hidden blocks.
LECTURE_BALANCED = """
import course_lib.sequence_parallel as sp


def layout(tokens, world_size):
    return [sp.sequence_positions(tokens, r, world_size, "zigzag") for r in range(world_size)]


def balanced_causal_attention(q, k, v):
    positions = layout(q.shape[-2] * world_size(), world_size())[rank()]
    return sp.ring_attention(q, k, v, positions, causal=True)
"""

# Part 5 on contiguous shards with Part 2's ring attention: exact, and hidden blocks skipped,
# but the last rank works about P times as much as the first.
CONTIGUOUS_RING = """
def layout(tokens, world_size):
    return list(torch.arange(tokens).tensor_split(world_size))


def balanced_causal_attention(q, k, v):
    return ring_attention(q, k, v, causal=True)
"""

CHEATS = [
    Cheat("the lecture's ring_attention, wrapped", "ring_attention", LECTURE_RING, RING_TESTS),
    Cheat(
        "the lecture's ulysses_attention, rebound",
        "ulysses_attention",
        LECTURE_ULYSSES,
        frozenset({"test_ulysses"}),
    ),
    Cheat("the lecture's online-softmax merge, pasted", "ring_attention", PASTED_MERGE, RING_TESTS),
    Cheat(
        "torch's attention on all-gathered K/V",
        "ring_attention",
        SDPA_ALL_GATHERED,
        frozenset({"test_ring_traffic"}),
    ),
    Cheat(
        "the lecture's zigzag ring attention, wrapped",
        "balanced_attention",
        LECTURE_BALANCED,
        BALANCED_TESTS,
    ),
    Cheat(
        "causal attention on contiguous shards: exact, unbalanced",
        "balanced_attention",
        CONTIGUOUS_RING,
        BALANCED_TESTS,
    ),
]

# Log-sum-exp merge: each block's normalised output and log-sum-exp, merged by logaddexp; K
# and V travel leftwards, in two messages, with blocking sends ordered by parity.
RING_LOGSUMEXP = '''
def ring_attention(q, k, v, causal=False):
    P, r = world_size(), rank()
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    blocks = (k, v)
    for step in range(P):
        source = (r + step) % P  # blocks come from the right
        if source <= r or not causal:
            bk, bv = blocks
            scores = torch.einsum("hqd,hkd->hqk", q, bk) / q.shape[-1] ** 0.5
            if causal and source == r:
                scores = scores + torch.full_like(scores, float("-inf")).triu(1)
            block_lse = torch.logsumexp(scores, dim=-1)
            block_out = torch.softmax(scores, dim=-1) @ bv
            total = torch.logaddexp(lse, block_lse)
            out = out * torch.exp(lse - total)[..., None] + block_out * torch.exp(
                block_lse - total
            )[..., None]
            lse = total
        if step < P - 1:
            blocks = shift_left(*blocks)
    return out


def shift_left(k, v):
    """K and V to rank - 1, from rank + 1: lengths, then K, then V (blocking, by parity)."""
    P, r = world_size(), rank()
    left, right = (r - 1) % P, (r + 1) % P
    n_in = torch.zeros(1, dtype=torch.int64)
    sends = [torch.tensor([k.shape[1]]), k.contiguous(), v.contiguous()]
    got = []
    for i, outgoing in enumerate(sends):
        if i == 0:
            into = n_in
        else:
            into = torch.empty(k.shape[0], int(n_in), k.shape[2], dtype=k.dtype)
        if r % 2 == 0:
            dist.send(outgoing, left)
            dist.recv(into, right)
        else:
            dist.recv(into, right)
            dist.send(outgoing, left)
        got.append(into)
    return got[1], got[2]
'''

ULYSSES_P2P = '''
import torch.nn.functional as F


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


def ulysses_attention(q, k, v, causal=False):
    P = world_size()
    if q.shape[0] % P != 0:
        raise ValueError(f"{q.shape[0]} heads do not split over {P} ranks")
    h = q.shape[0] // P
    q, k, v = (torch.cat(exchange(list(x.split(h))), dim=1) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return torch.cat(exchange(list(out.chunk(P, dim=1))), dim=0)
'''

# Part 5 striped (round robin: rank r holds positions r, r + P, r + 2P, ...): K and V
# all-gathered and interleaved back into sequence order, then one query row at a time against
# only the keys it sees, so no hidden score is computed.
STRIPED_ROWS = """
def layout(tokens, world_size):
    return [torch.arange(r, tokens, world_size) for r in range(world_size)]


def balanced_causal_attention(q, k, v):
    P, r = world_size(), rank()
    heads, n, d = q.shape

    def interleave(x):
        parts = [torch.empty_like(x) for _ in range(P)]
        dist.all_gather(parts, x.contiguous())
        return torch.stack(parts, dim=2).reshape(heads, n * P, d)  # row j of rank s: jP + s

    whole_k, whole_v = interleave(k), interleave(v)
    rows = []
    for j in range(n):
        seen = j * P + r + 1
        scores = torch.einsum("hd,hkd->hk", q[:, j], whole_k[:, :seen]) / d**0.5
        rows.append(torch.einsum("hk,hkd->hd", torch.softmax(scores, dim=-1), whole_v[:, :seen]))
    return torch.stack(rows, dim=1)
"""

ALTERNATIVES = [
    Alternative("log-sum-exp merge, K/V passed leftwards", "ring_attention", RING_LOGSUMEXP),
    Alternative(
        "Ulysses from isend/irecv with torch's attention", "ulysses_attention", ULYSSES_P2P
    ),
    Alternative("striped layout, one query row at a time", "balanced_attention", STRIPED_ROWS),
]
