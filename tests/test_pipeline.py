"""course_lib.pipeline: schedules keep their dependencies and the bubble formula, the real
multi-process pipeline trains exactly like one process and shows the formula's bubble, and the
stage partition by dynamic programming matches brute force.

Tolerances: a pipeline computes the same sums as single-process training, micro-batch by
micro-batch, so fp32 gradients differ by rounding only (~1e-7): atol 1e-6. The
measured bubble must be within 5 percentage points of (P-1)/(m+P-1) (issue 7).
"""

from __future__ import annotations

import itertools
import math
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from course_lib import RankError, WorkerPool, data, launch, models, rank, world_size
from course_lib.costs import bubble_formula, zero_bubble_formula
from course_lib.measure import pipeline as measure
from course_lib.measure.pipeline import (
    PipelineWidget,
    brute_force_partition,
    check_bubble_shares,
    check_first_backward,
    check_my_bubble,
    check_one_f_one_b_in_flight,
    check_zero_bubble_idle,
    check_zero_bubble_measured,
    measure_bubbles,
    peak_activations,
    peak_memory,
    pending_w_peak,
    play_split_backward,
    plot_bubbles,
    plot_schedule,
    profile_layers,
    simulate_zb_h1,
    simulate_zero_bubble,
    stretched_ops,
    torch_pipeline_step,
    what_w_needs,
    zero_bubble_order,
)
from course_lib.measure.pipeline import runs as measure_runs
from course_lib.pipeline import (
    BACKWARD,
    FORWARD,
    SCHEDULES,
    Partition,
    Stage,
    Timeline,
    optimal_partition,
    partition_stages,
    pipeline_step,
    schedule_order,
    simulate,
    trainer,
)

P = 4
ATOL = 1e-6
TIMEOUT = 60


# --- the simulator ----------------------------------------------------------------------------

CASES = [(p, m) for p in (1, 2, 3, 4, 5) for m in (1, 2, 3, 4, 8, 16)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("times", [(1.0, 2.0), (1.0, 1.0), (0.5, 3.0)])
def test_gpipe_and_1f1b_bubble_is_the_formula(schedule, times):
    for p, m in CASES:
        timeline = simulate(p, m, schedule, *times)
        assert math.isclose(timeline.bubble, bubble_formula(p, m), abs_tol=1e-12), (p, m)
        # the makespan behind it: m micro-batches plus P - 1 of fill and drain
        assert math.isclose(timeline.makespan, (m + p - 1) * sum(times)), (p, m)


def test_naive_keeps_one_stage_busy_and_interleaving_divides_the_bubble():
    for p, m in CASES:
        assert math.isclose(simulate(p, m, "naive").bubble, (p - 1) / p, abs_tol=1e-12)
        for chunks in (2, 3):
            if m % p == 0:
                timeline = simulate(p, m, "interleaved", chunks=chunks)
                expected = (p - 1) / (chunks * m + p - 1)
                assert math.isclose(timeline.bubble, expected, abs_tol=1e-12), (p, m, chunks)


def _check_dependencies(timeline: Timeline, chunks: int) -> None:
    tasks = {(t.kind, t.micro, t.chunk * timeline.n_stages + t.stage): t for t in timeline.tasks}
    assert len(tasks) == len(timeline.tasks), "an op ran twice"
    last = chunks * timeline.n_stages - 1
    for (kind, micro, v), task in tasks.items():
        if kind == FORWARD and v > 0:
            assert task.start >= tasks[(FORWARD, micro, v - 1)].end - 1e-12
        if kind == BACKWARD:
            assert task.start >= tasks[(FORWARD, micro, v)].end - 1e-12  # own F before B
            if v < last:
                assert task.start >= tasks[(BACKWARD, micro, v + 1)].end - 1e-12
    for s in range(timeline.n_stages):  # a stage runs one op at a time
        lane = sorted((t for t in timeline.tasks if t.stage == s), key=lambda t: t.start)
        assert all(a.end <= b.start + 1e-12 for a, b in itertools.pairwise(lane))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_op_runs_once_after_what_it_depends_on(schedule):
    for p, m in CASES:
        if schedule == "interleaved" and m % p:
            continue
        chunks = 2 if schedule == "interleaved" else 1
        timeline = simulate(p, m, schedule, forward_s=1.0, backward_s=2.5)
        assert len(timeline.tasks) == 2 * p * m * chunks
        _check_dependencies(timeline, chunks)


def test_in_flight_micro_batches():
    for p, m in CASES:
        gpipe, one_f = simulate(p, m, "gpipe"), simulate(p, m, "1f1b")
        for s in range(p):
            assert gpipe.peak_in_flight(s) == m
            assert one_f.peak_in_flight(s) == min(p - s, m) <= p - s


def test_per_stage_times_make_the_slowest_stage_the_pace():
    times = [1.0, 3.0, 1.0, 1.0]
    timeline = simulate(4, 32, "1f1b", forward_s=times, backward_s=[2 * t for t in times])
    # in steady state one micro-batch leaves every 3 + 6 time units
    assert 32 * 9 <= timeline.makespan <= 32 * 9 + 3 * 9


def test_bad_schedule_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match="divisible by P"):
        schedule_order("interleaved", 4, 6)
    with pytest.raises(ValueError, match="schedule must be one of"):
        simulate(4, 4, "zigzag")
    with pytest.raises(ValueError, match="m \\(micro-batches\\)"):
        simulate(4, 0)
    with pytest.raises(ValueError, match="one per stage"):
        simulate(4, 4, forward_s=[1.0, 2.0])


def test_widget_and_chart_draw_the_simulated_schedule():
    widget = PipelineWidget(4, 4, "gpipe")
    assert math.isclose(widget.timeline.bubble, bubble_formula(4, 4))
    widget.micro.value = 16
    assert math.isclose(widget.timeline.bubble, bubble_formula(4, 16))
    widget.schedule.value = "1f1b"
    assert widget.timeline.schedule == "1f1b" and widget.timeline.peak_in_flight(0) == 4
    fig = plot_schedule(simulate(2, 3, "gpipe"), simulate(2, 3, "1f1b"))
    assert len(fig.axes) == 2


# --- the real pipeline on 4 ranks --------------------------------------------------------------


@pytest.fixture(scope="module")
def pool4():
    with WorkerPool(P) as pool:
        yield pool


def tiny_gpt_stage():
    return models.TinyGPT(seed=0).pipeline_stages(world_size())[rank()]


def gpt_batch():
    return data.tokens(8, seed=3)


def gpt_reference_grads(x, y):
    model = models.TinyGPT(seed=0)
    loss = models.lm_loss(model(x), y)
    loss.backward()
    return [[p.grad for p in stage.parameters()] for stage in model.pipeline_stages(P)], loss


def run_step(x, y, m, schedule):
    return pipeline_step(tiny_gpt_stage(), x, y, models.lm_loss, m, schedule)


def assert_grads_match(per_rank_grads, reference):
    for stage, (got, want) in enumerate(zip(per_rank_grads, reference, strict=True)):
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            err = (g - w).abs().max().item()
            assert err <= ATOL, f"stage {stage}, parameter {i}: max abs error {err:.3g}"


@pytest.mark.parametrize("schedule", ["naive", "gpipe", "1f1b"])
def test_pipeline_gradients_match_single_process(pool4, schedule):
    x, y = gpt_batch()
    reference, loss = gpt_reference_grads(x, y)
    for m in (1, 4):
        logs = pool4.launch(run_step, x, y, m, schedule, timeout=TIMEOUT)
        assert_grads_match([log.grads for log in logs], reference)
        assert math.isclose(logs[-1].loss, loss.item(), rel_tol=1e-5)  # mean of micro-batches
        assert all(log.loss is None for log in logs[:-1])


def mlp_steps(x, y, m, schedule):
    """An MLP chain cut into one Linear(+ReLU) per rank, trained 2 steps with SGD."""
    layers = list(models.MLP((8, 16, 16, 16, 4), seed=1).layers)
    stage = torch.nn.Sequential(*layers[2 * rank() : 2 * rank() + 2])
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.1)
    for _ in range(2):
        pipeline_step(stage, x, y, F.mse_loss, m, schedule, optimizer=optimizer)
    return [p.detach().clone() for p in stage.parameters()]


def test_pipeline_training_matches_single_process_sgd(pool4):
    x, y = data.regression(16, in_dim=8, out_dim=4, seed=2)
    model = models.MLP((8, 16, 16, 16, 4), seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    want = list(model.parameters())
    got = [p for stage in pool4.launch(mlp_steps, x, y, 4, "1f1b", timeout=TIMEOUT) for p in stage]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max().item() <= ATOL


def torch_step(x, y, m, schedule):
    return torch_pipeline_step(tiny_gpt_stage(), x, y, models.lm_loss, m, schedule)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_torch_pipelining_reference_matches_single_process(pool4, schedule):
    x, y = gpt_batch()
    reference, _ = gpt_reference_grads(x, y)
    assert_grads_match(pool4.launch(torch_step, x, y, 4, schedule, timeout=TIMEOUT), reference)


def torch_interleaved(x, y, m):
    config = models.GPTConfig(n_layers=6)
    pieces = models.TinyGPT(config, seed=0).pipeline_stages(2 * world_size())
    return measure.torch_interleaved_step(pieces, x, y, models.lm_loss, m)


def test_torch_interleaved_1f1b_matches_single_process(pool4):
    """8 pieces, rank r holding r and r + 4: gradients of single-process training to fp32
    rounding (atol 1e-6)."""
    x, y = gpt_batch()
    model = models.TinyGPT(models.GPTConfig(n_layers=6), seed=0)
    models.lm_loss(model(x), y).backward()
    pieces = model.pipeline_stages(8)
    per_rank = pool4.launch(torch_interleaved, x, y, 4, timeout=TIMEOUT)
    for r, grads in enumerate(per_rank):
        expected = [p.grad for piece in pieces[r::4] for p in piece.parameters()]
        assert len(grads) == len(expected)
        for g, e in zip(grads, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=0, atol=ATOL)


def on_a_stand_in_device(step, schedule):
    """`step` at world size 1 with device() answering "meta" (no GPU here): a stage, batch or
    buffer left on the CPU fails with "Tensor on device cpu is not on the expected device
    meta", as it would on a GPU. Meta tensors hold no values, so .item() answers 0."""
    real_item = torch.Tensor.item
    # device() as the files that run the steps read it: pipeline/trainer.py and
    # measure/pipeline/runs.py (torch's pipelining)
    saved = trainer.device, measure_runs.device, torch.Tensor.item
    trainer.device = measure_runs.device = lambda: torch.device("meta")
    torch.Tensor.item = lambda t: 0.0 if t.is_meta else real_item(t)
    try:
        x, y = gpt_batch()
        out = step(models.TinyGPT(seed=0), x, y, models.lm_loss, 2, schedule)
        return [g.device.type for g in getattr(out, "grads", out)]
    finally:
        trainer.device, measure_runs.device, torch.Tensor.item = saved


@pytest.mark.parametrize("step", [pipeline_step, torch_pipeline_step])
def test_pipeline_steps_keep_everything_on_the_ranks_device(step):
    devices = launch(on_a_stand_in_device, step, "gpipe", world_size=1)[0]
    assert devices and set(devices) == {"meta"}


def test_in_flight_and_activation_memory_measured(pool4):
    x, y = gpt_batch()
    for schedule in ("gpipe", "1f1b"):
        logs = pool4.launch(run_step, x, y, 8, schedule, timeout=TIMEOUT)
        for s, log in enumerate(logs):
            expected = 8 if schedule == "gpipe" else min(P - s, 8)
            assert log.peak_in_flight == expected, (schedule, s)
            # equal micro-batches save equal bytes; the peak is in-flight x one micro-batch's
            assert len(set(log.activation_bytes)) == 1 and log.activation_bytes[0] > 0
            assert log.peak_activation_bytes == expected * log.activation_bytes[0], (schedule, s)


def test_measured_bubble_matches_the_formula(pool4):
    x, y = data.tokens(16, seed=4)
    logs = pool4.launch(
        measure_bubbles,
        tiny_gpt_stage,
        x,
        y,
        models.lm_loss,
        ("gpipe", "1f1b"),
        (1, 4, 16),
        0.04,
        0.08,
        timeout=120,
    )
    for key in logs[0]:
        measured = Timeline.from_logs([log[key] for log in logs]).bubble
        formula = bubble_formula(P, key[1])
        assert abs(measured - formula) <= 0.05, f"{key}: measured {measured:.3f}, {formula:.3f}"


def test_bad_micro_batch_count_is_a_clear_error(pool4):
    x, y = gpt_batch()
    with pytest.raises(RankError, match="does not split into m=3"):
        pool4.launch(run_step, x, y, 3, "1f1b", timeout=TIMEOUT)


# --- the optimal partition -------------------------------------------------------------------


@pytest.mark.parametrize("replicate", [True, False])
def test_optimal_partition_matches_brute_force(replicate):
    rng = random.Random(0)
    for trial in range(150):
        n, machines = rng.randint(1, 6), rng.randint(1, 5)
        times = [rng.uniform(0.1, 3.0) for _ in range(n)]
        acts = [rng.uniform(0.0, 2.0) for _ in range(n)]
        weights = [rng.uniform(0.0, 2.0) for _ in range(n)] if trial % 2 else None
        bandwidth = rng.choice([0.5, 1.0, 4.0])
        args = (times, acts, machines, bandwidth, weights, replicate)
        dp, brute = optimal_partition(*args), brute_force_partition(*args)
        assert math.isclose(dp.time, brute.time, rel_tol=1e-12), (args, dp, brute)
        # the DP's stages cover every layer once, in order, and really take dp.time
        assert [s.first for s in dp.stages] == [0] + [s.last + 1 for s in dp.stages[:-1]]
        assert dp.stages[-1].last == n - 1
        used = sum(s.machines for s in dp.stages)
        assert used == machines if replicate else all(s.machines == 1 for s in dp.stages)


def test_partition_examples_and_noam():
    # a slow link after layer 1 and a heavy layer 3: cut elsewhere, give layer 3 its own stage
    best = optimal_partition([1, 1, 1, 4], [0.1, 5.0, 0.1, 0.1], 2, replicate=False)
    assert [(s.first, s.last) for s in best.stages] == [(0, 2), (3, 3)] and best.time == 4
    # no weights to synchronise: replicating the whole model on 4 machines is best (DP)
    dp_only = optimal_partition([1.0, 1.0, 1.0], [1.0] * 3, 4)
    assert dp_only.stages == (dp_only.stages[0],) and dp_only.time == 0.75 and dp_only.noam == 1
    # NOAM: an input stage on 1 of 4 machines needs 4 micro-batches in flight to fill them
    assert Partition(1.0, (Stage(0, 0, 1), Stage(1, 2, 3))).noam == 4
    stages = partition_stages(list(models.TinyGPT().layers()), best)
    assert [len(s) for s in stages] == [3, 1]
    with pytest.raises(ValueError, match="one time and one activation size per layer"):
        optimal_partition([1.0, 2.0], [1.0], 2)


def test_profile_layers_measures_output_bytes_and_positive_times():
    layers = list(models.TinyGPT().layers())
    x, _ = data.tokens(2, seed=0)
    times, sizes = profile_layers(layers, x, repeats=2)
    assert all(t > 0 for t in times)
    d, vocab = models.GPTConfig().d_model, models.GPTConfig().vocab_size
    assert sizes == [2 * 16 * d * 4] * 3 + [2 * 16 * vocab * 4]  # fp32 outputs of each layer


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


def test_stretched_ops_counts_ops_longer_than_their_set_time():
    run = Timeline.from_logs(
        [
            SimpleNamespace(
                schedule="1f1b",
                tasks=[
                    trainer.Task(0, "F", 0, 0, 0.0, 0.040),  # on time
                    trainer.Task(0, "B", 0, 0, 0.040, 0.1205),  # 0.5 ms over: within the slack
                    trainer.Task(0, "F", 1, 0, 0.1205, 0.1655),  # 5 ms over: stretched
                ],
            )
        ]
    )
    assert stretched_ops(run, {"F": 0.04, "B": 0.08}) == 1


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


def test_my_bubble_check_refuses_the_library_and_takes_the_formula_written_out(capsys):
    def written(P, m, v):
        return (P - 1) / (v * m + P - 1)

    assert check_my_bubble(written) is True
    from course_lib.costs import bubble_formula as formula

    assert check_my_bubble(lambda P, m, v: formula(P, m, v)) is False
    assert check_my_bubble(lambda P, m, v: simulate(P, m, "interleaved", chunks=v).bubble) is False
    assert capsys.readouterr().out.count("from course_lib") == 2


# --- the zero-bubble schedule, run for real ------------------------------------------------------
# Gradients in float64 against single-process autograd and the 1F1B runtime: the same sums in
# the same micro-batch order, so they differ by rounding only: atol 1e-12, rtol 0.


def gpt64_stage():
    return models.TinyGPT(seed=0, dtype=torch.float64).pipeline_stages(world_size())[rank()]


def zero_bubble_and_1f1b(x, y, m, defer_w):
    zb = measure.zero_bubble_step(gpt64_stage(), x, y, models.lm_loss, m, defer_w)
    one_f = pipeline_step(gpt64_stage(), x, y, models.lm_loss, m, "1f1b")
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


def counted_step(x, y, m, schedule):
    """One step on `VirtualDevice`s (logical time): 1F1B with F = 1, B + W = 2, or zero bubble
    with F = B = W = 1. The 1F1B trainer builds its device by name, so the name is rebound
    in its file, course_lib/pipeline/trainer.py, for the call."""
    if schedule != "1f1b":
        return measure.zero_bubble_step(
            tiny_gpt_stage(),
            x,
            y,
            models.lm_loss,
            m,
            schedule == "deferred",
            (1, 1, 1),
            clock=measure.VirtualDevice,
            zb_h1=schedule == "zb-h1",
        )
    saved = trainer.EmulatedDevice
    trainer.EmulatedDevice = measure.VirtualDevice
    try:
        return pipeline_step(tiny_gpt_stage(), x, y, models.lm_loss, m, "1f1b", 1, 2)
    finally:
        trainer.EmulatedDevice = saved


@pytest.mark.parametrize("m", [4, 8])
def test_zero_bubble_runs_the_simulators_order_and_idles_less_than_1f1b(pool4, m):
    x, y = data.tokens(8, seed=6)
    counted = {
        name: Timeline.from_logs(pool4.launch(counted_step, x, y, m, name, timeout=TIMEOUT))
        for name in ("1f1b", "same memory", "deferred", "zb-h1")
    }
    for name, defer_w in (("same memory", False), ("deferred", True), ("zb-h1", False)):
        zb_h1 = name == "zb-h1"
        timeline = counted[name]
        simulated = simulate_zb_h1(P, m) if zb_h1 else simulate_zero_bubble(P, m, defer_w=defer_w)
        order = measure.zero_bubble_order(P, m, defer_w, zb_h1=zb_h1)
        for s in range(P):
            ran = sorted((t for t in timeline.tasks if t.stage == s), key=lambda t: t.start)
            assert [(t.kind, t.micro) for t in ran] == [(o.kind, o.micro) for o in order[s]]
        # real messages decided the waits: the counted timeline is the simulated one
        spans = [
            {(t.stage, t.kind, t.micro): (t.start, t.end) for t in x.tasks}
            for x in (timeline, simulated)
        ]
        assert spans[0].keys() == spans[1].keys()
        for op, span in spans[1].items():
            assert spans[0][op] == pytest.approx(span, abs=1e-9), op
    assert counted["1f1b"].bubble == pytest.approx(bubble_formula(P, m), abs=1e-9)
    assert counted["deferred"].bubble == pytest.approx(zero_bubble_formula(P, m), abs=1e-9)
    assert counted["zb-h1"].bubble == pytest.approx(zero_bubble_formula(P, m), abs=1e-9)
    assert counted["deferred"].bubble < counted["same memory"].bubble < counted["1f1b"].bubble
    assert counted["deferred"].bubble <= 0.5 * counted["1f1b"].bubble


def test_zero_bubble_memory_is_what_the_ws_owed_hold(pool4):
    x, y = data.tokens(8, seed=6)
    for name, defer_w in (("same memory", False), ("deferred", True), ("zb-h1", False)):
        logs = pool4.launch(counted_step, x, y, 8, name, timeout=TIMEOUT)
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


def test_the_bubble_exercise_takes_7_over_15_7_over_71_and_227(capsys):
    """P = 8: (P-1)/(m+P-1) is 7/15 for m = 8 and 7/71 for m = 64; under 3% needs
    7/(m+7) < 0.03, m > 226.3, so 227 (by hand, not from the formula's code)."""
    right = {"P=8, m=8": 7 / 15, "P=8, m=64": 7 / 71}
    assert check_bubble_shares(right, 227) is True
    assert capsys.readouterr().out.count("✓ Right") == 3
    assert check_bubble_shares({**right, "P=8, m=8": 7 / 8}, 226) is False  # m = 1's bubble
    out = capsys.readouterr().out
    assert "Idle stage-time over all stage-time" in out and "m is a whole number" in out
    assert "0.4667" not in out and "227" not in out
    assert check_bubble_shares({"P=8, m=8": ..., "P=8, m=64": ...}, ...) is None
    assert "Not answered yet" in capsys.readouterr().out


def test_the_in_flight_check_reads_the_simulated_peaks_of_stages_0_and_3(capsys):
    one_f = SimpleNamespace(peak_in_flight=lambda s: 4 - s)  # made up: P - s, P = 4
    assert check_one_f_one_b_in_flight("4", "1", one_f) == (True, True)
    assert "Stage s holds at most P - s" in capsys.readouterr().out
    assert check_one_f_one_b_in_flight("8", "2", one_f) == (False, False)  # GPipe holds all m
    assert check_one_f_one_b_in_flight(..., ..., one_f) == (None, None)


def test_the_zero_bubble_check_takes_the_nearest_share_of_1f1bs_idle_time(capsys):
    one_f = SimpleNamespace(makespan=30.0, bubble=0.3)  # made up: 9 idle per stage
    deferred = SimpleNamespace(makespan=24.0, bubble=0.125)  # 3 idle: a third
    assert check_zero_bubble_idle("a third of", one_f, deferred) is True
    assert "0.33 of 1F1B's idle time" in capsys.readouterr().out
    assert check_zero_bubble_idle("half of", one_f, deferred) is False
    assert check_zero_bubble_idle(..., one_f, deferred) is None


def test_the_measured_zero_bubble_check_reads_the_runs_bubbles_and_ws_owed(capsys):
    """Simulated timelines stand in for the runs: 1F1B's bubble (P-1)/(m+P-1), the deferred
    schedule's (P-1)(F+B-W) idle beside m(F+B+W) (the formulas of course_lib.costs), and the
    last stage owing all m = 8 W's at once."""
    deferred = simulate_zero_bubble(4, 8, defer_w=True)
    runs = {"1f1b": simulate(4, 8, "1f1b", forward_s=1, backward_s=2), deferred.schedule: deferred}
    right = {"1f1b": bubble_formula(4, 8), deferred.schedule: zero_bubble_formula(4, 8)}
    assert check_zero_bubble_measured(right, 8, runs, deferred.schedule) == (True, True)
    capsys.readouterr()
    wrong = {"1f1b": 0.5, deferred.schedule: 0.0}
    assert check_zero_bubble_measured(wrong, 1, runs, deferred.schedule) == (False, False)
    assert "Which stage runs each B soonest" in capsys.readouterr().out
    assert check_zero_bubble_measured(..., ..., runs, deferred.schedule) == (None, None)


def test_the_first_backward_check_finds_the_rank_whose_b0_started_first(capsys):
    def log(stage, b0_start):  # made up: each rank's forward of micro-batch 0, then its B
        tasks = [
            SimpleNamespace(kind="F", micro=0, start=stage),
            SimpleNamespace(kind="B", micro=0, start=b0_start),
        ]
        return SimpleNamespace(stage=stage, tasks=tasks)

    logs = [log(0, 9.0), log(1, 8.0), log(2, 7.0), log(3, 6.0)]
    assert check_first_backward("rank 3", logs) is True
    assert "on the last rank" in capsys.readouterr().out
    assert check_first_backward("rank 0", logs) is False
    assert check_first_backward(..., logs) is None
