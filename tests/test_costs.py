"""course_lib.costs against hand-worked numbers and against what CommCounter and the pipeline
simulator measure; and a guard that the formulas stay written once, in course_lib/costs/"""

from __future__ import annotations

import io
import math
import re
import tokenize
from pathlib import Path

import numpy as np
import pytest
import torch

from course_lib import CommCounter, launch
from course_lib.collectives import ring_all_reduce
from course_lib.costs import (
    BYTES_PER_PARAMETER,
    COLLECTIVE_MODEL,
    FP32_ADAMW,
    MIXED_ADAMW,
    ZERO_PASSES,
    activation_memory,
    all_gather_bytes,
    all_reduce_bytes,
    all_reduce_seconds,
    all_to_all_bytes,
    alpha_beta_time,
    bubble_formula,
    busiest_bytes,
    collective_steps,
    ep_bytes,
    expert_capacity,
    interleaved_peak_chunks,
    matmul_weights,
    pp_boundary_bytes,
    ring_attention_bytes,
    ring_bytes,
    tp_layer_bytes,
    two_level_all_reduce_seconds,
    ulysses_bytes,
    zero_bubble_formula,
    zero_bytes,
    zero_comm_bytes,
    zero_offload_bytes,
)
from course_lib.pipeline import simulate

STAGES = tuple(ZERO_PASSES)

# --- time ------------------------------------------------------------------------------------


def test_alpha_beta_time_by_hand():
    # 1 Gbit/s (125e6 B/s) and 5 ms: 1000 bytes take 5 ms + 8 us.
    assert alpha_beta_time(1000, 5e-3, 125e6) == pytest.approx(5.008e-3, rel=1e-12)
    assert alpha_beta_time(1000, 5e-3, 125e6, messages=6) == pytest.approx(30.008e-3, rel=1e-12)
    assert alpha_beta_time(0, 0.0, 1.0) == 0
    sizes = np.array([0.0, 1e6, 2e6])
    np.testing.assert_allclose(alpha_beta_time(sizes, 1e-5, 1e9), [1e-5, 1.01e-3, 2.01e-3])


def test_collective_steps_by_hand():
    assert collective_steps("all_reduce", 4) == 6  # 3 reduce-scatter steps, 3 all-gather steps
    assert collective_steps("all_gather", 4) == 3
    assert collective_steps("broadcast", 8) == 7  # a flat tree's root sends one after another
    assert collective_steps("barrier", 5) == 3  # ceil(log2 5) dissemination rounds
    assert all(collective_steps(op, 1) == 0 for op in ("all_reduce", "barrier", "scatter"))


def test_all_reduce_seconds_by_hand():
    n, alpha, beta = 1000, 1e-3, 1e-6  # one whole-tensor message: 1 ms + 1 ms
    assert all_reduce_seconds("naive", n, 4, alpha, beta) == pytest.approx(6 * 2e-3, rel=1e-12)
    assert all_reduce_seconds("tree", n, 4, alpha, beta) == pytest.approx(6 * 2e-3, rel=1e-12)
    assert all_reduce_seconds("butterfly", n, 4, alpha, beta) == pytest.approx(2 * 2e-3)
    # ring: 6 messages of N/4 bytes, 1 ms + 0.25 ms each
    assert all_reduce_seconds("ring", n, 4, alpha, beta) == pytest.approx(6 * 1.25e-3, rel=1e-12)
    assert all_reduce_seconds("ring", n, 1, alpha, beta) == 0
    # halving-doubling: 2 log2 4 = 4 latencies, and the ring's 2(P-1)/P N = 1.5 N of bytes
    assert all_reduce_seconds("halving_doubling", n, 4, alpha, beta) == pytest.approx(5.5e-3)
    with pytest.raises(ValueError, match="unknown all-reduce algorithm"):
        all_reduce_seconds("hypercube", n, 4, alpha, beta)


def test_two_level_all_reduce_seconds_by_hand():
    n, alpha, beta = 1000, 1e-3, 1e-6  # across nodes: 1 ms + 1 ms per whole-tensor message
    node_alpha, node_beta = 1e-5, 1e-8  # inside a node: 10 us + 10 us
    # 8 ranks in 2 nodes of 4: inside, 2 * 3 messages of 20 us; across, a ring of 2 leaders:
    # 2 messages of N/2 bytes, 1 ms + 0.5 ms each
    expected = 6 * 2e-5 + 2 * 1.5e-3
    got = two_level_all_reduce_seconds(n, 8, 4, alpha, beta, node_alpha, node_beta)
    assert got == pytest.approx(expected, rel=1e-12)
    # one node: no ring; nodes of one rank: the flat ring
    assert two_level_all_reduce_seconds(n, 4, 4, alpha, beta, 0, 0) == 0
    flat = two_level_all_reduce_seconds(n, 4, 1, alpha, beta, node_alpha, node_beta)
    assert flat == pytest.approx(all_reduce_seconds("ring", n, 4, alpha, beta), rel=1e-12)
    with pytest.raises(ValueError, match="does not divide"):
        two_level_all_reduce_seconds(n, 6, 4, alpha, beta, node_alpha, node_beta)


# --- volume ----------------------------------------------------------------------------------


def test_ring_volumes_by_hand():
    assert all_reduce_bytes(1000, 4) == 1500  # 2 * 3/4 * 1000
    assert all_reduce_bytes(1000, 1) == 0
    # whole bytes in, whole bytes out (rounded down, as CommCounter counts); floats stay exact
    assert all_reduce_bytes(10, 3) == 13 and isinstance(all_reduce_bytes(10, 3), int)
    assert all_reduce_bytes(10.0, 3) == pytest.approx(40 / 3, rel=1e-15, abs=0)
    assert ring_bytes(100, 4) == 75 and ring_bytes(100, 4, passes=3) == 225
    assert all_gather_bytes(10, 4) == 30  # three pieces of 10 bytes
    assert all_to_all_bytes(400, 4) == 300  # every 100-byte chunk but its own
    # As P grows the ring all-reduce tends to 2N per rank, never more.
    assert all(all_reduce_bytes(1e6, p) < 2e6 for p in (2, 8, 1024))
    assert all_reduce_bytes(1e6, 1024) == pytest.approx(2e6, rel=1e-3)


def test_busiest_bytes_follows_the_collective_model():
    n, p = 1200, 4
    expected = {"all_reduce": 1800, "barrier": 0, "all_to_all": 900, "all_to_all_single": 900}
    for op in COLLECTIVE_MODEL:
        # ring all-gather / reduce-scatter: (P-1) pieces; a flat tree's root: one per other rank
        assert busiest_bytes(op, n, p) == expected.get(op, 3 * n), op


def ring_sent(numel: int) -> int:
    with CommCounter() as counter:
        ring_all_reduce(torch.ones(numel))
    return counter.bytes_sent


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_bytes_is_what_the_ring_sends(world_size):
    # The course's ring sends real chunks with send/recv, which CommCounter counts exactly.
    numel = 1000  # divisible by P: every chunk the same size
    sent = launch(ring_sent, numel, world_size=world_size, timeout=60)
    assert sent == [all_reduce_bytes(4 * numel, world_size)] * world_size


# --- memory ----------------------------------------------------------------------------------


def test_bytes_per_parameter_of_mixed_precision_adamw():
    assert sum(BYTES_PER_PARAMETER.values()) == 16  # 2 + 2 + 12
    assert MIXED_ADAMW == {"params": 2, "grads": 2, "optimizer_state": 12}
    assert sum(FP32_ADAMW.values()) == 16  # 4 + 4 + 8


def test_zero_bytes_are_the_zero_papers():
    n, p = 7e9, 64
    totals = {s: sum(zero_bytes(s, n, p, MIXED_ADAMW).values()) for s in STAGES}
    assert totals["ddp"] == pytest.approx(16 * n, rel=1e-12)
    assert totals["zero1"] == pytest.approx(4 * n + 12 * n / p, rel=1e-12)
    assert totals["zero2"] == pytest.approx(2 * n + 14 * n / p, rel=1e-12)
    assert totals["zero3"] == pytest.approx(16 * n / p, rel=1e-12)
    # 7B parameters on 64 GPUs: 112 GB under DDP, 1.75 GB under ZeRO-3
    assert totals["ddp"] / 1e9 == pytest.approx(112) and totals["zero3"] / 1e9 == pytest.approx(
        1.75
    )


def test_zero_bytes_in_fp32_and_unknown_stages():
    n, p = 1000, 4
    totals = {s: sum(zero_bytes(s, n, p).values()) for s in STAGES}
    assert totals == pytest.approx(
        {"ddp": 16_000, "zero1": 10_000, "zero2": 7_000, "zero3": 4_000}, rel=1e-12
    )
    with pytest.raises(ValueError, match="unknown stage 'zero4'"):
        zero_bytes("zero4", n, p)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        zero_bytes("ddp", n, 0)


def test_zero_comm_bytes_by_hand():
    assert zero_comm_bytes("ddp", 100, 4) == 150  # one all-reduce: 2 * 3/4 * 100
    assert zero_comm_bytes("zero1", 100, 4) == 150  # reduce-scatter + all-gather
    assert zero_comm_bytes("zero2", 100, 4) == 150
    assert zero_comm_bytes("zero3", 100, 4) == 225  # + the second all-gather
    assert zero_comm_bytes("zero3", 90.0, 3) == pytest.approx(180, rel=1e-15)
    assert zero_comm_bytes("ddp", 10, 3) == pytest.approx(40 / 3, rel=1e-15)  # not rounded
    with pytest.raises(ValueError, match="unknown stage"):
        zero_comm_bytes("fsdp", 100, 4)


def test_activation_memory_by_hand():
    # s=4, b=1, h=8, a=2: sbh = 32 and 5as/h = 5, so sbh(34 + 5as/h) = 32 * 39.
    s, b, h, a = 4, 1, 8, 2
    assert activation_memory(s, b, h, a) == pytest.approx(32 * 39, rel=1e-15)
    # t=2: sbh(10 + 24/t + 5as/(ht)) = 32 * (10 + 12 + 2.5)
    assert activation_memory(s, b, h, a, 2) == pytest.approx(32 * 24.5, rel=1e-15)
    # t=2 with SP: sbh(34/t + 5as/(ht)) = 32 * (17 + 2.5)
    assert activation_memory(s, b, h, a, 2, sequence_parallel=True) == pytest.approx(32 * 19.5)
    # selective recomputation drops the 5as/h term
    assert activation_memory(s, b, h, a, recompute_attention=True) == pytest.approx(32 * 34)
    # GPT-3 175B (s=2048, h=12288, a=96): 5as/h = 80, so sbh * 114 bytes per layer
    assert activation_memory(2048, 1, 12288, 96) == pytest.approx(2048 * 12288 * 114, rel=1e-15)


# --- pipeline, tensor, context and expert parallelism ---------------------------------------


def test_bubble_formula_by_hand_and_against_the_simulator():
    assert bubble_formula(4, 8) == pytest.approx(3 / 11, rel=1e-15)
    assert bubble_formula(4, 8, chunks=2) == pytest.approx(3 / 19, rel=1e-15)
    assert bubble_formula(4, 1) == pytest.approx(3 / 4, rel=1e-15)  # the naive pipeline
    assert bubble_formula(1, 8) == 0
    for schedule in ("gpipe", "1f1b"):  # equal stages: the simulated idle share is the formula
        timeline = simulate(4, 8, schedule)
        assert math.isclose(timeline.bubble, bubble_formula(4, 8), abs_tol=1e-12), schedule


@pytest.mark.parametrize("n_stages, m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_interleaved_peak_is_what_the_simulator_keeps_in_flight(n_stages, m):
    assert interleaved_peak_chunks(4, 2) == 11  # by hand: 8 chunks filling, 3 more warming up
    timeline = simulate(n_stages, m, "interleaved", chunks=2)
    assert timeline.peak_in_flight(0) == interleaved_peak_chunks(n_stages, 2)


def test_parallelism_traffic_by_hand():
    assert pp_boundary_bytes(100) == 200  # activation forward, gradient back
    assert tp_layer_bytes(1000, 4) == 4 * 1500  # 4 all-reduces of 2 * 3/4 * 1000
    assert tp_layer_bytes(1000, 1) == 0
    assert ep_bytes(400, 4) == 600  # dispatch and combine, 3/4 of 400 each
    assert ring_attention_bytes(800, 4) == 600  # three of the four 200-byte K/V blocks
    assert ulysses_bytes(200, 4) == 600  # q, k, v and output: 3/4 of this rank's 200 each
    # 8 query heads of 100 bytes here, 2 K/V heads: each of 3 other ranks is sent one K head
    # and one V head (a copy: 4 ranks share 2 heads), q and the output as before
    assert ulysses_bytes(800, 4, heads=8, kv_heads=2) == 2 * 600 + 2 * 300
    assert ulysses_bytes(800, 4, heads=8, kv_heads=8) == ulysses_bytes(800, 4)


def test_expert_capacity_by_hand():
    assert expert_capacity(1024, 8, 2, 1.25) == 320  # 1.25 * 1024 * 2 / 8
    assert expert_capacity(10, 4, 1, 1.0) == 3  # 2.5 rounds up: no expert is short of a slot
    assert expert_capacity(100, 11, 1, 1.1) == 10  # 10.000000000000002 in floats, still 10
    assert expert_capacity(64, 4, 2, 0.5) == 16


# --- every formula once -------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
# The formulas' shapes, as token streams (comments and strings left out): (X - 1) / X and
# (X - 1) * ... // X; (P - 1) / (... + P - 1); 34 + (activations); latency + ... / bandwidth.
WRITTEN_ONCE = {
    "ring share (P-1)/P": re.compile(r"\( (\w+) - 1 \)(?: \* [^,;]*?)? /{1,2} \(? ?\1\b"),
    "bubble (P-1)/(m+P-1)": re.compile(r"\( (\w+) - 1 \) / \([^)]*\+ \1 - 1 \)"),
    "activations sbh(34 + 5as/h)": re.compile(r"\b34 \+"),
    "alpha-beta time": re.compile(r"\b(latency|alpha)\b.* \+ .*/ [\w. ]*?\b(bandwidth|beta)\b"),
}
SKIP = {tokenize.COMMENT, tokenize.STRING, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT}
SKIP |= {tokenize.DEDENT, tokenize.ENDMARKER}
SKIP |= {
    getattr(tokenize, n)
    for n in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END")
    if hasattr(tokenize, n)
}


def code_lines(source: str) -> dict[int, str]:
    """Each line's code tokens joined by spaces: comments, docstrings and strings left out."""
    lines: dict[int, list[str]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in SKIP:
            lines.setdefault(tok.start[0], []).append(tok.string)
    return {n: " ".join(toks) for n, toks in lines.items()}


# Lines that wrote the formulas before course_lib/costs/ gathered them: the guard must see each one.
WRITTEN_BEFORE = [
    'n = 2 * (p - 1) * _nbytes(args["tensor"]) // p',
    'sent = _nbytes(args["input"]) * (p - 1) // p',
    "return 2 * (world - 1) * 4 * numel // world",
    "return 2 * (world - 1) / world * nbytes",
    "return COMM_MODEL_SIZES[stage] * (world - 1) / world * model_bytes",
    "return 2 * (world - 1) * (alpha + n / world * beta)",
    "formula = (P - 1) / (m + P - 1)",
    "return (n_stages - 1) / (chunks * m + n_stages - 1)",
    "total = s * b * h * (34 + 5 * a * s / h)",
    "return self.latency + nbytes / self.bandwidth",
    "return self.alpha + np.asarray(nbytes, dtype=float) / self.beta",
    "return steps * self.latency + busiest_bytes(op, nbytes, world_size) / self.bandwidth",
]


@pytest.mark.parametrize("line", WRITTEN_BEFORE)
def test_the_guard_sees_a_formula_written_again(line):
    code = code_lines(line)[1]
    assert any(pattern.search(code) for pattern in WRITTEN_ONCE.values())
    assert not any(
        pattern.search(" ".join(code_lines(repr(line)).values()))
        for pattern in WRITTEN_ONCE.values()
    ), "a string is not code"


def test_no_cost_formula_is_written_outside_costs():
    written = []
    for path in sorted((ROOT / "course_lib").rglob("*.py")):
        if "costs" in path.relative_to(ROOT / "course_lib").parts[:1]:
            continue
        for n, line in code_lines(path.read_text()).items():
            written += [
                f"{path.relative_to(ROOT)}:{n}: {what}"
                for what, pattern in WRITTEN_ONCE.items()
                if pattern.search(line)
            ]
    assert not written, "use course_lib.costs instead of writing the formula again:\n" + "\n".join(
        written
    )


def test_zero_offload_keeps_16_bit_weights_on_the_gpu_and_the_rest_on_the_cpu():
    # 13B on one GPU (the ZeRO-Offload paper's headline): 26 GB of bf16 weights on the GPU;
    # on the CPU 26 GB of 16-bit gradients and 156 GB of fp32 weights and moments; 26 GB of
    # gradients down and of weights up per step.
    one = zero_offload_bytes(13e9)
    assert one == {"gpu": 26e9, "cpu": 182e9, "pcie_each_way": 26e9}
    # Over 4 GPUs (ZeRO-2) each GPU offloads only its shard; its weights stay whole.
    four = zero_offload_bytes(13e9, 4)
    assert four == {"gpu": 26e9, "cpu": 45.5e9, "pcie_each_way": 6.5e9}
    with pytest.raises(ValueError, match="world_size"):
        zero_offload_bytes(1e9, 0)


def test_zero_bubble_formula_is_a_third_of_1f1b_idle_time_for_equal_passes():
    # F = B = W = 1: (P-1)(1) idle per stage against 1F1B's (P-1)(3), beside 3m of work.
    assert zero_bubble_formula(4, 8) == pytest.approx(3 / 27, rel=1e-12)
    assert bubble_formula(4, 8) == pytest.approx(9 / 33, rel=1e-12)  # the same with B + W = 2
    # W as long as F + B: nothing left idle
    assert zero_bubble_formula(4, 8, 1.0, 1.0, 2.0) == 0.0


# --- utilisation and failures (lecture 13) ----------------------------------------------------


def test_6nd_is_the_matmul_part_of_compute_seconds():
    """An independent count: compute_seconds prices forward + backward as 3 x (24bsh^2 +
    4bs^2h) FLOPs per layer. A layer's matmul weights are 12h^2 (QKV and output 4h^2, the MLP
    8h^2), so 6ND with N = 12Lh^2 and D = bs tokens is exactly its h^2 part; the rest is the
    attention scores, 12 L s h per token."""
    from course_lib.costs import TransformerShape, compute_seconds, training_flops

    shape = TransformerShape(layers=4, hidden=256, heads=4, seq=128, batch=3)
    L, h, s, b = shape.layers, shape.hidden, shape.seq, shape.batch
    flops = compute_seconds(shape, t=1, p=1, flops_per_s=1.0)
    attention = 12 * L * s * h * (b * s)
    assert matmul_weights(shape) == 12 * L * h * h
    assert training_flops(matmul_weights(shape), b * s) + attention == pytest.approx(
        flops, rel=1e-12
    )


def test_mfu_by_hand():
    from course_lib.costs import mfu, training_flops

    # 7e9 parameters, 1M tokens per step, 100 s per step on 256 GPUs of 312 TFLOP/s peak:
    # 4.2e16 FLOPs over 256 * 312e12 * 100 = 7.99e18 FLOP-seconds available: 0.526.
    assert mfu(training_flops(7e9, 1e6) * 100, 100.0, 312e12, devices=256) == pytest.approx(
        4.2e18 / (256 * 312e12 * 100), rel=1e-12
    )
    assert mfu(1e12, 1.0, 1e12) == 1.0
    assert mfu(1e12, 2.0, 1e12) == 0.5  # twice the time: half the utilisation


def test_checkpoint_interval_minimises_the_time_lost():
    """Young's interval against a brute-force minimum of the time lost per second of work:
    C / T for checkpointing plus (T / 2) / M for the work a failure throws away."""
    from course_lib.costs import checkpoint_interval

    C, M = 30.0, 3 * 3600.0
    intervals = np.linspace(10, 5000, 200_000)
    lost = C / intervals + intervals / 2 / M
    assert checkpoint_interval(C, M) == pytest.approx(intervals[lost.argmin()], rel=1e-3)
    assert checkpoint_interval(30.0, 3 * 3600.0) == pytest.approx(math.sqrt(2 * 30 * 10800))


# --- lecture 7: ZeRO in mixed precision, kind by kind ------------------------------------------


@pytest.mark.parametrize("stage", ["ddp", "zero1", "zero2", "zero3"])
def test_zero_mixed_bytes_refines_zero_bytes_in_mixed_precision(stage):
    from course_lib.costs import MIXED_ADAMW, MIXED_KIND_GROUP, zero_bytes, zero_mixed_bytes

    n, p = 1000, 4
    fine = zero_mixed_bytes(stage, n, p)
    coarse = zero_bytes(stage, n, p, MIXED_ADAMW)
    for group, total in coarse.items():
        assert sum(b for k, b in fine.items() if MIXED_KIND_GROUP[k] == group) == total


def test_zero_mixed_bytes_stage2_on_4_ranks_by_hand():
    from course_lib.costs import zero_mixed_bytes

    got = zero_mixed_bytes("zero2", 1000, 4)
    # bf16 weights whole (2N); bf16 gradients, fp32 master and moments a quarter each.
    assert got == {
        "weights": 2000,
        "gradients": 500,
        "master weights": 1000,
        "optimizer: exp_avg": 1000,
        "optimizer: exp_avg_sq": 1000,
    }
    assert sum(got.values()) / 1000 == 5.5  # 2 + 14/4 bytes per parameter


# --- lecture 10: float64 AdamW, context and expert parallelism in the planner ------------------


def test_fp64_adamw_bytes_are_what_torch_holds():
    from course_lib.costs import FP64_ADAMW

    layer = torch.nn.Linear(10, 6, dtype=torch.float64)
    optimizer = torch.optim.AdamW(layer.parameters())
    layer(torch.ones(3, 10, dtype=torch.float64)).sum().backward()
    optimizer.step()
    n = sum(p.numel() for p in layer.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    held = {
        "params": sum(p.numel() * p.element_size() for p in layer.parameters()),
        "grads": sum(p.grad.numel() * p.grad.element_size() for p in layer.parameters()),
        "optimizer_state": sum(t.numel() * t.element_size() for t in state),
    }
    assert held == {kind: b * n for kind, b in FP64_ADAMW.items()}


def test_ring_attention_and_expert_all_to_all_bytes_per_layer_by_hand():
    from course_lib.costs import cp_layer_bytes, ep_layer_bytes

    # K and V of 1 MB for the whole sequence over 4 ranks: 3/4 MB forward, the same again and
    # dK, dV in backward
    assert cp_layer_bytes(1e6, 4) == pytest.approx(3 * 0.75e6, rel=1e-12)
    assert cp_layer_bytes(1e6, 1) == 0
    # 1 MB of routed tokens over 8 ranks: dispatch and combine (7/8 MB each), forward and back
    assert ep_layer_bytes(1e6, 8) == pytest.approx(4 * 0.875e6, rel=1e-12)


def test_moe_compute_factor_counts_the_active_parameters():
    from course_lib.costs import moe_compute_factor

    # 1 shared + 8 experts of 2 (in any unit), 2 experts per token: 1 + 2 x 2 = 5 active,
    # against 1 + 2 = 3 for the dense shape of one expert
    assert moe_compute_factor(17.0, 16.0, 8, 2) == pytest.approx(5 / 3, rel=1e-12)
    assert moe_compute_factor(7e9, 0.0, 1, 1) == 1.0  # a dense model
    assert moe_compute_factor(46.7e9, 45.1e9, 8, 2) == pytest.approx(12.875 / 7.2375, rel=1e-12)
