"""course_lib.memory: byte counts of weights, gradients and optimizer state, the mixed-precision
AdamW recipe and its 16 bytes/parameter, saved-tensor accounting of activations, and activation
checkpointing's peak against n/k + k. course_lib.measure.memory: a Megatron-style layer's saved
bytes against sbh(34 + 5as/h), autocast's memory and losses, fp16 loss scaling against
torch.amp.GradScaler, and the exercises' checks against answers worked by hand.

Every expected byte count is computed here from numel() * element_size() of the tensors
involved (or from the model's sizes), never read back from course_lib.memory.
"""

from __future__ import annotations

import math

import pytest
import torch

from course_lib import data, models
from course_lib.costs import activation_memory
from course_lib.measure.memory import (
    LossScaler,
    PaperBlock,
    ScaledStep,
    SequenceSplit,
    activation_sweep,
    activation_table,
    autocast_memory,
    check_course_vs_formula,
    check_first_steps,
    check_s_part_overtakes,
    check_sgd_budget,
    check_smallest_peak,
    course_block,
    layer_activations,
    plot_activation_sweep,
    plot_losses,
    plot_sequence_split,
    scaled_training,
    sequence_split,
    sequence_table,
    train_losses,
)
from course_lib.memory import (
    BYTES_PER_PARAMETER,
    CastMemory,
    MixedPrecisionAdamW,
    PeakMemory,
    SavedTensors,
    attention_share,
    budget,
    budget_table,
    chain,
    checkpoint_units,
    divisors,
    measure_chain,
    saved_by_forward,
    segments,
    square_bytes,
    storage_bytes,
    training_memory,
)

CONFIG = models.GPTConfig(vocab_size=36, seq_len=64, d_model=40, n_heads=4, n_layers=2, d_ff=160)
# AdamW keeps its step count as one fp32 scalar tensor per parameter tensor.
STEP_BYTES = torch.tensor(0.0).element_size()


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def one_step(model, optimizer_step, inputs, targets):
    models.lm_loss(model(inputs).float(), targets).backward()
    optimizer_step()


# --- counting bytes -------------------------------------------------------------------------


def test_storage_bytes_counts_a_storage_once_however_many_views():
    a = torch.zeros(10, 6)
    b = torch.zeros(7, dtype=torch.float64)
    views = [a, a[2:5], a.t(), a.view(60), b, b[1:]]
    assert storage_bytes(views) == nbytes([a, b]) == 10 * 6 * 4 + 7 * 8


def test_fp32_adamw_keeps_weights_gradients_and_two_fp32_moments():
    model = models.TinyGPT(CONFIG)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    x, y = data.tokens(4, seq_len=16, vocab_size=CONFIG.vocab_size)

    before = training_memory(model, optimizer)
    assert [r.category for r in before.rows] == ["weights"]  # no gradients or state yet
    one_step(model, optimizer.step, x, y)
    after = training_memory(model, optimizer)

    weight_bytes = nbytes(params)
    assert after.n_params == sum(p.numel() for p in params)
    assert after.bytes_of("weights") == weight_bytes
    assert after.bytes_of("gradients") == nbytes(p.grad for p in params) == weight_bytes
    # Adam's state after a step: m and v, each the size of the parameters in fp32.
    assert after.bytes_of("optimizer: exp_avg") + after.bytes_of("optimizer: exp_avg_sq") == (
        2 * after.n_params * 4
    )
    assert after.bytes_of("optimizer: step") == STEP_BYTES * len(params)
    assert after.bytes_of("master weights") == 0  # AdamW steps the model's own tensors
    assert after.total == 16 * after.n_params + STEP_BYTES * len(params)


def test_mixed_precision_adamw_measures_16_bytes_per_parameter():
    model = models.TinyGPT(CONFIG)
    n_params, n_tensors = models.count_parameters(model), len(list(model.parameters()))
    trainer = MixedPrecisionAdamW(model, lr=1e-3)
    x, y = data.tokens(4, seq_len=16, vocab_size=CONFIG.vocab_size)
    one_step(trainer.model, trainer.step, x, y)

    breakdown = training_memory(trainer.model, trainer.optimizer)
    rows = {r.category: r for r in breakdown.rows}
    # bf16 weights and gradients (2 + 2), fp32 master weights, m and v (4 + 4 + 4) ...
    expected = {
        "weights": (n_params * 2, "bfloat16"),
        "gradients": (n_params * 2, "bfloat16"),
        "master weights": (n_params * 4, "float32"),
        "optimizer: exp_avg": (n_params * 4, "float32"),
        "optimizer: exp_avg_sq": (n_params * 4, "float32"),
        "optimizer: step": (n_tensors * STEP_BYTES, "float32"),
    }
    assert {c: (r.bytes, r.dtype) for c, r in rows.items()} == expected
    # ... and no fp32 gradients left behind by the step: 16 bytes per parameter in all.
    assert "master gradients" not in rows
    assert breakdown.total == 16 * n_params + n_tensors * STEP_BYTES
    assert sum(BYTES_PER_PARAMETER.values()) == 16


def test_mixed_precision_step_is_adamw_on_the_fp32_master_copy():
    model = models.TinyGPT(CONFIG)
    reference = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    trainer = MixedPrecisionAdamW(model, lr=1e-2, weight_decay=0.1)
    x, y = data.tokens(4, seq_len=16, vocab_size=CONFIG.vocab_size)
    models.lm_loss(trainer.model(x).float(), y).backward()
    # The reference: torch's AdamW on fp32 tensors, given the bf16 gradients upcast.
    for ref, p in zip(reference, trainer.model.parameters(), strict=True):
        ref.grad = p.grad.float()
    torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1).step()
    trainer.step()
    for ref, master, p in zip(reference, trainer.master, trainer.model.parameters(), strict=True):
        torch.testing.assert_close(master, ref, rtol=0, atol=0)
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(p, ref.detach().bfloat16(), rtol=0, atol=0)


def test_budget_formula_for_7b_and_70b():
    assert sum(budget(7e9).values()) == pytest.approx(16 * 7e9)
    table = budget_table({"7B": 7e9, "70B": 70e9}, gpu_bytes=80e9)
    assert "112 GB" in table and "1,120 GB" in table
    gpus = table.splitlines()[-1].split()[-2:]
    assert gpus == [str(math.ceil(16 * 7e9 / 80e9)), str(math.ceil(16 * 70e9 / 80e9))]


# --- saved tensors ----------------------------------------------------------------------------


def test_saved_tensors_counts_shared_storage_once_excludes_and_sees_frees():
    w = torch.randn(100, requires_grad=True)  # plays a parameter: excluded
    x = torch.randn(100, requires_grad=True)
    with SavedTensors(exclude=[w]) as saved:
        y = x.exp()  # exp saves its result y
        z = y.sin()  # sin saves its input: y again, counted once
        assert saved.live_bytes == nbytes([y])
        loss = (z * w).sum()  # mul saves z and w; w is excluded
        assert saved.live_bytes == nbytes([y, z])
        loss.backward()
        assert saved.live_bytes == 0  # backward freed every saved tensor
    assert saved.peak_bytes == nbytes([y, z])
    assert [r.shape for r in saved.records] == [(100,), (100,)]


def test_saved_tensors_lets_a_graph_that_is_never_backwarded_go():
    x = torch.randn(100, requires_grad=True)
    with SavedTensors() as saved:
        y = x.exp()  # exp saves its own output: the tensor whose grad_fn holds what was saved
        assert saved.live_bytes == nbytes([y])
    del y  # no backward: dropping the output must free the graph and what it saved
    assert saved.live_bytes == 0


def test_gradients_through_counted_saved_tensors_are_unchanged():
    x = torch.randn(100, requires_grad=True)
    with SavedTensors():
        x.exp().sin().sum().backward()
    torch.testing.assert_close(x.grad, x.detach().exp().cos() * x.detach().exp(), rtol=0, atol=0)


def test_activation_bytes_grow_linearly_with_batch():
    model = models.TinyGPT(CONFIG)
    seq = 16
    live = []
    for batch in (1, 2, 3, 4):
        # Copies: data.tokens returns two views of one (batch, seq + 1) storage, which the
        # loss's reshape of the targets copies for batch > 1 only.
        x, y = (t.clone() for t in data.tokens(batch, seq_len=seq, vocab_size=CONFIG.vocab_size))
        live.append(saved_by_forward(model, x, y, models.lm_loss).live_bytes)
    steps = [b - a for a, b in zip(live[:-1], live[1:], strict=True)]
    assert steps[0] > 0 and steps == [steps[0]] * 3, live


def test_activation_bytes_grow_with_sequence_linearly_plus_attention_squares():
    model = models.TinyGPT(CONFIG)
    batch, rest = 3, []
    for seq in (16, 32, 48, 64):
        x, y = data.tokens(batch, seq_len=seq, vocab_size=CONFIG.vocab_size)
        saved = saved_by_forward(model, x, y, models.lm_loss)
        # Per block, softmax saves batch x heads x seq x seq fp32 values; the mask is bool.
        square = CONFIG.n_layers * (batch * CONFIG.n_heads * seq * seq * 4 + seq * seq)
        assert square_bytes(saved, seq) == square
        rest.append(saved.live_bytes - square)
    # Everything else grows by the same amount per 16 more tokens: linear in seq.
    steps = [b - a for a, b in zip(rest[:-1], rest[1:], strict=True)]
    assert steps[0] > 0 and steps == [steps[0]] * 3, rest


def test_sequence_split_measures_the_square_part_and_lays_a_line_through_the_rest():
    model = models.TinyGPT(CONFIG)

    def measure(batch, seq):
        x, y = (t.clone() for t in data.tokens(batch, seq_len=seq, vocab_size=CONFIG.vocab_size))
        return saved_by_forward(model, x, y, models.lm_loss)

    seqs = [16, 32, 48]
    split = sequence_split(measure, CONFIG, seqs, batch=3)
    for i, seq in enumerate(seqs):
        saved = measure(3, seq)
        assert split.total[i] == saved.live_bytes
        assert split.square[i] == split.formula[i] == square_bytes(saved, seq)
        assert split.rest[i] == saved.live_bytes - split.square[i]
    assert split.line == pytest.approx(split.rest)  # the rest is linear in seq
    rows = sequence_table(split).splitlines()
    assert len(rows) == 4 and rows[1].split()[:2] == ["16", f"{split.total[0]:,}"]
    assert len(plot_sequence_split(split).axes[0].lines) == 5  # 3 measured, 2 formula lines


# --- activation checkpointing -----------------------------------------------------------------

N_LAYERS, WIDTH, BATCH = 16, 8, 4
UNIT = BATCH * WIDTH * 4  # one layer's activation: batch x width fp32 values


@pytest.fixture(scope="module")
def chain_runs():
    layers = chain(N_LAYERS, WIDTH)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(0))
    return {k: measure_chain(layers, x, k) for k in [None, *divisors(N_LAYERS)]}


@pytest.mark.parametrize("k", divisors(N_LAYERS))
def test_checkpointing_does_not_change_gradients(chain_runs, k):
    plain = chain_runs[None].grads
    for got, expected in zip(chain_runs[k].grads, plain, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_checkpointing_forward_keeps_only_segment_inputs(chain_runs):
    # Plain: every layer's output plus the input; k segments: the k inputs plus the output
    # the loss saves.
    assert chain_runs[None].forward_bytes == (N_LAYERS + 1) * UNIT
    for k in divisors(N_LAYERS):
        assert chain_runs[k].forward_bytes == (k + 1) * UNIT


def test_checkpointing_peak_follows_n_over_k_plus_k(chain_runs):
    ks = divisors(N_LAYERS)
    offsets = {chain_runs[k].peak_bytes / UNIT - checkpoint_units(N_LAYERS, k) for k in ks}
    assert len(offsets) == 1, offsets  # the same shape, up to a constant
    best = min(ks, key=lambda k: chain_runs[k].peak_bytes)
    assert best == math.isqrt(N_LAYERS)
    # Recomputed activations are freed segment by segment: the peak stays far below the
    # sum of everything saved during forward and backward (k + n units).
    assert chain_runs[best].peak_bytes < chain_runs[None].peak_bytes / 2


def test_segments_rejects_impossible_cuts():
    layers = chain(4, 2)
    assert [len(s) for s in segments(layers, 3)] == [1, 2, 1]
    with pytest.raises(ValueError, match="cannot cut 4 layers into 5 segments"):
        segments(layers, 5)


def test_attention_share_is_korthikanti_5as_over_h_against_34():
    # CONFIG: h = 40, a = 4, so 5as/h = s/2: the two terms are equal at s = 68, and at s = 136
    # the attention terms are 68 of every 102 bytes.
    assert attention_share(CONFIG, batch=4, seq=68) == pytest.approx(0.5)
    assert attention_share(CONFIG, batch=1, seq=136) == pytest.approx(68 / 102)
    assert attention_share(CONFIG, batch=4, seq=16) < attention_share(CONFIG, batch=4, seq=256)


def test_peak_memory_counts_what_the_block_allocates_once_per_storage():
    x = torch.ones(1000)  # made before the block: not counted
    with PeakMemory() as m:
        a = x * 2  # 4000 bytes
        b = a.view(10, 100)  # a view: no new storage
        c = a + 1  # 8000 live
        del a, b  # a's storage goes: 4000
        d = torch.empty(3000)  # 16000 live, the peak
        del d
        x.add_(1)  # in place, on a tensor made before: nothing new
    assert (m.live_bytes, m.peak_bytes) == (4000, 16000)
    assert c.shape == (1000,)


# --- a layer as Korthikanti et al. count it (course_lib.measure.memory) -----------------------

LAYER_CONFIGS = [(32, 2, 64, 4), (64, 1, 32, 2), (48, 3, 64, 8)]  # (s, b, h, a)


def layer_norm_statistics(s, b, element_size):
    # Each of the two layer norms keeps a mean and a 1/std per token: the formula omits them.
    return 2 * 2 * s * b * element_size


@pytest.mark.parametrize(("s", "b", "h", "a"), LAYER_CONFIGS)
def test_paper_block_saves_what_the_formula_counts_plus_layer_norm_statistics(s, b, h, a):
    saved = layer_activations(PaperBlock(h, a), s, b)
    # By hand, in bf16 (2 bytes) with bool masks (1 byte): the layer's input and the residual
    # (the two layer-norm inputs), the QKV input, Q K V, the projection input, the first MLP
    # input, GeLU's input and output (4h each): 16 values per token and hidden unit; the two
    # sublayer dropout masks; softmax's output, the dropout mask on it and the dropout's output.
    by_hand = 16 * s * b * h * 2 + 2 * s * b * h + a * s * s * b * (2 + 1 + 2)
    assert saved.live_bytes == by_hand + layer_norm_statistics(s, b, 2)
    assert saved.live_bytes == activation_memory(s, b, h, a) + layer_norm_statistics(s, b, 2)
    masks = [r for r in saved.records if r.dtype == torch.bool]
    assert sorted(r.nbytes for r in masks) == sorted([s * b * h] * 2 + [a * s * s * b])
    assert {r.dtype for r in saved.records} == {torch.bfloat16, torch.bool}


def test_torch_cpu_dropout_keeps_a_two_byte_mask_where_the_fused_kernel_keeps_one():
    s, b, h, a = LAYER_CONFIGS[0]
    fused = layer_activations(PaperBlock(h, a), s, b).live_bytes
    unfused = layer_activations(PaperBlock(h, a, fused_dropout=False), s, b).live_bytes
    assert unfused - fused == 2 * s * b * h + a * s * s * b  # one more byte per mask entry


@pytest.mark.parametrize(("s", "b", "h", "a"), LAYER_CONFIGS)
def test_course_block_saves_fp32_values_softmax_and_a_boolean_causal_mask(s, b, h, a):
    saved = layer_activations(course_block(h, a), s, b)
    # The same 16 values per token and hidden unit at 4 bytes, no dropout, softmax's fp32
    # output, the s x s bool mask of masked_fill, the layer norms' statistics in fp32.
    by_hand = 16 * s * b * h * 4 + a * s * s * b * 4 + s * s
    assert saved.live_bytes == by_hand + layer_norm_statistics(s, b, 4)


def test_activation_sweep_rows_put_the_paper_block_within_a_percent_of_the_formula():
    rows = activation_sweep([(64, 2, 64, 4), (16, 1, 32, 2)])
    for r in rows:
        assert r.formula == activation_memory(r.s, r.b, r.h, r.a)
        # The layer norms' statistics are 8 bytes per token against sbh(34 + ...): < 1% here.
        assert r.paper / r.formula == pytest.approx(1, rel=1e-2)
        assert r.paper < r.unfused and r.course > r.paper
    assert "formula" in activation_table(rows)


# --- mixed precision as frameworks run it -----------------------------------------------------


def linear_parameters(model):
    return [p for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters()]


def test_cast_memory_counts_the_16_bit_copies_autocast_makes_of_the_weights():
    model = models.MLP((8, 32, 32, 4))
    x = torch.randn(16, 8)
    with CastMemory(model.parameters()) as casts:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()  # the input's cast is not a weight's
        loss.backward()
    assert casts.peak_bytes == 2 * models.count_parameters(model)  # every parameter, in bf16
    assert casts.live_bytes == 0  # backward freed the copies it kept
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_autocast_keeps_fp32_weights_and_gradients_and_16_bit_copies_in_flight():
    model = models.TinyGPT(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = data.tokens(4, seq_len=16, vocab_size=CONFIG.vocab_size)
    breakdown = autocast_memory(model, optimizer, lambda m: models.lm_loss(m(x), y))
    n = models.count_parameters(model)
    rows = {r.category: (r.bytes, r.dtype) for r in breakdown.rows}
    # Only the Linear layers compute in bf16: embeddings and layer norms stay fp32.
    assert rows["weights"] == (nbytes(linear_parameters(model)) // 2, "bfloat16")
    for category in ("master weights", "gradients", "optimizer: exp_avg", "optimizer: exp_avg_sq"):
        assert rows[category] == (4 * n, "float32"), category


def test_bf16_autocast_and_the_bf16_model_train_like_fp32():
    config = models.GPTConfig(vocab_size=32, seq_len=16, d_model=32, n_heads=4, n_layers=1)
    steps = 12
    fp32 = models.TinyGPT(config)
    reference = train_losses(fp32, torch.optim.AdamW(fp32.parameters(), lr=3e-3), steps)
    autocast = models.TinyGPT(config)
    bf16 = train_losses(
        autocast, torch.optim.AdamW(autocast.parameters(), lr=3e-3), steps, torch.bfloat16
    )
    trainer = MixedPrecisionAdamW(models.TinyGPT(config), lr=3e-3)
    bf16_model = train_losses(trainer.model, trainer, steps)
    assert reference[-1] < reference[0] - 0.1  # it learns: the comparison means something
    # bf16 keeps 8 significant bits (relative rounding 2^-9 = 0.2% per operation); the fp32
    # master weights keep the errors from piling up. Measured: losses near 3.5 differ by at
    # most 7e-4 here (8e-4 in the lecture's 30 steps); 3e-3 leaves room for other CPU kernels.
    torch.testing.assert_close(bf16, reference, rtol=0, atol=3e-3)
    torch.testing.assert_close(bf16_model, reference, rtol=0, atol=3e-3)
    assert bf16 != reference  # the runs did compute in bf16


# --- fp16 loss scaling --------------------------------------------------------------------------


def scaling_runs(scaler_class, steps=12, **kwargs):
    # A tiny TinyGPT under fp16 autocast overflows fp16 in backward from a loss scale of 2^20.
    return scaled_training(models.TinyGPT(models.GPTConfig()), scaler_class(**kwargs), steps)


def test_loss_scaler_decides_as_torch_gradscaler_step_by_step():
    kwargs = {"init_scale": 2.0**24, "growth_interval": 3}
    reference = scaling_runs(lambda **kw: torch.amp.GradScaler("cpu", **kw), **kwargs)
    ours = scaling_runs(LossScaler, **kwargs)
    # The same scales, the same skipped steps and, since every scale is a power of two (so
    # dividing by it is exact), bit-identical weights and so the same losses: rtol = atol = 0.
    assert ours == reference
    scales = [r.scale for r in reference]
    assert reference[0].skipped and not all(r.skipped for r in reference)  # overflow, then not
    assert any(b > a for a, b in zip(scales[:-1], scales[1:], strict=True))  # and growth


class NeverSkips(LossScaler):
    """A wrong scaler: it unscales and steps even when a gradient overflowed."""

    def step(self, optimizer):
        super().step(optimizer)
        if self.found_inf:
            optimizer.step()


def test_a_scaler_that_steps_on_inf_gradients_differs_from_gradscaler_and_breaks_the_weights():
    kwargs = {"init_scale": 2.0**24, "growth_interval": 3}
    reference = scaling_runs(lambda **kw: torch.amp.GradScaler("cpu", **kw), steps=3, **kwargs)
    wrong = scaling_runs(NeverSkips, steps=3, **kwargs)
    assert wrong != reference
    assert not wrong[0].skipped and math.isnan(wrong[1].loss)


def test_loss_scaler_skips_a_planted_inf_halves_the_scale_and_grows_after_the_interval():
    w = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([w], lr=0.5)
    scaler = LossScaler(init_scale=8.0, growth_interval=2)
    w.grad = torch.tensor([1.0, float("inf"), 0.0])
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(w.detach(), torch.ones(3)) and scaler.get_scale() == 4.0
    for expected_scale in (4.0, 8.0):  # two good steps, then the scale doubles
        w.grad = torch.full((3,), 4.0)  # a scaled gradient: 4 / scale unscaled
        before = w.detach().clone()
        scaler.step(optimizer)
        assert scaler.get_scale() == 4.0  # the step divides by the scale before the update
        torch.testing.assert_close(w.detach(), before - 0.5 * 4.0 / 4.0, rtol=0, atol=0)
        scaler.update()
        assert scaler.get_scale() == expected_scale


def test_the_figures_draw_each_measurement_over_its_reference():
    rows = activation_sweep([(16, 1, 32, 2), (32, 1, 32, 2)])
    ax = plot_activation_sweep(rows).axes[0]
    dots = [line for line in ax.lines if line.get_marker() == "o"]
    assert len(dots) == 3 and all(len(line.get_xdata()) == 2 for line in dots)
    assert list(dots[0].get_xdata()) == [r.formula / 1e6 for r in rows]  # x is the formula
    top, bottom = plot_losses({"fp32": [3.0, 2.0], "bf16": [3.001, 2.0]}, tolerance=2e-3).axes
    gaps = bottom.lines[1].get_ydata()
    assert gaps[0] == pytest.approx(1e-3) and gaps[1] == 0
    assert sorted(line.get_ydata()[0] for line in bottom.lines[2:]) == [-2e-3, 2e-3]


# --- the lecture's exercises, checked off the page (course_lib.measure.memory) ----------------


def test_the_sgd_budget_exercise_is_checked_off_the_page(capsys):
    # by hand: bf16 weights and gradients 2 + 2, fp32 master 4, momentum 4: 12 bytes; a 13B
    # model's 156e9 bytes fill 1.95 GPUs of 80 GB, so 2
    assert check_sgd_budget(12, 2) is True
    assert capsys.readouterr().out.count("✓ Right") == 2
    assert check_sgd_budget(16, 3) is False  # AdamW's bytes, and the GPUs they need
    out = capsys.readouterr().out
    assert "1.3x too large. Go through the five rows of the table" in out
    assert "1.5x too large. Bytes per parameter x 13e9" in out
    assert "12" not in out and "1.95" not in out
    assert check_sgd_budget(12, ...) is False  # one right, one still unanswered
    assert check_sgd_budget(..., ...) is None
    assert capsys.readouterr().out.count("Not answered yet") == 3


def test_the_smallest_peak_exercise_is_checked_off_the_page(capsys):
    # by hand: n/k + k for n = 64 is least at k = sqrt(64) = 8: 8 + 8 = 16 units
    assert check_smallest_peak(16, 8) is True
    assert capsys.readouterr().out.count("✓ Right") == 2
    assert check_smallest_peak(64 / 4 + 4, 4) is False  # k = 4: 20 units
    out = capsys.readouterr().out
    assert "1.2x too large. The peak is k segment inputs" in out
    assert "2x too small. Where is n/k + k least?" in out
    assert "16" not in out and " 8 " not in out
    assert check_smallest_peak(..., ...) is None
    assert capsys.readouterr().out.count("Not answered yet") == 2


def test_the_first_steps_check_reads_nan_losses_and_skipped_steps(capsys):
    def steps(*skipped, loss=2.0):  # made-up ScaledSteps
        return [ScaledStep(i, 2.0**24 / 2**i, skip, loss) for i, skip in enumerate(skipped)]

    assert check_first_steps("steps are skipped, then it trains", steps(True, True, False)) is True
    assert "no NaN reaches them" in capsys.readouterr().out
    assert check_first_steps("the loss becomes NaN", steps(True, False)) is False
    assert check_first_steps("the loss becomes NaN", steps(False, loss=math.nan)) is True
    assert check_first_steps("nothing is skipped", steps(False, False)) is True
    assert check_first_steps(..., steps(True)) is None


def test_the_s_part_check_finds_the_first_length_where_it_outgrows_the_rest(capsys):
    def split(square):  # made up: the rest grows by 10 bytes a token
        seqs = [16, 64, 128, 192, 256]
        rest = [10 * s for s in seqs]
        return SequenceSplit(seqs, [], square, [], rest, [])

    assert check_s_part_overtakes("between 128 and 256", split([1, 16, 64, 2000, 4000])) is True
    assert "about 70h/(4a) = 175" in capsys.readouterr().out
    assert check_s_part_overtakes("before 128", split([1, 16, 64, 2000, 4000])) is False
    assert check_s_part_overtakes("before 128", split([1, 16, 2000, 4000, 8000])) is True
    assert check_s_part_overtakes("not by 256", split([1, 2, 3, 4, 5])) is True
    assert check_s_part_overtakes(..., split([1, 2, 3, 4, 5])) is None


def test_the_course_block_check_holds_the_bytes_saved_against_the_formula(capsys):
    formula = activation_memory(512, 1, 64, 8)  # made-up measurements around it
    assert check_course_vs_formula("fewer than the formula", 0.9 * formula, 512, 1, 64, 8) is True
    assert "Measured 0.90x the formula" in capsys.readouterr().out
    assert check_course_vs_formula("between 1x and 2x", 0.9 * formula, 512, 1, 64, 8) is False
    assert check_course_vs_formula("more than 2x", 2.5 * formula, 512, 1, 64, 8) is True
    assert check_course_vs_formula(..., formula, 512, 1, 64, 8) is None
