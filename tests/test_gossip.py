"""course_lib.gossip and course_lib.measure.gossip: topologies, gossip rounds over
point-to-point messages, push-sum in one process, group all-reduce, the asynchronous push-sum,
stale-gradient SGD and the training loops.

References are independent of the code under test: torch.distributed's own all-reduce and
all-gather for sums and means, the mixing matrix applied in one process, and single-process
SGD (`compare.train`). Sums and means are checked in fp64 to 1e-12; training in fp32 to 1e-6
(split and whole batches differ by rounding only, ~1e-7).
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import RankError, WorkerPool, compare, data, models, rank
from course_lib.data_parallel import flat_parameters
from course_lib.gossip import (
    AsyncPushSum,
    ExponentialGraph,
    GroupAllReduce,
    RandomGroups,
    RandomPeer,
    Ring,
    contraction_rate,
    gossip_round,
    push_mixing_matrix,
    regular_degree,
    simulate_consensus,
    simulate_push_sum,
)
from course_lib.measure.gossip import (
    check_first_to_agree,
    check_non_iid_gossip,
    check_random_peer_plain_agrees,
    check_ring_of_5,
    check_rounds_for_1000x,
    class_sharded_batches,
    contraction_by_size,
    parameter_server,
    plot_contraction,
    plot_mixing_matrices,
    stale_sgd,
    synchronous_server,
    train_decentralized,
)

P = 4
SIZES = (8, 16, 4)


@pytest.fixture(scope="module")
def pool4():
    with WorkerPool(P) as pool:
        yield pool


def start_values(r: int, n: int = 5) -> torch.Tensor:
    """Different fp64 values on every rank, from a seed per rank."""
    return torch.randn(n, generator=torch.Generator().manual_seed(100 + r), dtype=torch.float64)


# --- topologies ----------------------------------------------------------------------------


def test_ring_neighbours():
    assert Ring(4).out_neighbors(0) == [1, 3]
    assert Ring(4).in_neighbors(2) == [1, 3]
    assert Ring(2).out_neighbors(0) == [1]  # left and right are the same rank
    assert Ring(1).out_neighbors(0) == []


def test_exponential_graph_cycles_over_powers_of_two():
    g = ExponentialGraph(8)
    assert g.hops() == [1, 2, 4] and g.period() == 3
    assert [g.out_neighbors(0, s) for s in range(4)] == [[1], [2], [4], [1]]
    assert [g.in_neighbors(0, s) for s in range(3)] == [[7], [6], [4]]
    assert g.all_out_neighbors(5) == [1, 6, 7]
    assert ExponentialGraph(5).hops() == [1, 2, 4]  # 2^k up to floor(log2(P - 1))
    assert ExponentialGraph(4).hops() == [1, 2]
    assert ExponentialGraph(2).hops() == [1]


@pytest.mark.parametrize("topology", [RandomPeer(6, seed=3), RandomGroups(6, 2, seed=3)])
def test_in_neighbours_are_the_reverse_of_out_neighbours(topology):
    for step in range(5):
        edges = {(i, j) for i in range(6) for j in topology.out_neighbors(i, step)}
        assert all(i != j for i, j in edges)
        reverse = {(i, j) for j in range(6) for i in topology.in_neighbors(j, step)}
        assert edges == reverse


def test_random_groups_split_every_rank_once_and_change():
    topology = RandomGroups(8, group_size=4, seed=1)
    splits = [topology.groups(step) for step in range(6)]
    for groups in splits:
        assert sorted(r for g in groups for r in g) == list(range(8))
        assert all(len(g) == 4 for g in groups)
    assert len({tuple(s) for s in splits}) > 1, "the groups should be re-drawn between steps"
    with pytest.raises(ValueError, match="divide the world size"):
        RandomGroups(6, group_size=4)


@pytest.mark.parametrize("topology", [Ring(5), ExponentialGraph(6), RandomPeer(5)])
def test_mixing_matrices_are_column_stochastic(topology):
    for step in range(3):
        w = topology.mixing_matrix(step)
        torch.testing.assert_close(w.sum(dim=0), torch.ones(w.shape[0], dtype=w.dtype))


def test_push_mixing_matrix_of_an_irregular_graph():
    # rank 0 sends to 1 and 2, rank 1 to 2, rank 2 to nobody: shares 1/3, 1/2 and 1
    w = push_mixing_matrix([[1, 2], [2], []])
    third = 1 / 3
    expected = [[third, 0.0, 0.0], [third, 0.5, 0.0], [third, 0.5, 1.0]]
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float64))
    ring = Ring(5)
    assert ring.out_neighbor_lists() == [ring.out_neighbors(j) for j in range(5)]
    torch.testing.assert_close(push_mixing_matrix(ring.out_neighbor_lists()), ring.mixing_matrix())


def test_contraction_rate_of_a_symmetric_mixing_is_its_second_eigenvalue_modulus():
    ring = Ring(8).mixing_matrix()  # symmetric: the norm is the second eigenvalue modulus
    second = sorted(torch.linalg.eigvals(ring).abs().tolist())[-2]
    assert contraction_rate(Ring(8)) == pytest.approx(second, abs=1e-12)


def test_exponential_graph_averages_exactly_in_log2_p_rounds():
    errors = simulate_consensus(ExponentialGraph(8), torch.randn(8, 3), rounds=3, push_sum=False)
    assert errors[0] > 0.1 and errors[3] < 1e-12


def push_sum_by_the_formula(topology, x0, rounds):
    """Push-sum rank by rank, as SGP writes it: x_i' = x_i / (d_i + 1) plus the shares
    x_j / (d_j + 1) of the ranks j that send to i; the same for w."""
    p = x0.shape[0]
    x, w = [row.double() for row in x0], [torch.ones((), dtype=torch.float64)] * p
    for step in range(rounds):
        new_x, new_w = [], []
        for i in range(p):
            senders = [j for j in range(p) if i in topology.out_neighbors(j, step)]
            keep = 1 + len(topology.out_neighbors(i, step))
            new_x.append(
                x[i] / keep
                + sum(x[j] / (1 + len(topology.out_neighbors(j, step))) for j in senders)
            )
            new_w.append(
                w[i] / keep
                + sum(w[j] / (1 + len(topology.out_neighbors(j, step))) for j in senders)
            )
        x, w = new_x, new_w
    return torch.stack(x), torch.stack(w).reshape(p, 1)


@pytest.mark.parametrize("topology", [RandomPeer(6, seed=0), ExponentialGraph(6)])
def test_simulate_push_sum_is_push_sum_rank_by_rank(topology):
    x0 = torch.randn(6, 2, dtype=torch.float64)
    history = simulate_push_sum(topology, x0, 7)
    assert len(history) == 8
    for t in (0, 1, 7):
        x, w = push_sum_by_the_formula(topology, x0, t)
        torch.testing.assert_close(history[t][0], x, rtol=0, atol=1e-12, msg=f"x, round {t}")
        torch.testing.assert_close(history[t][1], w, rtol=0, atol=1e-12, msg=f"w, round {t}")
        torch.testing.assert_close(x.sum(0), x0.sum(0), rtol=0, atol=1e-12)  # totals kept
        assert w.sum().item() == pytest.approx(6, abs=1e-12)


def test_plain_averaging_is_biased_on_a_random_peer_graph_and_push_sum_is_not():
    x0 = torch.randn(6, 2, dtype=torch.float64)
    x, w = simulate_push_sum(RandomPeer(6, seed=0), x0, 60)[-1]
    torch.testing.assert_close(x / w, x0.mean(0).expand(6, 2), rtol=0, atol=1e-8)
    assert (x.mean(0) - x0.mean(0)).abs().max() < 1e-12  # the total is conserved...
    assert (x - x0.mean(0)).abs().max() > 1e-3  # ...but x alone does not reach the average
    assert (w - 1).abs().max() > 1e-3  # the weights measure that bias


def test_regular_degree_is_the_common_degree_and_refuses_an_irregular_round():
    assert regular_degree(Ring(5)) == 2 and regular_degree(Ring(2)) == 1
    assert all(regular_degree(ExponentialGraph(8), s) == 1 for s in range(3))
    assert regular_degree(RandomGroups(8, 4, seed=1), 2) == 3
    irregular = RandomPeer(4, seed=2)
    degrees = {len(irregular.in_neighbors(j, 0)) for j in range(4)}
    assert len(degrees) > 1  # some rank receives two copies, some none
    with pytest.raises(ValueError, match="push-sum's weights"):
        regular_degree(irregular, 0)


# --- rounds over point-to-point messages ---------------------------------------------------


def gossip_rounds(topology, rounds):
    x = start_values(rank())
    start_mean = x.clone()
    dist.all_reduce(start_mean)
    start_mean /= P
    history = [x]
    for step in range(rounds):
        history.append(gossip_round(history[-1], topology, step))
    return start_mean, history


@pytest.mark.parametrize("topology", [Ring(P), ExponentialGraph(P)], ids=["ring", "expo"])
def test_gossip_round_keeps_the_mean_and_equals_the_mixing_matrix(pool4, topology):
    results = pool4.launch(gossip_rounds, topology, 3, timeout=60)
    start_mean = results[0][0]
    x = torch.stack([start_values(r) for r in range(P)])
    for step in range(3):
        x = topology.mixing_matrix(step) @ x  # the same round, computed in one process
        got = torch.stack([history[step + 1] for _, history in results])
        torch.testing.assert_close(got, x, rtol=0, atol=1e-12)
        torch.testing.assert_close(got.mean(dim=0), start_mean, rtol=0, atol=1e-12)


def gossip_irregular():
    return gossip_round(start_values(rank()), RandomPeer(P, seed=2), 0)


def test_gossip_round_refuses_an_irregular_round_on_every_rank(pool4):
    with pytest.raises(RankError, match="push-sum's weights"):
        pool4.launch(gossip_irregular, timeout=60)


def group_average(steps):
    groups = GroupAllReduce(RandomGroups(P, group_size=2, seed=5))
    out = []
    for step in range(steps):
        x = start_values(rank()) * (step + 1)
        everyone = [torch.empty_like(x) for _ in range(P)]
        dist.all_gather(everyone, x)
        members = groups.topology.group_of(rank(), step)
        expected = torch.stack([everyone[j] for j in members]).mean(dim=0)
        out.append((members, groups.average(x.clone(), step), expected))
    return out


def test_group_all_reduce_averages_within_the_drawn_groups(pool4):
    results = pool4.launch(group_average, 4, timeout=60)
    drawn = set()
    for r, steps in enumerate(results):
        for step, (members, got, expected) in enumerate(steps):
            assert r in members and len(members) == 2
            drawn.add((step, members))
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-12, msg=f"rank {r}")
    assert len({m for _, m in drawn}) > 2, "the same groups every step: are they re-drawn?"


def async_push_sum(seconds, rounds=10):
    x0 = start_values(rank(), n=3)
    pusher = AsyncPushSum(ExponentialGraph(P), x0, interval=0.001)
    if rank() == 2:
        time.sleep(seconds)  # a slow rank: the others keep gossiping meanwhile
    # At least `rounds` rounds before the step, however loaded the machine (a fixed sleep
    # gave some rank only 5 under load): the test is about what gossip keeps, not its pace.
    deadline = time.monotonic() + 30
    while pusher.rounds < rounds and time.monotonic() < deadline:
        time.sleep(0.005)
    pusher.step(torch.full_like(x0, 0.5))  # one "gradient step" per rank
    x, w = pusher.finish()
    totals = torch.cat([x, w.reshape(1), x0]).clone()
    dist.all_reduce(totals)
    return totals, pusher.rounds, x / w


def test_async_push_sum_conserves_the_totals(pool4):
    results = pool4.launch(async_push_sum, 0.1, timeout=60)
    totals = results[0][0]
    x, w, x0 = totals[:3], totals[3], totals[4:]
    # Each rank subtracted w * 0.5 from x at some moment: the total of x moved by 0.5 times
    # the weights held then, which we cannot know; but the weights' total is exact.
    assert w.item() == pytest.approx(P, abs=1e-12)
    assert all(rounds >= 10 for _, rounds, _ in results), "the gossip thread did not run"
    # The ranks' estimates agree more than their starting values did.
    spread = torch.stack([z for _, _, z in results]).std(dim=0).max()
    assert spread < torch.stack([start_values(r, 3) for r in range(P)]).std(dim=0).max()
    assert torch.isfinite(x).all() and torch.isfinite(x0).all()


# --- stale gradients -------------------------------------------------------------------------


def regression_batches(steps=6):
    x, y = data.regression(128, in_dim=SIZES[0], out_dim=SIZES[-1])
    return data.batches(x, y, 16, steps)


def sgd_reference():
    model = models.MLP(SIZES)
    compare.train(
        model, regression_batches(), F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1)
    )
    return model


def test_stale_sgd_with_zero_staleness_is_plain_sgd():
    model = models.MLP(SIZES)
    stale_sgd(model, regression_batches(), F.mse_loss, lr=0.1, staleness=0)
    compare.assert_same_parameters(model, sgd_reference(), rtol=0, atol=1e-6)
    stale = models.MLP(SIZES)
    stale_sgd(stale, regression_batches(), F.mse_loss, lr=0.1, staleness=2)
    assert compare.find_mismatch(stale, sgd_reference(), rtol=0, atol=1e-6) is not None


def test_parameter_server_with_one_worker_is_plain_sgd():
    model = models.MLP(SIZES)
    x, y = data.regression(64, in_dim=SIZES[0], out_dim=SIZES[-1])
    log = parameter_server(model, regression_batches(), F.mse_loss, 0.1, [1.0], (x, y))
    assert log.staleness == [0] * 6 and log.time == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    compare.assert_same_parameters(model, sgd_reference(), rtol=0, atol=1e-6)


def test_parameter_server_staleness_grows_with_the_number_of_workers():
    model = models.MLP(SIZES)
    x, y = data.regression(64, in_dim=SIZES[0], out_dim=SIZES[-1])
    log = parameter_server(model, regression_batches(12), F.mse_loss, 0.1, [1.0] * 3, (x, y))
    assert log.staleness[:3] == [0, 1, 2] and set(log.staleness[3:]) == {2}


# --- training loops ------------------------------------------------------------------------


def decentralized(method, **kwargs):
    model = models.MLP(SIZES)
    log = train_decentralized(method, model, regression_batches(), F.mse_loss, 0.1, **kwargs)
    return log, flat_parameters(model)


def test_allreduce_method_matches_single_process_sgd(pool4):
    results = pool4.launch(decentralized, "allreduce", timeout=60)
    reference = flat_parameters(sgd_reference())
    for r, (log, params) in enumerate(results):
        torch.testing.assert_close(params, reference, rtol=0, atol=1e-6, msg=f"rank {r}")
        assert len(log.losses) == 6


def spread_without_communication():
    """How far apart the ranks' models end when each trains on its shards alone."""
    finals = []
    for r in range(P):
        model = models.MLP(SIZES)
        shards = [(data.shard(x, r, P), data.shard(y, r, P)) for x, y in regression_batches()]
        compare.train(model, shards, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1))
        finals.append(flat_parameters(model))
    return torch.stack(finals).std(dim=0).max().item()


@pytest.mark.parametrize("method", ["gossip", "sgp", "group"])
def test_decentralized_methods_keep_the_copies_together(pool4, method):
    # Same data, same steps: the average follows all-reduce SGD, and mixing keeps the copies
    # much closer together than training each shard alone would.
    results = pool4.launch(decentralized, method, timeout=60)
    finals = torch.stack([params for _, params in results])
    reference = flat_parameters(sgd_reference())
    assert (finals.mean(dim=0) - reference).abs().max() < 0.05
    assert finals.std(dim=0).max().item() < 0.75 * spread_without_communication()
    for log, _ in results:
        assert all(torch.isfinite(torch.tensor(log.losses)))


def test_async_sgp_trains_near_all_reduce_sgd(pool4):
    # How much the copies mix in 6 fast steps depends on thread timing; their average does not
    # stray far from all-reduce SGD, and nothing blows up.
    results = pool4.launch(decentralized, "async_sgp", timeout=60)
    finals = torch.stack([params for _, params in results])
    assert torch.isfinite(finals).all()
    assert (finals.mean(dim=0) - flat_parameters(sgd_reference())).abs().max() < 0.1


def test_sgp_on_the_exponential_graph_sends_one_copy_and_keeps_every_weight_at_one(pool4):
    # Every rank receives exactly one share per round: w stays (1 + 1) / 2 = 1, and the
    # round is the gossip round of the directed graph, one copy of the model (fp32) a step.
    results = pool4.launch(decentralized, "sgp", timeout=60)
    size = models.count_parameters(models.MLP(SIZES))
    for log, _ in results:
        assert log.weights == [1.0] * len(log.losses)
        assert log.bytes_sent == [4 * size] * len(log.losses)


def test_synchronous_methods_refuse_a_time_budget(pool4):
    with pytest.raises(RankError, match="cannot stop on a per-rank time budget"):
        pool4.launch(decentralized, "gossip", max_seconds=1.0, timeout=60)


def test_synchronous_server_averages_one_gradient_per_worker():
    # Two workers with batches of 8 each, averaged: the same as SGD on batches of 16.
    x, y = data.regression(128, in_dim=SIZES[0], out_dim=SIZES[-1])
    halves = [(bx[i : i + 8], by[i : i + 8]) for bx, by in regression_batches() for i in (0, 8)]
    model = models.MLP(SIZES)
    log = synchronous_server(model, halves, F.mse_loss, 0.1, [1.0, 2.5], (x, y))
    assert log.time == [2.5 * k for k in range(1, 7)]
    compare.assert_same_parameters(model, sgd_reference(), rtol=0, atol=1e-6)


# --- lecture 4's figures: mixing matrices and lambda against P -----------------------------


def test_contraction_by_size_is_the_ring_formula_and_zero_for_exact_averaging():
    sizes = [4, 5, 8, 16]
    rates = contraction_by_size({"ring": Ring, "expo": ExponentialGraph}, sizes)
    for p, rate in zip(sizes, rates["ring"], strict=True):
        assert rate == pytest.approx(1 / 3 + 2 / 3 * math.cos(2 * math.pi / p), abs=1e-6)
    assert rates["expo"][0] == rates["expo"][2] == rates["expo"][3] == 0.0  # exact in log2 P
    assert 0 < rates["expo"][1] < 1  # P = 5: not exact, but it mixes


def test_mixing_matrix_heatmaps_draw_the_matrices_given():
    matrices = {"ring": Ring(8).mixing_matrix(), "expo": ExponentialGraph(8).mixing_matrix(1)}
    fig = plot_mixing_matrices(matrices)
    for ax, w in zip(fig.axes, matrices.values(), strict=False):
        assert torch.equal(torch.as_tensor(ax.images[0].get_array()), w)
        assert len(ax.texts) == int((w > 0).sum())  # each nonzero entry written in
    lines = plot_contraction([4, 8], {"ring": [0.3, 0.8]}).axes[0].lines
    assert list(lines[0].get_ydata()) == [0.3, 0.8]


def test_class_sharded_batches_give_rank_r_only_class_r():
    x, y = data.classification(400, dim=3, classes=4, seed=5)
    batches = class_sharded_batches(x, y, 8, 5, world_size=4)
    assert len(batches) == 5
    for xb, yb in batches:
        assert xb.shape == (8, 3)
        for r in range(4):  # the launcher's shard of rank r: its class only, and its own rows
            shard_y = data.shard(yb, r, 4)
            assert shard_y.tolist() == [r, r]
            rows = data.shard(xb, r, 4)
            assert all(any(torch.equal(row, xi) for xi in x[y == r]) for row in rows)
    with pytest.raises(ValueError, match="one class per rank"):
        class_sharded_batches(x, y, 8, 1, world_size=2)
    with pytest.raises(ValueError, match="splits evenly"):
        class_sharded_batches(x, y, 6, 1, world_size=4)


# --- lecture 4's exercises, checked off the page ---------------------------------------------


def test_the_ring_of_5_exercise_is_checked_entry_by_entry(capsys):
    # by hand: rank j keeps 1/3 and pushes 1/3 to j - 1 and j + 1 (mod 5)
    ring = [[1 / 3 if (i - j) % 5 in (0, 1, 4) else 0.0 for j in range(5)] for i in range(5)]
    assert check_ring_of_5(ring) is True
    assert "✓ Right: all 25 entries" in capsys.readouterr().out
    halves = [
        [{0: 0.5, 1: 0.25, 4: 0.25}.get((i - j) % 5, 0.0) for j in range(5)] for i in range(5)
    ]
    assert check_ring_of_5(halves) is False
    out = capsys.readouterr().out
    assert "15 entries wrong" in out and "Row i holds the shares rank i receives." in out
    assert "0.333" not in out and "1/3" not in out
    assert check_ring_of_5(...) is None
    assert "Not answered yet" in capsys.readouterr().out


def test_the_rounds_for_1000x_exercise_is_checked_off_the_page(capsys):
    # by hand: the ring's lambda is 1/3 + 2/3 cos(2 pi / P); lambda**t = 1/1000 at t = 132.6
    lam = 1 / 3 + 2 / 3 * math.cos(2 * math.pi / 16)
    assert check_rounds_for_1000x(math.log(1000) / -math.log(lam)) is True
    assert "✓ Right: 132.6 rounds" in capsys.readouterr().out
    assert check_rounds_for_1000x(1000) is False
    out = capsys.readouterr().out
    assert "7.5x too large" in out and "Solve lambda**t = 1/1000 for t" in out
    assert "132" not in out and "133" not in out
    assert check_rounds_for_1000x(...) is None
    assert "Not answered yet" in capsys.readouterr().out


# Made-up consensus errors per round (4 rounds): the exponential graph reaches 1e-12 at round 2,
# random groups at 3, the ring never; plain averaging on random peers stalls.
CURVES = {
    "ring": [1.0, 0.8, 0.6, 0.5, 0.4],
    "exponential graph": [1.0, 0.5, 1e-16, 1e-16, 1e-16],
    "random groups of 2": [1.0, 0.5, 0.1, 1e-13, 1e-16],
    "random peer, plain x": [1.0, 0.3, 0.2, 0.2, 0.2],
}


def test_the_first_to_agree_check_counts_the_rounds_to_rounding(capsys):
    assert check_first_to_agree("exponential graph", CURVES) is True
    out = capsys.readouterr().out
    assert "ring never, exponential graph 2, random groups of 2 3" in out
    assert "doubles the window" in out
    assert check_first_to_agree("random groups of 2", CURVES) is False
    assert check_first_to_agree(..., CURVES) is None


def test_the_random_peer_check_reads_the_last_error_of_plain_averaging(capsys):
    assert check_random_peer_plain_agrees("no", CURVES) is True
    assert "Its rows do not sum to 1" in capsys.readouterr().out
    assert check_random_peer_plain_agrees("yes", CURVES) is False
    agreeing = {**CURVES, "random peer, plain x": [1.0, 1e-3, 1e-9]}
    assert check_random_peer_plain_agrees("yes", agreeing) is True
    assert check_random_peer_plain_agrees(..., CURVES) is None


def test_the_non_iid_check_divides_gossips_loss_by_all_reduces(capsys):
    copy_loss = {  # made up: gossip 1.6x worse on class-sharded data, 1.02x on IID
        ("IID", "allreduce"): 0.50,
        ("IID", "gossip"): 0.51,
        ("class-sharded", "allreduce"): 0.50,
        ("class-sharded", "gossip"): 0.80,
    }
    assert check_non_iid_gossip("clearly worse", copy_loss) is True
    assert "1.60x all-reduce's with class-sharded data" in capsys.readouterr().out
    assert check_non_iid_gossip("about the same", copy_loss) is False
    assert check_non_iid_gossip(..., copy_loss) is None
