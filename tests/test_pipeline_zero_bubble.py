"""Zero-bubble pipeline schedules (course_lib.measure.pipeline.zero_bubble): simulated, every
pass runs once after what it needs and the idle time is (P-1)(F+B-W); run on ranks, the
gradients are single-process autograd's, the ranks play the simulator's order on the wall
clock, and the memory each rank held is what the W's owed hold."""

from __future__ import annotations

import pytest
import torch

from course_lib import data, launch, models, rank, world_size
from course_lib.costs import bubble_formula, zero_bubble_formula
from course_lib.measure import pipeline as measure
from course_lib.measure.pipeline import (
    peak_activations,
    peak_memory,
    pending_w_peak,
    play_split_backward,
    plot_bubbles,
    simulate_zb_h1,
    simulate_zero_bubble,
    torch_pipeline_step,
    what_w_needs,
    zero_bubble_order,
)
from course_lib.pipeline import Timeline, simulate
from tests.test_pipeline import TIMEOUT, P, tiny_gpt_stage

# --- the zero-bubble schedule (simulated) --------------------------------------------------------


@pytest.mark.parametrize("variant", ["1F1B's memory", "W's deferred", "ZB-H1"])
@pytest.mark.parametrize("p,m", [(2, 3), (4, 8), (4, 4), (8, 16)])
def test_zero_bubble_runs_every_pass_once_after_what_it_needs(p, m, variant):
    if variant == "ZB-H1":
        timeline = simulate_zb_h1(p, m)
    else:
        timeline = simulate_zero_bubble(p, m, defer_w=variant == "W's deferred")
    end = {(t.kind, t.micro, t.stage): t for t in timeline.tasks}
    assert len(end) == len(timeline.tasks) == 3 * p * m  # F, B and W of every micro-batch
    for (kind, i, s), t in end.items():
        needs = {
            "F": [("F", i, s - 1)] if s > 0 else [],
            "B": [("F", i, s)] + ([("B", i, s + 1)] if s < p - 1 else []),
            "W": [("B", i, s)],
        }[kind]
        assert all(end[n].end <= t.start for n in needs), (kind, i, s)
    for s in range(p):  # one op at a time per stage
        spans = sorted((t.start, t.end) for t in timeline.tasks if t.stage == s)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))


@pytest.mark.parametrize("p,m", [(2, 3), (4, 8), (4, 16), (8, 8)])
def test_zero_bubble_with_deferred_ws_reaches_the_formula_and_1f1b_memory_costs_some(p, m):
    deferred = simulate_zero_bubble(p, m, defer_w=True)
    assert deferred.bubble == pytest.approx(zero_bubble_formula(p, m), rel=1e-12)
    bounded = simulate_zero_bubble(p, m, defer_w=False)
    one_f = simulate(p, m, "1f1b", forward_s=1, backward_s=2)
    assert deferred.makespan <= bounded.makespan < one_f.makespan
    for s in range(p):  # 1F1B's limit on activations, each schedule counted its own way
        assert peak_activations(bounded, s, freed_by="W") <= p - s
        assert peak_activations(deferred, s, freed_by="B") <= p - s
        assert pending_w_peak(bounded, s) <= pending_w_peak(deferred, s)
    assert pending_w_peak(deferred, p - 1) == m  # the last stage owes every W at the end


@pytest.mark.parametrize("times", [(1, 1, 1), (1, 1.5, 0.5), (1, 2, 1)])
@pytest.mark.parametrize("p,m", [(2, 2), (2, 5), (4, 4), (4, 8), (4, 16), (8, 8), (8, 32)])
def test_zb_h1_reaches_the_formula_holding_at_most_p_micro_batches_on_every_stage(p, m, times):
    """The paper's ZB-H1 (m >= P): idle (P-1)(F+B-W) per stage, every stage at most P
    micro-batches from F to W (1F1B's first stage's peak), W's owed at most s + 1 on stage s."""
    zb_h1 = simulate_zb_h1(p, m, *times)
    assert zb_h1.bubble == pytest.approx(zero_bubble_formula(p, m, *times), rel=1e-12)
    for s in range(p):
        assert peak_activations(zb_h1, s, freed_by="W") == p
        assert peak_activations(zb_h1, s, freed_by="B") == p - s  # as 1F1B
        assert pending_w_peak(zb_h1, s) == min(s + 1, m)


@pytest.mark.parametrize("p,m", [(2, 3), (4, 8), (8, 8)])
def test_playing_the_greedy_orders_gives_the_greedy_timelines(p, m):
    """play_split_backward and simulate_zero_bubble agree on when every op ran."""
    for defer_w in (False, True):
        greedy = simulate_zero_bubble(p, m, defer_w=defer_w)
        played = play_split_backward(zero_bubble_order(p, m, defer_w))
        assert {(t.stage, t.kind, t.micro): (t.start, t.end) for t in played.tasks} == {
            (t.stage, t.kind, t.micro): (t.start, t.end) for t in greedy.tasks
        }


def test_peak_memory_counts_a_w_owed_as_its_share_of_a_micro_batch():
    """w_share = 1: held from F to W; 0: from F to B; 1F1B's merged backward frees it all."""
    zb_h1, deferred = simulate_zb_h1(4, 8), simulate_zero_bubble(4, 8, defer_w=True)
    for t in (zb_h1, deferred):
        for s in range(4):
            assert peak_memory(t, s, 1.0) == peak_activations(t, s, "W")
            assert peak_memory(t, s, 0.0) == peak_activations(t, s, "B")
    assert peak_memory(zb_h1, 3, 0.5) == 1 + 3 * 0.5  # stage 3: one whole, three W's owed
    one_f = simulate(4, 8, "1f1b")
    assert [peak_memory(one_f, s, 0.5) for s in range(4)] == [4, 3, 2, 1]


def test_what_w_needs_is_each_weighted_layers_input_and_output():
    """A Linear: W needs its input and its output's gradient; autograd saved the input."""
    layer, x = torch.nn.Linear(8, 3), torch.randn(5, 8, requires_grad=True)
    assert what_w_needs(layer, x) == (4 * (5 * 8 + 5 * 3), 4 * 5 * 8)
    relu_net = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(8, 3))
    needed, saved = what_w_needs(relu_net, x)  # relu has no weights; it saves its output
    assert needed == 4 * (5 * 8 + 5 * 3) and saved == 4 * 5 * 8


def test_plot_bubbles_draws_the_formula_under_each_schedules_dots():
    ms = [1, 4, 16]
    fig = plot_bubbles(ms, {"gpipe": [0.75, 0.43, 0.16]}, 4, "t", kind="on the ranks")
    formula, dots = fig.axes[0].lines
    assert list(formula.get_ydata()) == [bubble_formula(4, m) for m in ms]
    assert list(dots.get_ydata()) == [0.75, 0.43, 0.16]
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == [
        "formula (P-1)/(m+P-1)",
        "gpipe: on the ranks",
    ]


# --- the zero-bubble schedule, run for real ------------------------------------------------------
# Gradients in float64 against single-process autograd and torch's 1F1B: the same sums in the
# same micro-batch order, so they differ by rounding only: atol 1e-12, rtol 0.


def gpt64_stage():
    return models.TinyGPT(seed=0, dtype=torch.float64).pipeline_stages(world_size())[rank()]


def zero_bubble_and_1f1b(x, y, m, defer_w):
    zb = measure.zero_bubble_step(gpt64_stage(), x, y, models.lm_loss, m, defer_w)
    one_f = torch_pipeline_step(gpt64_stage(), x, y, models.lm_loss, m, "1f1b")
    return zb, one_f


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 4), (4, 8)])
def test_zero_bubble_gradients_match_1f1b_and_single_process(p, m):
    x, y = data.tokens(8, seed=5)
    model = models.TinyGPT(seed=0, dtype=torch.float64)
    loss = models.lm_loss(model(x), y)
    loss.backward()
    reference = [[p_.grad for p_ in stage.parameters()] for stage in model.pipeline_stages(p)]
    for defer_w in (False, True):
        logs = launch(zero_bubble_and_1f1b, x, y, m, defer_w, world_size=p, timeout=TIMEOUT)
        for s, (zb, one_f) in enumerate(logs):
            assert len(zb.grads) == len(one_f.grads) == len(reference[s])
            for i, (g, o, w) in enumerate(zip(zb.grads, one_f.grads, reference[s], strict=True)):
                assert g.dtype == torch.float64
                torch.testing.assert_close(g, w, rtol=0, atol=1e-12, msg=f"stage {s}, param {i}")
                torch.testing.assert_close(g, o, rtol=0, atol=1e-12, msg=f"stage {s}, param {i}")
        assert logs[-1][0].loss == pytest.approx(loss.item(), rel=1e-12)


def zero_bubble_run(x, y, m, schedule, times=(0.0, 0.0, 0.0)):
    """One zero-bubble step: W's at 1F1B's memory ("same memory"), W's deferred or ZB-H1,
    each op sleeping `times` = (F, B, W) after its compute."""
    return measure.zero_bubble_step(
        tiny_gpt_stage(),
        x,
        y,
        models.lm_loss,
        m,
        schedule == "deferred",
        times,
        zb_h1=schedule == "zb-h1",
    )


VARIANTS = (("same memory", False), ("deferred", True), ("zb-h1", False))


@pytest.mark.parametrize("m", [4, 8])
def test_zero_bubble_plays_the_simulators_order(pool4, m):
    x, y = data.tokens(8, seed=6)
    for name, defer_w in VARIANTS:
        logs = pool4.launch(zero_bubble_run, x, y, m, name, timeout=TIMEOUT)
        order = measure.zero_bubble_order(P, m, defer_w, zb_h1=name == "zb-h1")
        for s, log in enumerate(logs):
            ran = sorted(log.tasks, key=lambda t: t.start)
            assert [(t.kind, t.micro) for t in ran] == [(o.kind, o.micro) for o in order[s]]


def test_zero_bubble_idles_less_than_1f1b_on_the_wall_clock(pool4):
    """F, B and W sleep 30 ms each (1F1B's backward 60 ms): the measured bubbles keep the
    simulator's ranking, each at least its simulated share less 1 point and at most 10 points
    above it (messages and late wake-ups on 2 shared cores)."""
    x, y = data.tokens(8, seed=6)
    times = (0.03, 0.03, 0.03)
    logs = pool4.launch(
        measure.measure_zero_bubble, tiny_gpt_stage, x, y, models.lm_loss, 8, times, timeout=120
    )
    runs = {name: Timeline.from_logs([log[name] for log in logs]) for name in logs[0]}
    simulated = {
        t.schedule: t
        for t in (
            simulate(P, 8, "1f1b", 1, 2),
            simulate_zero_bubble(P, 8, defer_w=False),
            simulate_zb_h1(P, 8),
            simulate_zero_bubble(P, 8, defer_w=True),
        )
    }
    assert runs.keys() == simulated.keys()
    for name, run in runs.items():
        share = simulated[name].bubble
        assert share - 0.01 <= run.bubble <= share + 0.10, f"{name}: {run.bubble:.3f}"
        assert all(t.end - t.start >= 0.03 for t in run.tasks), name  # real time, sleep included
    same_memory, deferred = measure.zero_bubble_name(False), measure.zero_bubble_name(True)
    assert runs[deferred].bubble < runs["1f1b"].bubble
    assert runs[measure.ZB_H1].bubble < runs[same_memory].bubble < runs["1f1b"].bubble


def test_zero_bubble_memory_is_what_the_ws_owed_hold(pool4):
    x, y = data.tokens(8, seed=6)
    for name, defer_w in VARIANTS:
        logs = pool4.launch(zero_bubble_run, x, y, 8, name, timeout=TIMEOUT)
        if name == "zb-h1":
            simulated = simulate_zb_h1(P, 8)
        else:
            simulated = simulate_zero_bubble(P, 8, defer_w=defer_w)
        for s, log in enumerate(logs):
            # B keeps the graph for W: a micro-batch holds its activations from F to W
            held = peak_activations(simulated, s, freed_by="W")
            assert log.peak_in_flight == held, (name, s)
            assert len(set(log.activation_bytes)) == 1 and log.activation_bytes[0] > 0
            assert log.peak_activation_bytes == held * log.activation_bytes[0], (name, s)
