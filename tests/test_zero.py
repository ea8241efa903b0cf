"""course_lib.zero: the bytes a rank holds under DDP, ZeroRedundancyOptimizer and FSDP2,
their training against single-process AdamW, the traffic per step, and sharded checkpoints.

Tolerances: distributed AdamW differs from single-process AdamW by
rounding only; in fp64 that is ~1e-14, so atol 1e-10. (In fp32 TinyGPT's key biases, whose
true gradient is exactly zero, get Adam-amplified rounding noise of ~1e-4: fp64 avoids it.)
Mixed precision (bf16 compute, fp32 master): losses within 2e-2 of fp32 (measured ~6e-4).
Prefetching changes when all-gathers run, not the arithmetic: float64, atol 1e-12, rtol 0.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from course_lib import RankError, WorkerPool, compare, data, models, rank, world_size, zero
from course_lib.costs import zero_comm_bytes
from course_lib.zero import (
    STAGES,
    build,
    checkpoint_files,
    consolidate,
    full_parameters,
    load_sharded,
    measured_step,
    save_sharded,
    shard_units,
    train_stage,
)

P = 4
BATCH, STEPS, LR = 16, 3, 1e-2


def make_batches(steps=STEPS):
    x, y = data.tokens(BATCH * steps, seed=1)
    return data.batches(x, y, BATCH, steps)


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def chunk_numel(shape, r, p):
    """Elements of rank r's piece of a tensor cut along dim 0 like torch.chunk (FSDP2)."""
    size = math.ceil(shape[0] / p)
    rows = max(0, min(size, shape[0] - r * size))
    return rows * math.prod(shape[1:])


# --- bytes held, and traffic, on 4 ranks -----------------------------------------------------


def measure_all_stages(batches):
    """Each stage's measurement, and the bytes expected from plain numel * element_size."""
    reference = models.TinyGPT(seed=0)
    full = nbytes(reference.parameters())
    r, p = rank(), world_size()
    shard = 4 * sum(chunk_numel(t.shape, r, p) for t in reference.parameters())
    largest_unit = max(nbytes(u.parameters()) for u in shard_units(reference))
    out = {}
    for stage in STAGES:
        run = train_stage(stage, batches, lr=LR)
        expected = {"params_in_step": full, "grads": full, "optimizer_state": 2 * full}
        if stage == "zero1":
            _, optimizer = build(stage, models.TinyGPT(seed=0), lr=LR)
            owned = optimizer.optim.param_groups  # the parameters this rank's AdamW steps
            expected["optimizer_state"] = 2 * nbytes(t for g in owned for t in g["params"])
        if stage in ("zero2", "zero3"):
            expected.update(grads=shard, optimizer_state=2 * shard, params_at_rest=shard)
        if stage == "zero3":
            expected["params_in_step"] = shard
        out[stage] = (run, expected, shard, largest_unit)
    return out


@pytest.fixture(scope="module")
def measured(pool4):
    return pool4.launch(measure_all_stages, make_batches(), timeout=120)


@pytest.mark.parametrize("stage", STAGES)
def test_bytes_held_per_rank_equal_numel_times_element_size(measured, stage):
    for r, per_stage in enumerate(measured):
        run, expected, _, _ = per_stage[stage]
        for kind, value in expected.items():
            got = getattr(run.memory, kind)
            assert got == value, f"rank {r}, {stage}: {kind} is {got} bytes, expected {value}"


def test_sharded_bytes_add_up_to_the_model(measured):
    n_bytes = 4 * models.count_parameters(models.TinyGPT())
    for stage, kind, total in [
        ("zero1", "optimizer_state", 2 * n_bytes),
        ("zero2", "grads", n_bytes),
        ("zero3", "params_at_rest", n_bytes),
        ("zero3", "optimizer_state", 2 * n_bytes),
    ]:
        got = sum(getattr(per_stage[stage][0].memory, kind) for per_stage in measured)
        assert got == total, f"{stage}: {kind} summed over ranks is {got}, expected {total}"


def test_zero3_gathers_one_unit_at_a_time(measured):
    for r, per_stage in enumerate(measured):
        run, _, shard, largest_unit = per_stage["zero3"]
        peak = run.memory.params_peak
        assert shard < peak <= shard + largest_unit, f"rank {r}: peak {peak}, shard {shard}"


@pytest.mark.parametrize("stage", ["ddp", "zero2", "zero3"])
def test_traffic_per_step_matches_the_ring_formula(measured, stage):
    for r, per_stage in enumerate(measured):
        run = per_stage[stage][0]
        expected = zero_comm_bytes(stage, 4 * run.n_params, P)
        assert run.comm_received == pytest.approx(expected, rel=1e-9), f"rank {r}"


def test_fsdp_collective_counts(measured):
    units = len(models.TinyGPT().layers())
    calls2, calls3 = measured[0]["zero2"][0].comm_calls, measured[0]["zero3"][0].comm_calls
    assert calls2 == {"all_gather_single": units, "reduce_scatter_single": units}
    assert calls3 == {"all_gather_single": 2 * units, "reduce_scatter_single": units}


def test_zero_redundancy_optimizer_adds_broadcasts_to_ddps_all_reduce(measured):
    model_bytes = 4 * measured[0]["zero1"][0].n_params
    for per_stage in measured:
        run, expected, _, _ = per_stage["zero1"]
        own = expected["optimizer_state"] // 2  # bytes of the parameters this rank owns
        assert run.comm_received == zero_comm_bytes("ddp", model_bytes, P) + model_bytes - own


# --- training matches single-process AdamW ---------------------------------------------------


def train_fp64(batches):
    return {s: train_stage(s, batches, lr=LR, dtype=torch.float64) for s in STAGES}


def test_every_stage_matches_single_process_adamw(pool4):
    batches = make_batches()
    runs = pool4.launch(train_fp64, batches, timeout=120)
    reference = models.TinyGPT(seed=0, dtype=torch.float64)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    losses = compare.train(reference, batches, models.lm_loss, optimizer)
    for r, per_stage in enumerate(runs):
        for stage, run in per_stage.items():
            compare.assert_same_parameters(
                run.params, reference, rtol=0, atol=1e-10, context=f"rank {r}, {stage}"
            )
            mean_losses = [sum(v) / P for v in zip(*(rs[stage].losses for rs in runs), strict=True)]
            assert mean_losses == pytest.approx(losses, abs=1e-10)


# --- sharded checkpoints -------------------------------------------------------------------


def train_zero3(model, optimizer, batches):
    for x, y in batches:
        measured_step(model, optimizer, x, y)


def checkpoint_round_trip(path, batches):
    first, rest = batches[:3], batches[3:]
    model, optimizer = build("zero3", models.TinyGPT(seed=0), lr=LR)
    train_zero3(model, optimizer, first)
    save_sharded(model, optimizer, path)
    saved = full_parameters(model)
    train_zero3(model, optimizer, rest)  # the uninterrupted run
    uninterrupted = full_parameters(model)

    model, optimizer = build("zero3", models.TinyGPT(seed=0), lr=LR)
    load_sharded(model, optimizer, path)
    train_zero3(model, optimizer, rest)
    resumed = full_parameters(model)

    # Control: the same steps without the checkpoint's optimizer state (fresh AdamW moments).
    model, optimizer = build("zero3", models.TinyGPT(seed=0), lr=LR)
    load_sharded(model, optimizer, path)
    optimizer.state.clear()
    train_zero3(model, optimizer, rest)
    return saved, uninterrupted, resumed, full_parameters(model)


def test_sharded_checkpoint_resumes_identically(pool4, tmp_path):
    path = str(tmp_path / "ckpt")
    results = pool4.launch(checkpoint_round_trip, path, make_batches(6), timeout=120)
    files = checkpoint_files(path)
    assert sorted(f for f in files if f.endswith(".distcp")) == [
        f"__{r}_0.distcp" for r in range(P)
    ], "each rank writes its own shard file"
    saved, uninterrupted, resumed, fresh_moments = results[0]
    compare.assert_same_parameters(resumed, uninterrupted, rtol=0, atol=0, context="resumed")
    assert compare.find_mismatch(fresh_moments, uninterrupted, rtol=0, atol=1e-6), (
        "training without the saved optimizer state should not match: the check is blind"
    )
    rebuilt = consolidate(path)
    compare.assert_same_parameters(rebuilt["model"], saved, rtol=0, atol=0, context="rebuilt")
    n = models.count_parameters(models.TinyGPT())
    moments = sum(t.numel() for s in rebuilt["optimizer"]["state"].values() for t in s.values())
    assert moments - len(rebuilt["optimizer"]["state"]) == 2 * n  # m and v, plus step counters


# --- bad input -----------------------------------------------------------------------------


def uneven_batch():
    x, y = data.tokens(6)
    return train_stage("zero3", [(x, y)])


def test_uneven_batch_is_a_clear_error(pool4):
    with pytest.raises(RankError, match="does not split into 4 equal shards"):
        pool4.launch(uneven_batch, timeout=60)


def test_a_training_step_keeps_everything_on_the_ranks_device(monkeypatch):
    """device() answering "meta" stands in for a GPU (none here): a batch or target left on
    the CPU fails with "Tensor on device cpu is not on the expected device meta", as lecture
    07 did on one GPU. Meta tensors hold no values, so .item() answers 0."""
    real_item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: 0.0 if t.is_meta else real_item(t))
    monkeypatch.setattr(zero, "device", lambda: torch.device("meta"))
    model = models.TinyGPT(seed=0).to("meta")  # where train_stage puts it: on device()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = data.tokens(8, seed=3)
    zero.measured_step(model, optimizer, x, y)
    assert all(p.is_meta and p.grad is None for p in model.parameters())


# --- shard_units on an MLP ---------------------------------------------------------------------


def test_shard_units_takes_an_mlps_linear_layers():
    """MLP's `layers` is an nn.Sequential attribute, not TinyGPT's `layers()` method."""
    mlp = models.MLP((8, 16, 16, 4))
    assert shard_units(mlp) == [m for m in mlp.modules() if isinstance(m, torch.nn.Linear)]
    gpt = models.TinyGPT()
    assert shard_units(gpt) == gpt.layers()


# --- ZeRO in mixed precision: bytes against (2 + 2 + 12)N ------------------------------------
# Tolerance on the losses: bf16 keeps 8 significant bits (relative rounding 2^-9 = 2e-3), so
# a loss near 3.5 computed in bf16 may differ from fp32's by ~1e-2; we allow 2e-2 absolute.
LOSS_ATOL = 2e-2


def measure_mixed(batches):
    from course_lib.measure.zero import train_mixed

    return [train_mixed(stage, batches, lr=LR) for stage in STAGES], train_stage(
        "ddp", batches, lr=LR
    ).losses


@pytest.fixture(scope="module")
def mixed(pool4):
    return pool4.launch(measure_mixed, make_batches(), timeout=180)


def test_mixed_ddp_holds_exactly_2_2_4_4_4_bytes_per_parameter(mixed):
    from course_lib.costs import zero_mixed_bytes

    for runs, _ in mixed:
        run = runs[STAGES.index("ddp")]
        assert run.kinds == zero_mixed_bytes("ddp", run.n_params, P)


def test_mixed_zero1_shards_the_moments_but_not_torchs_master_copy(mixed):
    n = mixed[0][0][0].n_params
    runs = [per_rank[STAGES.index("zero1")] for per_rank, _ in mixed]
    for run in runs:
        assert (run.kinds["weights"], run.kinds["gradients"]) == (2 * n, 2 * n)
        assert run.kinds["master weights"] == 4 * n  # ZeroRedundancyOptimizer: replicated
    assert sum(r.kinds["optimizer: exp_avg"] + r.kinds["optimizer: exp_avg_sq"] for r in runs) == (
        8 * n
    )


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_mixed_fsdp_shards_add_up_to_the_formula(mixed, stage):
    """Over the 4 ranks: fp32 master and moments exactly 4N and 8N (FSDP2's shards), the
    gradient shards 4N (fp32: FSDP2 casts the reduced gradient to the master's dtype, twice
    the formula's bf16 2N); bf16 weights 2N on every rank for ZeRO-2 (kept from forward to the
    end of backward) and none for ZeRO-3 after forward (each unit freed after its forward)."""
    from course_lib.costs import zero_mixed_bytes

    runs = [per_rank[STAGES.index(stage)] for per_rank, _ in mixed]
    n = runs[0].n_params

    def total(kind):
        return sum(r.kinds[kind] for r in runs)

    assert total("master weights") == 4 * n
    assert total("optimizer: exp_avg") == total("optimizer: exp_avg_sq") == 4 * n
    assert total("gradients") == 4 * n
    assert all(r.kinds["weights"] == (2 * n if stage == "zero2" else 0) for r in runs)
    if stage == "zero3":  # what FSDP2 saves on bf16 shards it spends on fp32 gradient shards
        assert sum(r.total for r in runs) == P * sum(zero_mixed_bytes(stage, n, P).values())


def test_mixed_losses_follow_fp32_within_tolerance(mixed):
    for runs, fp32_losses in mixed:
        for run in runs:
            assert len(run.losses) == len(fp32_losses)
            for got, want in zip(run.losses, fp32_losses, strict=True):
                assert abs(got - want) < LOSS_ATOL, (run.stage, run.losses, fp32_losses)


# --- FSDP2 prefetching on a timeline ---------------------------------------------------------


def timelines(batches):
    from course_lib.measure.zero import prefetch_timeline

    return [
        prefetch_timeline(batches, prefetch=p, dtype=torch.float64, bandwidth=20e6, latency=2e-3)
        for p in (False, True)
    ]


@pytest.fixture(scope="module")
def prefetch_runs():
    with WorkerPool(2) as pool:
        yield pool.launch(timelines, make_batches(), timeout=180)


def test_prefetch_changes_when_not_what_the_parameters_become(prefetch_runs):
    """Prefetching moves all-gathers earlier; the arithmetic is the same (float64, atol 1e-12,
    rtol 0; measured: identical)."""
    for off, on in prefetch_runs:
        for name, want in off.params.items():
            torch.testing.assert_close(on.params[name], want, rtol=0, atol=1e-12)


def test_next_units_all_gather_starts_before_the_current_forward_ends_only_with_prefetch(
    prefetch_runs,
):
    for off, on in prefetch_runs:
        n_units = len(on.unit_bytes)
        for i in range(n_units - 1):
            (compute_on,) = on.of("forward", i)
            (compute_off,) = off.of("forward", i)
            assert on.of("all_gather", i + 1)[0].start < compute_on.end, on.events
            assert off.of("all_gather", i + 1)[0].start >= compute_off.end, off.events


def test_prefetch_holds_one_more_unit(prefetch_runs):
    for off, on in prefetch_runs:
        pairs = [a + b for a, b in zip(on.unit_bytes[:-1], on.unit_bytes[1:], strict=True)]
        assert off.gathered_peak == max(on.unit_bytes)
        assert on.gathered_peak == max(pairs)


def test_exposed_time_is_every_gather_without_prefetch_and_at_most_that_with_it(prefetch_runs):
    for off, on in prefetch_runs:
        assert off.exposed_seconds == pytest.approx(off.gather_seconds, rel=1e-9)
        assert 0 <= on.exposed_seconds <= on.gather_seconds


# --- the lecture's exercises on the formulas ----------------------------------------------------
# Each check against numbers worked out here by hand from 2 + 2 + 12 = 16 bytes per parameter
# (GB = 1e9 bytes): a right answer is taken, a wrong one gets the hint and not the answer, and
# `...` is not answered yet.


def test_the_gb_per_gpu_check_takes_the_stages_bytes_and_ddps_63_copies(capsys):
    from course_lib.measure.zero import check_gb_per_gpu

    # 13B on 32 GPUs: ZeRO-1 divides the 12 optimizer bytes by P, ZeRO-2 the 2 gradient bytes
    # too, ZeRO-3 all 16. 7B on 64 GPUs under DDP: 112 GB each, 63 copies beyond the one needed.
    right = {"ddp": 208, "zero1": 52 + 156 / 32, "zero2": 26 + 182 / 32, "zero3": 208 / 32}
    assert check_gb_per_gpu(right, 63 * 112) is True
    assert capsys.readouterr().out.count("✓ Right") == 5
    assert check_gb_per_gpu({**right, "zero2": right["zero1"]}, 112) is False
    out = capsys.readouterr().out
    assert "Which kinds does this stage divide by P?" in out and "count the others" in out
    assert "31.69" not in out and "7056" not in out  # ZeRO-2's GB and the copies' GB
    assert check_gb_per_gpu(right, 64 * 112) is False  # every copy counted, the needed one too
    assert "1.6% too large" in capsys.readouterr().out
    assert check_gb_per_gpu({stage: ... for stage in right}, ...) is None
    assert "Not answered yet" in capsys.readouterr().out


def test_the_zero2_check_takes_2_plus_14_over_4_bytes_per_parameter(capsys):
    from course_lib.measure.zero import check_zero2_bytes_per_param

    assert check_zero2_bytes_per_param(2 + 14 / 4) is True
    assert "✓ Right" in capsys.readouterr().out
    assert check_zero2_bytes_per_param(16 / 4) is False  # ZeRO-3's share
    out = capsys.readouterr().out
    assert "bf16 weights stay whole" in out and "5.5" not in out
    assert check_zero2_bytes_per_param(...) is None
    assert "Not answered yet" in capsys.readouterr().out


def test_the_zero3_check_takes_one_more_ring_pass_of_the_bf16_weights(capsys):
    from course_lib.measure.zero import check_zero3_extra_gb

    assert check_zero3_extra_gb(14 * 63 / 64) is True  # M = 14 GB, (P-1)/P of it once more
    assert "✓ Right" in capsys.readouterr().out
    assert check_zero3_extra_gb(3 * 14 * 63 / 64) is False  # ZeRO-3's whole traffic
    out = capsys.readouterr().out
    assert "Count the ring passes" in out and "13.78" not in out
    assert check_zero3_extra_gb(...) is None
    assert "Not answered yet" in capsys.readouterr().out


def test_the_offload_check_takes_the_gpus_2n_and_the_cpus_14n_over_p(capsys):
    from course_lib.measure.zero import check_offload

    # 7B on 2 GPUs: 2N on the GPU; 14N/2 on the CPU; 2N/2 bytes each way at 16 GB/s, twice
    right = {"GPU GB": 14, "CPU GB": 49, "PCIe seconds": 2 * 7 / 16}
    assert check_offload(right) is True
    assert capsys.readouterr().out.count("✓ Right") == 3
    assert check_offload({**right, "CPU GB": 98}) is False  # the CPU's 14N, not per shard
    out = capsys.readouterr().out
    assert "the copies are per shard" in out and "49" not in out
    assert check_offload({"GPU GB": ..., "CPU GB": ..., "PCIe seconds": ...}) is None
    assert "Not answered yet" in capsys.readouterr().out


def test_the_torch_zero1_check_compares_its_bytes_received_with_ddps(capsys):
    from course_lib.measure.zero import check_torch_zero1_vs_ddp

    def received(ddp, zero1):  # made up: rank 0's runs of every stage on 4 ranks
        got = {"ddp": ddp, "zero1": zero1}
        return {4: [[SimpleNamespace(comm_received=got.get(s, 0)) for s in zero.STAGES]]}

    assert check_torch_zero1_vs_ddp("more", received(150, 225)) is True
    assert "the broadcasts come on top" in capsys.readouterr().out
    assert check_torch_zero1_vs_ddp("the same", received(150, 225)) is False
    assert check_torch_zero1_vs_ddp("the same", received(150, 153)) is True  # within 5%
    assert check_torch_zero1_vs_ddp(..., received(150, 225)) is None


def test_the_prefetch_check_counts_the_gathered_peak_in_blocks(capsys):
    from course_lib.measure.zero import check_blocks_gathered_with_prefetch

    def ranks(peak):  # made up: two ranks' timelines, units of 100 and 1000 bytes
        return [SimpleNamespace(unit_bytes=[100, 1000], gathered_peak=p) for p in (peak, peak - 50)]

    on, off = ranks(2100), ranks(1100)
    assert check_blocks_gathered_with_prefetch("2", on, off) is True
    assert "still gathered" in capsys.readouterr().out
    assert check_blocks_gathered_with_prefetch("1", on, off) is False
    assert check_blocks_gathered_with_prefetch(..., on, off) is None


def test_a_prefetched_gathers_end_is_when_its_data_arrived_not_when_fsdp_waits():
    """Issue 29: a gather that completed early and was waited on later ends when its future
    completed (or at the modelled finish, if later), not at the wait."""
    import time

    from course_lib.measure.zero.prefetch import _DelayedWork

    class Finished:  # a collective's handle whose data arrived at once
        def __init__(self):
            self.future = torch.futures.Future()

        def get_future(self):
            return self.future

        def wait(self):
            return True

    ends = []
    handle = Finished()
    start = time.time()
    delayed = _DelayedWork(handle, finish=start + 0.01, done=ends.append)
    handle.future.set_result(None)  # the data arrives now
    arrived = time.time()
    time.sleep(0.1)  # the rank computes the previous unit; FSDP waits only after it
    delayed.wait()
    assert len(ends) == 1
    assert ends[0] == pytest.approx(max(start + 0.01, arrived), abs=0.005)
    assert ends[0] < start + 0.05  # not the wait, 0.1 s later
