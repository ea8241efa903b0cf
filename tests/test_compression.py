"""course_lib.compression: torch's 8-bit quantization per chunk and the all-gather hook built
on it, top-k / 1-bit compressors with error feedback, torch's powerSGD_hook, and the byte
formulas, against independent references (plain arithmetic for the scales and codes,
torch.topk, dist.all_gather of the exact tensors, plain fp32 DDP, CommCounter).

Tolerances: quantization bounds are checked with a relative slack of 1e-5 (torch computes
x * (1/s) in fp32); sums over 50-200 fp32 steps are exact to ~1e-5.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import WorkerPool, data, models
from course_lib.compression import (
    LEVELS,
    EFMomentumSGD,
    Sign,
    TopK,
    bytes_per_step,
    cast_error,
    comm_seconds,
    compress_with_feedback,
    fp32_all_reduce_bytes,
    int8_allgather_bytes,
    int8_chunks,
    int8_two_phase_bytes,
    latency_steps,
    powersgd_bytes,
)
from course_lib.measure.compression import (
    CompressionLog,
    build_ddp,
    check_fastest_at_100Mbit,
    check_momentum_ends,
    check_powersgd_ratio,
    measure_int8_all_reduce,
    network_table,
    plot_quantization_error,
    slow_network_table,
    sweep_bandwidth,
    train_compressed,
)

P = 4
SLACK = 1 + 1e-5
SIZES = (8, 32, 32, 4)


@pytest.fixture(scope="module")
def pool4():
    with WorkerPool(P) as pool:
        yield pool


def batches(steps: int):
    x, y = data.classification(16 * steps, dim=8, classes=4, seed=3)
    return data.batches(x, y, batch_size=16, steps=steps)


# --- single process --------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [None, 1, 7, 256])
def test_int8_chunks_scales_codes_and_error_within_half_a_scale(chunk):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    x[10] = 50.0  # an outlier
    x[300:600] = 0.0  # all-zero chunks must come back as exact zeros
    q = int8_chunks(x, chunk)
    # the scales, independently: max |x| over each chunk / 127, never below float32's eps
    size = x.numel() if chunk is None else chunk
    n_chunks = math.ceil(x.numel() / size)
    padded = torch.zeros(n_chunks * size)
    padded[: x.numel()] = x
    rows = padded.view(n_chunks, size)
    scales = (rows.abs().max(dim=1).values / LEVELS).clamp_min(torch.finfo(torch.float32).eps)
    torch.testing.assert_close(q.scales, scales, rtol=1e-6, atol=0)
    # the codes: x / s rounded to the nearest integer (torch multiplies by 1/s in fp32)
    assert q.codes.dtype == torch.int8 and q.codes.shape == (n_chunks, size)
    assert ((q.codes.float() - rows / scales[:, None]).abs() <= 0.5 + 1e-4).all()
    assert q.codes.abs().max() <= LEVELS
    assert q.nbytes == n_chunks * size + 4 * n_chunks
    err = (q.restored() - x).abs()
    bound = scales.repeat_interleave(size)[: x.numel()] / 2
    torch.testing.assert_close(q.error_bound(), bound, rtol=1e-6, atol=0)
    assert (err <= bound * SLACK).all(), f"max excess {(err - bound).max():.3g}"
    assert torch.equal(q.restored()[300:600], torch.zeros(300))


def test_int8_per_chunk_beats_per_tensor_with_an_outlier():
    x = 1e-3 * torch.randn(4096, generator=torch.Generator().manual_seed(1))
    x[0] = 1.0
    whole = (int8_chunks(x, None).restored() - x).abs().mean()
    chunked = (int8_chunks(x, 256).restored() - x).abs().mean()
    assert chunked < whole / 10


def test_int8_chunks_rejects_a_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_size"):
        int8_chunks(torch.ones(4), 0)


def test_topk_keeps_exactly_the_k_largest_entries():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    topk = TopK(0.05)
    payload = topk.compress(x)
    assert payload.numel() * 4 == topk.payload_bytes(1000) == 8 * 50
    dense = topk.decompress(payload, 1000)
    kept = torch.topk(x.abs(), 50).indices
    assert dense.count_nonzero() == 50
    assert torch.equal(dense[kept], x[kept])


def test_sign_sends_one_bit_per_entry_and_the_mean_magnitude():
    x = torch.randn(1001, generator=torch.Generator().manual_seed(3))
    sign = Sign()
    payload = sign.compress(x)
    assert payload.dtype == torch.uint8 and payload.numel() == sign.payload_bytes(1001) == 4 + 126
    dense = sign.decompress(payload, 1001)
    assert torch.equal(dense > 0, x >= 0)
    torch.testing.assert_close(dense.abs(), x.abs().mean().expand(1001), rtol=0, atol=0)


@pytest.mark.parametrize("compressor", [TopK(0.01), Sign()], ids=["topk", "sign"])
def test_error_feedback_invariant(compressor):
    """e_T + sum of applied updates = sum of gradients, to fp32 rounding."""
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(500, generator=gen) for _ in range(100)]
    error, applied = None, torch.zeros(500)
    for step, g in enumerate(grads):
        payload, error = compress_with_feedback(g, error, compressor)
        applied += compressor.decompress(payload, 500)
        total = torch.stack(grads[: step + 1]).sum(dim=0)
        torch.testing.assert_close(error + applied, total, rtol=0, atol=2e-4)


def test_byte_formulas():
    assert fp32_all_reduce_bytes(1000, 4) == 2 * 3 * 4 * 1000 // 4
    # 1000 elements, chunks of 256: 4 chunks of codes and scales to each of 3 other ranks
    assert int8_allgather_bytes(1000, 4, 256) == 3 * 4 * (256 + 4)
    # the two-phase design, 4 ranks: parts of 256, two phases of 3 parts + scales
    assert int8_two_phase_bytes(1000, 4, 256) == 2 * 3 * (256 + 4)
    shapes = [torch.Size([64, 32]), torch.Size([64]), torch.Size([4, 64])]
    # r = 2: 64x32 -> P 128 + Q 64; 4x64 at r=2 gains 256 / 136 < 2: uncompressed with the bias
    assert powersgd_bytes(shapes, 2, 4) == sum(fp32_all_reduce_bytes(c, 4) for c in (128, 64, 320))


def test_cast_error_measures_rounding_overflow_and_underflow():
    x = torch.tensor([1.0, 1 + 2**-10, 3.0, 2.0**-30, 2.0**17, 0.0])
    fp16 = cast_error(x, torch.float16)
    bf16 = cast_error(x, torch.bfloat16)
    # of the 5 nonzero entries fp16 sends 2^17 (> 65,504) as inf and 2^-30 as 0; the others
    # are exact in fp16 (1 + 2^-10 needs 10 bits after the point: fp16 has them)
    assert fp16["inf"] == fp16["zero"] == 1 / 5 and fp16["max"] == 0.0
    # bf16 keeps all of them, exactly but for 1 + 2^-10, which rounds to 1 (7 bits)
    assert bf16["inf"] == bf16["zero"] == 0.0 and bf16["median"] == 0.0
    assert bf16["max"] == pytest.approx(2**-10 / (1 + 2**-10))


def test_bf16_sends_fp16_bytes_in_as_many_messages():
    shapes = [torch.Size([64, 32]), torch.Size([64])]
    assert bytes_per_step("bf16", shapes, 4) == bytes_per_step("fp16", shapes, 4)
    assert latency_steps("bf16", 4) == latency_steps("fp16", 4)


def test_network_table_is_the_formulas():
    shapes = [torch.Size([64, 32]), torch.Size([64])]
    links = {"slow": 1e6, "fast": 1e8}
    network_s, table = network_table(("fp32", "int8"), shapes, 2, links, 1e-3)
    for (m, link), seconds in network_s.items():
        assert seconds == comm_seconds(m, shapes, 2, links[link], 1e-3)
    assert len(network_s) == 4 and table.splitlines()[0].startswith("2,112 parameters")
    assert table.splitlines()[-1].startswith("int8     saves per parameter:")


def test_ef_momentum_applies_momentum_to_the_received_average_by_hand():
    x = torch.nn.Parameter(torch.tensor([1.0, -1.0], dtype=torch.float64))
    optimizer = EFMomentumSGD([x], lr=0.1, momentum=0.5)
    g1, g2 = (
        torch.tensor([1.0, 2.0], dtype=torch.float64),
        torch.tensor([-3.0, 4.0], dtype=torch.float64),
    )
    x.grad = g1.clone()
    optimizer.step()  # m = g1, x = x0 - lr (g1 + m)
    x1 = torch.tensor([1.0, -1.0], dtype=torch.float64) - 0.1 * (g1 + g1)
    torch.testing.assert_close(x.detach(), x1, rtol=0, atol=1e-15)
    x.grad = g2.clone()
    optimizer.step()  # m = 0.5 g1 + g2, x = x1 - lr (g2 + m)
    torch.testing.assert_close(x.detach(), x1 - 0.1 * (g2 + 0.5 * g1 + g2), rtol=0, atol=1e-15)


def test_build_ddp_rejects_an_unknown_method():
    with pytest.raises(ValueError, match="unknown method"):
        build_ddp(torch.nn.Linear(2, 2), "int4")


# --- on 4 ranks -----------------------------------------------------------------------------


def _one_step_gradients(method):
    """This rank's averaged gradient after one DDP step, the exact average, and the bound."""
    x, y = batches(1)[0]
    p, r = dist.get_world_size(), dist.get_rank()
    xs, ys = data.shard(x, r, p), data.shard(y, r, p)
    plain = models.MLP(SIZES)
    torch.nn.functional.cross_entropy(plain(xs), ys).backward()
    local = torch.cat([q.grad.reshape(-1) for q in plain.parameters()])
    everyone = [torch.empty_like(local) for _ in range(p)]
    dist.all_gather(everyone, local)
    ddp = build_ddp(models.MLP(SIZES), method)
    torch.nn.functional.cross_entropy(ddp(xs), ys).backward()
    got = torch.cat([q.grad.reshape(-1) for q in ddp.module.parameters()])
    # each rank's payload is rounded once, on its rank: the mean errs by the mean of the s/2
    bound = sum(int8_chunks(g).error_bound() for g in everyone) / p
    return got, torch.stack(everyone).mean(dim=0), bound


def test_int8_hook_average_within_bound_and_the_same_on_every_rank(pool4):
    results = pool4.launch(_one_step_gradients, "int8", timeout=60)
    for got, exact, bound in results:
        assert not torch.equal(got, exact)  # it did quantize
        assert ((got - exact).abs() <= bound * SLACK).all()
        assert torch.equal(got, results[0][0])  # bit for bit: the copies stay equal


def _torch_quantization_hook():
    from torch.distributed.algorithms.ddp_comm_hooks.quantization_hooks import (
        quantization_perchannel_hook,
    )

    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    ddp.register_comm_hook(None, quantization_perchannel_hook)
    try:
        ddp(torch.ones(3, 4)).sum().backward()
    except RuntimeError as error:
        return str(error)
    return None


def test_torchs_own_quantization_hook_still_fails_on_gloo():
    """Lecture 5 says torch's quantization_perchannel_hook fails on gloo (it indexes the
    all-gather's future as NCCL fills it) and runs `int8_hook` instead; the day torch's runs,
    this fails, and the lecture should run torch's. (A pool of its own: a failed hook leaves
    nothing behind for the other tests.)"""
    with WorkerPool(2) as pool:
        for error in pool.launch(_torch_quantization_hook, timeout=60):
            assert error is not None and "IndexError" in error, error


def _train_pair(method_a, method_b, steps, **options):
    b = batches(steps)
    return train_compressed(method_a, b, sizes=SIZES, **options), train_compressed(
        method_b, b, sizes=SIZES, **options
    )


def test_powersgd_hook_exact_before_start_then_bytes_match_formula(pool4):
    start, steps, r = 4, 7, 2
    results = pool4.launch(
        _train_pair,
        "fp32",
        "powersgd",
        steps,
        timeout=60,
        powersgd_rank=r,
        start_powersgd_iter=start,
    )
    shapes = [p.shape for p in models.MLP(SIZES).parameters()]
    for fp32, powersgd in results:
        # before start_powerSGD_iter the hook all-reduces plainly: same losses, bit for bit
        assert powersgd.losses[:start] == fp32.losses[:start]
        assert powersgd.bytes_sent[:start] == fp32.bytes_sent[:start]
        assert powersgd.bytes_sent[start:] == [powersgd_bytes(shapes, r, P)] * (steps - start)
        assert powersgd.bytes_sent[-1] < fp32.bytes_sent[-1]
        assert powersgd.losses[start:] != fp32.losses[start:]  # compression did start


def test_powersgd_matches_plain_ddp_parameters_before_start(pool4):
    results = pool4.launch(_train_pair, "fp32", "powersgd", 3, timeout=60, start_powersgd_iter=4)
    for fp32, powersgd in results:
        for name, value in fp32.params.items():
            torch.testing.assert_close(powersgd.params[name], value, rtol=0, atol=1e-6)


def _one_step(method, lr):
    return train_compressed(method, batches(1), sizes=SIZES, lr=lr).params


def test_majority_vote_steps_by_the_sign_of_the_ranks_signs(pool4):
    lr = 0.01
    (x, y), start = batches(1)[0], models.MLP(SIZES)
    votes = {name: torch.zeros_like(p) for name, p in start.named_parameters()}
    for r in range(P):  # each rank's gradient on its shard, computed here in one process
        model = models.MLP(SIZES)
        F.cross_entropy(model(data.shard(x, r, P)), data.shard(y, r, P)).backward()
        for name, p in model.named_parameters():
            votes[name] += torch.where(p.grad >= 0, 1.0, -1.0)  # one bit: 0 votes +1
    for params in pool4.launch(_one_step, "vote", lr, timeout=60):
        for name, p in start.named_parameters():
            expected = p.detach() - lr * votes[name].sign()  # ties (2 against 2) do not move
            torch.testing.assert_close(params[name], expected, rtol=0, atol=1e-7)


def test_fp16_compression_stays_within_fp16_rounding_of_fp32(pool4):
    fp32 = pool4.launch(_one_step, "fp32", 0.1, timeout=60)[0]
    fp16 = pool4.launch(_one_step, "fp16", 0.1, timeout=60)[0]
    worst = max((fp16[n] - fp32[n]).abs().max().item() for n in fp32)
    assert 0 < worst < 1e-4  # lr x gradient x fp16's 2^-11 relative rounding, and not exact


def test_bf16_compression_stays_within_bf16_rounding_of_fp32(pool4):
    fp32 = pool4.launch(_one_step, "fp32", 0.1, timeout=60)[0]
    bf16 = pool4.launch(_one_step, "bf16", 0.1, timeout=60)[0]
    worst = max((bf16[n] - fp32[n]).abs().max().item() for n in fp32)
    assert 0 < worst < 1e-3  # lr x gradient x bf16's 2^-8 relative rounding, and not exact


def test_measure_int8_all_reduce_counts_and_measures_its_bytes(pool4):
    n = 10_000
    for result in pool4.launch(measure_int8_all_reduce, n, timeout=60):
        assert 0 < result["max error"] <= result["bound"]
        assert result["counted"] == int8_allgather_bytes(n, P)
        # what reached the sockets: the payloads, plus gloo's headers (a few percent)
        assert int8_allgather_bytes(n, P) <= result["written"] <= 1.2 * int8_allgather_bytes(n, P)
        fp32 = fp32_all_reduce_bytes(n, P)
        assert fp32 <= result["fp32 written"] <= 1.2 * fp32


def _dgc_and_ef(momentum):
    runs = [
        train_compressed(m, batches(3), sizes=SIZES, topk_fraction=0.1, dgc_momentum=momentum)
        for m in ("dgc", "topk+ef")
    ]
    return [run.params for run in runs]


def test_dgc_without_momentum_is_error_feedback_and_with_it_is_not(pool4):
    for r, (dgc, ef) in enumerate(pool4.launch(_dgc_and_ef, 0.0, timeout=60)):
        for name, value in ef.items():
            torch.testing.assert_close(dgc[name], value, rtol=0, atol=1e-7, msg=f"rank {r}")
    dgc, ef = pool4.launch(_dgc_and_ef, 0.9, timeout=60)[0]
    assert max((dgc[n] - ef[n]).abs().max().item() for n in ef) > 1e-3


def _bytes_of(method):
    run = train_compressed(method, batches(3), sizes=SIZES, topk_fraction=0.1)
    return run.bytes_sent


@pytest.mark.parametrize(
    "method", ["fp32", "fp16", "bf16", "int8", "topk+ef", "dgc", "sign", "vote"]
)
def test_bytes_per_step_match_formula(pool4, method):
    shapes = [p.shape for p in models.MLP(SIZES).parameters()]
    expected = bytes_per_step(method, shapes, P, topk_fraction=0.1)
    for sent in pool4.launch(_bytes_of, method, timeout=60):
        assert sent == [expected] * 3


def _step_and_wait(method, network):
    run = train_compressed(method, batches(3), sizes=SIZES, network=network)
    return run.step_s, run.wait_s


@pytest.mark.parametrize("method", ["fp32", "int8"])
def test_train_records_the_network_wait_of_each_step(pool4, method):
    """With no bandwidth limit a step's emulated network time is its latencies: the recorded
    wait is that less what the step spent in the real calls, so at most that, most of it on
    average, and part of the step; without a network it is 0."""
    latency = 0.05
    expected = latency_steps(method, P) * latency
    network = {"bandwidth": math.inf, "latency": latency}
    for step_s, wait_s in pool4.launch(_step_and_wait, method, network, timeout=60):
        assert len(wait_s) == len(step_s) == 3
        for step, wait in zip(step_s, wait_s, strict=True):
            assert 0 <= wait <= min(step, expected + 1e-6)
        assert sum(wait_s) >= 0.5 * 3 * expected
    for _, wait_s in pool4.launch(_step_and_wait, method, None, timeout=60):
        assert wait_s == [0.0] * 3


# --- lecture 5's measuring helpers: the error histogram, the table, the bandwidth sweep -------


def test_quantization_error_histogram_counts_every_element_with_an_error():
    g = 1e-3 * torch.randn(5_000, generator=torch.Generator().manual_seed(0))
    g[7] = 1.0
    fig = plot_quantization_error(g, [None, 256])
    ax = fig.axes[0]
    for chunk, bars in zip([None, 256], ax.containers, strict=True):
        nonzero = int(((int8_chunks(g, chunk_size=chunk).restored() - g) != 0).sum())
        assert sum(bar.get_height() for bar in bars) == nonzero
    assert len(ax.lines) == 2  # one typical-bound line per chunk size


def _log(method, steps, waits, losses):
    return CompressionLog(method, losses=losses, step_s=steps, wait_s=waits)


def test_slow_network_table_reads_the_runs_it_is_given():
    rank0 = {
        "fp32": _log("fp32", [1.0, 1.0, 1.0], [0.0, 0.9, 0.9], [1.0, 0.5, 0.25]),
        "int8": _log("int8", [1.0, 0.5, 0.5], [0.0, 0.3, 0.3], [1.0, 0.5, 0.5]),
    }
    rank1 = {m: _log(m, run.step_s, run.wait_s, run.losses) for m, run in rank0.items()}
    network_s = {("fp32", "slow"): 0.9, ("int8", "slow"): 0.3}
    network_s |= {("fp32", "fast"): 0.09, ("int8", "fast"): 0.03}
    table = slow_network_table([rank0, rank1], network_s, "slow", n_params=1000, start=1)
    lines = table.splitlines()
    # per step from step 1 on: fp32 100 ms compute, 900 ms wait; int8 200 + 300 ms, 2x faster
    assert lines[1].split() == ["fp32", "100.0", "900.0", "1000.0", "900.0", "1.00x"]
    assert lines[2].split() == ["int8", "200.0", "300.0", "500.0", "300.0", "2.00x"]
    assert "int8" in lines[6] and "1.50x" in lines[6] and "2.5e-01" in lines[6]
    # 100 ms more compute over 1000 parameters: 1e5 ns each; 0.6 s saved: 6e5 ns at "slow"
    assert lines[-1] == (
        "int8: extra compute 100000 ns per parameter; network saved 600000 ns at slow "
        "(60000 ns at fast)"
    )
    with pytest.raises(ValueError, match="compares with fp32"):
        slow_network_table([{"int8": rank0["int8"]}], network_s, "slow", 1000, 1)


def _sweep(bandwidths):
    # Six steps, the first two skipped: the median of four steps, so that one step slowed
    # by the loaded machine moves neither time (with one step, it did: CI saw 29 ms for 35).
    return sweep_bandwidth(("fp32", "int8"), bandwidths, batches(6), 0.01, sizes=SIZES)


def test_sweep_bandwidth_times_steps_on_the_emulated_network(pool4):
    """Each median step takes at least the network time the model gives it (the emulation
    waits exactly that), and a slower link makes fp32's step longer by about the bytes'
    time."""
    bandwidths = [math.inf, 2e5]
    shapes = [p.shape for p in models.MLP(SIZES).parameters()]
    times = pool4.launch(_sweep, bandwidths, timeout=120)[0]
    for m, seconds in times.items():
        for bandwidth, s in zip(bandwidths, seconds, strict=True):
            assert s >= 0.95 * comm_seconds(m, shapes, P, bandwidth, 0.01)
    extra = times["fp32"][1] - times["fp32"][0]
    assert extra >= 0.8 * bytes_per_step("fp32", shapes, P) / 2e5
    with pytest.raises(ValueError, match="more than skip=2 batches"):
        sweep_bandwidth(("fp32",), [1e6], batches(2), 0.01, sizes=SIZES)


def test_the_powersgd_ratio_exercise_is_checked_off_the_page(capsys):
    # worked by hand: 1024 x 1024 numbers against (1024 + 1024) x 4, 128 times fewer
    assert check_powersgd_ratio(128) is True
    assert "✓ Right: 128" in capsys.readouterr().out
    assert check_powersgd_ratio(256) is False  # at rank 2, section 3's table
    out = capsys.readouterr().out
    assert "2x too large" in out and "compare (n + m) r numbers with n m" in out
    assert "128" not in out
    assert check_powersgd_ratio(...) is None
    assert "Not answered yet" in capsys.readouterr().out


def test_the_momentum_check_holds_the_losses_of_the_last_steps_against_each_other(capsys):
    last10 = {"topk+ef": 0.40, "topk+ef, momentum": 0.30}  # made up: 0.75 times, below
    assert check_momentum_ends("below", last10) is True
    assert "Measured: 0.75 times the plain-SGD loss" in capsys.readouterr().out
    assert check_momentum_ends("near", last10) is False
    assert check_momentum_ends("near", {**last10, "topk+ef, momentum": 0.44}) is True
    assert check_momentum_ends(..., last10) is None


def test_the_slow_network_check_takes_the_method_of_fewest_seconds_in_all(capsys):
    def rank_runs(**seconds):  # made up: each method's step seconds on one rank
        return {m: SimpleNamespace(step_s=s) for m, s in seconds.items()}

    slow_runs = [rank_runs(fp32=[1.0, 1.0], int8=[0.3, 0.3], powersgd=[0.3, 0.2])]
    assert check_fastest_at_100Mbit("powersgd", slow_runs) is True
    assert "the bytes dominate" in capsys.readouterr().out
    assert check_fastest_at_100Mbit("int8", slow_runs) is False
    assert check_fastest_at_100Mbit("fp16", slow_runs) is False  # not one of the options
    assert check_fastest_at_100Mbit(..., slow_runs) is None
