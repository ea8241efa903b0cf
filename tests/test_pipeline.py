"""course_lib.pipeline: schedules keep their dependencies and the bubble formula; torch's
pipeline schedules, run on 4 ranks and timed by course_lib.measure.pipeline, train exactly like
one process, run `schedule_order`'s order, and show the formula's bubble plus what the machine
adds; and the best stage partition found by trying every cut is right on hand-solved cases
(against Assignment 8's dynamic program: test_grading_pipeline_partition.py).

Tolerances: a pipeline computes the same sums as single-process training, micro-batch by
micro-batch, so fp32 gradients differ by rounding only (~1e-7): atol 1e-6. A measured bubble
is at least the formula's less 1 point (timing noise can only shorten an idle gap by the
clock's resolution) and at most 10 points above it (messages and late wake-ups on 2 shared
cores: 2-5 points measured on an idle machine).

The zero-bubble schedules: test_pipeline_zero_bubble.py; lecture 8's exercise checks:
test_pipeline_exercises.py.
"""

from __future__ import annotations

import itertools
import math
import time

import pytest
import torch
import torch.nn.functional as F

from course_lib import RankError, data, launch, models, rank, world_size
from course_lib.costs import bubble_formula
from course_lib.measure import pipeline as measure
from course_lib.measure.pipeline import (
    PipelineWidget,
    TimedStage,
    brute_force_partition,
    measure_bubbles,
    op_seconds,
    plot_schedule,
    profile_layers,
    torch_pipeline_step,
)
from course_lib.measure.pipeline import runs as measure_runs
from course_lib.pipeline import (
    BACKWARD,
    FORWARD,
    SCHEDULES,
    Partition,
    Stage,
    Timeline,
    partition_stages,
    schedule_order,
    simulate,
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


def tiny_gpt_stage():
    return models.TinyGPT(seed=0).pipeline_stages(world_size())[rank()]


def gpt_batch():
    return data.tokens(8, seed=3)


def gpt_reference_grads(x, y):
    model = models.TinyGPT(seed=0)
    loss = models.lm_loss(model(x), y)
    loss.backward()
    return [[p.grad for p in stage.parameters()] for stage in model.pipeline_stages(P)], loss


def run_step(x, y, m, schedule, forward_s=0.0, backward_s=0.0):
    return torch_pipeline_step(
        tiny_gpt_stage(), x, y, models.lm_loss, m, schedule, forward_s, backward_s
    )


def assert_grads_match(per_rank_grads, reference):
    for stage, (got, want) in enumerate(zip(per_rank_grads, reference, strict=True)):
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            err = (g - w).abs().max().item()
            assert err <= ATOL, f"stage {stage}, parameter {i}: max abs error {err:.3g}"


def ran_order(log):
    return [(t.kind, t.micro) for t in sorted(log.tasks, key=lambda t: t.start)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_torch_pipeline_matches_single_process_and_runs_schedule_order(pool4, schedule):
    x, y = gpt_batch()
    reference, loss = gpt_reference_grads(x, y)
    for m in (4, 8):
        logs = pool4.launch(run_step, x, y, m, schedule, timeout=TIMEOUT)
        assert_grads_match([log.grads for log in logs], reference)
        assert math.isclose(logs[-1].loss, loss.item(), rel_tol=1e-5)  # mean of micro-batches
        assert all(log.loss is None for log in logs[:-1])
        # the recorder saw every op torch ran, in the course's order for that schedule
        for s, log in enumerate(logs):
            want = [(op.kind, op.micro) for op in schedule_order(schedule, P, m)[s]]
            assert ran_order(log) == want, (schedule, m, s)


def test_recorded_times_are_the_wall_clocks():
    """No logical clock: an op lasts its sleep plus its compute, and one step's ops, one after
    another, take as long as the step did on the clock the test reads."""
    x, y = gpt_batch()
    start = time.perf_counter()
    (log,) = launch(run_step, x, y, 2, "gpipe", 0.02, 0.03, world_size=1, timeout=TIMEOUT)
    elapsed = time.perf_counter() - start
    lengths = op_seconds(Timeline.from_logs([log]))
    assert len(lengths["F"]) == len(lengths["B"]) == 2
    assert all(0.02 <= t < 0.02 + 0.5 for t in lengths["F"])
    assert all(0.03 <= t < 0.03 + 0.5 for t in lengths["B"])
    first, last = min(t.start for t in log.tasks), max(t.end for t in log.tasks)
    assert 2 * (0.02 + 0.03) <= last - first <= elapsed  # real seconds inside the launch
    # the lengths differ from op to op, as measured times do (a logical clock repeats 0.02)
    assert len({round(t, 9) for t in lengths["F"] + lengths["B"]}) == 4


def test_timed_stage_sleeps_and_keeps_the_stages_gradients():
    stage = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    plain = torch.nn.Linear(3, 2)
    plain.load_state_dict(stage.state_dict())
    timed = TimedStage(stage, 0.01, 0.02)
    start = time.perf_counter()
    out = timed(x)
    forward = time.perf_counter() - start
    out.sum().backward()
    backward = time.perf_counter() - start - forward
    plain(x).sum().backward()
    assert forward >= 0.01 and backward >= 0.02
    torch.testing.assert_close(out, plain(x), rtol=0, atol=0)
    for p, q in zip(stage.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    assert list(timed.parameters()) == list(stage.parameters())


def mlp_steps(x, y, m, schedule):
    """An MLP chain cut into one Linear(+ReLU) per rank, trained 2 steps with SGD."""
    layers = list(models.MLP((8, 16, 16, 16, 4), seed=1).layers)
    stage = torch.nn.Sequential(*layers[2 * rank() : 2 * rank() + 2])
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.1)
    for _ in range(2):
        torch_pipeline_step(stage, x, y, F.mse_loss, m, schedule)
        optimizer.step()
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


def on_a_stand_in_device(schedule):
    """torch_pipeline_step at world size 1 with device() answering "meta" (no GPU here): a
    stage, batch or buffer left on the CPU fails with "Tensor on device cpu is not on the
    expected device meta", as it would on a GPU. Meta tensors hold no values, so .item()
    answers 0."""
    real_item = torch.Tensor.item
    saved = measure_runs.device, torch.Tensor.item  # device() as runs.py reads it
    measure_runs.device = lambda: torch.device("meta")
    torch.Tensor.item = lambda t: 0.0 if t.is_meta else real_item(t)
    try:
        x, y = gpt_batch()
        out = torch_pipeline_step(models.TinyGPT(seed=0), x, y, models.lm_loss, 2, schedule)
        return [g.device.type for g in out.grads]
    finally:
        measure_runs.device, torch.Tensor.item = saved


def test_torch_pipeline_step_keeps_everything_on_the_ranks_device():
    devices = launch(on_a_stand_in_device, "gpipe", world_size=1)[0]
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


def test_measured_bubble_is_the_formula_plus_what_the_machine_adds(pool4):
    x, y = data.tokens(16, seed=4)
    logs = pool4.launch(
        measure_bubbles,
        tiny_gpt_stage,
        x,
        y,
        models.lm_loss,
        ("gpipe", "1f1b"),
        (4, 16),
        0.04,
        0.08,
        timeout=120,
    )
    for key in logs[0]:
        run = Timeline.from_logs([log[key] for log in logs])
        formula = bubble_formula(P, key[1])
        assert formula - 0.01 <= run.bubble <= formula + 0.10, f"{key}: {run.bubble:.3f}"
        # the sleeps alone, played by the simulator, are a floor the real step cannot beat
        assert run.makespan >= simulate(P, key[1], key[0], 0.04, 0.08).makespan, key


def test_bad_micro_batch_count_is_a_clear_error(pool4):
    x, y = gpt_batch()
    with pytest.raises(RankError, match="does not split into m=3"):
        pool4.launch(run_step, x, y, 3, "1f1b", timeout=TIMEOUT)


# --- the best partition -------------------------------------------------------------------


def test_partition_examples_and_noam():
    # a slow link after layer 1 and a heavy layer 3: cut elsewhere, give layer 3 its own stage
    best = brute_force_partition([1, 1, 1, 4], [0.1, 5.0, 0.1, 0.1], 2, replicate=False)
    assert [(s.first, s.last) for s in best.stages] == [(0, 2), (3, 3)] and best.time == 4
    # no weights to synchronise: replicating the whole model on 4 machines is best (DP)
    dp_only = brute_force_partition([1.0, 1.0, 1.0], [1.0] * 3, 4)
    assert dp_only.stages == (dp_only.stages[0],) and dp_only.time == 0.75 and dp_only.noam == 1
    # NOAM: an input stage on 1 of 4 machines needs 4 micro-batches in flight to fill them
    assert Partition(1.0, (Stage(0, 0, 1), Stage(1, 2, 3))).noam == 4
    stages = partition_stages(list(models.TinyGPT().layers()), best)
    assert [len(s) for s in stages] == [3, 1]
    with pytest.raises(ValueError, match="one time and one activation size per layer"):
        brute_force_partition([1.0, 2.0], [1.0], 2)


def test_profile_layers_measures_output_bytes_and_positive_times():
    layers = list(models.TinyGPT().layers())
    x, _ = data.tokens(2, seed=0)
    times, sizes = profile_layers(layers, x, repeats=2)
    assert all(t > 0 for t in times)
    d, vocab = models.GPTConfig().d_model, models.GPTConfig().vocab_size
    assert sizes == [2 * 16 * d * 4] * 3 + [2 * 16 * vocab * 4]  # fp32 outputs of each layer
