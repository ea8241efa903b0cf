"""course_lib.expert_parallel: the router against a token-by-token loop, the dense layer against
a per-token sum, `ExpertParallelMoE` against the dense layer (forward and backward, float64,
dropped tokens included) on 1, 2 and 4 ranks, the bytes its all-to-alls send against the
exact count and `costs.ep_bytes`, the errors it gives for input it cannot take, and what
capacity costs against dropless (drops, padded rows, largest batch) on a routing made by hand."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist

from course_lib import RankError, WorkerPool, rank, world_size
from course_lib.costs import all_gather_bytes, all_reduce_bytes, ep_bytes, expert_capacity
from course_lib.expert_parallel import (
    ExpertParallelMoE,
    MoE,
    load_balancing_loss,
    route,
)
from course_lib.measure.expert_parallel import (
    D_MODEL,
    balance_router,
    batch,
    bytes_sent,
    check_capacity,
    check_dropped_at_one,
    check_ep_forward_bytes,
    check_faster_ep_or_tp,
    check_worst_balance_loss,
    largest_errors,
    small_moe,
    step_spread,
    step_times,
    torch_all_to_all,
)
from course_lib.measure.expert_parallel.dropless import (
    DROPLESS,
    capacity_work,
    check_no_drop_factor,
    expert_rows,
    lecture_capacity_work,
)

# float64: expert parallelism computes each expert on the same rows in the same order as one
# process, so outputs agree to the bit; only the router's gradient is summed over ranks in
# another order (~1e-16 relative). 1e-12 leaves room and still catches any wrong term.
TOL = dict(rtol=0.0, atol=1e-12)


@pytest.fixture(scope="module")
def pools():
    """pools(P): one warm pool of P ranks for the whole module (starting one takes seconds)."""
    made: dict[int, WorkerPool] = {}
    with contextlib.ExitStack() as stack:

        def get(p: int) -> WorkerPool:
            if p not in made:
                made[p] = stack.enter_context(WorkerPool(p))
            return made[p]

        yield get


@pytest.fixture(params=[1, 2, 4], ids=lambda p: f"P={p}")
def pool(request, pools):
    return pools(request.param)


# --- routing and the dense layer, against loops over tokens ----------------------------------


def routing_by_loop(x, router_weight, k, capacity_factor):
    """The routing rules written out token by token: each token's k most probable experts;
    an expert keeps the first C tokens that chose it, in token order."""
    probs = torch.softmax(x @ router_weight.T, dim=-1)
    n_tokens, n_experts = probs.shape
    capacity = math.ceil(capacity_factor * n_tokens * k / n_experts - 1e-9)
    taken = [0] * n_experts
    choices = []  # per token: [(expert, probability, kept)]
    for t in range(n_tokens):
        ranked = sorted(range(n_experts), key=lambda e: -probs[t, e].item())[:k]
        mine = []
        for e in ranked:
            mine.append((e, probs[t, e].item(), taken[e] < capacity))
            taken[e] += 1
        choices.append(mine)
    return choices, capacity


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.25, 4.0])
def test_routing_is_the_token_by_token_rule(k, capacity_factor):
    moe = MoE(D_MODEL, 8, 6, k, capacity_factor)
    x = batch(37)
    r = route(x, moe.router.weight.detach(), k, capacity_factor)
    choices, capacity = routing_by_loop(x, moe.router.weight.detach(), k, capacity_factor)
    assert r.capacity == capacity == expert_capacity(37, 6, k, capacity_factor)
    for t, mine in enumerate(choices):
        assert r.experts[t].tolist() == [e for e, _, _ in mine], t
        assert r.kept[t].tolist() == [kept for _, _, kept in mine], t
        torch.testing.assert_close(r.weights[t], torch.tensor([p for _, p, _ in mine]).double())
    if capacity_factor < 1:
        assert not r.kept.all(), "a capacity below the even share must drop something"


def test_the_dense_layer_is_the_per_token_weighted_sum_of_its_kept_experts():
    moe = MoE(D_MODEL, 8, 6, k=2, capacity_factor=0.75)
    x = batch(40)
    y, _ = moe(x)
    choices, _ = routing_by_loop(x, moe.router.weight.detach(), 2, 0.75)
    with torch.no_grad():
        for t, mine in enumerate(choices):
            expected = sum(
                (p * moe.experts[e](x[t : t + 1])[0] for e, p, kept in mine if kept),
                torch.zeros(D_MODEL, dtype=torch.float64),
            )
            torch.testing.assert_close(y[t], expected, **TOL)
    all_dropped = [t for t, mine in enumerate(choices) if not any(kept for *_, kept in mine)]
    assert all_dropped, "capacity 0.75 should drop every choice of some token"
    assert (y[all_dropped] == 0).all(), "a token with no kept choice gets a zero output"


def test_load_balancing_loss_by_hand():
    n, tokens = 4, 8
    # Every token sure of expert 0: f_0 = 1 and P_0 = 1, E * 1 * 1 = E, the worst.
    probs = torch.zeros(tokens, n, dtype=torch.float64)
    probs[:, 0] = 1.0
    experts = torch.zeros(tokens, 1, dtype=torch.long)
    assert load_balancing_loss(probs, experts).item() == pytest.approx(n)
    # Uniform probabilities and choices spread evenly: E * E * (1/E * 1/E) = 1, the best.
    uniform = torch.full((tokens, n), 1 / n, dtype=torch.float64)
    spread = torch.arange(tokens).remainder(n).unsqueeze(1)
    assert load_balancing_loss(uniform, spread).item() == pytest.approx(1.0)
    # Top-2, tokens split between experts {0, 1} and {2, 3}: f = 1/4 each, so 1 again.
    pairs = torch.tensor([[0, 1], [2, 3]] * (tokens // 2))
    assert load_balancing_loss(uniform, pairs).item() == pytest.approx(1.0)


def test_sgd_on_the_balancing_loss_evens_out_the_router_as_lecture_12_shows():
    history = balance_router(steps=60)
    assert history["dropped"][0] > 0.05 and history["dropped"][-1] == 0
    assert history["loss"][-1] < history["loss"][0]
    assert history["chosen"][-1] == [64] * 8  # 256 tokens * 2 choices / 8 experts


# --- expert parallelism against the dense layer ----------------------------------------------


def against_dense(n_tokens, n_experts, k, capacity_factor):
    """On each rank: ExpertParallelMoE on this rank's share of n_tokens (torch.tensor_split:
    the shares may differ, or be empty) against MoE on all of them, forward and backward."""
    moe = MoE(D_MODEL, 8, n_experts, k, capacity_factor)
    x = batch(n_tokens).requires_grad_()
    weight = batch(n_tokens, seed=5)
    y, aux = moe(x)
    ((y * weight).sum() + 0.1 * aux).backward()
    ep = ExpertParallelMoE(moe)
    mine = torch.tensor_split(torch.arange(n_tokens), world_size())[rank()]
    x_mine = x.detach()[mine].clone().requires_grad_()
    y_mine, aux_mine = ep(x_mine)
    ((y_mine * weight[mine]).sum() + 0.1 * aux_mine).backward()
    if world_size() > 1:  # the router saw only this rank's tokens
        dist.all_reduce(ep.router.weight.grad)
    pairs = [(y_mine, y[mine]), (aux_mine, aux), (x_mine.grad, x.grad[mine])]
    pairs.append((ep.router.weight.grad, moe.router.weight.grad))
    for i, expert in enumerate(ep.experts):
        dense = moe.experts[ep.first + i]
        pairs += [
            (a.grad, b.grad) for a, b in zip(expert.parameters(), dense.parameters(), strict=True)
        ]
    return [(a - b).abs().max().item() if a.numel() else 0.0 for a, b in pairs]


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("k", [1, 2])
def test_expert_parallel_equals_the_dense_layer_forward_and_backward(pool, k, capacity_factor):
    for n_tokens, n_experts in [(32, 4), (13, 8), (3, 4)]:  # even, uneven, fewer than ranks
        results = pool.launch(against_dense, n_tokens, n_experts, k, capacity_factor, timeout=60)
        for r, errors in enumerate(results):
            assert max(errors) <= TOL["atol"], (n_tokens, n_experts, r, errors)


def test_the_lectures_comparison_drops_tokens_and_agrees(pools):
    results = pools(4).launch(largest_errors, 16, 0.5, timeout=60)
    for r in results:
        assert r["dropped"] > 0
        assert max(v for name, v in r.items() if name != "dropped") <= TOL["atol"], r


# --- bytes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [2, 4])
def test_an_even_router_sends_exactly_ep_bytes(pools, p):
    """Every expert gets as many tokens from every rank: each all-to-all sends (P-1)/P of this
    rank's T/P * k routed rows, dispatch and combine in forward (costs.ep_bytes), the same
    again in backward; plus the all-gather of 2E counts and probability sums (float64)."""
    results = pools(p).launch(bytes_sent, 64, True, timeout=60)
    for r in results:
        assert r["forward all-to-alls"] == ep_bytes(r["N"], p) == r["backward all-to-alls"]
        assert r["all-gather of counts"] == all_gather_bytes(2 * 8 * 8, p)
        # What the process wrote to its sockets: the same, plus gloo's headers (under 2 KB for
        # the dozen or so messages, as lecture 12 says).
        counted = r["forward all-to-alls"] + r["all-gather of counts"]
        assert 0 <= r["forward, written to sockets"] - counted < 2048, r


def test_a_real_router_sends_the_rows_it_routes_to_other_ranks(pools):
    """With the seeded router the shares are uneven: a rank's dispatch sends its kept choices
    of other ranks' experts, its combine sends back the rows other ranks sent it, counted from
    the dense routing on one process, d * 8 bytes each."""
    p, per_rank, n_experts = 4, 64, 8
    results = pools(p).launch(bytes_sent, per_rank, False, timeout=60)

    moe = small_moe(capacity_factor=2.0)
    r = route(batch(per_rank * p), moe.router.weight.detach(), moe.k, 2.0)
    owner = r.experts // (n_experts // p)  # the rank holding each chosen expert
    home = (torch.arange(per_rank * p) // per_rank).unsqueeze(1).expand_as(owner)
    for me, got in enumerate(results):
        dispatched = int(((home == me) & (owner != me) & r.kept).sum())
        returned = int(((owner == me) & (home != me) & r.kept).sum())
        assert got["forward all-to-alls"] == (dispatched + returned) * D_MODEL * 8, me
    totals = [got["forward all-to-alls"] for got in results]
    assert len(set(totals)) > 1, "the seeded router should spread tokens unevenly"


# --- what gloo offers, and what the layer refuses ------------------------------------------


def test_gloo_all_to_all_single_takes_uneven_splits_and_commcounter_counts_them(pools):
    results = pools(4).launch(torch_all_to_all, timeout=60)
    assert all(r["runs"] is True for r in results), results
    assert all(r["CommCounter"] == r["really sent"] for r in results), results
    # The splits matter: an even split of the same tensor would be another count.
    assert any(r["CommCounter"] != r["even model"] for r in results), results


def six_experts_on_my_ranks():
    return ExpertParallelMoE(MoE(D_MODEL, 8, 6))


def test_experts_that_do_not_divide_over_the_ranks_are_refused():
    with WorkerPool(4) as pool, pytest.raises(RankError, match="6 experts cannot be split evenly"):
        pool.launch(six_experts_on_my_ranks, timeout=60)


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="between 1 and 4 experts"):
        MoE(D_MODEL, 8, 4, k=5)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        MoE(D_MODEL, 8, 4, capacity_factor=0)
    moe = MoE(D_MODEL, 8, 4)
    with pytest.raises(ValueError, match=r"x.reshape\(-1, 16\)"):
        moe(torch.zeros(2, 3, D_MODEL, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\[tokens, d_model=16\]"):
        ExpertParallelMoE(moe)(torch.zeros(5, 8, dtype=torch.float64))


def test_step_times_compares_layers_of_the_same_size(pools):
    """EP and TP hold as many parameters but the router and E - 1 more output biases, and
    TP sends two all-reduces of the T x d activation (forward g, backward f)."""
    kw = dict(n_tokens=32, d_model=8, d_ff=4, n_experts=4, steps=2, bandwidth=1e12, latency=0.0)
    ep = pools(2).launch(step_times, "EP", **kw, timeout=60)
    tp = pools(2).launch(step_times, "TP", **kw, timeout=60)
    assert ep[0]["params"] - tp[0]["params"] == 4 * 8 + 3 * 8
    assert tp[0]["bytes"] == 2 * all_reduce_bytes(32 * 8 * 4, 2)
    assert all(len(r["times"]) == 2 and min(r["times"]) > 0 for r in ep + tp)


def test_a_step_is_timed_by_its_slowest_rank_and_summed_up_by_median_and_spread():
    # rank 0 took 1, 5, 2 s on its three steps, rank 1 2, 1, 3: the steps ended after 2, 5, 3
    runs = [{"EP": [{"times": [1.0, 5.0, 2.0]}]}, {"EP": [{"times": [2.0, 1.0, 3.0]}]}]
    assert step_spread(runs, "EP", 0) == (3.0, 2.0, 5.0)


# --- capacity against dropless, counted on a routing made by hand ---------------------------

# Eight tokens, four experts, top-2: token t chooses HAND[t] (most probable first). Choices per
# expert: 0 -> 7 (tokens 0-6), 1 -> 4 (0, 2, 4, 6), 2 -> 3 (1, 5, 7), 3 -> 2 (3, 7); T k = 16,
# an even share of 4.
HAND = [(0, 1), (0, 2), (0, 1), (0, 3), (1, 0), (2, 0), (0, 1), (3, 2)]


def routed_by_hand(choices=HAND, n_experts=4):
    """A layer whose router sends token t to choices[t], and those tokens: the router is the
    identity on the first E coordinates, and each token is large at its chosen experts."""
    moe = MoE(D_MODEL, 8, n_experts, k=2)
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(n_experts, D_MODEL, dtype=torch.float64))
    x = torch.zeros(len(choices), D_MODEL, dtype=torch.float64)
    for t, (first, second) in enumerate(choices):
        x[t, first], x[t, second] = 2.0, 1.5
    return moe, x


def test_the_hand_made_routing_is_the_one_the_layer_follows():
    moe, x = routed_by_hand()
    r = route(x, moe.router.weight.detach(), moe.k, 4.0)
    assert r.experts.tolist() == [list(c) for c in HAND]
    assert expert_rows(moe, x) == [5, 4, 3, 2]  # capacity factor 1.25: C = 5, expert 0 cut


def test_capacity_work_counts_drops_padding_and_the_largest_batch_as_worked_by_hand():
    """C = ceil(factor x 4). Factor 0.5: C = 2, every expert keeps 2 (8 rows, 8 dropped, no
    padding). 1: C = 4, keeps 4, 4, 3, 2 = 13 of 16 rows of 16 slots. 2: C = 8, keeps all 16
    of 32 slots. Dropless: all 16, no slots beyond them; the largest batch is expert 0's 7."""
    moe, x = routed_by_hand()
    work = capacity_work(moe, x, [0.5, 1.0, 2.0, DROPLESS])
    got = [
        (w["capacity"], w["computed"], w["dropped"], w["padded rows"], w["padding"]) for w in work
    ]
    assert got == [
        (2, 8, 8 / 16, 8, 0.0),
        (4, 13, 3 / 16, 16, 3 / 16),
        (8, 16, 0.0, 32, 16 / 32),
        (None, 16, 0.0, 16, 0.0),
    ]
    assert [w["largest batch"] for w in work] == [2, 4, 7, 7]
    assert {w["choices"] for w in work} == {16} and {w["even share"] for w in work} == {4.0}
    assert moe.capacity_factor == 1.25, "capacity_work must give the layer its factor back"


def test_dropless_on_the_lectures_router_drops_nothing_and_pads_nothing():
    moe, x = small_moe(), batch(256)
    chosen = torch.bincount(route(x, moe.router.weight.detach(), moe.k, 1.0).experts.flatten())
    (dropless,) = lecture_capacity_work([DROPLESS])
    assert dropless["dropped"] == 0.0 and dropless["padding"] == 0.0
    assert dropless["computed"] == dropless["padded rows"] == 256 * 2
    assert dropless["largest batch"] == chosen.max().item()


def test_the_no_drop_factor_check_takes_the_largest_batch_over_the_even_share(capsys):
    moe, x = routed_by_hand()
    work = capacity_work(moe, x, [1.0, DROPLESS])
    assert check_no_drop_factor(7 / 4, work) is True  # expert 0's 7 over the even share 4
    assert "✓ Right" in capsys.readouterr().out
    assert check_no_drop_factor(1.0, work) is False  # the even router's answer
    assert "the busiest expert's count" in capsys.readouterr().out
    assert check_no_drop_factor(..., work) is None


# --- the lecture's exercises, against numbers worked out by hand ------------------------------


def test_the_capacity_check_takes_the_even_share_with_a_quarter_more(capsys):
    assert check_capacity(1.25 * 4096 * 2 / 64) is True  # 1.25 x 128 = 160 tokens
    assert "✓ Right" in capsys.readouterr().out
    assert check_capacity(4096 * 2 / 64) is False  # the even share, without the headroom
    out = capsys.readouterr().out
    assert "the factor adds headroom" in out and "160" not in out
    assert check_capacity(...) is None
    assert "Not answered yet" in capsys.readouterr().out


def test_the_worst_balance_loss_check_takes_e(capsys):
    assert check_worst_balance_loss(8 * 1.0 * 1.0) is True  # E * f_0 * P_0, the rest 0
    assert "✓ Right" in capsys.readouterr().out
    assert check_worst_balance_loss(2) is False
    out = capsys.readouterr().out
    assert "f and P are 1 there" in out and "8" not in out
    assert check_worst_balance_loss(...) is None
    assert "Not answered yet" in capsys.readouterr().out


def test_the_ep_bytes_check_takes_two_all_to_alls_of_seven_eighths(capsys):
    """N = 4096 tokens x 2 choices x 4096 values x 2 bytes = 67,108,864; dispatch and combine
    each send 7/8 of it on 8 ranks."""
    assert check_ep_forward_bytes(2 * 67_108_864 * 7 / 8) is True
    assert "✓ Right" in capsys.readouterr().out
    assert check_ep_forward_bytes(2 * 67_108_864) is False  # the 1/8 kept at home sent too
    out = capsys.readouterr().out
    assert "each send (P-1)/P of it" in out and "1.174e+08" not in out
    assert check_ep_forward_bytes(...) is None
    assert "Not answered yet" in capsys.readouterr().out


def test_the_dropped_check_reads_the_share_at_factor_one(capsys):
    factors, shares = [0.5, 1.0, 2.0], [0.5, 0.12, 0.0]  # made up: 12% dropped at 1.0
    assert check_dropped_at_one("10% to 30%", factors, shares) is True
    assert "only their excess" in capsys.readouterr().out
    assert check_dropped_at_one("none", factors, shares) is False  # the perfectly even router
    assert check_dropped_at_one(..., factors, shares) is None


def test_the_ep_or_tp_check_takes_each_bandwidths_faster_median_or_both_when_close(capsys):
    bandwidths = [125e6, 12.5e6, 1.25e6]
    spread = {  # made-up (median, fastest, slowest) seconds: TP ahead at 1 Gbit/s, EP at 10
        "EP": [(0.10, 0.09, 0.12), (0.2, 0.2, 0.2), (0.5, 0.5, 0.6)],
        "TP": [(0.05, 0.05, 0.06), (0.2, 0.2, 0.2), (0.9, 0.9, 1.0)],
    }
    assert check_faster_ep_or_tp("EP", "TP", bandwidths, spread) == (True, True)
    assert "the time at high bandwidth is fixed costs" in capsys.readouterr().out
    assert check_faster_ep_or_tp("TP", "EP", bandwidths, spread) == (False, False)
    assert check_faster_ep_or_tp(..., ..., bandwidths, spread) == (None, None)
    spread["TP"][0] = (0.11, 0.1, 0.12)  # within 20% of EP's: either counts
    assert check_faster_ep_or_tp(..., "TP", bandwidths, spread) == (None, True)
    assert check_faster_ep_or_tp(..., "EP", bandwidths, spread) == (None, True)
