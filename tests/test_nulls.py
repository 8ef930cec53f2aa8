from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from lens_parallel import geometry
from lens_parallel.analyses.nulls import NullResult, ReconstructionError, causal_null, gqa_alignment, null_positions
from lens_parallel.data import token_blocks
from lens_parallel.hooks import expand_kv
from lens_parallel.models import model_info, wrap_hf_model
from lens_parallel.stats import bootstrap_mean_ci

from .conftest import get_model

gen = torch.Generator().manual_seed(0)


def test_null_positions_are_earlier_seeded_and_drawn_per_head():
    j = null_positions(50, 30, 3, seed=1, layer=0)
    t = torch.arange(30)[None, :, None]
    assert j.shape == (50, 30, 3) and ((j[:, 1:] >= 0) & (j[:, 1:] < t[:, 1:])).all() and (j[:, 0] == 0).all()
    assert torch.equal(j, null_positions(50, 30, 3, seed=1, layer=0))
    assert not torch.equal(j, null_positions(50, 30, 3, seed=2, layer=0))
    assert not torch.equal(j, null_positions(50, 30, 3, seed=1, layer=1))  # seeded by layer, as the paper
    assert not torch.equal(j[..., 0], j[..., 1])  # one draw per head
    assert set(j[:, 10, 0].tolist()) == set(range(10))  # every earlier position is drawn


def test_self_attention_only_gives_cos_self_one_and_null_equal_to_cosine_with_earlier_values():
    v = torch.randn(4, 12, 3, 8, generator=gen, dtype=torch.float64)
    j = null_positions(4, 12, 3, seed=0, layer=0)
    cos_self, cos_null = geometry.self_and_null_cosines(v, v, j)  # y_t = v_t: every head attends only to itself
    torch.testing.assert_close(cos_self, torch.ones_like(cos_self))
    expected = torch.stack(
        [
            torch.stack([torch.cosine_similarity(v[b, :, h], v[b, j[b, :, h], h], dim=-1) for h in range(3)], -1)
            for b in range(4)
        ]
    )
    torch.testing.assert_close(cos_null, expected)
    # the exact null is the mean over every earlier position (O(T^2) brute force here)
    exact = geometry.mean_earlier_cosine(v, v)
    brute = torch.zeros_like(exact)
    for t in range(1, 12):
        brute[:, t] = torch.cosine_similarity(v[:, t : t + 1], v[:, :t], dim=-1).mean(1)
    torch.testing.assert_close(exact[:, 1:], brute[:, 1:], atol=1e-12, rtol=0)


def test_iid_values_with_uniform_attention_have_no_excess():
    n, t, h, d = 200, 24, 2, 16
    v = torch.randn(n, t, h, d, generator=gen, dtype=torch.float64)
    y = v.cumsum(1) / torch.arange(1, t + 1, dtype=torch.float64)[None, :, None, None]  # uniform causal attention
    cos_self, cos_null = geometry.self_and_null_cosines(y, v, null_positions(n, t, h, seed=3, layer=0))
    per_doc = (cos_self - cos_null)[:, 1:].mean((1, 2)).numpy()[:, None]
    lo, hi = bootstrap_mean_ci(per_doc, seed=0)
    assert lo[0] < 0 < hi[0] and abs(per_doc.mean()) < 0.02


def test_swapped_kv_groups_flip_within_and_across():
    v_kv = torch.randn(3, 10, 2, 8, generator=gen, dtype=torch.float64)
    j = null_positions(3, 10, 6, seed=0, layer=0)
    results = []
    for source in (v_kv, torch.roll(v_kv, 1, dims=2)):  # each query head reads its own / the other kv group
        y = expand_kv(source, 6)
        within, null = geometry.self_and_null_cosines(y, expand_kv(v_kv, 6), j)
        across = torch.cosine_similarity(y, expand_kv(torch.roll(v_kv, -1, dims=2), 6), dim=-1)
        results.append(((within - null)[:, 1:].mean().item(), (across - null)[:, 1:].mean().item()))
    (within_a, across_a), (within_b, across_b) = results
    assert within_a > across_a + 0.5 and across_b > within_b + 0.5


def test_runs_on_every_family_deterministically(toy):
    info = model_info(toy)
    blocks = token_blocks(toy, "wikipedia-en", n_docs=4, seq_len=16)
    a = causal_null(toy, blocks, seed=5, batch_size=3, n_resamples=200)
    b = causal_null(toy, blocks, seed=5, batch_size=2, n_resamples=200)
    c = causal_null(toy, blocks, seed=6, batch_size=3, n_resamples=200)
    assert a.layers == tuple(range(info.n_layers)) and a.reconstruction_error < 1e-5 and a.null == "sampled"
    gate = a.provenance.settings["gate"]
    layers = info.softmax_layers
    first_middle_last = sorted({layers[0], layers[len(layers) // 2], layers[-1]})
    assert gate == {"layers": first_middle_last, "tolerance": 1e-2, "documents": 1}
    # batches of 2 or 3 documents: the same partners, the same numbers but for float32's rounding by batch shape
    # (MKL on AVX2 blocks products by shape; bit for bit on AVX-512); another seed: other partners, other numbers
    same = {"rtol": 1e-5, "atol": 1e-9, "equal_nan": True}  # NaN: a head a linear layer does not have
    assert np.allclose(a.cos_self, b.cos_self, **same) and np.allclose(a.cos_null, b.cos_null, **same)
    assert np.allclose(a.excess_lo, b.excess_lo, **same)
    assert np.array_equal(a.cos_self, c.cos_self, equal_nan=True) and not np.allclose(a.cos_null, c.cos_null, **same)
    tidy = a.to_dataframe()  # one row per (document, layer, head)
    n_heads = sum(info.output_heads(layer) for layer in a.layers)  # linear layers: their value heads
    assert len(tidy) == 4 * n_heads
    np.testing.assert_array_equal(tidy.cos_self, a.cos_self.ravel()[~np.isnan(a.cos_self.ravel())])
    df = a.head_table()
    assert len(df) == n_heads
    np.testing.assert_allclose(df.cos_self, tidy.groupby(["layer", "head"], sort=False).cos_self.mean(), atol=1e-12)
    np.testing.assert_allclose(df.self_specific_fraction, df.excess / df.cos_self)
    assert (df.excess_lo <= df.excess).all() and (df.excess <= df.excess_hi).all()
    # the model-level row is the paper's: means over heads, the fraction a ratio of those means
    row = a.summary().iloc[0]
    assert row.cos_self == pytest.approx(df.cos_self.mean()) and row.cos_null == pytest.approx(df.cos_null.mean())
    assert row.self_specific_fraction == pytest.approx((df.cos_self.mean() - df.cos_null.mean()) / df.cos_self.mean())
    assert row.median_head_self_specific_fraction == pytest.approx(df.self_specific_fraction.median())
    # the exact null: the same cos_self, the mean over every earlier position (brute force from a cache)
    exact = causal_null(toy, blocks, null="exact", batch_size=3, n_resamples=200)
    assert np.array_equal(exact.cos_self, a.cos_self, equal_nan=True) and exact.null == "exact"
    layer = info.softmax_layers[-1]  # (tests/test_linear_attention.py checks the linear layers)
    names = [f"blocks.{layer}.attn.hook_v", f"blocks.{layer}.attn.hook_pattern"]
    with torch.inference_mode():
        _, cache = toy.run_with_cache(blocks.tokens, names_filter=names)
    v = expand_kv(cache[names[0]].double(), info.n_heads)
    y = torch.einsum("bhqk,bkhd->bqhd", cache[names[1]].double(), v)  # the pre-gate aggregate A v
    brute = torch.stack([torch.cosine_similarity(y[:, t : t + 1], v[:, :t], dim=-1).mean(1) for t in range(1, 16)], 1)
    np.testing.assert_allclose(exact.cos_null[:, exact.layers.index(layer)], brute.mean(1).numpy(), atol=1e-6)


def test_gqa_alignment_matches_a_direct_computation(tmp_path):
    model = get_model("toy-qwen3")
    blocks = token_blocks(model, "austen", n_docs=3, seq_len=12)
    result = gqa_alignment(model, blocks, seed=2, n_resamples=200)
    with torch.inference_mode():
        _, cache = model.run_with_cache(blocks.tokens, names_filter=["blocks.2.attn.hook_z", "blocks.2.attn.hook_v"])
    z, v_kv = cache["blocks.2.attn.hook_z"].double(), cache["blocks.2.attn.hook_v"].double()
    # 2 kv groups: each group's neighbour is the other one, and "all other groups" is that one group too
    across = torch.cosine_similarity(z, expand_kv(v_kv.flip(2), 6), dim=-1)[:, 1:].mean(1)
    np.testing.assert_allclose(result.cos_across[:, 2], across.numpy(), atol=1e-10)
    every = gqa_alignment(model, blocks, groups="all", seed=2, n_resamples=200)
    np.testing.assert_allclose(every.cos_across, result.cos_across, atol=1e-12)
    with pytest.raises(ValueError, match=r"toy-gpt2 has 4 query heads and 4 kv heads: no groups of query heads"):
        gqa_alignment(get_model("toy-gpt2"), blocks)
    one_kv = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=1)
    )
    one_kv = wrap_hf_model(one_kv, model.tokenizer, name="one-kv")  # Gemma-3-270m's shape: 4 query heads, 1 kv head
    with pytest.raises(ValueError, match="one-kv: all 4 query heads share one kv head, so there is no other group"):
        gqa_alignment(one_kv, blocks)
    summary = result.summary()
    assert len(summary) == 1
    assert {"cos_self", "cos_null", "excess", "within_excess", "across_excess", "cos_across"} <= set(summary.columns)
    fig = result.figure()
    assert [a.text for a in fig.layout.annotations] == [
        "self-cosine vs earlier-position null",
        "GQA: within- vs across-group excess",
    ]
    result.save(tmp_path / "null")
    again = NullResult.load(tmp_path / "null")
    assert np.array_equal(again.cos_across, result.cos_across) and again.seed == 2


def test_reconstruction_gate_refuses_to_run():
    model = get_model("toy-gpt2")
    blocks = token_blocks(model, "austen", n_docs=2, seq_len=10)
    # z + 1 into the output projection, before hook_z fires (a torch hook: a TransformerLens hook would be refused)
    bump = model.blocks[1].attn.o.register_forward_pre_hook(lambda module, args: (args[0] + 1.0, *args[1:]))
    try:
        with pytest.raises(ReconstructionError, match=r"relative error [\d.e+-]+ > tolerance"):
            causal_null(model, blocks)
    finally:
        bump.remove()


def test_neighbour_and_all_groups_with_four_kv_groups():
    """4 kv groups of 2 query heads: the neighbour of group g is g - 1 (the paper's roll); "all" averages over the
    three other groups (hand-built values, computed directly)."""
    from lens_parallel.analyses.nulls import _across
    from lens_parallel.models import ModelInfo

    info = ModelInfo("t", "llama", "Llama", 1, 8, 4, 8, 64, 10, 16, False, False, "rotary", "h", ("softmax",))
    y = torch.randn(2, 5, 8, 8, generator=gen, dtype=torch.float64)
    v_kv = torch.randn(2, 5, 4, 8, generator=gen, dtype=torch.float64)
    neighbour = _across(y, {"v": v_kv}, info, 0, "neighbour")
    every = _across(y, {"v": v_kv}, info, 0, "all")
    for h in range(8):
        g = h // 2
        expected = torch.cosine_similarity(y[:, :, h], v_kv[:, :, (g - 1) % 4], dim=-1)
        torch.testing.assert_close(neighbour[:, :, h], expected)
        others = [torch.cosine_similarity(y[:, :, h], v_kv[:, :, o], dim=-1) for o in range(4) if o != g]
        torch.testing.assert_close(every[:, :, h], torch.stack(others).mean(0))


def test_sampled_null_converges_to_the_exact_one():
    model = get_model("toy-llama")
    blocks = token_blocks(model, "wikipedia-en", n_docs=4, seq_len=24)
    exact = causal_null(model, blocks, null="exact", n_resamples=50).cos_null.mean(0)
    sampled = np.mean([causal_null(model, blocks, seed=s, n_resamples=50).cos_null.mean(0) for s in range(12)], 0)
    one = causal_null(model, blocks, seed=0, n_resamples=50).cos_null.mean(0)
    assert np.abs(sampled - exact).mean() < 0.5 * np.abs(one - exact).mean()
