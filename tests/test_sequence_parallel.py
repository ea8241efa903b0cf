"""course_lib.sequence_parallel: ring attention and Ulysses against torch's own attention on
the whole sequence (float64), the bytes they send, who they talk to, and the causal work
each rank does with contiguous and zigzag shards."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from course_lib import CommCounter, RankError, WorkerPool, models, rank, world_size
from course_lib.costs import (
    all_gather_bytes,
    ring_attention_bytes,
    tp_layer_bytes,
    ulysses_bytes,
)
from course_lib.measure.collectives import record_peers
from course_lib.measure.sequence_parallel import (
    causal_work as measured_causal_work,
)
from course_lib.measure.sequence_parallel import (
    check_busiest_over_idlest,
    check_fewer_bytes_with_one_kv_head,
    check_memory_saving,
    check_merge,
    check_rescale,
    check_ring_bytes_per_rank,
    check_waits_at_the_largest_block,
    peak_bytes,
    ring_overlap,
    sweep_peak_bytes,
    torch_context_parallel,
    tp_against_sp,
)
from course_lib.sequence_parallel import (
    ScatterTokens,
    SequenceParallelBlock,
    attention,
    merge_block,
    ring_attention,
    sequence_positions,
    ulysses_attention,
)
from course_lib.tensor_parallel import local_view

# float64 throughout: the ring adds the same terms as one softmax in another order, so only
# rounding differs (~1e-16 relative); 1e-12 leaves room and still catches any wrong term.
TOL = dict(rtol=0.0, atol=1e-12)
BATCH, HEADS, DIM = 2, 4, 8


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda p: f"P={p}")
def pool(request):
    with WorkerPool(request.param) as pool:
        yield pool


def whole_sequence(seq_len: int):
    """The same q, k, v on every rank: [batch, heads, seq_len, dim]."""
    g = torch.Generator().manual_seed(seq_len)
    return [
        torch.randn(BATCH, HEADS, seq_len, DIM, dtype=torch.float64, generator=g) for _ in "qkv"
    ]


def ring_on_my_shard(seq_len, layout, causal):
    q, k, v = whole_sequence(seq_len)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    mine = sequence_positions(seq_len, rank(), world_size(), layout)
    out = ring_attention(q[..., mine, :], k[..., mine, :], v[..., mine, :], mine, causal)
    return torch.allclose(out, expected[..., mine, :], **TOL)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ring_attention_equals_attention_on_the_whole_sequence(pool, layout, causal):
    for seq_len in (1, 3, 8, 13):  # fewer tokens than ranks, even, uneven
        assert all(pool.launch(ring_on_my_shard, seq_len, layout, causal, timeout=60)), seq_len


def ulysses_on_my_shard(seq_len, causal):
    q, k, v = whole_sequence(seq_len)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    mine = sequence_positions(seq_len, rank(), world_size())
    out = ulysses_attention(q[..., mine, :], k[..., mine, :], v[..., mine, :], causal)
    return torch.allclose(out, expected[..., mine, :], **TOL)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ulysses_attention_equals_attention_on_the_whole_sequence(pool, causal):
    if HEADS % pool.world_size:
        pytest.skip("Ulysses needs heads divisible by P")
    for seq_len in (1, 3, 8, 13):
        assert all(pool.launch(ulysses_on_my_shard, seq_len, causal, timeout=60)), seq_len


def grouped(seq_len: int, heads: int, kv_heads: int):
    """q with `heads` heads, k and v with `kv_heads` (grouped-query attention)."""
    g = torch.Generator().manual_seed(seq_len)
    shapes = [(BATCH, n, seq_len, DIM) for n in (heads, kv_heads, kv_heads)]
    return [torch.randn(shape, dtype=torch.float64, generator=g) for shape in shapes]


def gqa_on_my_shard(method, seq_len, heads, kv_heads, causal):
    q, k, v = grouped(seq_len, heads, kv_heads)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    mine = sequence_positions(seq_len, rank(), world_size())
    shard = [t[..., mine, :] for t in (q, k, v)]
    if method == "ring":
        out = ring_attention(*shard, mine, causal)
    else:
        out = ulysses_attention(*shard, causal)
    return torch.allclose(out, expected[..., mine, :], **TOL)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_grouped_query_attention_equals_torchs(pool, causal):
    """K/V heads shared by groups of query heads (torch's `enable_gqa`): more K/V heads than
    ranks, as many, fewer, and groups that straddle two ranks' query heads (12 heads over 3 K/V
    heads on 4 ranks: rank 1's heads 3-5 use K/V heads 0 and 1)."""
    for kv_heads in (6, 4, 3, 1):
        q, k, v = grouped(5, 12, kv_heads)
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        torch.testing.assert_close(attention(q, k, v, causal), expected, **TOL)
        for method in ("ring", "ulysses"):
            for seq_len in (4, 13):
                args = (method, seq_len, 12, kv_heads, causal)
                assert all(pool.launch(gqa_on_my_shard, *args, timeout=60)), args
    with pytest.raises(ValueError, match="12 query heads cannot be grouped over 5"):
        attention(*grouped(5, 12, 5))


def gqa_traffic(method, seq_len, heads, kv_heads):
    q, k, v = grouped(seq_len, heads, kv_heads)
    mine = sequence_positions(seq_len, rank(), world_size())
    shard = [t[..., mine, :] for t in (q, k, v)]
    with CommCounter() as counter:
        if method == "ring":
            ring_attention(*shard, mine)
        else:
            ulysses_attention(*shard)
    return counter.bytes_sent


def test_grouped_query_attention_sends_what_costs_says():
    """The ring carries K/V blocks of H_kv heads: H_kv/H of multi-head attention's bytes.
    Ulysses sends q and the output whole, and K and V to each rank only the heads its query
    heads use: H_kv/P of them, or one once H_kv < P (the formula in course_lib.costs)."""
    p, seq_len, heads = 4, 16, 8
    q_bytes = BATCH * heads * (seq_len // p) * DIM * 8
    with WorkerPool(p) as pool:
        for kv_heads in (8, 4, 2, 1):
            ring = pool.launch(gqa_traffic, "ring", seq_len, heads, kv_heads, timeout=60)
            kv_bytes = 2 * BATCH * kv_heads * seq_len * DIM * 8
            extra = (p - 1) * (3 * 8 + seq_len // p * 8)  # sizes and positions, per hop
            assert ring == [ring_attention_bytes(kv_bytes, p) + extra] * p, kv_heads
            ulysses = pool.launch(gqa_traffic, "ulysses", seq_len, heads, kv_heads, timeout=60)
            expected = ulysses_bytes(q_bytes, p, heads, kv_heads) + all_gather_bytes(8, p)
            assert ulysses == [expected] * p, kv_heads


def test_ulysses_refuses_heads_that_do_not_split():
    with WorkerPool(3) as pool, pytest.raises(RankError, match="4 heads across 3 ranks"):
        pool.launch(ulysses_on_my_shard, 6, False, timeout=60)


def test_the_reference_attention_is_torchs():
    q, k, v = whole_sequence(5)
    for causal in (False, True):
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.testing.assert_close(attention(q, k, v, causal), expected, **TOL)


def ring_traffic(seq_len):
    q, k, v = whole_sequence(seq_len)
    mine = sequence_positions(seq_len, rank(), world_size())
    with CommCounter() as counter, record_peers() as peers:
        ring_attention(q[..., mine, :], k[..., mine, :], v[..., mine, :], mine)
    return counter.bytes_sent, sorted(peers), mine.numel()


def test_ring_attention_sends_the_ring_volume_to_its_neighbours_only():
    """Per hop a rank sends one K/V block, its positions (float64 here) and three sizes; over
    P-1 hops the K/V part is (P-1)/P of the whole sequence's K and V (course_lib.costs)."""
    p, seq_len = 4, 16
    kv_bytes = 2 * BATCH * HEADS * seq_len * DIM * 8
    with WorkerPool(p) as pool:
        results = pool.launch(ring_traffic, seq_len, timeout=60)
    for r, (sent, peers, local) in enumerate(results):
        assert peers == sorted({(r - 1) % p, (r + 1) % p}), r
        extra = (p - 1) * (3 * 8 + local * 8)
        assert sent == ring_attention_bytes(kv_bytes, p) + extra, r


def causal_work(seq_len, layout):
    q, k, v = whole_sequence(seq_len)
    mine = sequence_positions(seq_len, rank(), world_size(), layout)
    work = []
    ring_attention(q[..., mine, :], k[..., mine, :], v[..., mine, :], mine, True, work=work)
    return sum(work)  # scores per (batch, head)


def test_zigzag_gives_every_rank_the_same_causal_work_contiguous_does_not():
    """P = 4, 32 tokens: contiguous shards of 8 leave rank r r+1 blocks of 64 scores (64 to
    256); zigzag chunks of 4 give every rank 2P+1 = 9 pairs of 16 scores, 144, but rank 3,
    whose chunks 3 and 4 are neighbours and so one stretch, computes its own block as one
    square of 64 where the others skip its masked corner of 16: 160."""
    with WorkerPool(4) as pool:
        contiguous = pool.launch(causal_work, 32, "contiguous", timeout=60)
        zigzag = pool.launch(causal_work, 32, "zigzag", timeout=60)
    assert contiguous == [64, 128, 192, 256]
    assert zigzag == [144, 144, 144, 160]


def test_sequence_positions_cover_the_sequence_once():
    for layout in ("contiguous", "zigzag"):
        for p, n in [(1, 5), (3, 7), (4, 16), (4, 3)]:
            held = torch.cat([sequence_positions(n, r, p, layout) for r in range(p)])
            assert sorted(held.tolist()) == list(range(n)), (layout, p, n)
    assert sequence_positions(16, 1, 4, "zigzag").tolist() == [2, 3, 12, 13]
    with pytest.raises(ValueError, match="layout must be one of"):
        sequence_positions(8, 0, 2, "striped")


def ulysses_traffic(seq_len):
    q, k, v = whole_sequence(seq_len)
    mine = sequence_positions(seq_len, rank(), world_size())
    with CommCounter() as counter:
        ulysses_attention(q[..., mine, :], k[..., mine, :], v[..., mine, :])
    return counter.bytes_sent


def test_ulysses_sends_four_all_to_alls_of_its_tokens():
    """Each of q, k, v and the output leaves a rank but for its own head group: (P-1)/P of
    its N/P tokens, four times (course_lib.costs), plus the all-gather of the shard lengths."""
    p, seq_len = 4, 16
    local_bytes = BATCH * HEADS * (seq_len // p) * DIM * 8
    with WorkerPool(p) as pool:
        sent = pool.launch(ulysses_traffic, seq_len, timeout=60)
    assert sent == [ulysses_bytes(local_bytes, p) + all_gather_bytes(8, p)] * p


def test_a_ring_rank_holds_pieces_of_the_scores_a_ulysses_rank_whole_squares():
    """Lecture 11's memory claim, at N = 1024 on 4 ranks (4 heads): one process holds the
    4 x N x N scores and their softmax; a ring rank (N/P)^2 per head at a time, two
    score-sized blocks at its peak as one process (merge_block exponentiates in place: with a
    third buffer it measured 9.4x), over 11x less here (measured 12.3x; 16x as N grows); a
    Ulysses rank N x N for one head, P = 4 times less (within 10%: outputs and buffers)."""
    one = peak_bytes("one process", 1024)
    with WorkerPool(4) as pool:
        per_rank = pool.launch(sweep_peak_bytes, [1024], timeout=120)
    ring = max(r["ring"][0] for r in per_rank)
    ulysses = max(r["ulysses"][0] for r in per_rank)
    assert one / ring > 11, (one, ring)
    assert one / ulysses == pytest.approx(4, rel=0.1), (one, ulysses)


def test_torchs_context_parallel_does_not_run_on_the_cpu_as_lecture_11_says():
    with WorkerPool(2) as pool:
        said = pool.launch(torch_context_parallel, timeout=120)
    assert all(line.startswith("NotImplementedError") for line in said), said
    assert "_scaled_dot_product_flash_attention_for_cpu" in said[0]


def sp_block_against_dense(seq_len):
    """On each rank: SequenceParallelBlock on this rank's tokens against the dense block on
    all of them, forward and backward; the largest difference of each."""
    cfg = models.GPTConfig(d_model=32, n_heads=4, d_ff=64)
    torch.manual_seed(0)
    dense = models.Block(cfg, torch.float64)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, seq_len, 32, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(2, seq_len, 32, dtype=torch.float64, generator=g)
    sp = SequenceParallelBlock(dense)
    (dense(x) * weight).sum().backward()
    mine = torch.tensor_split(torch.arange(seq_len), world_size())[rank()]
    x_mine = x.detach()[:, mine].clone().requires_grad_()
    out = sp(x_mine)
    (out * weight[:, mine]).sum().backward()
    sp.sync_replicated_grads()
    dense_grads = {n: p.grad for n, p in dense.named_parameters()}
    expected = local_view(sp.tp, dense_grads)
    got = {n: p.grad for n, p in sp.tp.named_parameters()}
    assert expected.keys() == got.keys()
    return (
        (out - dense(x)[:, mine]).abs().max().item(),
        (x_mine.grad - x.grad[:, mine]).abs().max().item(),
        max((got[n] - expected[n]).abs().max().item() for n in got),
    )


def test_megatron_sequence_parallel_block_equals_the_dense_block(pool):
    if HEADS % pool.world_size:
        pytest.skip("tensor parallelism splits the 4 heads evenly")
    for seq_len in (4, 8):
        for errors in pool.launch(sp_block_against_dense, seq_len, timeout=60):
            assert max(errors) < 1e-12, (seq_len, errors)


def sp_gather_uneven():
    return ScatterTokens.apply(torch.zeros(1, 5, 4), None)


def test_sequence_parallel_refuses_tokens_that_do_not_split():
    with WorkerPool(2) as pool, pytest.raises(RankError, match="5 tokens cannot be split"):
        pool.launch(sp_gather_uneven, timeout=60)


def test_sequence_parallel_sends_what_tp_sends_and_saves_less():
    """Lecture 11's claims: by the ring model TP + SP sends TP's bytes (all-gather +
    reduce-scatter = all-reduce, costs.tp_layer_bytes) and saves less for backward (LayerNorm
    inputs on shards). On gloo's wire TP's all-reduces are that formula (within 10%: gloo's
    headers), while TP + SP writes 1.5 times as much: gloo's reduce-scatter writes what a
    whole all-reduce does (measured: 100,280 against 100,032 bytes for 64 KB on 4 ranks)."""
    with WorkerPool(2) as pool:
        runs = pool.launch(tp_against_sp, 16, 32, timeout=60)
    for r in runs:
        tp, sp = r["TP"], r["TP + SP"]
        assert tp["bytes sent"] == sp["bytes sent"] == tp_layer_bytes(2 * 16 * 32 * 8, 2)
        assert tp["on the wire"] == pytest.approx(tp["bytes sent"], rel=0.1)
        assert sp["on the wire"] == pytest.approx(1.5 * tp["on the wire"], rel=0.05)
        assert sp["activations saved"] < tp["activations saved"]
        assert max(tp["largest error"], sp["largest error"]) < 1e-12


def test_merging_blocks_one_by_one_is_the_softmax_of_the_whole_row():
    # Reference: torch.softmax over all the keys at once; float64, so only rounding differs.
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 5, 8, generator=g, dtype=torch.float64) for _ in range(3))
    scores = q @ k.transpose(-2, -1)
    state = (torch.full((2, 5, 1), float("-inf")), torch.zeros(2, 5, 1), torch.zeros(2, 5, 8))
    state = tuple(t.double() for t in state)
    for keys in (slice(0, 2), slice(2, 3), slice(3, 8)):
        state = merge_block(state, scores[..., keys], v[..., keys, :])
    expected = torch.softmax(scores, dim=-1) @ v
    assert torch.allclose(state[2] / state[1], expected, rtol=1e-12, atol=1e-14)


def test_the_merge_check_takes_a_right_merge_and_refuses_one_that_does_not_rescale(capsys):
    def right(state, scores, v):  # written out here, not the library's
        old_max, old_sum, old_out = state
        new_max = torch.maximum(old_max, scores.max(dim=-1, keepdim=True).values)
        weights, rescale = torch.exp(scores - new_max), torch.exp(old_max - new_max)
        return (
            new_max,
            old_sum * rescale + weights.sum(-1, keepdim=True),
            old_out * rescale + weights @ v,
        )

    def no_rescale(state, scores, v):  # right while the max stays, wrong once it rises
        old_max, old_sum, old_out = state
        new_max = torch.maximum(old_max, scores.max(dim=-1, keepdim=True).values)
        weights = torch.exp(scores - new_max)
        return new_max, old_sum + weights.sum(-1, keepdim=True), old_out + weights @ v

    assert check_merge(right) is True
    assert check_merge(no_rescale) is False
    assert "Not yet: on a block with larger scores" in capsys.readouterr().out
    assert check_merge(...) is None
    assert check_merge(lambda state, scores, v: (1, 2)) is False
    assert "return the three tensors" in capsys.readouterr().out


def test_the_rescale_check_takes_e_to_the_minus_2(capsys):
    assert check_rescale(math.exp(3 - 5)) is True  # exp(old max - new max)
    assert "✓ Right" in capsys.readouterr().out
    assert check_rescale(math.exp(5 - 3)) is False  # the wrong way round
    out = capsys.readouterr().out
    assert "it must become exp(score - 5)" in out and "0.1353" not in out
    assert check_rescale(...) is None
    assert "Not answered yet" in capsys.readouterr().out


def test_the_ring_bytes_check_takes_seven_eighths_of_k_and_v(capsys):
    """K and V of 32k tokens of width 4096 in 2 bytes: 2 * 32768 * 4096 * 2 = 536,870,912
    bytes, of which a rank sends 7/8 around a ring of 8 (by hand)."""
    assert check_ring_bytes_per_rank(536_870_912 * 7 / 8) is True
    assert "✓ Right" in capsys.readouterr().out
    assert check_ring_bytes_per_rank(536_870_912 / 8) is False  # only its own block, once
    out = capsys.readouterr().out
    assert "the ring passes (P-1)/P of them" in out and "4.698e+08" not in out
    assert check_ring_bytes_per_rank(...) is None
    assert "Not answered yet" in capsys.readouterr().out


def test_the_memory_saving_check_takes_the_option_nearest_to_the_run(capsys):
    """Made-up peaks: one process 1600 bytes, the ring's busiest rank 160 (10x, nearest 16x),
    Ulysses's 400 (4x)."""
    one_process, busiest = [100, 1600], {"ring": [50, 160], "ulysses": [25, 400]}
    assert check_memory_saving("16x", "4x", one_process, busiest) == (True, True)
    assert "towards P^2 = 16" in capsys.readouterr().out
    assert check_memory_saving("4x", "16x", one_process, busiest) == (False, False)
    assert "16x was" in capsys.readouterr().out
    assert check_memory_saving("3x", ..., one_process, busiest) == (False, None)
    assert "is not one of" in capsys.readouterr().out


def test_the_lectures_work_per_hop_shows_who_waits():
    """Lecture 11's grid, 64 tokens on 4 ranks (blocks of 16 x 16 scores): on contiguous
    shards rank r computes its own block whole (the stretch holds its diagonal) and the blocks
    of ranks before it, and nothing at the hops that bring later ranks' blocks; with the
    zigzag every rank computes two of the four 8 x 8 chunk pairs at every later hop (its
    early queries against the sender's early keys, or its late against the sender's late)."""
    with WorkerPool(4) as pool:
        contiguous = pool.launch(measured_causal_work, 64, "contiguous", timeout=60)
        zigzag = pool.launch(measured_causal_work, 64, "zigzag", timeout=60)
    assert contiguous == [[256] + [256 if hop <= r else 0 for hop in (1, 2, 3)] for r in range(4)]
    # hop 0: two diagonal chunks and one whole one (192); rank 3's chunks 3 and 4 are
    # neighbours, one stretch, so its own block is computed as one 16 x 16 square
    assert zigzag == [[192, 128, 128, 128]] * 3 + [[256, 128, 128, 128]]


def test_the_busiest_over_idlest_check_divides_the_contiguous_work(capsys):
    work = {
        "contiguous": [[16], [16, 16], [16, 16, 16], [16, 16, 16, 16]],
        "zigzag": [[10, 10, 10, 10]] * 4,
    }
    assert check_busiest_over_idlest("4x", work) is True
    assert "the first idles" in capsys.readouterr().out
    assert check_busiest_over_idlest("1x", work) is False  # the zigzag's balance, not asked
    assert check_busiest_over_idlest(..., work) is None


def test_the_gqa_check_names_the_method_that_sent_less_at_one_kv_head(capsys):
    """Judged on the run's last column (one K/V head), whatever the earlier ones were."""
    sent = {"ring": [400, 50], "ulysses": [200, 150]}
    assert check_fewer_bytes_with_one_kv_head("ring", sent) is True
    assert check_fewer_bytes_with_one_kv_head("ulysses", sent) is False
    assert "at least one K/V head" in capsys.readouterr().out
    swapped = {"ring": [400, 150], "ulysses": [200, 50]}
    assert check_fewer_bytes_with_one_kv_head("ulysses", swapped) is True
    assert check_fewer_bytes_with_one_kv_head("tree", sent) is False
    assert check_fewer_bytes_with_one_kv_head(..., sent) is None


def test_the_ring_waits_for_a_slow_link_and_not_for_a_fast_one():
    """Lecture 11's overlap figure, 2 ranks, 32 tokens each: a hop sends its float32 K/V block
    (2 x 32 tokens x 4 heads x 16 dims x 4 bytes), its positions and three sizes. At 1 MB/s that
    takes ~16.5 ms against well under a millisecond of compute, so the ring waits for most of
    it (the real loopback transfer, inside the emulated time, takes a little off); at 1 TB/s it
    waits for nothing worth a millisecond."""
    hop_bytes = 2 * 32 * 4 * 16 * 4 + 32 * 4 + 3 * 8
    with WorkerPool(2) as pool:
        slow = pool.launch(ring_overlap, [64], 1e6, timeout=60)
        fast = pool.launch(ring_overlap, [64], 1e12, timeout=60)
    for run in slow:
        assert run["hop bytes"] == [hop_bytes]
        transfer = hop_bytes / 1e6
        assert 0.5 * transfer < run["waited"][0] <= 1.05 * transfer, run
    for run in fast:
        assert run["waited"][0] < 1e-3, run


def test_the_overlap_check_reads_the_wait_at_the_largest_block(capsys):
    waited = {"bandwidth": 1e6, "one block": [0.001], "waited": [0.015], "hop bytes": [16_000]}
    hidden = {**waited, "one block": [0.1], "waited": [0.0]}
    assert check_waits_at_the_largest_block("yes", waited) is True
    assert check_waits_at_the_largest_block("no", waited) is False
    assert "its transfer 16 ms" in capsys.readouterr().out
    assert check_waits_at_the_largest_block("no", hidden) is True
    assert check_waits_at_the_largest_block(..., hidden) is None
