"""course_lib.collectives: four all-reduces against dist.all_reduce, their byte formulas
against CommCounter, the ring schedule against the ring's real data, and the ring's picture
(course_lib.measure.collectives) against the schedule."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from matplotlib.figure import Figure
from matplotlib.text import Annotation

from course_lib import CommCounter, RankError, WorkerPool, launch, rank, world_size
from course_lib.collectives import (
    ALGORITHMS,
    ALL_GATHER,
    REDUCE_SCATTER,
    bytes_sent,
    chunk_sizes,
    halving_doubling_rounds,
    halving_round,
    messages_sent,
    model_seconds,
    ring_all_reduce,
    ring_schedule,
    ring_state,
    ring_step,
    two_level_all_reduce,
)
from course_lib.costs import two_level_all_reduce_seconds
from course_lib.measure.collectives import (
    PHASE_COLOURS,
    AllReduceModelWidget,
    RingWidget,
    check_crossover,
    check_faster_on_two_nodes,
    check_fastest_at_4kB,
    check_naive_over_ring_at_16MB,
    crossovers,
    draw_ring_frame,
    plot_all_reduce_sweep,
    record_peers,
    ring_frame,
    ring_steps_figure,
    sweep_all_reduce,
    time_against_model,
    time_all_reduce,
    two_level_model,
)

# Tolerances against dist.all_reduce. The algorithms add the same numbers in another order, so
# float results differ by rounding only: in float64 by ~1e-15 on sums of size ~4, and in float32
# by a few ulps (torch's own float32 defaults, rtol 1.3e-6 / atol 1e-5, leave 10x headroom).
TOLERANCE = {
    torch.float64: dict(rtol=0.0, atol=1e-12),
    torch.float32: dict(rtol=1.3e-6, atol=1e-5),
}


def shapes(p: int) -> list[tuple[int, ...]]:
    """Awkward sizes: empty, one element, fewer than P, P +- 1, not divisible by P, 2-D."""
    return [(0,), (1,), (max(p - 1, 1),), (p,), (p + 1,), (2 * p + 1,), (1000,), (3, 5)]


def algorithms_for(p: int) -> list[str]:
    power_of_two = p & (p - 1) == 0
    return [a for a in ALGORITHMS if power_of_two or a not in ("butterfly", "halving_doubling")]


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda p: f"P={p}")
def pool(request):
    with WorkerPool(request.param) as pool:
        yield pool


def seeded_input(shape, dtype, case: int) -> torch.Tensor:
    """A different tensor on every rank and for every case, the same on every run."""
    g = torch.Generator().manual_seed(1000 * case + rank())
    if dtype == torch.int64:
        return torch.randint(-(10**6), 10**6, shape, generator=g)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def run_cases(cases):
    """On each rank: every (algorithm, shape, dtype), with the result of dist.all_reduce on
    the same input, and what CommCounter saw."""
    out = []
    for i, (algorithm, shape, dtype) in enumerate(cases):
        x = seeded_input(shape, dtype, i)
        expected = x.clone()
        dist.all_reduce(expected)
        with CommCounter() as counter:
            returned = ALGORITHMS[algorithm](x)
        sends = counter.calls["send"] + counter.calls["isend"]
        out.append((x, expected, returned is x, counter.bytes_sent, counter.bytes_received, sends))
    return out


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.float32], ids=str)
def test_every_algorithm_equals_dist_all_reduce(pool, dtype):
    p = pool.world_size
    cases = [(a, s, dtype) for a in algorithms_for(p) for s in shapes(p)]
    per_rank = pool.launch(run_cases, cases, timeout=60)
    for i, (algorithm, shape, _) in enumerate(cases):
        where = f"{algorithm} all-reduce, P={p}, shape {shape}, {dtype}"
        for r in range(p):
            got, expected, in_place = per_rank[r][i][:3]
            assert in_place, f"{where}: must work in place and return its argument"
            assert got.shape == expected.shape, where
            if dtype == torch.int64:
                assert torch.equal(got, expected), f"{where}, rank {r}: not the exact sum"
            else:
                torch.testing.assert_close(got, expected, **TOLERANCE[dtype], msg=where)
            # Replicas must stay identical bit for bit, or data-parallel models drift apart.
            assert torch.equal(got, per_rank[0][i][0]), f"{where}: rank {r} differs from rank 0"


def test_bytes_and_messages_per_rank_follow_the_formulas(pool):
    p = pool.world_size
    cases = [(a, s, torch.float32) for a in algorithms_for(p) for s in shapes(p)]
    cases += [(a, (12,), torch.float64) for a in algorithms_for(p)]  # 8-byte elements
    per_rank = pool.launch(run_cases, cases, timeout=60)
    for i, (algorithm, shape, dtype) in enumerate(cases):
        numel, size = math.prod(shape), torch.tensor([], dtype=dtype).element_size()
        for r in range(p):
            sent, received, sends = per_rank[r][i][3:]
            where = f"{algorithm}, P={p}, rank {r}, {numel} elements"
            assert sent == bytes_sent(algorithm, numel, p, r, size), where
            assert sends == messages_sent(algorithm, numel, p, r), where
        # What is sent is received: totals over the ranks match.
        assert sum(x[i][3] for x in per_rank) == sum(x[i][4] for x in per_rank)


def test_formulas_match_the_textbook_when_p_divides_n():
    n = 8 * 3 * 5 * 7  # elements, divisible by every P below
    for p in (2, 3, 4, 5, 7, 8):
        nbytes = 4 * n
        assert bytes_sent("ring", n, p, 0) == 2 * (p - 1) * nbytes // p
        assert bytes_sent("naive", n, p, 0) == (p - 1) * nbytes  # the root
        assert bytes_sent("naive", n, p, p - 1) == nbytes
        assert max(bytes_sent("tree", n, p, r) for r in range(p)) <= 3 * nbytes
        assert messages_sent("ring", n, p, 1) == 2 * (p - 1)
        if p in (2, 4, 8):
            assert bytes_sent("butterfly", n, p, 1) == int(math.log2(p)) * nbytes
            # halving-doubling: the ring's bytes in the butterfly's rounds, each way
            assert bytes_sent("halving_doubling", n, p, 1) == 2 * (p - 1) * nbytes // p
            assert messages_sent("halving_doubling", n, p, 1) == 2 * int(math.log2(p))
    # the ring's per-rank volume stays under 2N while the naive root's grows with P
    assert bytes_sent("ring", n, 8, 0) < 2 * 4 * n < bytes_sent("naive", n, 8, 0)


def test_formulas_reject_bad_arguments():
    with pytest.raises(ValueError, match="power-of-two"):
        bytes_sent("butterfly", 10, 3, 0)
    with pytest.raises(ValueError, match="halving_doubling_all_reduce needs a power-of-two"):
        messages_sent("halving_doubling", 10, 6, 0)
    with pytest.raises(ValueError, match="one of"):
        bytes_sent("star", 10, 4, 0)
    with pytest.raises(ValueError, match="rank"):
        messages_sent("ring", 10, 4, 4)


def butterfly_on_three():
    from course_lib.collectives import butterfly_all_reduce

    butterfly_all_reduce(torch.ones(4))


def test_butterfly_refuses_a_world_size_that_is_not_a_power_of_two():
    with pytest.raises(RankError) as error:
        launch(butterfly_on_three, world_size=3, timeout=30)
    assert error.value.exc_type == "ValueError"
    assert "power-of-two" in str(error.value) and "got 3" in str(error.value)


def test_a_non_contiguous_tensor_is_refused_clearly():
    for algorithm in ALGORITHMS.values():
        with pytest.raises(ValueError, match="contiguous"):
            algorithm(torch.ones(4, 3).t())


# --- the ring's schedule ---------------------------------------------------------------------


@pytest.mark.parametrize("p", range(1, 9))
def test_schedule_has_two_phases_of_p_minus_1_steps_between_neighbours(p):
    schedule = ring_schedule(p)
    assert [s.phase for s in schedule] == [REDUCE_SCATTER] * (p - 1) + [ALL_GATHER] * (p - 1)
    for step in schedule:
        for r in range(p):
            # what rank r sends is what its right neighbour expects to receive
            assert step.recv[(r + 1) % p] == step.send[r]
    for phase in (REDUCE_SCATTER, ALL_GATHER):
        sent = [[s.send[r] for s in schedule if s.phase == phase] for r in range(p)]
        assert all(len(set(chunks)) == len(chunks) for chunks in sent), "a chunk sent twice"


@pytest.mark.parametrize("p", range(1, 9))
def test_schedule_reduces_each_chunk_once_then_spreads_it(p):
    for k, step in enumerate(ring_schedule(p)[: p - 1]):
        before = ring_state(p, k)
        for r in range(p):  # never add a contribution already there (that would double it)
            chunk = step.recv[r]
            assert not before[r][chunk] & before[(r - 1) % p][chunk], (p, k, r)
    everyone = frozenset(range(p))
    half = ring_state(p, p - 1)
    for c in range(p):
        owners = [r for r in range(p) if half[r][c] == everyone]
        assert owners == [c], f"P={p}: chunk {c} fully reduced on ranks {owners}, expected [{c}]"
    done = ring_state(p, 2 * (p - 1))
    assert all(chunk == everyone for row in done for chunk in row)


def test_schedule_rejects_steps_out_of_range():
    with pytest.raises(ValueError, match="step"):
        ring_step(4, 6)
    with pytest.raises(ValueError, match="steps_done"):
        ring_state(4, 7)


def ring_digits(steps):
    """Rank r contributes 10**r to every element: the digits of a partial sum say whose
    contributions it holds, and a digit above 1 would mean one was added twice."""
    t = torch.full((2 * world_size(),), 10 ** rank(), dtype=torch.int64)
    ring_all_reduce(t, steps=steps)
    return [int(chunk[0]) for chunk in t.tensor_split(world_size())]


def test_the_ring_holds_what_the_schedule_says_after_every_step(pool):
    p = pool.world_size
    for k in range(2 * (p - 1) + 1):
        per_rank = pool.launch(ring_digits, k, timeout=30)
        for r, values in enumerate(per_rank):
            for c, value in enumerate(values):
                digits = [int(d) for d in str(value)[::-1]]
                assert set(digits) <= {0, 1}, f"step {k}: rank {r} chunk {c} = {value}"
                held = frozenset(i for i, d in enumerate(digits) if d == 1)
                assert held == ring_state(p, k)[r][c], f"P={p}, {k} steps, rank {r}, chunk {c}"


def test_chunk_sizes_cover_n_like_tensor_split():
    for n in range(0, 12):
        for p in range(1, 6):
            expected = [len(c) for c in torch.arange(n).tensor_split(p)]
            assert chunk_sizes(n, p) == expected


# --- who talks to whom, time ------------------------------------------------------------


def peers_of(algorithm, counter_outside):
    t = torch.ones(10)
    if counter_outside:
        with CommCounter() as counter, record_peers() as peers:
            ALGORITHMS[algorithm](t)
    else:
        with record_peers() as peers, CommCounter() as counter:
            ALGORITHMS[algorithm](t)
    restored = not hasattr(dist.isend, "__wrapped_by_course_lib__")
    return dict(peers), sum(peers.values()), sum(counter.calls.values()), restored


@pytest.mark.parametrize("counter_outside", [True, False])
def test_the_ring_talks_to_neighbours_only_and_the_naive_root_to_everyone(counter_outside):
    p = 4
    ring = launch(peers_of, "ring", counter_outside, world_size=p, timeout=30)
    naive = launch(peers_of, "naive", counter_outside, world_size=p, timeout=30)
    for r, (peers, messages, counted, restored) in enumerate(ring):
        assert set(peers) == {(r - 1) % p, (r + 1) % p}
        assert messages == counted == 4 * (p - 1), "2(P-1) sends and 2(P-1) receives"
        assert restored
    assert set(naive[0][0]) == {1, 2, 3}
    assert all(set(peers) == {0} for peers, *_ in naive[1:])


def test_time_all_reduce_times_each_algorithm(pool):
    p = pool.world_size
    for algorithm in ["torch", *algorithms_for(p)]:
        seconds = pool.launch(time_all_reduce, algorithm, 100, 1, timeout=30)
        assert all(0 < s < 10 for s in seconds), (algorithm, seconds)


def test_alpha_beta_model():
    n, alpha, beta = 10**6, 1e-5, 1e-9
    one_message = alpha + 4 * n * beta
    assert model_seconds("naive", n, 4, alpha, beta) == pytest.approx(6 * one_message)
    assert model_seconds("tree", n, 4, alpha, beta) == pytest.approx(6 * one_message)
    assert model_seconds("butterfly", n, 4, alpha, beta) == pytest.approx(2 * one_message)
    assert model_seconds("ring", n, 4, alpha, beta) == pytest.approx(6 * (alpha + n * beta))
    # halving-doubling: 4 messages (2 log2 4) carrying the ring's 1.5 N in all
    halving = model_seconds("halving_doubling", n, 4, alpha, beta)
    assert halving == pytest.approx(4 * alpha + 1.5 * 4 * n * beta)
    assert all(model_seconds(a, n, 1, alpha, beta) == 0 for a in ALGORITHMS)
    # bandwidth-bound (alpha = 0): the ring's time tends to 2N*beta whatever P; naive grows
    ring = [model_seconds("ring", n, p, 0, beta) for p in (2, 4, 8, 16)]
    assert all(4 * n * beta <= t < 2 * 4 * n * beta for t in ring)
    naive = [model_seconds("naive", n, p, 0, beta) for p in (2, 4, 8, 16)]
    assert naive == sorted(naive) and naive[-1] > 7 * ring[-1]


# --- the ring, drawn (course_lib.measure.collectives): checked on the data behind the drawing,
# not on pixels -----------------------------------------------------------------------------


def drawn(frame):
    """Draw `frame` and read back what is on the axes: image, cell texts, arrows."""
    ax = Figure().add_subplot()
    draw_ring_frame(frame, ax)
    image = np.asarray(ax.images[0].get_array())
    texts = {
        (round(t.get_position()[1]), round(t.get_position()[0])): t.get_text()
        for t in ax.texts
        if not isinstance(t, Annotation)
    }
    arrows = [a for a in ax.texts if isinstance(a, Annotation)]
    return image, texts, arrows


@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_each_frame_shows_the_state_and_sends_the_schedule_gives(p):
    schedule = ring_schedule(p)
    for k in range(len(schedule) + 1):
        frame = ring_frame(p, k)
        state = ring_state(p, k)
        image, texts, arrows = drawn(frame)
        # the shading is the share of ranks summed into each (rank, chunk)
        expected = np.array([[len(s) / p for s in row] for row in state])
        np.testing.assert_allclose(image, expected)
        # each cell names the ranks whose pieces it holds ("a+c"), or "sum" when complete
        for r in range(p):
            for c in range(p):
                label = texts[(r, c)]
                if len(state[r][c]) == p:
                    assert label == "sum"
                elif len(state[r][c]) > 4:  # too long to spell out: a count
                    assert label == f"{len(state[r][c])}/{p}"
                else:
                    assert label == "+".join("abcdefgh"[i] for i in sorted(state[r][c]))
        if k == len(schedule):
            assert frame.arrows == [] and arrows == [] and "full sum" in frame.title
            continue
        step = schedule[k]
        assert frame.arrows == [(r, (r + 1) % p, step.send[r]) for r in range(p)]
        assert frame.phase == step.phase and step.phase in frame.title
        # one arrow per rank, the wrap-around (last rank -> rank 0) drawn as two stubs
        assert len(arrows) == p + 1
        colours = {a.arrow_patch.get_edgecolor() for a in arrows}
        assert len(colours) == 1
        # every arrow sits in the column of the chunk it carries
        columns = sorted(round(a.xy[0] - 0.38) for a in arrows)
        sent = sorted(step.send) + [step.send[p - 1]]
        assert columns == sorted(sent)


def test_phases_are_drawn_in_different_colours():
    assert PHASE_COLOURS[REDUCE_SCATTER] != PHASE_COLOURS[ALL_GATHER]
    first = drawn(ring_frame(4, 0))[2][0].arrow_patch.get_edgecolor()
    last = drawn(ring_frame(4, 5))[2][0].arrow_patch.get_edgecolor()
    assert first != last


def test_widget_redraws_the_frame_for_the_chosen_step_and_ranks():
    widget = RingWidget(4)
    assert (widget.step.min, widget.step.max, widget.step.value) == (0, 6, 0)
    assert widget.frame == ring_frame(4, 0)
    for k in (3, 6, 1):
        widget.step.value = k
        assert widget.frame == ring_frame(4, k)
        image = np.asarray(widget.figure.axes[0].images[0].get_array())
        np.testing.assert_allclose(image, ring_frame(4, k).fraction)
    widget.ranks.value = 5
    assert (widget.step.max, widget.step.value) == (8, 0)
    assert widget.frame == ring_frame(5, 0)
    widget.step.value = 8
    assert widget.frame == ring_frame(5, 8) and widget.frame.phase is None


def test_widget_refuses_a_ring_of_one():
    with pytest.raises(ValueError, match="world"):
        RingWidget(1)


def test_the_static_strip_has_one_panel_per_frame():
    fig = ring_steps_figure(3)
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == 2 * (3 - 1) + 1
    final = np.asarray(panels[-1].images[0].get_array())
    assert (final == 1).all()


def test_figures_show_themselves_as_png_without_pyplot():
    png = ring_steps_figure(2)._repr_png_()
    assert png.startswith(b"\x89PNG")


def halving_schedule_holds(p: int) -> None:
    """Replay every rank's halving-doubling rounds on sets of contributions: after them every
    rank holds every chunk with all P contributions, and each exchange is mirrored."""
    held = [[{r} for c in range(p)] for r in range(p)]  # chunk c of rank r: whose values
    schedules = [halving_doubling_rounds(p, r) for r in range(p)]
    for k in range(len(schedules[0])):
        before = [[set(x) for x in row] for row in held]
        for r in range(p):
            step, partner = schedules[r][k], schedules[r][k].partner
            mirror = schedules[partner][k]
            assert mirror.partner == r and mirror.send == step.recv and mirror.recv == step.send
            for c in range(*step.recv):
                held[r][c] = (
                    before[r][c] | before[partner][c]
                    if step.phase == REDUCE_SCATTER
                    else before[partner][c]
                )
    assert all(chunk == set(range(p)) for row in held for chunk in row)


def test_halving_round_is_the_reduce_scatter_part_of_the_schedule():
    # 8 ranks, rank 5: partners 4, 2, 1 apart; it keeps chunks 4-7, then 4-5, then 5 alone
    assert [halving_round(8, 5, k) for k in range(3)] == [(1, 4, 8), (7, 4, 6), (4, 5, 6)]
    for p in (2, 4, 16):
        for r in range(p):
            d = p // 2
            for k in range(p.bit_length() - 1):  # partner r xor d; keep the d chunks holding r
                assert halving_round(p, r, k) == (r ^ d, r // d * d, r // d * d + d)
                d //= 2
    with pytest.raises(ValueError, match="k must be in"):
        halving_round(8, 0, 3)
    with pytest.raises(ValueError, match="power-of-two"):
        halving_round(6, 0, 0)


@pytest.mark.parametrize("p", [1, 2, 4, 8, 16])
def test_halving_doubling_rounds_sum_everything_in_2_log2_p_rounds(p):
    halving_schedule_holds(p)
    rounds = halving_doubling_rounds(p, 0)
    assert len(rounds) == 2 * int(math.log2(p))
    assert {r.partner for r in rounds} == {2**k for k in range(int(math.log2(p)))}


# --- all-reduce on an emulated network, against the model -----------------------------------


def test_the_models_fastest_algorithm_changes_where_the_formulas_cross():
    """For P a power of two, the butterfly's log2(P)(a + Nb) and halving-doubling's
    2 log2(P) a + 2(P-1)/P Nb cross at N = log2(P) a / (b (log2 P - 2(P-1)/P)): the only change
    of the fastest algorithm (the grid has 200 points per decade: 1.2% apart)."""
    for p, alpha, beta in [(4, 1e-3, 8e-9), (8, 10e-6, 0.8e-9), (64, 2e-6, 0.1e-9)]:
        k = math.log2(p)
        expected = k * alpha / (beta * (k - 2 * (p - 1) / p))
        ((at, before, after),) = crossovers(p, alpha, beta)
        assert (before, after) == ("butterfly", "halving_doubling")
        assert at == pytest.approx(expected, rel=0.012)


def test_the_crossover_exercise_is_checked_off_the_page(capsys):
    # worked by hand: 3(a + Nb) = 6a + 1.75 Nb, so N = 3a / (1.25 b) = 2.4 x 10e-6 / 8e-10
    assert check_crossover(30_000) is True
    assert "✓ Right: 3e+04 bytes" in capsys.readouterr().out
    assert check_crossover(60_000) is False
    out = capsys.readouterr().out
    assert "2x too large" in out and "Set the two times equal and solve for N" in out
    assert "3e+04" not in out and "30000" not in out and "3.02e+04" not in out
    assert check_crossover(...) is None
    assert "Not answered yet" in capsys.readouterr().out


def test_the_model_widget_moves_the_crossover_with_the_latency():
    widget = AllReduceModelWidget(latency_us=10.0, gbits=10.0, world_size=8)
    ((first, *_),) = widget.best
    widget.latency.value = 100.0  # ten times the latency: the crossover moves 10x up in N
    ((moved, *_),) = widget.best
    assert moved / first == pytest.approx(10, rel=0.03)
    assert isinstance(widget.figure, Figure)


def test_on_an_emulated_network_the_naive_root_is_the_bottleneck_the_model_says(pool4):
    """4 MB of float32 at 100 MB/s and no latency: the naive algorithm's root takes in and
    sends out 3N one message at a time, 6 Nb = 240 ms (the model's 2(P-1)(a + Nb)), measured
    within 25% (the band leaves room for a busy machine's scheduling). The ring's 2(P-1) steps
    of N/4 take the model's 60 ms or more (each step also pays the machine's wake-ups, which
    a busy machine makes long), and less than the naive root's time."""
    network = {"bandwidth": 100e6, "latency": 0.0}
    sizes = [1_000_000]
    measured = pool4.launch(sweep_all_reduce, sizes, network, 3, timeout=120)[0]
    model = {
        name: model_seconds(name, sizes[0], 4, 0.0, 1 / network["bandwidth"])
        for name in ("naive", "ring")
    }
    naive, ring = measured["naive"][0], measured["ring"][0]
    assert naive == pytest.approx(model["naive"], rel=0.25), (naive, model)
    assert 0.95 * model["ring"] <= ring < naive, (ring, naive, model)
    # two levels with nodes of 2 on the same links: 2 Nb inside the node, Nb for 2 leaders
    two_level = measured["two_level"][0]
    (two_level_formula,) = two_level_model([4 * sizes[0]], 4, 2, network)
    assert two_level_formula == pytest.approx(3 * 4 * sizes[0] / network["bandwidth"])
    assert 0.95 * two_level_formula <= two_level <= 1.5 * two_level_formula, two_level
    fig = plot_all_reduce_sweep(sizes, measured, 4, {**network, "latency": 1e-3})
    assert isinstance(fig, Figure)


# --- two levels: nodes of fast links ----------------------------------------------------------


@pytest.mark.parametrize("node_size", [1, 2, 4])
def test_two_level_all_reduce_equals_dist_all_reduce(pool4, node_size):
    def run(numel):
        x = torch.randn(numel, dtype=torch.float64, generator=torch.Generator().manual_seed(rank()))
        expected = x.clone()
        dist.all_reduce(expected)
        two_level_all_reduce(x, node_size)
        return torch.allclose(x, expected, **TOLERANCE[torch.float64])

    for numel in (0, 1, 3, 1001):
        assert all(pool4.launch(run, numel, timeout=30)), (node_size, numel)


def test_two_level_refuses_nodes_that_do_not_divide_the_ranks(pool4):
    def run():
        two_level_all_reduce(torch.ones(4), node_size=3)

    with pytest.raises(RankError, match="node_size must divide the 4 ranks"):
        pool4.launch(run, timeout=30)


def two_level_against_ring(numel, network):
    return {
        "ring": time_all_reduce("ring", numel, 3, network),
        "two_level": time_all_reduce(two_level_all_reduce, numel, 3, network),
    }


def test_two_levels_beat_a_flat_ring_when_nodes_are_fast_as_the_model_says(pool4):
    """Two nodes of 2 ranks, 2.5 MB/s between nodes and 100 MB/s inside (slow, so that the
    real copies stay far below the emulated times): on 400 kB, the flat ring sends 1.5N over
    the slow links (6 steps of N/4, 240 ms); the two leaders' ring N (2 steps of N/2, 160 ms),
    plus 8 ms inside the nodes. Measured: no faster than the model, and within 50% above it
    (each of its four phases also waits for real process wake-ups, long on a busy machine)."""
    network = {"bandwidth": 2.5e6, "latency": 0.0, "node_size": 2, "node_bandwidth": 100e6}
    numel = 100_000
    measured = pool4.launch(two_level_against_ring, numel, network, timeout=120)[0]
    model = two_level_all_reduce_seconds(4 * numel, 4, 2, 0.0, 1 / 2.5e6, 0.0, 1 / 100e6)
    assert 0.95 * model <= measured["two_level"] <= 1.5 * model, (measured, model)
    assert measured["two_level"] < measured["ring"], measured


def test_two_level_model_uses_the_node_links_only_when_the_network_has_those_nodes():
    nbytes = 400_000
    nodes = {"bandwidth": 2.5e6, "latency": 1e-3, "node_size": 2, "node_bandwidth": 100e6}
    fast_inside = two_level_all_reduce_seconds(nbytes, 4, 2, 1e-3, 1 / 2.5e6, 0.0, 1 / 100e6)
    assert two_level_model([nbytes], 4, 2, nodes) == [pytest.approx(fast_inside)]
    flat = {"bandwidth": 2.5e6, "latency": 1e-3}
    same_links = two_level_all_reduce_seconds(nbytes, 4, 2, 1e-3, 1 / 2.5e6, 1e-3, 1 / 2.5e6)
    assert two_level_model([nbytes], 4, 2, flat) == [pytest.approx(same_links)]


def test_time_against_model_prints_a_row_per_algorithm_and_returns_both_times(capsys):
    measured, model = time_against_model(1000, 2, 10e-6, 8 / 10e9, repeats=1)
    assert list(measured) == ["torch", *ALGORITHMS] and list(model) == list(ALGORITHMS)
    assert all(seconds > 0 for seconds in measured.values())
    assert model["ring"] == model_seconds("ring", 1000, 2, 10e-6, 8 / 10e9)
    lines = capsys.readouterr().out.splitlines()
    assert "model, 10 Gbit/s" in lines[0] and len(lines) == 1 + 1 + len(ALGORITHMS)
    assert lines[-1].split()[0] == "halving_doubling" and lines[-1].endswith("2 N")


# Made-up sweep seconds at 4 kB and 16 MB: butterfly first at 4 kB, naive 3.2x the ring at 16 MB.
SWEPT = {
    "naive": [0.020, 0.96],
    "tree": [0.012, 0.50],
    "butterfly": [0.010, 0.40],
    "ring": [0.030, 0.30],
    "halving_doubling": [0.011, 0.31],
    "two_level": [0.005, 0.45],  # not one of the question's five: never the answer
}


def test_the_fastest_at_4kb_check_takes_the_quickest_of_the_five(capsys):
    assert check_fastest_at_4kB("butterfly", SWEPT) is True
    assert "Few messages win when latency dominates" in capsys.readouterr().out
    assert check_fastest_at_4kB("ring", SWEPT) is False
    assert check_fastest_at_4kB(..., SWEPT) is None


def test_the_naive_over_ring_check_takes_the_nearest_ratio_on_a_log_scale(capsys):
    assert check_naive_over_ring_at_16MB("4x", SWEPT) is True
    assert "Measured: 3.2x" in capsys.readouterr().out
    assert check_naive_over_ring_at_16MB("2x", SWEPT) is False
    assert check_naive_over_ring_at_16MB(..., SWEPT) is None


def test_the_two_nodes_check_takes_the_one_that_finished_first(capsys):
    on_two_nodes = {"ring": 0.290, "two_level": 0.180}  # made up, seconds
    assert check_faster_on_two_nodes("two_level", on_two_nodes) is True
    assert "the leaders' ring of 2 sends N" in capsys.readouterr().out
    assert check_faster_on_two_nodes("ring", on_two_nodes) is False
    assert check_faster_on_two_nodes(..., on_two_nodes) is None
