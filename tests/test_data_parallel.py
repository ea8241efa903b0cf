"""course_lib.data_parallel: the host scheme and all-reduce loop match single-process training,
timelines are well formed, the timing comm hook still averages, stragglers show in step times;
and the large-batch measurements (course_lib.measure.data_parallel) against independent ones.

Tolerances: 4 ranks against single-process training on the full batch
differ by rounding only, so fp32 atol 1e-6 for SGD and 1e-5 for Adam.
"""

from __future__ import annotations

import re
import statistics
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib import (
    CommCounter,
    RankError,
    WireCounter,
    compare,
    costs,
    data,
    models,
    rank,
)
from course_lib.data_parallel import (
    DDPTimeline,
    accumulation_step,
    flat_parameters,
    host_step,
    local_sgd,
    plot_timeline,
    train_data_parallel,
)
from course_lib.measure import data_parallel as large_batches

P = 4
SIZES = (8, 32, 32, 4)
BATCH, STEPS = 32, 4
TOLERANCE = {"sgd": 1e-6, "adam": 1e-5}


def make_optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01)


def full_batches():
    x, y = data.regression(256, in_dim=SIZES[0], out_dim=SIZES[-1])
    return data.batches(x, y, BATCH, STEPS)


def single_process_reference(kind):
    model = models.MLP(SIZES)
    compare.train(model, full_batches(), F.mse_loss, make_optimizer(kind, model.parameters()))
    return model.state_dict()


# --- the host scheme ------------------------------------------------------------------------


def host_training(kind):
    model = models.MLP(SIZES)
    optimizer = make_optimizer(kind, model.parameters()) if rank() == 0 else None
    with CommCounter() as counter:
        for x, y in full_batches():
            if rank() != 0:  # workers know only the shape: poison the values to prove it
                x, y = torch.full_like(x, float("nan")), torch.full_like(y, float("nan"))
            host_step(model, optimizer, F.mse_loss, x, y)
    return model.state_dict(), counter.bytes_sent, counter.bytes_received


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_host_scheme_matches_single_process_training(pool4, kind):
    results = pool4.launch(host_training, kind, timeout=60)
    reference = single_process_reference(kind)
    for r, (state, _, _) in enumerate(results):
        tol = TOLERANCE[kind]
        compare.assert_same_parameters(state, reference, rtol=0, atol=tol, context=f"rank {r}")
        # The host broadcast its parameters: every rank holds exactly the same values.
        for name, value in state.items():
            assert torch.equal(value, results[0][0][name]), f"rank {r}: {name} differs"


def test_host_scheme_traffic_is_concentrated_at_the_host(pool4):
    results = pool4.launch(host_training, "sgd", timeout=60)
    model_bytes = models.count_parameters(models.MLP(SIZES)) * 4
    shard_bytes = BATCH // P * (SIZES[0] + SIZES[-1]) * 4
    host_sent, host_received = results[0][1:]
    # The host receives P-1 gradients and sends P-1 parameter copies and P-1 data shards.
    assert host_received == STEPS * (P - 1) * model_bytes
    assert host_sent == STEPS * (P - 1) * (model_bytes + shard_bytes)
    for _, sent, received in results[1:]:
        assert sent == STEPS * model_bytes
        assert received == STEPS * (model_bytes + shard_bytes)
    # The lecture's formula (course_lib.costs) is what was counted.
    model = costs.host_bytes(model_bytes, P * shard_bytes, P)
    assert [STEPS * b for b in model["host"]] == [host_sent, host_received]
    assert [STEPS * b for b in model["worker"]] == list(results[1][1:])


def host_step_uneven():
    model = models.MLP(SIZES)
    x, y = data.regression(30, in_dim=SIZES[0], out_dim=SIZES[-1])
    host_step(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, x, y)


def test_host_step_rejects_a_batch_that_does_not_split_evenly(pool4):
    with pytest.raises(RankError, match="does not split into 4 equal shards"):
        pool4.launch(host_step_uneven, timeout=30)


# --- the all-reduce loop, and DDP through it -------------------------------------------------


def allreduce_training(kind, use_ddp):
    model = models.MLP(SIZES)
    trained = DDP(model) if use_ddp else model
    optimizer = make_optimizer(kind, trained.parameters())
    log = train_data_parallel(trained, optimizer, F.mse_loss, full_batches())
    return model.state_dict(), log


@pytest.mark.parametrize("use_ddp", [False, True], ids=["allreduce_loop", "torch_ddp"])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_data_parallel_matches_single_process_training(pool4, kind, use_ddp):
    results = pool4.launch(allreduce_training, kind, use_ddp, timeout=60)
    reference = single_process_reference(kind)
    for r, (state, log) in enumerate(results):
        tol = TOLERANCE[kind]
        compare.assert_same_parameters(state, reference, rtol=0, atol=tol, context=f"rank {r}")
        assert len(log.losses) == len(log.step_s) == STEPS
        # Same start, same averaged gradient, same deterministic step: identical replicas.
        for name, value in state.items():
            assert torch.equal(value, results[0][0][name]), f"rank {r}: {name} differs"
    # The mean of the ranks' shard losses is the single-process loss of the first batch.
    x, y = full_batches()[0]
    first = F.mse_loss(models.MLP(SIZES)(x), y).item()
    assert statistics.fmean(log.losses[0] for _, log in results) == pytest.approx(first, rel=1e-6)


def loop_and_ddp_side_by_side():
    plain, wrapped = models.MLP(SIZES), DDP(models.MLP(SIZES))
    for net in (plain, wrapped):
        train_data_parallel(net, make_optimizer("sgd", net.parameters()), F.mse_loss,
                            full_batches())  # fmt: skip
    return compare.errors(flat_parameters(plain), flat_parameters(wrapped.module))[0]


def test_allreduce_loop_and_torch_ddp_agree(pool4):
    for max_abs in pool4.launch(loop_and_ddp_side_by_side, timeout=60):
        assert max_abs <= 1e-6


# --- timelines and the comm hook ------------------------------------------------------------


def timeline_run(use_ddp, bucket_cap_mb):
    model = models.MLP(SIZES)
    trained = DDP(model, bucket_cap_mb=bucket_cap_mb) if use_ddp else model
    timeline = DDPTimeline(trained)
    optimizer = make_optimizer("sgd", trained.parameters())
    return train_data_parallel(trained, optimizer, F.mse_loss, full_batches(), timeline=timeline)


def events_of(log, step, kind):
    return [e for e in log.events if e.step == step and e.kind == kind]


@pytest.mark.parametrize("use_ddp", [False, True], ids=["allreduce_loop", "torch_ddp"])
def test_timeline_records_are_well_formed_and_ordered(pool4, use_ddp):
    # 0.001 MiB buckets: every layer's gradients fill at least one bucket of their own.
    logs = pool4.launch(timeline_run, use_ddp, 0.001, timeout=60)
    for r, log in enumerate(logs):
        assert {e.rank for e in log.events} == {r}
        assert all(e.start <= e.end for e in log.events)
        for step in range(STEPS):
            (forward,) = events_of(log, step, "forward")
            (optimizer,) = events_of(log, step, "optimizer")
            backward = events_of(log, step, "backward")
            allreduce = events_of(log, step, "allreduce")
            # Backward runs from the last layer to the first, each layer once, after forward.
            assert [e.name for e in backward] == ["layers.4", "layers.2", "layers.0"]
            assert forward.end <= backward[0].start
            assert all(a.end <= b.start for a, b in zip(backward, backward[1:], strict=False))
            # Every all-reduce starts after backward began, and ends before the step.
            assert allreduce
            assert all(backward[0].start <= e.start and e.end <= optimizer.start
                       for e in allreduce)  # fmt: skip
            if use_ddp:
                # DDP's buckets cover every parameter tensor exactly once ...
                counts = [int(re.search(r"\((\d+) tensors\)", e.name)[1]) for e in allreduce]
                assert sum(counts) == 6
                # ... and from step 1 (DDP starts with one bucket, then rebuilds them in the
                # order gradients arrived) there are several, the first one all-reduced while
                # backward is still running: overlap.
                if step >= 1:
                    assert len(counts) > 1
                    assert min(e.start for e in allreduce) < backward[-1].end
            else:
                # One all-reduce of all gradients, only after the whole backward.
                assert len(allreduce) == 1 and allreduce[0].start >= backward[-1].end


def gradients_after_one_backward(with_timeline):
    model = DDP(models.MLP(SIZES), bucket_cap_mb=0.001)
    if with_timeline:
        DDPTimeline(model)
    x, y = full_batches()[0]
    F.mse_loss(model(data.shard(x, rank(), P)), data.shard(y, rank(), P)).backward()
    return {name: p.grad.clone() for name, p in model.module.named_parameters()}


def test_timing_comm_hook_still_averages_gradients(pool4):
    hooked = pool4.launch(gradients_after_one_backward, True, timeout=60)
    plain = pool4.launch(gradients_after_one_backward, False, timeout=60)
    # The independent reference: the full-batch gradient of a single process.
    model = models.MLP(SIZES)
    x, y = full_batches()[0]
    F.mse_loss(model(x), y).backward()
    expected = {name: p.grad for name, p in model.named_parameters()}
    for r in range(P):
        compare.assert_same_parameters(hooked[r], plain[r], rtol=0, atol=1e-7, context=f"r{r}")
        compare.assert_same_parameters(hooked[r], expected, rtol=0, atol=1e-6, context=f"r{r}")


def test_plot_timeline_draws_one_bar_per_event(pool4):
    import matplotlib

    matplotlib.use("Agg")
    logs = pool4.launch(timeline_run, True, 0.001, timeout=60)
    events = {r: log.events for r, log in enumerate(logs)}
    ax = plot_timeline(events, step=1)
    assert len(ax.patches) == sum(1 for log in logs for e in log.events if e.step == 1)
    with pytest.raises(ValueError, match="no events"):
        plot_timeline(events, step=99)


# --- stragglers -----------------------------------------------------------------------------


def step_times(straggler):
    model = models.MLP(SIZES)
    batches = full_batches() * 2
    log = train_data_parallel(
        model, make_optimizer("sgd", model.parameters()), F.mse_loss, batches, straggler=straggler
    )
    dist.barrier()
    return log.step_s


def test_a_straggler_slows_every_rank(pool4):
    delay = 0.1
    normal = pool4.launch(step_times, None, timeout=60)
    slowed = pool4.launch(step_times, (2, delay), timeout=60)
    for r in range(P):
        # Skip step 0 (first all-reduce sets up connections); then every step waits for rank 2.
        extra = statistics.median(slowed[r][1:]) - statistics.median(normal[r][1:])
        assert extra >= 0.8 * delay, f"rank {r}: steps only {extra * 1000:.0f} ms slower"
        assert min(slowed[r][1:]) >= 0.8 * delay


def bad_straggler():
    model = models.MLP(SIZES)
    optimizer = make_optimizer("sgd", model.parameters())
    train_data_parallel(model, optimizer, F.mse_loss, full_batches(), straggler=(7, 0.1))


def test_straggler_rank_must_exist(pool4):
    with pytest.raises(RankError, match="straggler rank 7 is not in 0..3"):
        pool4.launch(bad_straggler, timeout=30)


# --- fewer all-reduces: gradient accumulation under no_sync, local SGD ------------------------

K = 4  # micro-batches per step: each full batch of 32 is K x P ranks x 2 samples


def accumulated_training(no_sync):
    model = DDP(models.MLP(SIZES))
    optimizer = make_optimizer("sgd", model.parameters())
    written = []
    for x, y in full_batches():
        micro = zip(x.chunk(K), y.chunk(K), strict=True)
        mine = [(data.shard(a, rank(), P), data.shard(b, rank(), P)) for a, b in micro]
        with WireCounter() as wire:
            accumulation_step(model, optimizer, F.mse_loss, mine, no_sync=no_sync)
        written.append(wire.bytes_written)
    return model.module.state_dict(), statistics.median(written)


def test_accumulation_equals_the_full_batch_and_no_sync_sends_a_kth(pool4):
    reference = single_process_reference("sgd")
    runs = {flag: pool4.launch(accumulated_training, flag, timeout=60) for flag in (False, True)}
    for flag, results in runs.items():
        for r, (state, _) in enumerate(results):
            compare.assert_same_parameters(state, reference, rtol=0, atol=TOLERANCE["sgd"],
                                           context=f"no_sync={flag}, rank {r}")  # fmt: skip
    # Measured bytes on the wire: one all-reduce per step instead of K (gloo's headers aside).
    for r in range(P):
        share = runs[True][r][1] / runs[False][r][1]
        assert 0.2 <= share <= 0.3, f"rank {r}: no_sync wrote {share:.2f} of the bytes"


def test_accumulation_needs_a_ddp_model():
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        accumulation_step(models.MLP(SIZES), None, F.mse_loss, [])


def local_then_allreduce(every):
    local = models.MLP(SIZES)
    with WireCounter() as wire:
        losses = local_sgd(local, torch.optim.SGD(local.parameters(), lr=0.1), F.mse_loss,
                           full_batches(), every)  # fmt: skip
    synced = models.MLP(SIZES)
    train_data_parallel(synced, torch.optim.SGD(synced.parameters(), lr=0.1), F.mse_loss,
                        full_batches())  # fmt: skip
    return local.state_dict(), synced.state_dict(), losses, wire.bytes_written


def test_local_sgd_every_step_is_data_parallel_and_every_k_sends_a_kth(pool4):
    every_step = pool4.launch(local_then_allreduce, 1, timeout=60)
    for r, (local, synced, losses, _) in enumerate(every_step):
        compare.assert_same_parameters(local, synced, rtol=0, atol=1e-6, context=f"rank {r}")
        assert len(losses) == STEPS
    every_two = pool4.launch(local_then_allreduce, 2, timeout=60)  # STEPS = 4: averaged at 2, 4
    for r, (local, _, _, written) in enumerate(every_two):
        for name, value in local.items():  # just averaged: the copies are one model again
            assert torch.equal(value, every_two[0][0][name]), f"rank {r}: {name} differs"
        assert 0.4 <= written / every_step[r][3] <= 0.6
    differs = max(compare.errors(every_two[0][0][n], every_step[0][0][n])[0] for n in local)
    assert differs > 1e-4  # drifting copies averaged twice are not the synchronous model


def test_local_sgd_needs_a_period_of_at_least_one_step():
    with pytest.raises(ValueError, match=">= 1"):
        local_sgd(models.MLP(SIZES), None, F.mse_loss, [], every=0)


# --- large batches (course_lib.measure.data_parallel) -----------------------------------------


def test_gradient_noise_scale_is_the_covariance_trace_over_the_squared_mean():
    rows = 0.5 + torch.randn(
        200, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    # Independent reference: torch.cov's unbiased covariance of the coordinates.
    expected = torch.trace(torch.cov(rows.T)) / rows.mean(dim=0).square().sum()
    assert large_batches.gradient_noise_scale(rows) == pytest.approx(expected.item(), rel=1e-12)


def test_per_example_gradients_equal_one_backward_per_example():
    x, y = large_batches.large_batch_task(n=6)
    model = models.MLP(large_batches.SIZES)
    rows = large_batches.per_example_gradients(model, x, y)
    for i in range(len(x)):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        one = torch.cat([p.grad.flatten() for p in model.parameters()])
        torch.testing.assert_close(rows[i], one, rtol=1e-5, atol=1e-7)


def test_fit_critical_batch_recovers_the_model_it_fits():
    best = {b: (0.1, 50 * (1 + 200 / b)) for b in (8, 32, 128, 512)}
    s_min, b_crit = large_batches.fit_critical_batch(best)
    assert (s_min, b_crit) == (pytest.approx(50, rel=1e-9), pytest.approx(200, rel=1e-9))


def test_warmup_grows_the_rate_linearly_then_holds_it():
    factors = [large_batches.warmup_factor(step, 4) for step in range(1, 7)]
    assert factors == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert large_batches.warmup_factor(1, 0) == 1.0


def test_a_larger_batch_takes_fewer_steps_and_too_large_a_rate_diverges():
    small = large_batches.steps_to_loss(16, 0.1, target=0.3)
    large = large_batches.steps_to_loss(256, 0.8, target=0.3)
    assert small is not None and large is not None and large < small / 2
    assert large_batches.steps_to_loss(1024, 6.4, target=0.3) is None
    best = large_batches.best_steps({16: {0.1: small, 0.4: None}, 256: {0.8: large}})
    assert best == {16: (0.1, small), 256: (0.8, large)}


# --- DDP's two tools: gradient-ready hooks, asynchronous all-reduce --------------------------


def test_gradients_become_ready_from_the_last_layer_to_the_first():
    order = large_batches.gradient_ready_order(SIZES)
    names = [name for name, _ in models.MLP(SIZES).named_parameters()]
    assert sorted(order) == sorted(names)  # every parameter, once
    layers = [int(name.split(".")[1]) for name in order]
    assert layers == sorted(layers, reverse=True)


def right_async(tensor, compute):
    work = dist.all_reduce(tensor, async_op=True)
    result = compute()
    work.wait()
    return result


def forgets_the_result(tensor, compute):
    right_async(tensor, compute)
    return "something else"


def stub(tensor, compute): ...


@pytest.mark.parametrize(
    "fn,verdict", [(right_async, True), (forgets_the_result, False), (stub, None)]
)
def test_the_async_exercise_check_tells_right_wrong_and_unanswered(fn, verdict, capsys):
    assert large_batches.check_all_reduce_while_computing(fn) is verdict
    assert capsys.readouterr().out


def test_the_ring_bytes_limit_exercise_is_checked_off_the_page(capsys):
    assert large_batches.check_ring_bytes_limit(2) is True  # 2(P-1)/P -> 2
    assert "✓ Right: 2" in capsys.readouterr().out
    assert large_batches.check_ring_bytes_limit(1) is False
    out = capsys.readouterr().out
    assert "2x too small" in out and "What does (P-1)/P tend to?" in out and "2.0" not in out
    assert large_batches.check_ring_bytes_limit(...) is None
    assert "Not answered yet" in capsys.readouterr().out


def test_the_redundancy_exercise_is_checked_off_the_page(capsys):
    # worked by hand: one copy is 16 x 7e9 = 1.12e11 bytes; 63 more of them, or 1/64 of one
    check = large_batches.check_redundancy
    assert check(63 * 1.12e11, 1.12e11 / 64) is True
    assert capsys.readouterr().out.count("✓ Right") == 2
    assert check(1.12e11, 1.12e11) is False  # one copy, and ZeRO-3 not sharding at all
    out = capsys.readouterr().out
    assert "63x too small. One copy is 16 bytes x 7e9." in out
    assert "64x too large. Every kind of state is divided by P." in out
    assert "7.056e+12" not in out and "1.75e+09" not in out
    assert check(64 * 1.12e11, 1.12e11 / 64) is False  # counting the copy that is needed
    assert "1.6% too large" in capsys.readouterr().out
    assert check(63 * 1.12e11, ...) is False  # one right, one still unanswered
    assert check(..., ...) is None
    assert capsys.readouterr().out.count("Not answered yet") == 3


def test_the_overlap_table_prints_medians_without_the_first_two_steps(capsys):
    """Lecture 3's table: medians in ms of steps 2 on, the loop's parts summed both ways."""
    from course_lib.data_parallel import Event, TrainLog

    def log(step: float, backward: float, sync: float, forward: float = 0.0) -> TrainLog:
        slow = [9.0, 9.0]  # steps 0 and 1 (set-up, bucket rebuild): left out of the medians
        events = [Event(0, s, "forward", "f", 0.0, forward) for s in range(5)]
        return TrainLog(
            step_s=slow + [step] * 2,
            backward_s=slow + [backward] * 2,
            sync_s=slow + [sync] * 2,
            events=events,
        )

    runs = {
        "all-reduce after backward": [log(0.010, 0.004, 0.005, forward=0.001)],
        "DDP, one 1000 MB bucket": [log(0.008, 0.007, 0.0)],
        "DDP, 4 MB buckets": [log(0.005, 0.004, 0.0)],
    }
    large_batches.overlap_table(runs)
    out = capsys.readouterr().out
    assert re.search(r"all-reduce after backward\s+10\.0ms\s+4\.0ms\s+5\.0ms", out)
    assert "T_fwd = 1.0 ms, T_bwd = 4.0 ms, T_comm = 5.0 ms" in out
    assert "T_fwd + T_bwd + T_comm      = 10.0 ms" in out
    assert "T_fwd + max(T_bwd, T_comm) = 6.0 ms" in out
    assert "2.00x as fast per step as all-reduce after backward" in out
    assert "1.60x as fast per step as DDP, one 1000 MB bucket" in out


# --- the predictions' checks, with made-up measurements -----------------------------------------


def test_the_first_ready_check_takes_the_first_name_the_hooks_saw(capsys):
    order = ["layers.4.bias", "layers.4.weight", "layers.0.bias", "layers.0.weight"]
    assert large_batches.check_first_ready("layers.4.bias", order) is True
    assert "the last layer's gradients come first" in capsys.readouterr().out
    assert large_batches.check_first_ready("layers.0.weight", order) is False
    assert large_batches.check_first_ready(..., order) is None


def test_the_straggler_check_takes_rank_0s_growth_nearest_an_option(capsys):
    def run(ms):  # made up: two set-up steps, then steps of `ms` milliseconds
        return [SimpleNamespace(step_s=[1.0, 1.0] + [ms / 1000] * 5)]

    assert large_batches.check_rank0_grows_by("50 ms", run(20), run(65)) is True
    assert "Rank 0 grew by 45.0 ms" in capsys.readouterr().out
    assert large_batches.check_rank0_grows_by("0 ms", run(20), run(65)) is False
    assert large_batches.check_rank0_grows_by("0 ms", run(20), run(19)) is True  # no growth
    assert large_batches.check_rank0_grows_by(..., run(20), run(65)) is None


def test_the_large_batch_check_divides_the_best_steps(capsys):
    best = {256: (0.8, 300), 1024: (1.6, 200)}  # made up: 1.5x fewer steps
    assert large_batches.check_steps_fall_from_256_to_1024("less than 2x", best) is True
    assert "300 -> 200 steps" in capsys.readouterr().out
    assert large_batches.check_steps_fall_from_256_to_1024("about 4x", best) is False
    assert large_batches.check_steps_fall_from_256_to_1024(..., best) is None


def test_the_no_sync_check_takes_the_share_of_the_bytes_written(capsys):
    accumulated = {False: [(None, 40_000)], True: [(None, 10_500)]}  # made up: about 1/4
    assert large_batches.check_no_sync_sends("about a quarter", accumulated, 4) is True
    assert "Only the last of the 4 backwards" in capsys.readouterr().out
    assert large_batches.check_no_sync_sends("the same", accumulated, 4) is False
    assert large_batches.check_no_sync_sends(..., accumulated, 4) is None
