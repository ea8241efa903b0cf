"""Assignment 12's cheats (each scores 0 on its part) and right answers written differently
(full marks), among them the ways to take what a check trusts from the rank's process (its
frames and heap, the given case builders regenerating the check's draw, the counters on the
rank). tests/test_grading_expert_parallel.py holds the checks against the same texts and
against named wrong implementations (experts on the wrong ranks, capacity ignored, rank-local
queues, no gate weights, router gradients not summed, every token to every rank; for Part 4,
one row per (token, expert), every token to every rank, outputs summed without their
gates)."""

from __future__ import annotations

from tests.cheats import Alternative, Cheat

ALL_TESTS = frozenset({"test_forward", "test_backward", "test_traffic"})
# Part 4's dedup_moe (the solution's) sends its rows through the exchange cell's ExchangeRows.
WITH_DEDUP = ALL_TESTS | {"test_dedup"}

# The lecture's layer, wrapped: its experts and router copied from the ones handed in.
LECTURE_LAYER = """
from course_lib.expert_parallel import ExpertParallelMoE, MoE


def expert_parallel_moe(x, router, experts, k, capacity_factor):
    n_experts, P = router.out_features, world_size()
    moe = MoE(x.shape[1], 12, n_experts, k=k, capacity_factor=capacity_factor)
    if n_experts % P:
        raise ValueError("experts do not split")
    layer = ExpertParallelMoE(moe)
    layer.router = router
    layer.experts = experts
    return layer(x)[0]
"""

# The lecture's routing helpers, rebound under the student's names, with a hand-written rest.
LECTURE_ROUTING = """
from course_lib import expert_parallel as _ep

pick = _ep.choose
fits = _ep.within_capacity


def expert_parallel_moe(x, router, experts, k, capacity_factor):
    P, r = world_size(), rank()
    n_experts = router.out_features
    if n_experts % P:
        raise ValueError("experts do not split")
    per_rank = n_experts // P
    probs, gates, chosen = pick(x, router.weight, k)
    mine = torch.nn.functional.one_hot(chosen, n_experts).sum((0, 1))
    counts = [torch.zeros_like(mine) for _ in range(P)]
    dist.all_gather(counts, mine)
    counts = torch.stack(counts)
    capacity = expert_capacity(int(counts.sum()) // k, n_experts, k, capacity_factor)
    before = counts.cumsum(0) - counts
    kept = fits(chosen, n_experts, capacity, before[r])
    kept_per_rank = (capacity - before).clamp(min=0).minimum(counts)
    token, slot = torch.nonzero(kept, as_tuple=True)
    expert = chosen[token, slot]
    order = torch.argsort(expert * x.shape[0] + token)
    token, slot, expert = token[order], slot[order], expert[order]
    by_rank = kept_per_rank.view(P, P, per_rank).sum(2)
    send_counts, recv_counts = by_rank[r].tolist(), by_rank[:, r].tolist()
    arrived = ExchangeRows.apply(x[token], send_counts, recv_counts)
    here = kept_per_rank[:, r * per_rank : (r + 1) * per_rank]
    owner = torch.arange(per_rank).repeat(P).repeat_interleave(here.flatten())
    done = torch.zeros_like(arrived)
    for i, module in enumerate(experts):
        rows = torch.nonzero(owner == i).flatten()
        done = done.index_copy(0, rows, module(arrived[rows]))
    back = ExchangeRows.apply(done, recv_counts, send_counts)
    return torch.zeros_like(x).index_add(0, token, gates[token, slot, None] * back)
"""

# Lecture 11's all-to-all (the one lecture 12's layer uses), pasted under another name.
PASTED_ALL_TO_ALL = """
def exchange_rows(rows, send_counts, recv_counts):
    pieces = list(rows.split(send_counts))
    shapes = [(n, rows.shape[1]) for n in recv_counts]
    return torch.cat(swap_pieces(pieces, shapes, None))


def swap_pieces(pieces, receive_shapes, group):
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


class ExchangeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, send_counts, recv_counts):
        ctx.counts = (list(send_counts), list(recv_counts))
        return exchange_rows(rows, send_counts, recv_counts)

    @staticmethod
    def backward(ctx, grad_rows):
        sent, received = ctx.counts
        return exchange_rows(grad_rows.contiguous(), received, sent), None, None
"""

# Every rank all-gathers every token (padded), routes the whole batch itself, runs its experts
# on their kept tokens and all-reduces the outputs: right numbers, none of the dispatch.
ALL_GATHERED = """
import torch.distributed.nn.functional as dnn


def expert_parallel_moe(x, router, experts, k, capacity_factor):
    P, r = world_size(), rank()
    n_experts = router.out_features
    if n_experts % P:
        raise ValueError("experts do not split")
    sizes = [torch.zeros((), dtype=torch.long) for _ in range(P)]
    dist.all_gather(sizes, torch.tensor(x.shape[0]))
    sizes = [int(n) for n in sizes]
    padded = torch.zeros(max(sizes), x.shape[1], dtype=x.dtype)
    padded = padded.index_copy(0, torch.arange(x.shape[0]), x)
    whole = torch.cat([p[:n] for p, n in zip(dnn.all_gather(padded), sizes)])
    probs = torch.softmax(router(whole), dim=-1)
    gates, chosen = probs.topk(k, dim=-1)
    capacity = expert_capacity(whole.shape[0], n_experts, k, capacity_factor)
    out = torch.zeros_like(whole)
    per_rank = n_experts // P
    for i, module in enumerate(experts):
        e = r * per_rank + i
        token, slot = torch.nonzero(chosen == e, as_tuple=True)
        token, slot = token[:capacity], slot[:capacity]
        out = out.index_add(0, token, gates[token, slot, None] * module(whole[token]))
    out = dnn.all_reduce(out)
    start = sum(sizes[:r])
    return out[start : start + x.shape[0]]
"""

# Part 4 answered by the lecture's layer, which sends one row per (token, expert).
LECTURE_DEDUP = """
from course_lib.expert_parallel import ExpertParallelMoE, MoE


def dedup_moe(x, router, experts, k, capacity_factor):
    moe = MoE(x.shape[1], 12, router.out_features, k=k, capacity_factor=capacity_factor)
    layer = ExpertParallelMoE(moe)
    layer.router = router
    layer.experts = experts
    return layer(x)[0]
"""

# (1) The other ranks' tokens and experts, taken from the process instead of the messages.
# Given the whole batch (and the output gradient), this rank's rows of `moe_dense` (the set-up
# cell's), with the other ranks' rows' share of this rank's experts' gradients folded in as a
# term that is zero but carries it: forward and backward would both be right. One element to
# the neighbour, so that some traffic is seen. On a rank there is nothing to find: it holds its
# own tokens and experts only, drawn from a secret seed, and the reference is the judge's.
DENSE_ROWS = """
import gc
import sys


def _token():
    p, me = world_size(), rank()
    if p > 1:
        request = dist.isend(torch.zeros(1), (me + 1) % p)
        dist.recv(torch.zeros(1), (me - 1) % p)
        request.wait()


def _rows(whole, g_all, every, x, router, k, capacity_factor):
    p, r = world_size(), rank()
    start = sum(len(c) for c in torch.arange(len(whole)).tensor_split(p)[:r])
    batch = torch.cat([whole[:start], x, whole[start + len(x) :]])
    out = moe_dense(batch, router, every, k, capacity_factor)[start : start + len(x)]
    if g_all is None or not torch.is_grad_enabled():
        return out
    fixed = lambda t: torch.nn.functional.linear(t, router.weight.detach())  # noqa: E731
    others = torch.ones(len(whole), 1, dtype=whole.dtype)
    others[start : start + len(x)] = 0
    extra = (moe_dense(whole, fixed, every, k, capacity_factor) * g_all * others).sum()
    return out + (extra - extra.detach()) / g_all[start : start + len(x)].sum()
"""

FRAMES_AND_HEAP = (
    DENSE_ROWS
    + """

def _held():
    # Everything the callers' frames hold (through lists, tuples and dicts), then the heap.
    found, frame = [], sys._getframe(2)
    while frame is not None:
        stack = list(frame.f_locals.values())
        while stack:
            value = stack.pop()
            found.append(value)
            if isinstance(value, dict):
                stack += list(value.values())
            elif isinstance(value, (list, tuple)) and len(value) < 100:
                stack += list(value)
        frame = frame.f_back
    return found + gc.get_objects()


def _first(found, keep):
    return next((o for o in found if keep(o)), None)


def expert_parallel_moe(x, router, experts, k, capacity_factor):
    p, r = world_size(), rank()
    n_experts = router.out_features
    if n_experts % p:
        raise ValueError("experts do not split")
    _token()
    held, mine = _held(), x.detach()
    rows = lambda o: (  # noqa: E731
        isinstance(o, torch.Tensor) and o is not x and o.dtype == x.dtype and o.dim() == 2
        and o.shape[1] == x.shape[1]
    )
    whole = _first(held, lambda o: rows(o) and torch.equal(o.tensor_split(p)[r], mine))
    every = _first(
        held,
        lambda o: isinstance(o, (list, tuple, torch.nn.ModuleList)) and len(o) == n_experts
        and all(any(m is e for m in o) for e in experts),
    )
    if whole is None or every is None:
        return torch.zeros_like(x)
    whole, every = whole.detach(), list(every)
    g_all = _first(held, lambda o: rows(o) and o.shape == whole.shape and not torch.equal(o, whole))
    g_all = None if g_all is None else g_all.detach()
    return _rows(whole, g_all, every, x, router, k, capacity_factor)
"""
)

# ... and the check's case rebuilt with the builders the set-up cell is given (`layer`,
# `inputs`), trying the seeds and batch sizes the notebook states until this rank's tokens
# match: the check's draws come from a secret, so nothing matches.
REGENERATED = (
    DENSE_ROWS
    + """
from course_lib.grading.expert_parallel import Case


def expert_parallel_moe(x, router, experts, k, capacity_factor):
    p, r = world_size(), rank()
    n_experts = router.out_features
    if n_experts % p:
        raise ValueError("experts do not split")
    _token()
    per_rank = n_experts // p
    for seed in range(4):
        for tokens in range(p * (len(x) - 1), p * (len(x) + 1) + 1):
            case = Case(p, tokens, n_experts, k, capacity_factor, seed, d_model=x.shape[1])
            whole, g_all = inputs(case)
            if not torch.equal(whole.tensor_split(p)[r], x.detach()):
                continue
            every = layer(case)[1]
            every[r * per_rank : (r + 1) * per_rank] = list(experts)
            return _rows(whole, g_all, every, x, router, k, capacity_factor)
    return torch.zeros_like(x)
"""
)

# (2) The counters on the rank emptied around a built-in all-gather of every row, and put
# back: the exchange sends every token to every rank, but a tally kept on the rank would see
# only the layer's counts. The launcher was told of the all-gather as it happened: Part 3's
# and Part 4's rules (tokens by all-to-all only, bytes) fail on it; Parts 1 and 2 are right.
COUNTERS_EMPTIED = """
import course_lib.comm as comm


def exchange_rows(rows, send_counts, recv_counts):
    p, me = world_size(), rank()
    counters, hooks = list(comm._active), list(comm._around)
    comm._active.clear()
    comm._around.clear()
    try:
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(p)]
        dist.all_gather(sizes, torch.tensor([len(rows)]))
        padded = torch.zeros(max(int(s) for s in sizes), rows.shape[1], dtype=rows.dtype)
        padded[: len(rows)] = rows
        everyone = [torch.empty_like(padded) for _ in range(p)]
        dist.all_gather(everyone, padded)
        counts = [torch.zeros(p, dtype=torch.long) for _ in range(p)]
        dist.all_gather(counts, torch.tensor(send_counts, dtype=torch.long))
    finally:
        comm._active.extend(counters)
        comm._around.extend(hooks)
    pieces = []
    for j in range(p):
        start = int(counts[j][:me].sum())
        pieces.append(everyone[j][start : start + recv_counts[j]])
    return torch.cat(pieces)


class ExchangeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, send_counts, recv_counts):
        ctx.counts = (list(send_counts), list(recv_counts))
        return exchange_rows(rows, send_counts, recv_counts)

    @staticmethod
    def backward(ctx, grad_rows):
        sent, received = ctx.counts
        return exchange_rows(grad_rows.contiguous(), received, sent), None, None
"""

CHEATS = [
    Cheat("the lecture's ExpertParallelMoE, wrapped", "moe_layer", LECTURE_LAYER, ALL_TESTS),
    Cheat("the lecture's routing, rebound", "moe_layer", LECTURE_ROUTING, ALL_TESTS),
    Cheat("the lecture's all-to-all, pasted", "exchange", PASTED_ALL_TO_ALL, WITH_DEDUP),
    Cheat(
        "every token all-gathered, outputs all-reduced",
        "moe_layer",
        ALL_GATHERED,
        frozenset({"test_traffic"}),
    ),
    Cheat("the lecture's layer as dedup_moe", "dedup", LECTURE_DEDUP, frozenset({"test_dedup"})),
    Cheat(
        "the whole batch and every expert taken from the frames and the heap",
        "moe_layer",
        FRAMES_AND_HEAP,
        ALL_TESTS,
    ),
    Cheat(
        "the check's case regenerated with the given layer() and inputs()",
        "moe_layer",
        REGENERATED,
        ALL_TESTS,
    ),
    Cheat(
        "every row all-gathered, the counters on the rank emptied around it",
        "exchange",
        COUNTERS_EMPTIED,
        frozenset({"test_traffic", "test_dedup"}),
    ),
]

# torch's all_to_all_single with uneven split sizes (gloo runs it; its list version,
# dist.all_to_all, wants pieces of one size), the gradient by the same call the other way.
ALL_TO_ALL_SINGLE = """
def exchange_rows(rows, send_counts, recv_counts):
    out = torch.empty(sum(recv_counts), rows.shape[1], dtype=rows.dtype)
    dist.all_to_all_single(
        out, rows.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts
    )
    return out


class ExchangeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, send_counts, recv_counts):
        ctx.send_counts, ctx.recv_counts = send_counts, recv_counts
        return exchange_rows(rows, send_counts, recv_counts)

    @staticmethod
    def backward(ctx, grad):
        return exchange_rows(grad, ctx.recv_counts, ctx.send_counts), None, None
"""

# Sends grouped by destination but in token order inside each (not by expert), with the
# expert id travelling as an extra column; router gradients summed by all_reduce on a copy.
TOKEN_ORDER = """
def expert_parallel_moe(x, router, experts, k, capacity_factor):
    P, r = world_size(), rank()
    n_experts = router.out_features
    if n_experts % P != 0:
        raise ValueError(f"{n_experts} experts do not divide over {P} ranks")
    per_rank = n_experts // P
    gates, chosen = torch.softmax(router(x), dim=-1).topk(k, dim=-1)
    onehot = torch.zeros(x.shape[0], n_experts, dtype=torch.long).scatter(1, chosen, 1)
    flat = torch.empty(P * n_experts, dtype=torch.long)
    dist.all_gather_into_tensor(flat, onehot.sum(0))
    counts = flat.view(P, n_experts)
    capacity = expert_capacity(int(counts.sum()) // k, n_experts, k, capacity_factor)
    ahead = counts[:r].sum(0)
    queue = ahead + onehot.cumsum(0) - onehot
    keep = queue.gather(1, chosen) < capacity
    token, slot = torch.nonzero(keep, as_tuple=True)  # token order, then slot
    expert = chosen[token, slot]
    dest = expert // per_rank
    order = torch.argsort(dest * (k * x.shape[0]) + token * k + slot)
    token, slot, expert, dest = token[order], slot[order], expert[order], dest[order]
    send_counts = torch.bincount(dest, minlength=P).tolist()
    kept = (capacity - (counts.cumsum(0) - counts)).clamp(min=0).minimum(counts)
    recv_counts = kept[:, r * per_rank : (r + 1) * per_rank].sum(1).tolist()
    ids = exchange_rows(expert.to(x.dtype)[:, None], send_counts, recv_counts)[:, 0].long()
    arrived = ExchangeRows.apply(x[token], send_counts, recv_counts)
    done = torch.zeros_like(arrived)
    for i, module in enumerate(experts):
        rows = torch.nonzero(ids == r * per_rank + i).flatten()
        done = done.index_copy(0, rows, module(arrived[rows]))
    back = ExchangeRows.apply(done, recv_counts, send_counts)
    return torch.zeros_like(x).index_add(0, token, back * gates[token, slot].unsqueeze(1))
"""

# Part 4's other design: one row per (token, rank) there, with a 0/1 column per expert of that
# rank; every kept expert's output comes back on its own and is weighted at home.
PER_EXPERT_RETURN = """
def dedup_moe(x, router, experts, k, capacity_factor):
    P, r = world_size(), rank()
    n_experts = router.out_features
    if n_experts % P:
        raise ValueError("the experts do not split evenly over the ranks")
    per_rank, (n, d) = n_experts // P, x.shape
    gates, chosen = torch.softmax(router(x), dim=-1).topk(k, dim=-1)
    picked = torch.zeros(n, n_experts, dtype=torch.long).scatter(1, chosen, 1)
    flat = torch.empty(P * n_experts, dtype=torch.long)
    dist.all_gather_into_tensor(flat, picked.sum(0))
    counts = flat.view(P, n_experts)
    capacity = expert_capacity(int(counts.sum()) // k, n_experts, k, capacity_factor)
    queue = counts[:r].sum(0) + picked.cumsum(0) - picked
    kept = (picked == 1) & (queue < capacity)
    by_rank = kept.view(n, P, per_rank)
    token, dest = torch.nonzero(by_rank.any(2), as_tuple=True)
    order = torch.argsort(dest * n + token)
    token, dest = token[order], dest[order]
    sizes = torch.bincount(dest, minlength=P)
    table = torch.empty(P * P, dtype=torch.long)
    dist.all_gather_into_tensor(table, sizes)
    send, recv = sizes.tolist(), table.view(P, P)[:, r].tolist()
    rows = torch.cat([x[token], by_rank[token, dest].to(x.dtype)], dim=1)
    arrived = ExchangeRows.apply(rows, send, recv)
    here, wanted = arrived[:, :d], arrived[:, d:] > 0.5
    row, which = torch.nonzero(wanted, as_tuple=True)  # by source rank, token, expert
    outs = torch.zeros(len(row), d, dtype=x.dtype)
    for i, expert in enumerate(experts):
        sel = torch.nonzero(which == i).flatten()
        outs = outs.index_copy(0, sel, expert(here[row[sel]]))
    back_send = [int(w.sum()) for w in wanted.split(recv)]
    t, e = torch.nonzero(kept, as_tuple=True)
    order = torch.argsort((e // per_rank) * n * n_experts + t * n_experts + e)
    t, e = t[order], e[order]
    back_recv = torch.bincount(e // per_rank, minlength=P).tolist()
    back = ExchangeRows.apply(outs, back_send, back_recv)
    weight = torch.zeros(n, n_experts, dtype=x.dtype).scatter(1, chosen, gates)
    return torch.zeros_like(x).index_add(0, t, weight[t, e, None] * back)
"""

ALTERNATIVES = [
    Alternative("all_to_all_single with uneven splits", "exchange", ALL_TO_ALL_SINGLE),
    Alternative(
        "token order inside a destination, expert ids sent along", "moe_layer", TOKEN_ORDER
    ),
    Alternative("dedup: each expert's output back, weighted at home", "dedup", PER_EXPERT_RETURN),
]
