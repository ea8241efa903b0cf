"""course_lib.tensor_parallel: Megatron's parallel layers against the dense layers they are cut
from, their communication against the ring all-reduce formula, the vocabulary-parallel
cross-entropy against F.cross_entropy, and the activation-memory formulas.

Every expected slice, byte count and formula value is computed here from the dense model and
the sizes, never read back from course_lib.tensor_parallel. Layers run in float64, so a right
layer matches the dense one to ~1e-15 (summation order only): atol 1e-12.
One pool of 4 ranks runs tensor-parallel groups of 1, 2 and 4 ranks side by side.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import CommCounter, models, rank
from course_lib.costs import (
    GPT3_175B,
    activation_memory,
    compute_seconds,
    traffic_per_microbatch,
)
from course_lib.measure.tensor_parallel import (
    LAYERS,
    LayerRun,
    check_block_all_reduces,
    check_f_and_g_backward,
    check_head_loss_backward,
    check_row_backward_all_reduces,
    check_tp_over_pp,
    comm_formula,
    f_and_g_all_reduces,
    measure_mlp_saved,
    plot_activation_memory,
    run_against_dense,
    run_torch_mlp,
)
from course_lib.tensor_parallel import (
    ColumnParallelLinear,
    ParallelBlock,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_shard,
    gelu_split_errors,
    row_shard,
    shard_range,
    vocab_parallel_cross_entropy,
)

P = 4
TP_SIZES = (1, 2, 4)
ATOL = 1e-12
CONFIG = models.GPTConfig()  # vocab 32, seq 16, d_model 32, 4 heads, d_ff 128
BATCH = 2
F64 = 8  # bytes per float64


# --- what each rank should hold, sliced here by hand ----------------------------------------


def rows(t, r, size):
    k = t.shape[0] // size
    return t[r * k : (r + 1) * k]


def cols(t, r, size):
    k = t.shape[-1] // size
    return t[..., r * k : (r + 1) * k]


def qkv_rows(t, r, size):
    """Rank r's heads of a fused (q; k; v) weight or bias: its rows of each third."""
    return torch.cat([rows(part, r, size) for part in t.chunk(3, dim=0)])


def sub(grads, prefix):
    return {k[len(prefix) :]: v for k, v in grads.items() if k.startswith(prefix)}


def expected_grads(layer, g, r, size):
    """name -> rank r's piece of the dense layer's gradients `g`, by the Megatron layout."""
    if layer == "column":
        return {"weight": rows(g["weight"], r, size), "bias": rows(g["bias"], r, size)}
    if layer == "row":
        return {"weight": cols(g["weight"], r, size), "bias": g["bias"]}
    if layer == "mlp":
        return {
            "fc.weight": rows(g["fc.weight"], r, size),
            "fc.bias": rows(g["fc.bias"], r, size),
            "proj.weight": cols(g["proj.weight"], r, size),
            "proj.bias": g["proj.bias"],
        }
    if layer == "attention":
        return {
            "qkv.weight": qkv_rows(g["qkv.weight"], r, size),
            "qkv.bias": qkv_rows(g["qkv.bias"], r, size),
            "proj.weight": cols(g["proj.weight"], r, size),
            "proj.bias": g["proj.bias"],
        }
    if layer == "block":
        out = {k: v for k, v in g.items() if k.startswith("ln")}
        for prefix, part in (("attn.", "attention"), ("mlp.", "mlp")):
            pieces = expected_grads(part, sub(g, prefix), r, size)
            out.update({prefix + k: v for k, v in pieces.items()})
        return out
    if layer == "embedding":
        return {"weight": rows(g["weight"], r, size)}
    if layer == "head + cross-entropy":
        return {"weight": rows(g["weight"], r, size)}
    raise KeyError(layer)


def build(layer, model, group):
    """(dense module, parallel module, dense fn, parallel fn, input kind) for one layer."""
    block = model.blocks[0]
    if layer == "column":
        d = block.mlp.fc
        p = ColumnParallelLinear(d, group=group)
    elif layer == "row":
        d = block.mlp.proj
        p = RowParallelLinear(d, group=group)
    elif layer == "mlp":
        d = block.mlp
        p = ParallelMLP(d, group)
    elif layer == "attention":
        d = block.attn
        p = ParallelSelfAttention(d, group)
    elif layer == "block":
        d = block
        p = ParallelBlock(d, group)
    elif layer == "embedding":
        d = model.embed.tokens
        p = VocabParallelEmbedding(d, group)
    else:
        d = model.head.out
        p = ColumnParallelLinear(d, group=group)
        targets = torch.arange(BATCH * CONFIG.seq_len).remainder(CONFIG.vocab_size)
        targets = targets.view(BATCH, CONFIG.seq_len)

        def dense_fn(h):
            return F.cross_entropy(d(h).flatten(0, 1), targets.flatten(), reduction="none").view(
                targets.shape
            )

        return d, p, dense_fn, lambda h: vocab_parallel_cross_entropy(p(h), targets, group)
    return d, p, d, p


def all_layers_in_groups():
    """On each of 4 ranks: every layer in tensor-parallel groups of 1, 2 and 4 ranks, against
    the dense layer; the worst errors, and the bytes and calls each pass made."""
    groups = {}
    for size in TP_SIZES:  # every rank creates every group, in the same order
        for first in range(0, P, size):
            members = list(range(first, first + size))
            handle = dist.new_group(members)
            if rank() in members:
                groups[size] = handle
    out = {}
    for size, group in groups.items():
        r = dist.get_rank(group)
        for layer in LAYERS:
            model = models.TinyGPT(CONFIG, seed=3, dtype=torch.float64)
            dense, par, dense_fn, par_fn = build(layer, model, group)
            g = torch.Generator().manual_seed(7)
            if layer == "embedding":
                x = torch.randint(CONFIG.vocab_size, (BATCH, CONFIG.seq_len), generator=g)
            else:
                width = CONFIG.d_ff if layer == "row" else CONFIG.d_model
                x = torch.randn(BATCH, CONFIG.seq_len, width, generator=g, dtype=torch.float64)
                x.requires_grad_()
            y = dense_fn(x)
            upstream = torch.randn(y.shape, generator=g, dtype=torch.float64)
            y.backward(upstream)

            xp = cols(x.detach(), r, size) if layer == "row" else x.detach()
            if xp.is_floating_point():
                xp = xp.clone().requires_grad_()
            want_y = cols(y.detach(), r, size) if layer == "column" else y.detach()
            up = cols(upstream, r, size) if layer == "column" else upstream
            with CommCounter() as fwd:
                yp = par_fn(xp)
            with CommCounter() as bwd:
                yp.backward(up)
            grads = expected_grads(layer, {n: q.grad for n, q in dense.named_parameters()}, r, size)
            got = dict(par.named_parameters())
            assert got.keys() == grads.keys(), (layer, sorted(got), sorted(grads))
            errors = {"output": (yp - want_y).abs().max().item()}
            if xp.grad is not None:
                want_dx = cols(x.grad, r, size) if layer == "row" else x.grad
                errors["input grad"] = (xp.grad - want_dx).abs().max().item()
            for name, want in grads.items():
                assert got[name].shape == want.shape, (layer, name, got[name].shape, want.shape)
                errors[f"{name} grad"] = (got[name].grad - want).abs().max().item()
            out[(layer, size)] = {
                "errors": errors,
                "sent": (fwd.bytes_sent, bwd.bytes_sent),
                "all_reduces": (fwd.calls["all_reduce"], bwd.calls["all_reduce"]),
                "other_calls": sum(fwd.calls.values())
                + sum(bwd.calls.values())
                - fwd.calls["all_reduce"]
                - bwd.calls["all_reduce"],
            }
    return out


@pytest.fixture(scope="module")
def layer_runs(pool4):
    return pool4.launch(all_layers_in_groups, timeout=120)


@pytest.mark.parametrize("size", TP_SIZES)
@pytest.mark.parametrize("layer", LAYERS)
def test_parallel_layer_matches_dense_output_and_gradients(layer_runs, layer, size):
    for r, per_rank in enumerate(layer_runs):
        errors = per_rank[(layer, size)]["errors"]
        bad = {k: v for k, v in errors.items() if not v <= ATOL}
        assert not bad, f"rank {r}, {layer} on {size} ranks: errors above {ATOL}: {bad}"
        assert "output" in errors and len(errors) >= 2


# Megatron's all-reduces of a (tokens x hidden) activation per layer (forward, backward): the
# specification these layers implement, from the paper's f and g.
MEGATRON_ALL_REDUCES = {
    "column": (0, 1),
    "row": (1, 0),
    "mlp": (1, 1),
    "attention": (1, 1),
    "block": (2, 2),
    "embedding": (1, 0),
    "head + cross-entropy": (3, 1),  # forward: max, sum of exp, target logit (per token)
}


@pytest.mark.parametrize("size", TP_SIZES)
@pytest.mark.parametrize("layer", LAYERS)
def test_bytes_per_layer_equal_the_ring_all_reduce_formula(layer_runs, layer, size):
    tokens = BATCH * CONFIG.seq_len
    activation = tokens * CONFIG.d_model * F64  # every big all-reduce is of this tensor
    ring = 2 * (size - 1) / size  # fraction of its tensor a rank sends in a ring all-reduce
    fwd_calls, bwd_calls = MEGATRON_ALL_REDUCES[layer]
    if layer == "head + cross-entropy":
        want = (ring * 3 * tokens * F64, ring * activation)
    else:
        want = (ring * fwd_calls * activation, ring * bwd_calls * activation)
    for r, per_rank in enumerate(layer_runs):
        run = per_rank[(layer, size)]
        assert run["sent"] == pytest.approx(want, abs=0), f"rank {r}"
        assert run["other_calls"] == 0, f"rank {r}: collectives other than all-reduce"
        if size > 1:
            assert run["all_reduces"] == (fwd_calls, bwd_calls), f"rank {r}"
    assert comm_formula(layer, tokens, CONFIG.d_model, size, F64) == pytest.approx(want, abs=0)


# --- vocabulary-parallel cross-entropy on its own --------------------------------------------


def vocab_ce_against_torch():
    """Big logits (max subtraction matters), targets spread over every rank's range."""
    g = torch.Generator().manual_seed(11)
    n, vocab = 40, 24
    logits = 300 * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    targets = torch.randint(vocab, (n,), generator=g)
    upstream = torch.rand(n, generator=g, dtype=torch.float64)
    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full, targets, reduction="none")
    want.backward(upstream)
    local = cols(logits, rank(), P).clone().requires_grad_()
    got = vocab_parallel_cross_entropy(local, targets)
    got.backward(upstream)
    return (
        (got - want).abs().max().item(),
        (local.grad - cols(full.grad, rank(), P)).abs().max().item(),
        torch.isfinite(got).all().item(),
    )


def test_vocab_parallel_cross_entropy_equals_f_cross_entropy(pool4):
    for r, (loss_err, grad_err, finite) in enumerate(pool4.launch(vocab_ce_against_torch)):
        assert finite, f"rank {r}: non-finite loss (is the global max subtracted?)"
        assert loss_err <= 1e-10, f"rank {r}: loss differs by {loss_err}"
        assert grad_err <= ATOL, f"rank {r}: logits gradient differs by {grad_err}"


# --- the library's own runner and torch's reference ------------------------------------------


def runner_and_torch():
    return [run_against_dense(layer) for layer in LAYERS], run_torch_mlp(), f_and_g_all_reduces()


def test_run_against_dense_on_the_world_group_and_torchs_parallelize_module(pool4):
    tokens = BATCH * CONFIG.seq_len
    activation = tokens * CONFIG.d_model * F64
    for r, (runs, torch_mlp, f_g) in enumerate(pool4.launch(runner_and_torch, timeout=120)):
        assert f_g == {"f": (0, 1), "g": (1, 0)}, f"rank {r}: {f_g}"
        for run in runs:
            worst = max(run.output_error, run.input_grad_error, run.weight_grad_error)
            assert worst <= ATOL, f"rank {r}, {run.layer}: error {worst}"
            # the sockets carry the ring's volume plus gloo's headers (a few hundred bytes a
            # message, 2(t-1) messages an all-reduce), and nothing when nothing is sent
            passes = [
                (run.forward_bytes, run.forward_wire),
                (run.backward_bytes, run.backward_wire),
            ]
            for counted, wire in passes:
                assert counted <= wire <= counted + 8192 * (counted > 0), (r, run.layer, wire)
        mlp = next(run for run in runs if run.layer == "mlp")
        assert (mlp.forward_bytes, mlp.backward_bytes) == (1.5 * activation, 1.5 * activation)
        for name in ("ours", "torch"):
            result = torch_mlp[name]
            assert result["output error"] <= ATOL and result["input grad error"] <= ATOL, name
            assert result["fc weight on this rank"] == (CONFIG.d_ff // P, CONFIG.d_model)
            assert sum(result["forward collectives"].values()) == 1, (name, result)
            assert sum(result["backward collectives"].values()) == 1, (name, result)


def test_uneven_split_is_a_clear_error():
    assert shard_range(12, 2, 4) == (6, 9)
    with pytest.raises(ValueError, match="n_heads of size 6 cannot be split evenly over 4"):
        shard_range(6, 0, 4, "n_heads")


def heads_not_divisible():
    config = models.GPTConfig(n_heads=2, d_model=32)
    try:
        ParallelSelfAttention(models.TinyGPT(config).blocks[0].attn)
    except ValueError as exc:
        return str(exc)
    return None


def test_two_heads_on_four_ranks_is_refused(pool4):
    for message in pool4.launch(heads_not_divisible):
        assert message is not None and "2 ranks" not in message and "4 ranks" in message


# --- GeLU and the column split ---------------------------------------------------------------


def test_gelu_commutes_with_the_column_split_not_the_row_split():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 12, generator=g, dtype=torch.float64)
    a = torch.randn(12, 20, generator=g, dtype=torch.float64)
    columns, rows_, summed_first = gelu_split_errors(x, a, parts=2).values()
    assert columns <= 1e-14  # exactly a slice of GeLU(XA)
    assert rows_ > 0.1  # GeLU is not additive: the row split needs its all-reduce first
    assert summed_first <= 1e-12


# --- activation memory -----------------------------------------------------------------------


def test_activation_memory_formulas():
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B, one sequence per micro-batch
    sbh = s * b * h
    # 5as/h = 5 * 96 * 2048 / 12288 = 80: the attention scores outweigh everything else
    assert activation_memory(s, b, h, a) == pytest.approx(sbh * (34 + 80))
    assert activation_memory(s, b, h, a) == pytest.approx(2_868_903_936)
    for t in (1, 2, 4, 8):
        tp = sbh * (10 + 24 / t + 5 * a * s / (h * t))
        tp_sp = sbh * (34 / t + 5 * a * s / (h * t))
        assert activation_memory(s, b, h, a, t) == pytest.approx(tp)
        assert activation_memory(s, b, h, a, t, sequence_parallel=True) == pytest.approx(tp_sp)
        assert activation_memory(
            s, b, h, a, t, sequence_parallel=True, recompute_attention=True
        ) == pytest.approx(34 * sbh / t)
        assert activation_memory(s, b, h, a, t, recompute_attention=True) == pytest.approx(
            sbh * (10 + 24 / t)
        )
    # 96 layers at t = 8 with TP alone: 23 sbh per layer, 55.6 GB
    assert GPT3_175B.layers * activation_memory(s, b, h, a, 8) / 1e9 == pytest.approx(
        96 * 23 * sbh / 1e9
    )


def saved_by_parallel_mlp():
    return measure_mlp_saved()


def test_parallel_mlp_saves_the_input_whole_and_its_d_ff_activations_split(pool4):
    tokens = BATCH * CONFIG.seq_len
    # input x (replicated), GeLU's input and output (d_ff / P wide each), fp32
    want = tokens * (CONFIG.d_model + 2 * CONFIG.d_ff // P) * 4
    assert pool4.launch(saved_by_parallel_mlp) == [want] * P


def test_traffic_per_microbatch_tp_against_pp():
    t, p = 8, 8
    activation = 2048 * 1 * 12288 * 2  # bf16
    traffic = traffic_per_microbatch(GPT3_175B, t, p)
    # 12 layers per stage, 4 all-reduces each, a ring all-reduce sends 2 * 7/8 of its tensor
    assert traffic["TP"] == pytest.approx(12 * 4 * 1.75 * activation)
    assert traffic["PP"] == pytest.approx(2 * activation)
    # with sequence parallelism each of the stage's t GPUs sends its 1/t of the sequence
    split = traffic_per_microbatch(GPT3_175B, t, p, sequence_parallel=True)
    assert split["PP"] == pytest.approx(2 * activation / t) and split["TP"] == traffic["TP"]


def test_compute_seconds_per_microbatch():
    s, h, t, p = 2048, 12288, 8, 8
    flops = 3 * (24 * s * h * h + 4 * s * s * h) * (96 / p) / t  # fwd + bwd, 12 layers, 1/t
    assert compute_seconds(GPT3_175B, t, p, 150e12) == pytest.approx(flops / 150e12)


def test_activation_plot_draws_the_formula():
    tps = (1, 2, 4, 8)
    fig = plot_activation_memory(GPT3_175B, tps)
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    sbh = 2048 * 12288
    tp_only = [96 * sbh * (10 + 24 / t + 80 / t) / 1e9 for t in tps]
    assert list(lines["TP"].get_xdata()) == list(tps)
    assert list(lines["TP"].get_ydata()) == pytest.approx(tp_only)
    assert list(lines["TP + SP"].get_ydata()) == pytest.approx(
        [96 * sbh * (34 + 80) / t / 1e9 for t in tps]
    )


def test_column_and_row_shards_are_the_slices_that_rebuild_xa():
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(12, 8, generator=g, dtype=torch.float64)  # nn.Linear: (out, in)
    x = torch.randn(5, 8, generator=g, dtype=torch.float64)
    for size in (1, 2, 4):
        cols = [column_shard(weight, r, size) for r in range(size)]
        assert all(c.shape == (12 // size, 8) for c in cols)
        assert torch.allclose(torch.cat([x @ c.T for c in cols], dim=1), x @ weight.T, atol=1e-12)
        rows = [row_shard(weight, r, size) for r in range(size)]
        assert all(w.shape == (12, 8 // size) for w in rows)
        partial = [xi @ w.T for xi, w in zip(x.chunk(size, dim=1), rows, strict=True)]
        assert torch.allclose(sum(partial), x @ weight.T, atol=1e-12)
    qkv = torch.arange(12.0).reshape(12, 1)  # three blocks of 4 rows: q 0-3, k 4-7, v 8-11
    assert column_shard(qkv, 1, 2, parts=3).flatten().tolist() == [2, 3, 6, 7, 10, 11]
    with pytest.raises(ValueError, match="cannot be split evenly over 3 ranks"):
        row_shard(weight, 0, 3)


def test_the_tp_over_pp_exercise_takes_18(capsys):
    """GPT-3 at t = 4, p = 16: 96 / 16 = 6 layers per stage, each 4 all-reduces of 2 * 3/4 of
    the activation A, so 36 A of TP against 2 A across the boundary: 18 (by hand)."""
    assert check_tp_over_pp(6 * 4 * 2 * 3 / 4 / 2) is True
    assert "✓ Right" in capsys.readouterr().out
    assert check_tp_over_pp(96 * 4 * 2 * 3 / 4 / 2) is False  # every layer, not the stage's 6
    out = capsys.readouterr().out
    assert "Layers per stage x 4 all-reduces" in out and "18" not in out
    assert check_tp_over_pp(...) is None
    assert "Not answered yet" in capsys.readouterr().out


def counted(layer: str, forward: int, backward: int) -> LayerRun:
    """A made-up run of `layer` that counted these all-reduces and nothing else."""
    calls = (
        ({"all_reduce": forward} if forward else {}),
        ({"all_reduce": backward} if backward else {}),
    )
    return LayerRun(layer, 0.0, 0.0, 0.0, 0, 0, *calls)


def test_the_f_and_g_check_reads_the_backward_counts(capsys):
    fg_calls = {"f": (0, 1), "g": (1, 0)}  # made up: rank 0's (forward, backward) all-reduces
    assert check_f_and_g_backward("all-reduce", "identity", fg_calls) == (True, True)
    out = capsys.readouterr().out
    assert "the ranks add them up" in out and "already whole on every rank" in out
    assert check_f_and_g_backward("identity", "all-reduce", fg_calls) == (False, False)
    assert check_f_and_g_backward(..., ..., fg_calls) == (None, None)


def test_the_head_loss_check_counts_rank_0s_backward_all_reduces(capsys):
    head_loss = [counted("head + cross-entropy", 3, 1), counted("head + cross-entropy", 3, 1)]
    assert check_head_loss_backward("1", head_loss) is True
    assert "The loss's gradient is local" in capsys.readouterr().out
    assert check_head_loss_backward("4", head_loss) is False  # forward's 3 and backward's 1
    assert check_head_loss_backward(..., head_loss) is None


# Made-up counts of rank 0 on t = 2 (and nothing on t = 1, which the checks do not read).
COUNTED_RUNS = {
    1: [{"layers": []}],
    2: [{"layers": [counted("column", 0, 1), counted("row", 1, 0), counted("block", 2, 2)]}],
}


def test_the_row_check_reads_the_row_layers_backward_count_on_2_ranks(capsys):
    assert check_row_backward_all_reduces("0", COUNTED_RUNS) is True
    assert "the identity backward" in capsys.readouterr().out
    assert check_row_backward_all_reduces("1", COUNTED_RUNS) is False
    assert check_row_backward_all_reduces(..., COUNTED_RUNS) is None


def test_the_block_check_adds_the_blocks_forward_and_backward_counts_on_2_ranks(capsys):
    assert check_block_all_reduces("4", COUNTED_RUNS) is True
    assert "one f and one g" in capsys.readouterr().out
    assert check_block_all_reduces("2", COUNTED_RUNS) is False  # forward only
    assert check_block_all_reduces(..., COUNTED_RUNS) is None
