"""course_lib.parallel_3d: the grid of ranks against the groups torch.distributed really builds,
each estimate against a configuration computed here by hand from the textbook formulas, and
the planner's choices against brute force.

Expected numbers are written out from the formulas (16 bytes per parameter, ZeRO's shards,
sbh(34 + 5as/h) and its TP/SP forms, 3 x (24bsh^2 + 4bs^2h) FLOPs, ring traffic 2(P-1)/P,
the bubble (P-1)/(m+P-1)), never read back from the modules the planner imports.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from course_lib import launch, models
from course_lib.costs import TransformerShape
from course_lib.measure.parallel_3d import (
    STEP_CONFIG,
    PlannerWidget,
    candidate_table,
    check_interleaved_bubble,
    check_pipeline_with_128,
    check_pipeline_with_cp,
    check_plan,
    check_plan_memory,
    check_plan_mfu,
    check_tp_bytes_per_rank,
    close_calls,
    gather_dense,
    grid_table,
    group_members,
    plot_step_times,
    predicted_vs_measured,
    reference_3d,
    step_batches,
    summary,
    train_3d,
)
from course_lib.parallel_3d import (
    GPT3,
    LLAMA_7B,
    LLAMA_70B,
    MOE_8X7B,
    Cluster,
    Model,
    Plan,
    ProcessGrid,
    activation_bytes,
    best,
    candidates,
    estimate,
    factorizations,
    spans_nodes,
)

RTOL = 1e-12  # the estimates are a few float operations: only rounding may differ

# --- the grid ------------------------------------------------------------------------------


def test_grid_of_eight_ranks_by_hand():
    grid = ProcessGrid(tp=2, pp=2, dp=2)
    assert grid.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.coords(6) == {"tp": 0, "pp": 1, "dp": 1}
    assert grid.group_of(6, "pp") == [4, 6]
    assert "[4, 6]" in grid_table(grid).splitlines()[7]  # rank 6's line names its pipeline


@pytest.mark.parametrize("tp,pp,dp", [(2, 4, 2), (4, 1, 4), (1, 3, 2), (8, 2, 1)])
def test_every_kind_of_group_partitions_the_ranks(tp, pp, dp):
    grid = ProcessGrid(tp, pp, dp)
    for kind, size in (("tp", tp), ("pp", pp), ("dp", dp)):
        groups = grid.groups(kind)
        assert sorted(r for g in groups for r in g) == list(range(grid.world_size))
        for group in groups:
            assert len(group) == size
            coords = [grid.coords(r) for r in group]
            # members differ in this coordinate only, and are listed in its order
            assert [c[kind] for c in coords] == list(range(size))
            for other in {"tp", "pp", "dp"} - {kind}:
                assert len({c[other] for c in coords}) == 1
    for r in range(grid.world_size):  # the layout: tp fastest, then pp, then dp
        c = grid.coords(r)
        assert r == (c["dp"] * pp + c["pp"]) * tp + c["tp"]


def test_groups_made_with_new_group_hold_the_grid_ranks():
    grids = [ProcessGrid(2, 1, 2), ProcessGrid(1, 2, 2), ProcessGrid(2, 2, 1)]

    def members(grids):
        return [group_members(g) for g in grids]

    per_rank = launch(members, grids, world_size=4, timeout=60)
    for r, result in enumerate(per_rank):
        for grid, seen in zip(grids, result, strict=True):
            for kind in ("tp", "pp", "dp"):
                assert seen[kind] == grid.group_of(r, kind), (r, grid, kind)


def test_bad_grids_and_clusters_are_refused():
    with pytest.raises(ValueError, match="tp must be"):
        ProcessGrid(0, 1, 1)
    with pytest.raises(ValueError, match="rank 8"):
        ProcessGrid(2, 2, 2).coords(8)
    with pytest.raises(ValueError, match="whole nodes"):
        Cluster(12, gpus_per_node=8)
    with pytest.raises(ValueError, match="uses 8 GPUs, not 16"):
        estimate(SMALL, CLUSTER, Plan(2, 2, 2))


# --- the estimates, by hand -----------------------------------------------------------------

# A small model with round numbers: 8 layers, h = 1024, 16 heads, s = 512, micro-batch 2.
SMALL = Model("small", 1e9, TransformerShape(8, 1024, 16, 512, 2), global_batch=64)
# 16 GPUs in 4 nodes of 4; 100 GB/s inside a node, 10 GB/s between nodes, 1e14 FLOP/s.
CLUSTER = Cluster(16, 4, gpu_memory=80e9, intra_bandwidth=100e9, inter_bandwidth=10e9,
                  flops_per_s=1e14)  # fmt: skip
S, B, H, A, L = 512, 2, 1024, 16, 8
SBH = S * B * H


def forward_backward_flops(layers):
    return layers * 3 * (24 * B * S * H * H + 4 * B * S * S * H)


def test_estimate_tp2_pp2_dp4_zero1_by_hand():
    e = estimate(SMALL, CLUSTER, Plan(2, 2, 4, "zero1", "none", sequence_parallel=True))
    m = 64 // (4 * 2)  # 8 micro-batches per step
    share = 1e9 * (4 / 8) / 2  # 4 of 8 layers, half of each: 2.5e8 parameters
    assert e.micro_batches == m and e.params_per_gpu == pytest.approx(share, rel=RTOL)
    # ZeRO-1 shards only the 12 bytes of optimizer state over the 4 DP ranks
    assert e.memory["params"] == pytest.approx(2 * share, rel=RTOL)
    assert e.memory["grads"] == pytest.approx(2 * share, rel=RTOL)
    assert e.memory["optimizer_state"] == pytest.approx(12 * share / 4, rel=RTOL)
    # TP + SP: sbh(34/t + 5as/(ht)) per layer; 1F1B stage 0 holds P = 2 micro-batches x 4 layers
    per_layer = SBH * (34 / 2 + 5 * A * S / (H * 2))
    assert e.memory["activations"] == pytest.approx(2 * 4 * per_layer, rel=RTOL)
    assert e.fits == (sum(e.memory.values()) <= 80e9)
    # links: tp [0,1] and pp [0,2] inside a node of 4; dp [0,4,8,12] crosses nodes
    assert e.links == {"tp": "intra-node", "pp": "intra-node", "dp": "inter-node"}
    compute = forward_backward_flops(4) / 2 / 1e14
    tp_bytes = 4 * 4 * (2 * (2 - 1) / 2) * SBH * 2  # 4 all-reduces per layer, bf16
    pp_bytes = 2 * SBH * 2 / 2  # activation forward, gradient back; SP sends 1/t each
    dp_bytes = 2 * (3 / 4) * 2 * share  # one all-reduce of bf16 gradients
    assert e.traffic["tp"] == pytest.approx(m * tp_bytes, rel=RTOL)
    assert e.traffic["pp"] == pytest.approx(m * pp_bytes, rel=RTOL)
    assert e.traffic["dp"] == pytest.approx(dp_bytes, rel=RTOL)
    per_micro = compute + tp_bytes / 100e9 + pp_bytes / 100e9
    assert e.bubble == pytest.approx(1 / 9, rel=RTOL)  # (P-1)/(m+P-1)
    assert e.step_seconds == pytest.approx((m + 2 - 1) * per_micro + dp_bytes / 10e9, rel=RTOL)
    assert e.seconds["bubble"] == pytest.approx(1 * per_micro, rel=RTOL)
    assert e.utilisation == pytest.approx(m * compute / e.step_seconds, rel=RTOL)
    # MFU: the GPU's share of the model's FLOPs (1/(t p)) per second of step, over the peak
    model_flops = m * forward_backward_flops(L) / (2 * 2)
    assert e.mfu == pytest.approx(model_flops / e.step_seconds / 312e12, rel=RTOL)
    assert e.free_memory == pytest.approx(80e9 - sum(e.memory.values()), rel=RTOL)


def test_estimate_zero3_with_full_checkpointing_no_sp_by_hand():
    e = estimate(SMALL, CLUSTER, Plan(2, 1, 8, "zero3", "full", sequence_parallel=False))
    m = 64 // (8 * 2)  # 4
    share = 1e9 / 2
    assert e.memory["params"] == pytest.approx(2 * share / 8, rel=RTOL)
    assert e.memory["grads"] == pytest.approx(2 * share / 8, rel=RTOL)
    assert e.memory["optimizer_state"] == pytest.approx(12 * share / 8, rel=RTOL)
    # one micro-batch in flight (no pipeline): 8 layer inputs of 2sbh (not split without SP),
    # plus one layer recomputed at a time, sbh(10 + 24/t + 5as/(ht))
    one_layer = SBH * (10 + 24 / 2 + 5 * A * S / (H * 2))
    assert e.memory["activations"] == pytest.approx(8 * 2 * SBH + one_layer, rel=RTOL)
    compute = forward_backward_flops(8) / 2 / 1e14
    assert e.seconds["recompute"] == pytest.approx(m * compute / 3, rel=RTOL)  # one forward more
    tp_bytes = 8 * 6 * 1 * SBH * 2  # 4 all-reduces per layer, and forward's 2 again
    assert e.traffic["tp"] == pytest.approx(m * tp_bytes, rel=RTOL)
    dp_bytes = m * 3 * (7 / 8) * 2 * share  # gather, gather, reduce-scatter per micro-batch
    assert e.traffic["dp"] == pytest.approx(dp_bytes, rel=RTOL)
    assert e.bubble == 0 and e.traffic["pp"] == 0
    expected = m * (compute * 4 / 3 + tp_bytes / 100e9) + dp_bytes / 10e9
    assert e.step_seconds == pytest.approx(expected, rel=RTOL)


def test_selective_recompute_and_zero2_by_hand():
    e = estimate(SMALL, CLUSTER, Plan(1, 1, 16, "zero2", "selective"))
    m = 64 // (16 * 2)  # 2
    # without the as^2b attention terms, sbh x 34 per layer, 8 layers, one micro-batch
    assert e.memory["activations"] == pytest.approx(8 * 34 * SBH, rel=RTOL)
    assert e.seconds["recompute"] == pytest.approx(m * 8 * 4 * B * S * S * H / 1e14, rel=RTOL)
    dp_bytes = (m + 1) * (15 / 16) * 2 * 1e9  # reduce-scatter per micro-batch, one all-gather
    assert e.traffic["dp"] == pytest.approx(dp_bytes, rel=RTOL)
    assert e.traffic["tp"] == 0 and e.links["dp"] == "inter-node"


# --- the planner ---------------------------------------------------------------------------

CASES = [
    (LLAMA_7B, Cluster(8)),
    (LLAMA_7B, Cluster(64, gpus_per_node=4, gpu_memory=40e9)),
    (LLAMA_70B, Cluster(64)),
    (LLAMA_70B, Cluster(512)),
    (GPT3, Cluster(512, inter_bandwidth=5e9)),
]


@pytest.mark.parametrize("model,cluster", CASES, ids=lambda x: getattr(x, "name", None))
def test_planner_proposes_only_plans_that_fit_with_tp_inside_a_node(model, cluster):
    estimates = candidates(model, cluster)
    for e in estimates:  # no candidate at all puts TP across nodes
        grid = ProcessGrid(e.plan.tp, e.plan.pp, e.plan.dp)
        assert not any(spans_nodes(g, cluster.gpus_per_node) for g in grid.groups("tp"))
    chosen = best(model, cluster)
    assert chosen is not None
    assert sum(chosen.memory.values()) <= cluster.gpu_memory
    fitting = [e for e in estimates if sum(e.memory.values()) <= cluster.gpu_memory]
    assert chosen.step_seconds == min(e.step_seconds for e in fitting)
    assert str(chosen.plan) in summary(model, cluster)


def test_when_nothing_fits_the_planner_says_so():
    assert best(LLAMA_70B, Cluster(8)) is None  # 16 bytes x 70e9 / 8 = 140 GB per GPU at least
    assert "nothing fits" in summary(LLAMA_70B, Cluster(8))


def test_only_one_plan_fits_and_the_planner_finds_it():
    # One head, so tp = 1; 4 GPUs as dp x pp. DDP keeps 16 bytes/parameter of 1/pp of the
    # model: 16, 8, 4 GB for pp = 1, 2, 4 (activations are a few kB). Only pp = 4 fits in 5 GB,
    # and it is not the fastest plan: on these slow GPUs compute dominates, and pp = 1 has no
    # bubble.
    tiny = Model("tiny", 1e9, TransformerShape(4, 64, 1, 8, 1), global_batch=4)
    cluster = Cluster(4, 4, gpu_memory=5e9, flops_per_s=1e7)
    options = {"zero_stages": ("ddp",), "checkpointing": ("none",)}
    estimates = candidates(tiny, cluster, **options)
    assert {(e.plan.tp, e.plan.pp, e.plan.dp) for e in estimates} == {
        (1, 1, 4),
        (1, 2, 2),
        (1, 4, 1),
    }
    assert [e.fits for e in estimates].count(True) == 1
    found = best(tiny, cluster, **options)
    assert (found.plan.tp, found.plan.pp, found.plan.dp) == (1, 4, 1)
    assert estimates[0].plan != found.plan  # the fastest plan does not fit


@pytest.mark.parametrize(
    "cluster", [Cluster(8), Cluster(16, 4), Cluster(64), Cluster(4, 8), Cluster(24, 4)]
)
def test_candidates_are_exactly_the_brute_force_factorizations(cluster):
    model = replace(LLAMA_7B, shape=replace(LLAMA_7B.shape, heads=4, hidden=1024, layers=6),
                    global_batch=48)  # fmt: skip
    n = cluster.gpus
    brute = {
        (tp, pp, dp)
        for tp, pp, dp in itertools.product(range(1, n + 1), repeat=3)
        if tp * pp * dp == n and cluster.gpus_per_node % tp == 0
    }
    assert set(factorizations(cluster)) == brute
    usable = {
        (tp, pp, dp)
        for tp, pp, dp in brute
        if 4 % tp == 0 and pp <= 6 and 48 % dp == 0  # heads, layers, batch
    }
    stages, ckpts = ("ddp", "zero3"), ("none", "full")
    estimates = candidates(model, cluster, zero_stages=stages, checkpointing=ckpts)
    assert {(e.plan.tp, e.plan.pp, e.plan.dp) for e in estimates} == usable
    assert len(estimates) == sum(2 * (2 if dp > 1 else 1) for _, _, dp in usable)
    assert len({e.plan for e in estimates}) == len(estimates)
    steps = [e.step_seconds for e in estimates]
    assert steps == sorted(steps)
    legend = {flag for e in estimates for flag in e.flags}  # one line per flag shown
    assert len(candidate_table(estimates).splitlines()) == len(estimates) + 1 + len(legend)


def test_widget_replans_when_a_value_changes():
    widget = PlannerWidget(model="7B", gpus=64)
    assert widget.best.plan == best(LLAMA_7B, Cluster(64)).plan
    widget.gpus.value = 512
    assert widget.best.plan == best(LLAMA_7B, Cluster(512)).plan
    assert widget.best.plan.dp * widget.best.plan.tp * widget.best.plan.pp == 512
    widget.memory.value = 40
    assert widget.best.plan == best(LLAMA_7B, Cluster(512, gpu_memory=40e9)).plan
    assert widget.best.total_memory <= 40e9
    widget.model.value = "175B"
    assert widget.batch.value == GPT3.global_batch  # a model brings its own global batch
    assert widget.best.plan == best(GPT3, Cluster(512, gpu_memory=40e9)).plan
    widget.gpus.value = 8
    assert widget.best is None and widget.estimates  # 175B on 8 GPUs: candidates, none fits
    assert not any(e.fits for e in widget.estimates)
    assert widget.inter.label == "25"  # the cluster's 25 GB/s, shown as written
    widget.gpus.value, widget.inter.label = 512, "5"
    assert widget.chosen()[1].inter_bandwidth == 5e9
    assert widget.best.plan == best(GPT3, Cluster(512, gpu_memory=40e9, inter_bandwidth=5e9)).plan


def test_fewer_micro_batches_than_stages_keep_only_m_in_flight():
    # 1F1B holds min(P, m) micro-batches on stage 0: with m = 3 < P = 4, three, of 2 layers each
    plan = Plan(1, 4, 4, "ddp", "selective")
    per_layer = 34 * SBH  # selective recomputation, no TP
    assert activation_bytes(SMALL, plan, micro_batches=3) == pytest.approx(3 * 2 * per_layer)
    assert activation_bytes(SMALL, plan, micro_batches=9) == pytest.approx(4 * 2 * per_layer)


def test_step_time_chart_stacks_each_cause_and_hatches_what_does_not_fit():
    estimates = candidates(LLAMA_70B, Cluster(512))
    shown = [next(e for e in estimates if e.fits), next(e for e in estimates if not e.fits)]
    ax = plot_step_times(shown).axes[0]
    for row, e in enumerate(shown):
        bars = [p for p in ax.patches if abs(p.get_y() + p.get_height() / 2 - row) < 1e-9]
        assert sum(p.get_width() for p in bars) == pytest.approx(e.step_seconds, rel=RTOL)
        assert all(bool(p.get_hatch()) == (not e.fits) for p in bars)


def test_zero2_and_zero3_under_a_pipeline_are_flagged_and_zero1_is_not():
    for zero, pp, flagged in [("zero3", 2, True), ("zero2", 2, True), ("zero1", 2, False),
                              ("zero3", 1, False)]:  # fmt: skip
        e = estimate(SMALL, CLUSTER, Plan(2, pp, 8 // pp, zero, "none"))
        assert ("Z" in e.flags) == flagged, (zero, pp)
    assert "Z:" in candidate_table([estimate(SMALL, CLUSTER, Plan(2, 2, 4, "zero3", "none"))])


def test_a_plan_with_under_a_tenth_of_memory_free_is_flagged_tight():
    e = estimate(SMALL, CLUSTER, Plan(2, 2, 4, "zero1", "none"))
    used = sum(e.memory.values())
    for memory, tight in [(used / 0.95, True), (used / 0.85, False)]:
        cluster = replace(CLUSTER, gpu_memory=memory)
        e = estimate(SMALL, cluster, Plan(2, 2, 4, "zero1", "none"))
        assert ("M" in e.flags) == tight and e.fits


def test_plans_within_two_percent_of_the_best_are_called_too_close():
    cluster = Cluster(512)
    fitting = [e for e in candidates(LLAMA_70B, cluster) if e.fits]
    close = close_calls(LLAMA_70B, cluster)
    fastest = fitting[0].step_seconds
    assert close and fitting[0] not in close
    assert close == [e for e in fitting[1:] if e.step_seconds <= 1.02 * fastest]
    assert "too close to call" in summary(LLAMA_70B, cluster)
    tiny = Model("tiny", 1e9, TransformerShape(4, 64, 1, 8, 1), global_batch=4)
    only_one = Cluster(4, 4, gpu_memory=5e9, flops_per_s=1e7)
    assert close_calls(tiny, only_one, zero_stages=("ddp",), checkpointing=("none",)) == []


def test_the_plan_check_says_right_too_big_or_slower_and_never_names_the_best(capsys):
    cluster = Cluster(512, gpu_memory=40e9)  # 40 GB GPUs, as lecture 10's exercise
    top = best(LLAMA_70B, cluster).plan
    fields = ("tp", "pp", "dp", "zero", "checkpointing")
    assert check_plan({k: getattr(top, k) for k in fields}, LLAMA_70B, cluster) is True
    assert "✓ Right" in capsys.readouterr().out
    # Without checkpointing stage 0 keeps all 80 layers' activations: 65 GB, over 40.
    too_big = dict(tp=8, pp=4, dp=16, zero="zero1", checkpointing="none")
    assert check_plan(too_big, LLAMA_70B, cluster) is False
    out = capsys.readouterr().out
    assert "Too big" in out and "of it activations" in out
    # ZeRO-3 alone gathers the whole model twice per micro-batch across nodes: DP dominates.
    fsdp = dict(tp=1, pp=1, dp=512, zero="zero3", checkpointing="full")
    assert check_plan(fsdp, LLAMA_70B, cluster) is False
    out = capsys.readouterr().out
    assert "slower than the planner's best, most of the gap in dp" in out and str(top) not in out
    assert check_plan(dict(tp=..., pp=4, dp=16), LLAMA_70B, cluster) is None
    assert check_plan(dict(tp=4, pp=4, dp=16), LLAMA_70B, cluster) is False
    assert "uses 256 GPUs, not 512" in capsys.readouterr().out


def test_the_by_hand_memory_check_takes_16_bytes_split_and_stage_0s_activations(capsys):
    """70B, TP 8 x PP 8 x DP 8, ZeRO-1: N/64 parameters of 2 + 2 + 12/8 bytes; m = 1024/8 = 128,
    so stage 0 holds min(8, 128) micro-batches of 10 layers of sbh(34/8 + 5as/(8h)) bytes."""
    sbh, five_as_over_h = 4096 * 8192, 5 * 64 * 4096 / 8192
    right = {
        "model state": 70e9 / 64 * (2 + 2 + 12 / 8) / 1e9,
        "activations": 8 * 10 * sbh * (34 / 8 + five_as_over_h / 8) / 1e9,
    }
    assert check_plan_memory(right) is True
    assert capsys.readouterr().out.count("✓ Right") == 2
    wrong = {**right, "model state": 70e9 / 64 * 16 / 1e9}  # ZeRO-1's shard forgotten
    assert check_plan_memory(wrong) is False
    out = capsys.readouterr().out
    assert "ZeRO-1 divides the 12 optimizer bytes by d" in out and "6.016" not in out
    assert check_plan_memory({"model state": ..., "activations": ...}) is None
    assert "Not answered yet" in capsys.readouterr().out


def test_the_interleaved_bubble_check_takes_3_over_131(capsys):
    """PP 4, m = 64, v = 2: (P-1)/(vm + P-1) = 3/131 (by hand)."""
    assert check_interleaved_bubble(3 / 131) is True
    assert "✓ Right" in capsys.readouterr().out
    assert check_interleaved_bubble(3 / 67) is False  # v = 1: the bubble without interleaving
    out = capsys.readouterr().out
    assert "The fill and drain are v times shorter" in out and "0.0229" not in out
    assert check_interleaved_bubble(...) is None
    assert "Not answered yet" in capsys.readouterr().out


def test_the_mfu_check_takes_utilisation_times_achieved_over_peak(capsys):
    """The MFU the exercise's hint describes: the printed utilisation x 150 / 312 TFLOP/s."""
    plan = estimate(LLAMA_70B, Cluster(512), Plan(8, 4, 16, "zero1", "none"))
    right = plan.utilisation * 150e12 / 312e12
    assert check_plan_mfu(right) is True
    assert "✓ Right" in capsys.readouterr().out
    assert check_plan_mfu(plan.utilisation) is False  # against the achieved, not the peak
    out = capsys.readouterr().out
    assert "divide by the peak" in out and f"{right:.4g}" not in out
    assert check_plan_mfu(...) is None
    assert "Not answered yet" in capsys.readouterr().out


# --- one real DP x TP x PP step against one process, and against the planner ----------------

# The TinyGPT of train_3d (vocab 32, seq 8, d 16, d_ff 64, 2 blocks), parameters by hand:
EMBED = 32 * 16 + 8 * 16  # token and position embeddings
LN = 2 * 16  # a layer norm's weight and bias
BLOCK = 2 * LN + (16 * 48 + 48) + (16 * 16 + 16) + (16 * 64 + 64) + (64 * 16 + 16)
HEAD = LN + 16 * 32  # final layer norm, projection to the vocabulary (no bias)
# One TP rank of two: half of qkv, fc (weights and biases) and of both proj weights; the
# layer norms and the proj biases whole.
BLOCK_SHARE = 2 * LN + (16 * 48 + 48) // 2 + 16 * 16 // 2 + 16 + (16 * 64 + 64) // 2 + 64 * 8 + 16
F64 = 8


@pytest.fixture(scope="module")
def run_8_ranks():
    """One launch of 8 ranks, dp = tp = pp = 2: two AdamW steps of train_3d."""
    grid = ProcessGrid(tp=2, pp=2, dp=2)
    return grid, launch(train_3d, grid, world_size=8, timeout=300)


def assert_equals_one_process(grid, results, **options):
    reference = reference_3d(**options)  # torch's TinyGPT and AdamW, the whole batch
    dense = gather_dense(results, grid)
    assert dense.keys() == reference.keys()
    for name, expected in reference.items():
        torch.testing.assert_close(dense[name], expected, rtol=1e-10, atol=1e-10, msg=name)
    split = re.compile(r"(qkv|fc)\.(weight|bias)$|proj\.weight$")  # lecture 9's TP shards
    for r, result in enumerate(results):  # DP replicas hold the same; TP copies too
        replica, tp_first = grid.group_of(r, "dp")[0], grid.group_of(r, "tp")[0]
        for name, value in result["params"].items():
            assert torch.equal(value, results[replica]["params"][name]), (r, name)
            if not split.search(name):
                assert torch.equal(value, results[tp_first]["params"][name]), (r, name)


def test_dp_tp_pp_step_on_8_ranks_equals_one_process(run_8_ranks):
    grid, results = run_8_ranks
    assert_equals_one_process(grid, results)
    # the last stages' loss: the same on TP partners; the replicas' mean is the whole batch's
    assert all(r["losses"] == [None, None] for r in results if r["coords"]["pp"] == 0)
    last = [results[r]["losses"] for r in (2, 3, 6, 7)]
    assert last[0] == last[1] and last[2] == last[3]
    x, y = step_batches(2, 8)[0]
    whole = models.lm_loss(models.TinyGPT(STEP_CONFIG, dtype=torch.float64)(x), y).item()
    assert (last[0][0] + last[2][0]) / 2 == pytest.approx(whole, rel=1e-12)


def test_a_second_grid_pp2_dp2_with_four_micro_batches_equals_one_process():
    grid = ProcessGrid(tp=1, pp=2, dp=2)
    results = launch(train_3d, grid, steps=1, batch=8, m=4, world_size=4, timeout=300)
    assert_equals_one_process(grid, results, steps=1, batch=8)


def test_planner_predicts_the_measured_bytes_where_its_model_is_exact(run_8_ranks):
    grid, results = run_8_ranks
    rows = {row[0]: row[1:] for row in predicted_vs_measured(results, grid)}
    n, first, last = EMBED + 2 * BLOCK + HEAD, EMBED + BLOCK_SHARE, BLOCK_SHARE + HEAD
    stage = [last if grid.coords(r)["pp"] else first for r in range(8)]
    # the planner spreads every parameter evenly: n / (tp pp); the embedding, the head and
    # the replicated layer norms and biases make the real ranks hold more
    assert rows["parameters (count)"] == (pytest.approx(n / 4, rel=RTOL), stage)
    assert rows["params (bytes)"][1] == [F64 * k for k in stage]
    assert rows["optimizer_state (bytes)"][1] == [2 * F64 * k for k in stage]  # AdamW's moments
    # TP: 4 all-reduces per block of the (micro 2, seq 8, d 16) float64 activation, 2 ranks
    # (2(P-1)/P = 1 of it each), 1 block per stage, 2 micro-batches: exact
    tp = 2 * 4 * 1 * (2 * 8 * 16 * F64)
    assert rows["tp sent (bytes)"] == (pytest.approx(tp, rel=RTOL), [tp] * 8)
    # PP: one activation (or gradient) out and one in per micro-batch; each message of
    # pipeline.p2p.send_shaped carries a 9-value float64 header the planner does not count
    pp = 2 * 2 * (2 * 8 * 16 * F64)
    assert rows["pp sent+received (bytes)"] == (pytest.approx(pp, rel=RTOL), [pp + 4 * 72] * 8)
    # DP: one all-reduce of the rank's float64 gradients over 2 ranks: 2(P-1)/P = 1 of them
    assert rows["dp sent (bytes)"] == (
        pytest.approx(F64 * n / 4, rel=RTOL),
        [F64 * k for k in stage],
    )


# --- context and expert parallelism in the planner -------------------------------------------


def test_context_parallel_splits_activations_and_adds_ring_traffic_by_hand():
    base = estimate(SMALL, CLUSTER, Plan(2, 2, 4, "zero1", "none"))
    e = estimate(SMALL, CLUSTER, Plan(2, 2, 2, "zero1", "none", cp=2))
    m = 64 // (2 * 2)  # 16 micro-batches: CP does not split the batch
    short = (S // 2) * B * H
    # the weights are copied over dp x cp = 4 ranks: the same state as DP 4
    for kind in ("params", "grads", "optimizer_state"):
        assert e.memory[kind] == pytest.approx(base.memory[kind], rel=RTOL)
    per_layer = short * (34 / 2 + 5 * A * (S // 2) / (H * 2))  # TP + SP, s / cp tokens
    assert e.memory["activations"] == pytest.approx(2 * 4 * per_layer, rel=RTOL)
    kv = 2 * 2 * S * B * H / 2  # K and V of the whole sequence, bf16, this TP rank's heads
    ring = 4 * 3 * (1 / 2) * kv  # 4 layers; K, V forward, again and dK, dV back; (P-1)/P
    assert e.traffic["cp"] == pytest.approx(m * ring, rel=RTOL)
    assert e.traffic["tp"] == pytest.approx(m * 4 * 4 * (2 * (2 - 1) / 2) * short * 2, rel=RTOL)
    assert e.traffic["dp"] == pytest.approx(2 * (3 / 4) * 2 * 1e9 / 4, rel=RTOL)
    # tp [0, 1], cp [0, 2] within a node of 4; the rest crosses nodes
    assert e.links == {
        "tp": "intra-node",
        "pp": "inter-node",
        "dp": "inter-node",
        "cp": "intra-node",
    }
    compute = forward_backward_flops(4) / 2 / 2 / 1e14  # half a stage's work on each CP rank
    assert e.seconds["compute"] == pytest.approx(m * compute, rel=RTOL)
    assert str(e.plan).startswith("TP2+SP x CP2 x PP2 x DP2")


def test_expert_parallel_divides_the_experts_and_adds_all_to_alls_by_hand():
    moe = replace(SMALL, num_experts=4, top_k=2, expert_params=8e8)  # 2e8 shared
    e = estimate(moe, CLUSTER, Plan(1, 1, 16, "ddp", "none", ep=4))
    m = 64 // (16 * 2)
    assert e.params_per_gpu == pytest.approx(2e8 + 8e8 / 4, rel=RTOL)
    assert e.memory["params"] == pytest.approx(2 * 4e8, rel=RTOL)
    # all-to-all of the tokens, each to 2 experts: dispatch and combine, forward and backward
    tokens = 2 * S * B * H * 2
    assert e.traffic["ep"] == pytest.approx(m * 8 * 2 * 2 * (3 / 4) * tokens, rel=RTOL)
    # shared gradients all-reduced over 16 ranks, the experts' over the 4 copies of each
    dp = 2 * (15 / 16) * 2 * 2e8 + 2 * (3 / 4) * 2 * 2e8
    assert e.traffic["dp"] == pytest.approx(dp, rel=RTOL)
    # each token runs 2 of 4 experts: (2e8 + 4e8) / (2e8 + 2e8) the dense shape's FLOPs
    assert e.seconds["compute"] == pytest.approx(
        m * forward_backward_flops(8) * 1.5 / 1e14, rel=RTOL
    )
    assert e.links["ep"] == "intra-node"  # ranks 0-3: one node of 4
    with pytest.raises(ValueError, match="ep=3"):
        estimate(moe, CLUSTER, Plan(1, 1, 16, ep=3))


def test_cp_and_ep_default_to_one_and_leave_the_candidates_unchanged():
    plain = candidates(LLAMA_7B, Cluster(64))
    assert all(e.plan.cp == e.plan.ep == 1 and "cp" not in e.traffic for e in plain)
    assert [e.plan for e in candidates(LLAMA_7B, Cluster(64), cp=(1,), ep=(1,))] == [
        e.plan for e in plain
    ]


def test_cp_pays_for_long_sequences_and_ep_for_mixtures_of_experts():
    # 16 sequences of 128k tokens on 256 GPUs: DP stops at 16 replicas, so without CP the
    # rest goes to a pipeline with one micro-batch per stage (a 50% bubble)
    long = replace(LLAMA_7B, shape=replace(LLAMA_7B.shape, seq=131072), global_batch=16)
    without, with_cp = best(long, Cluster(256)), best(long, Cluster(256), cp=(1, 2, 4, 8))
    assert without.plan.cp == 1 and without.bubble == pytest.approx(0.5)
    assert with_cp.plan.cp > 1 and with_cp.step_seconds < 0.6 * without.step_seconds
    # Mixtral's sizes, 64 sequences on 256 GPUs linked at 32 GB/s inside a node: the experts
    # split over EP ranks instead of TP x PP
    moe, slow = replace(MOE_8X7B, global_batch=64), Cluster(256, intra_bandwidth=32e9)
    without, with_ep = best(moe, slow), best(moe, slow, ep=(1, 2, 4, 8))
    assert without.plan.ep == 1 and with_ep.plan.ep > 1
    assert with_ep.step_seconds < 0.9 * without.step_seconds


def test_table_and_chart_show_the_cp_seconds_in_the_step():
    long = replace(LLAMA_7B, shape=replace(LLAMA_7B.shape, seq=131072), global_batch=16)
    shown = [e for e in candidates(long, Cluster(256), cp=(1, 2)) if e.fits][:3]
    header, first = candidate_table(shown).splitlines()[:2]
    assert header.split()[:4] == ["tp", "pp", "dp", "cp"] and "CP" in header.split()
    assert f"{shown[0].seconds['cp']:.2f}" in first and shown[0].plan.cp == 2
    ax = plot_step_times(shown).axes[0]
    assert sum(p.get_width() for p in ax.patches) == pytest.approx(
        sum(e.step_seconds for e in shown), rel=RTOL
    )


def planned(pp: int) -> SimpleNamespace:
    """A made-up best plan with a pipeline of `pp` stages, all the two checks read of it."""
    return SimpleNamespace(plan=SimpleNamespace(pp=pp))


def test_the_small_batch_check_compares_the_two_best_pipelines(capsys):
    plans = {1536: planned(8), 128: planned(16)}
    assert check_pipeline_with_128("deeper", plans) is True
    assert "fewer parameters to reduce" in capsys.readouterr().out
    assert check_pipeline_with_128("the same", plans) is False
    assert check_pipeline_with_128(..., plans) is None
    assert check_pipeline_with_128("the same", {1536: planned(8), 128: planned(8)}) is True
    assert check_pipeline_with_128("shallower", {1536: planned(8), 128: planned(4)}) is True


def test_the_cp_check_reads_whether_the_best_plan_keeps_a_pipeline(capsys):
    assert check_pipeline_with_cp("dropped", planned(1)) is True
    assert "with no bubble" in capsys.readouterr().out
    assert check_pipeline_with_cp("kept", planned(1)) is False
    assert check_pipeline_with_cp("kept", planned(2)) is True
    assert check_pipeline_with_cp(..., planned(1)) is None


def test_the_tp_bytes_check_reads_rank_0s_measured_bytes(capsys):
    run = [{"sent": {"tp": 16_384}}, {"sent": {"tp": 99}}]
    assert check_tp_bytes_per_rank(16_384, run) is True
    assert check_tp_bytes_per_rank(8_192, run) is False
    assert "Count the all-reduces" in capsys.readouterr().out
    assert check_tp_bytes_per_rank(..., run) is None
