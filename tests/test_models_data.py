"""Seeded models and data, and the reference-and-compare helpers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from course_lib import compare, data, launch, models, rank, world_size


def test_same_seed_same_weights_and_caller_rng_untouched():
    torch.manual_seed(7)
    expected_next = torch.rand(1)
    torch.manual_seed(7)
    a, b = models.MLP(seed=3), models.MLP(seed=3)
    assert torch.rand(1) == expected_next, "building a model disturbed the global RNG"
    assert compare.find_mismatch(a, b, rtol=0, atol=0) is None
    c = models.MLP(seed=4)
    assert compare.find_mismatch(a, c, rtol=0, atol=0) is not None


def test_models_in_float64():
    model = models.TinyGPT(seed=0, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert models.MLP(dtype=torch.float64)(torch.zeros(2, 8, dtype=torch.float64)).shape == (2, 4)


def test_tiny_gpt_is_causal_and_its_stages_compose_to_the_model():
    config = models.GPTConfig()
    model = models.TinyGPT(config, seed=1)
    x, _ = data.tokens(3, seed=0)
    logits = model(x)
    assert logits.shape == (3, config.seq_len, config.vocab_size)
    # Changing a later token must not change earlier predictions.
    changed = x.clone()
    changed[:, -1] = (changed[:, -1] + 1) % config.vocab_size
    assert torch.allclose(model(changed)[:, :-1], logits[:, :-1], rtol=0, atol=0)
    for n in (1, 2, 4):
        out = x
        stages = model.pipeline_stages(n)
        assert len(stages) == n
        for stage in stages:
            out = stage(out)
        assert torch.equal(out, logits)
    with pytest.raises(ValueError, match="cannot cut 4 layers into 5 stages"):
        model.pipeline_stages(5)
    with pytest.raises(ValueError, match="must be divisible by n_heads"):
        models.TinyGPT(models.GPTConfig(d_model=30, n_heads=4))


def test_tiny_gpt_learns_the_synthetic_language():
    x, y = data.tokens(256, seed=0)
    model = models.TinyGPT(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = compare.train(model, data.batches(x, y, 32, 60, seed=0), models.lm_loss, opt)
    assert losses[-1] < 0.75 * losses[0], losses[::10]


def test_data_is_deterministic_and_seeded():
    for make in (data.regression, data.classification):
        a, b, c = make(20, seed=1), make(20, seed=1), make(20, seed=2)
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
        assert not torch.equal(a[0], c[0])
    x1, _ = data.tokens(4, seed=5)
    x2, _ = data.tokens(4, seed=5)
    assert torch.equal(x1, x2)
    x, y = data.tokens(4, seq_len=10, seed=5)
    full, _ = data.tokens(4, seq_len=10, seed=5)
    assert torch.equal(x[:, 1:], y[:, :-1]), "targets are the inputs shifted by one"
    assert torch.equal(x, full)


def test_shard_splits_unevenly_and_covers_the_batch():
    batch = torch.arange(10)
    parts = [data.shard(batch, r, 4) for r in range(4)]
    assert [len(p) for p in parts] == [3, 3, 2, 2]
    assert torch.equal(torch.cat(parts), batch)
    with pytest.raises(ValueError, match="rank 4 is not in 0..3"):
        data.shard(batch, 4, 4)


def test_batches_cover_the_data_before_repeating():
    x, y = torch.arange(10.0), torch.arange(10.0)
    seen = torch.cat([xb for xb, _ in data.batches(x, y, batch_size=5, steps=2)])
    assert sorted(seen.tolist()) == list(range(10))


def test_find_mismatch_names_the_parameter_and_error():
    a = models.MLP(seed=0, dtype=torch.float64)
    b = models.MLP(seed=0, dtype=torch.float64)
    with torch.no_grad():
        b.layers[2].weight[3, 1] += 1e-6
    assert compare.find_mismatch(a, b, rtol=0, atol=1e-5) is None
    problem = compare.find_mismatch(a, b, rtol=0, atol=1e-8)
    assert problem.startswith("'layers.2.weight' differs: max abs error 1e-06")
    assert "index (3, 1)" in problem
    with pytest.raises(AssertionError, match="rank 2, step 3: 'layers.2.weight' differs"):
        compare.assert_same_parameters(a, b, rtol=0, atol=1e-8, context="rank 2, step 3")
    other = models.MLP(sizes=(8, 16, 32, 4), seed=0, dtype=torch.float64)
    assert "has shape" in compare.find_mismatch(other, a, rtol=0, atol=1)
    named = dict(a.named_parameters())
    del named["layers.0.bias"]
    assert "missing ['layers.0.bias']" in compare.find_mismatch(named, a, rtol=0, atol=1)
    assert "layers.2.weight" in compare.error_table(a, b)


def data_parallel_sgd(steps):
    """All-reduce data parallel on a shard of each batch, to compare with the reference."""
    model = models.MLP(seed=0, dtype=torch.float64)
    x, y = data.regression(64, seed=0, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for xb, yb in data.batches(x, y, 16, steps):
        opt.zero_grad()
        xs, ys = data.shard(xb, rank(), world_size()), data.shard(yb, rank(), world_size())
        torch.nn.functional.mse_loss(model(xs), ys).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size()
        opt.step()
    return model.state_dict()


def test_reference_and_comparison_work_across_processes():
    reference = models.MLP(seed=0, dtype=torch.float64)
    x, y = data.regression(64, seed=0, dtype=torch.float64)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    compare.train(reference, data.batches(x, y, 16, 5), torch.nn.functional.mse_loss, opt)
    for state in launch(data_parallel_sgd, 5, world_size=4):
        compare.assert_same_parameters(state, reference, rtol=0, atol=1e-12)
