"""Sequence parallelism: every rank holds 1/P of the tokens (lecture 11).

    positions = sequence_positions(seq_len, rank(), world_size(), "zigzag")
    out = ring_attention(q, k, v, positions, causal=True)   # q, k, v: this rank's tokens only
    out = ulysses_attention(q, k, v, causal=True)           # tokens in rank order, heads % P == 0
    block = SequenceParallelBlock(dense_block)              # Megatron's SP on lecture 9's TP

Attention is the one layer whose tokens talk to each other: every query needs every key. Two
ways to give it that while no rank holds the whole sequence:

- `ring_attention` (Liu et al., 2023): the K/V blocks travel around a ring of ranks, one
  neighbour to the next, P - 1 times; each rank meets every block once and merges the partial
  results with the online softmax (`merge_block`), so the N x N score matrix is never whole on a
  rank, only (N/P) x (N/P) pieces of it.
- `ulysses_attention` (DeepSpeed-Ulysses, Jacobs et al., 2023): an all-to-all swaps sequence
  shards for head shards, so that each rank holds the whole sequence for H/P heads; ordinary
  attention runs; a second all-to-all swaps back. It cannot use more ranks than heads. Its
  all-to-alls are built from sends and receives, so `CommCounter` counts their real bytes.

Causal attention on contiguous shards leaves rank 0 with one block of work and rank P-1 with P:
the "zigzag" layout of `sequence_positions` gives each rank one early and one late chunk, so
all do the same work. Ranks pass their tokens' positions with their K/V, and the causal mask is
built from positions, so it is the global mask whatever the layout.

All tensors are [..., tokens, head_dim] (e.g. [batch, heads, tokens, head_dim]). The formulas
for the bytes are in `course_lib.costs` (`ring_attention_bytes`, `all_to_all_bytes`). Forward
passes only: their backward passes are Assignment 11's.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.models import causal_attention
from course_lib.processes import ring_neighbours
from course_lib.tensor_parallel import ParallelBlock

LAYOUTS = ("contiguous", "zigzag")


def sequence_positions(seq_len: int, rank: int, world_size: int, layout: str = "contiguous"):
    """The positions (a LongTensor) of the tokens `rank` holds: chunk `rank` of P equal chunks
    ("contiguous", as `torch.tensor_split`), or chunks `rank` and 2P-1-`rank` of 2P
    ("zigzag": one early, one late, so causal attention gives every rank the same work)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not one of {world_size} ranks")
    every = torch.arange(seq_len)
    if layout == "contiguous":
        return every.tensor_split(world_size)[rank]
    chunks = every.tensor_split(2 * world_size)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]])


def _kv_groups(q, k) -> int:
    """How many query heads share each K/V head: 1 for multi-head attention, H / H_kv for
    grouped-query attention (K and V with H_kv of the H heads, on dimension -3)."""
    if q.dim() < 3 or k.shape[-3] == q.shape[-3]:
        return 1
    if q.shape[-3] % k.shape[-3]:
        raise ValueError(
            f"grouped-query attention shares each K/V head among a group of query heads: "
            f"{q.shape[-3]} query heads cannot be grouped over {k.shape[-3]} K/V heads"
        )
    return q.shape[-3] // k.shape[-3]


def _expand_kv(x, groups: int):
    """K or V with each head repeated for the `groups` query heads that share it (query head
    i uses K/V head i // groups, as in Llama's grouped-query attention)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=-3)


def attention(q, k, v, causal: bool = False, q_positions=None, k_positions=None):
    """Softmax attention on one process: softmax(q k^T / sqrt(d)) v, a query at position i
    seeing keys at positions <= i when causal (positions default to 0, 1, 2, ...). k and v may
    have fewer heads than q (grouped-query attention, see `_expand_kv`)."""
    groups = _kv_groups(q, k)
    k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        qp = torch.arange(q.shape[-2]) if q_positions is None else q_positions
        kp = torch.arange(k.shape[-2]) if k_positions is None else k_positions
        scores = scores.masked_fill(kp[None, :] > qp[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


# --- ring attention -------------------------------------------------------------------------


def _runs(positions: torch.Tensor) -> list[slice]:
    """Maximal stretches of consecutive positions, as slices: [0..3] and [12..15] for a
    zigzag shard. Causal masks are decided stretch by stretch."""
    if positions.numel() == 0:
        return []
    breaks = (torch.nonzero(positions.diff() != 1).flatten() + 1).tolist()
    edges = [0, *breaks, positions.numel()]
    return [slice(a, b) for a, b in itertools.pairwise(edges)]


def _block_scores(q, k, q_pos, k_pos, causal: bool, work: list | None):
    """Scores of this rank's queries against one K block, -inf where the mask hides a key.
    Under the causal mask, a (query stretch, key stretch) pair whose keys all come after its
    queries is never computed; `work` gets the number of scores that were, per (batch, head)."""
    scale = 1 / math.sqrt(q.shape[-1])
    if not causal:
        if work is not None:
            work.append(q.shape[-2] * k.shape[-2])
        return q @ k.transpose(-2, -1) * scale
    shape = (*q.shape[:-1], k.shape[-2])
    scores = torch.full(shape, float("-inf"), dtype=q.dtype)
    computed = 0
    for qs in _runs(q_pos):
        for ks in _runs(k_pos):
            if k_pos[ks][0] > q_pos[qs][-1]:
                continue  # every key after every query: all masked, nothing to compute
            part = q[..., qs, :] @ k[..., ks, :].transpose(-2, -1) * scale
            hidden = k_pos[ks][None, :] > q_pos[qs][:, None]
            scores[..., qs, ks] = part.masked_fill(hidden, float("-inf"))
            computed += part.shape[-2] * part.shape[-1]
    if work is not None:
        work.append(computed)
    return scores


def merge_block(state, scores, v):
    """The online softmax: fold one block's scores ([..., queries, keys]) and values into the
    running (max, sum, unnormalised output) of every query ([..., queries, 1], [..., queries,
    1], [..., queries, d]), rescaling what was there by exp(old max - new max). Returns the
    new (max, sum, output); the attention result is output / sum once every block is in."""
    row_max, row_sum, acc = state
    new_max = torch.maximum(row_max, scores.amax(dim=-1, keepdim=True))
    # A query that has seen only masked keys so far has max -inf; shift by 0 there instead,
    # so exp(-inf - shift) is 0, not exp(-inf + inf) = nan.
    shift = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
    # In place on the difference: the block then holds two score-sized tensors at its peak
    # (the scores and their exponentials), as one process's softmax does, not three.
    weights = (scores - shift).exp_()
    rescale = torch.exp(row_max - shift)
    return new_max, row_sum * rescale + weights.sum(-1, keepdim=True), acc * rescale + weights @ v


def _post(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group) -> list:
    """Post a send to `dst` and a receive from `src`; the caller waits on the returned works."""
    return [dist.isend(send, dst, group=group), dist.irecv(recv, src, group=group)]


def _start_pass(payload: list[torch.Tensor], group) -> tuple[list, torch.Tensor, list[int]]:
    """Start sending `payload` to the next rank and receiving the previous rank's. The sizes
    go first (shards may differ in length), then one flat message that travels while this
    rank computes; `_finish_pass` waits for it. Only neighbours talk."""
    right, left = ring_neighbours(dist.get_rank(group), dist.get_world_size(group))
    if group is not None:
        right, left = dist.get_global_rank(group, right), dist.get_global_rank(group, left)
    sizes_out = torch.tensor([t.numel() for t in payload])
    sizes_in = torch.empty_like(sizes_out)
    for work in _post(sizes_out, right, sizes_in, left, group):
        work.wait()
    flat_out = torch.cat([t.flatten().to(payload[0].dtype) for t in payload])
    flat_in = torch.empty(int(sizes_in.sum()), dtype=payload[0].dtype)
    return _post(flat_out, right, flat_in, left, group), flat_in, sizes_in.tolist()


def _finish_pass(started) -> list[torch.Tensor]:
    works, flat_in, sizes = started
    for work in works:
        work.wait()
    return list(flat_in.split(sizes))


def ring_attention(q, k, v, positions, causal: bool = False, group=None, work=None):
    """Attention of this rank's queries over the whole sequence, each rank holding only its
    own tokens' q, k, v ([..., s_local, d]) at `positions` (see `sequence_positions`): equal to
    `attention` on the gathered sequence. K and V go around the ring of ranks, P - 1 hops;
    `work` (a list) gets the number of scores computed for each block. With grouped-query
    attention (k, v with fewer heads than q, on dimension -3) the blocks travel with their own
    heads and are expanded only where they are used, so the ring carries H_kv/H of the bytes.
    Forward only: the backward pass is Assignment 11's."""
    if positions.shape != (q.shape[-2],) or k.shape[-2] != q.shape[-2]:
        raise ValueError(
            f"positions must hold one position per local token: q has {q.shape[-2]} tokens, "
            f"k {k.shape[-2]}, positions shape {tuple(positions.shape)}"
        )
    groups = _kv_groups(q, k)
    p = dist.get_world_size(group)
    out_shape = (*q.shape[:-1], v.shape[-1])
    state = (
        torch.full((*q.shape[:-1], 1), float("-inf"), dtype=q.dtype),
        torch.zeros((*q.shape[:-1], 1), dtype=q.dtype),
        torch.zeros(out_shape, dtype=q.dtype),
    )
    block = (k, v, positions)
    for hop in range(p):
        bk, bv, bpos = block
        if hop < p - 1:  # send this block on before computing with it: the two overlap
            started = _start_pass([bk, bv, bpos.to(bk.dtype)], group)
        if bk.shape[-2] and q.shape[-2]:  # a shard may be empty: fewer tokens than ranks
            bk, bv = _expand_kv(bk, groups), _expand_kv(bv, groups)
            state = merge_block(state, _block_scores(q, bk, positions, bpos, causal, work), bv)
        if hop < p - 1:
            nk, nv, npos = _finish_pass(started)
            tokens = npos.numel()
            block = (
                nk.view(*k.shape[:-2], tokens, k.shape[-1]),
                nv.view(*v.shape[:-2], tokens, v.shape[-1]),
                npos.round().long(),
            )
    _, row_sum, acc = state
    return acc / row_sum


# --- DeepSpeed-Ulysses ------------------------------------------------------------------------


def _all_to_all(pieces: list[torch.Tensor], receive_shapes: list[tuple], group) -> list:
    """Send pieces[j] to rank j and return what each rank j sent here, shaped receive_shapes[j].
    Built from sends and receives (as gloo's own all-to-all is), so `CommCounter` counts the
    bytes that really leave this rank: every piece but its own."""
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


def ulysses_attention(q, k, v, causal: bool = False, group=None):
    """Attention over the whole sequence, each rank holding its tokens' q, k, v
    ([batch, heads, s_local, d], the sequence cut into contiguous shards in rank order, which
    may differ in length): equal to `attention` on the gathered sequence. One all-to-all turns
    sequence shards into head shards (every rank: all tokens, heads/P heads), attention runs,
    and a second all-to-all turns the result back. Needs heads divisible by P.

    With grouped-query attention (k, v with H_kv < H heads) each rank is sent only the K/V
    heads its query heads use: H_kv/P of them while H_kv >= P, and one (a copy of a head other
    ranks get too) once there are more ranks than K/V heads."""
    p = dist.get_world_size(group)
    heads = q.shape[-3]
    if heads % p:
        raise ValueError(
            f"ulysses_attention splits the {heads} heads across {p} ranks: the number of "
            f"heads must be divisible by the world size"
        )
    groups = _kv_groups(q, k)
    lengths = [torch.zeros((), dtype=torch.long) for _ in range(p)]
    dist.all_gather(lengths, torch.tensor(q.shape[-2]), group=group)  # shards may differ
    lengths = [int(n) for n in lengths]
    lead, h, me = q.shape[:-3], heads // p, dist.get_rank(group)
    # Rank j owns query heads j*h .. j*h + h - 1, which use K/V heads kv_heads(j).
    kv_heads = [range(j * h // groups, (j * h + h - 1) // groups + 1) for j in range(p)]

    def to_heads(x, owned):  # [.., H, s_local, d] -> [.., my heads, S, d]: every token
        pieces = [x[..., owned[j].start : owned[j].stop, :, :] for j in range(p)]
        shapes = [(*lead, len(owned[me]), n, x.shape[-1]) for n in lengths]
        return torch.cat(_all_to_all(pieces, shapes, group), dim=-2)

    queries = [range(j * h, j * h + h) for j in range(p)]
    my_k, my_v = to_heads(k, kv_heads), to_heads(v, kv_heads)
    if groups > 1:  # local query head t is global head me*h + t, whose K/V head is that // groups
        use = torch.tensor([(me * h + t) // groups - kv_heads[me].start for t in range(h)])
        my_k, my_v = my_k.index_select(-3, use), my_v.index_select(-3, use)
    out = attention(to_heads(q, queries), my_k, my_v, causal)
    # And back: rank j gets its own tokens for my heads; I get mine for every rank's heads.
    pieces = list(out.split(lengths, dim=-2))
    shapes = [(*lead, h, lengths[me], out.shape[-1])] * p
    return torch.cat(_all_to_all(pieces, shapes, group), dim=-3)


# --- Megatron's sequence parallelism: tensor parallelism's companion --------------------------
# Under tensor parallelism (lecture 9) every rank holds the whole [batch, tokens, width]
# activation between the parallel layers, and computes LayerNorm, dropout and the residual
# adds on all of it, the same work and memory on every rank. Megatron's sequence parallelism
# (Korthikanti et al., 2022) gives each rank 1/t of the tokens there instead: f becomes an
# all-gather of the tokens, g a reduce-scatter of them, for the same bytes as g's all-reduce.


def _collect_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather the ranks' token shards ([batch, tokens/t, width]) into the whole sequence."""
    shard = x.movedim(1, 0).contiguous()  # tokens first: the collectives cut along dim 0
    whole = torch.empty(
        (shard.shape[0] * dist.get_world_size(group), *shard.shape[1:]), dtype=x.dtype
    )
    dist.all_gather_single(whole, shard, group=group)
    return whole.movedim(0, 1)


def _sum_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """Sum the ranks' partial [batch, tokens, width] and keep this rank's shard of the tokens."""
    whole = x.movedim(1, 0).contiguous()
    t = dist.get_world_size(group)
    if whole.shape[0] % t:
        raise ValueError(f"{whole.shape[0]} tokens cannot be split evenly over {t} ranks")
    shard = torch.empty((whole.shape[0] // t, *whole.shape[1:]), dtype=x.dtype)
    dist.reduce_scatter_single(shard, whole, group=group)
    return shard.movedim(0, 1)


class GatherTokens(torch.autograd.Function):
    """Megatron's f under sequence parallelism: forward all-gathers the token shards; backward
    reduce-scatters the gradient, since every rank used all tokens for its part."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _collect_tokens(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _sum_tokens(grad, ctx.group), None


class ScatterTokens(torch.autograd.Function):
    """Megatron's g under sequence parallelism: forward sums the ranks' partial results and
    keeps this rank's tokens (reduce-scatter); backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _sum_tokens(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _collect_tokens(grad, ctx.group), None


class SequenceParallelBlock(nn.Module):
    """A transformer block (`models.Block`) under tensor and sequence parallelism: it takes
    and returns this rank's 1/t of the tokens. LayerNorms and residual adds run on the shard;
    the attention and MLP run on the whole sequence with this rank's heads and columns (the
    weights of lecture 9's `ParallelBlock`), entered through `GatherTokens` and left through
    `ScatterTokens`. The LayerNorms and the row layers' biases (replicated) see only this
    rank's tokens, so their gradients must be summed over the group after backward:
    `sync_replicated_grads`."""

    def __init__(self, block, group=None) -> None:
        super().__init__()
        self.group = group
        self.tp = ParallelBlock(block, group)  # this rank's share of the weights

    def _through(self, x, column, row, inner):
        whole = GatherTokens.apply(x, self.group)
        partial = F.linear(inner(F.linear(whole, column.weight, column.bias)), row.weight)
        return ScatterTokens.apply(partial, self.group) + row.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        heads, width = tp.attn.n_heads, tp.attn.qkv.weight.shape[0] // 3

        def attend(qkv):
            return causal_attention(*qkv.split(width, dim=-1), heads)

        x = x + self._through(tp.ln1(x), tp.attn.qkv, tp.attn.proj, attend)
        return x + self._through(tp.ln2(x), tp.mlp.fc, tp.mlp.proj, F.gelu)

    def sync_replicated_grads(self) -> None:
        tp = self.tp
        for p in [*tp.ln1.parameters(), *tp.ln2.parameters(), tp.attn.proj.bias, tp.mlp.proj.bias]:
            dist.all_reduce(p.grad, group=self.group)
