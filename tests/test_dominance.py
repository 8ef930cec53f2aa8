from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from lens_parallel import geometry
from lens_parallel.analyses.dominance import DominanceResult, head_dominance
from lens_parallel.data import token_blocks
from lens_parallel.edits import HeadEdit, apply_edits
from lens_parallel.hooks import effective_qk_roles, hook_name
from lens_parallel.models import model_info
from lens_parallel.stats import concentration

from .conftest import get_model


def test_concentration_on_hand_built_shares():
    out = concentration(np.array([[1.0] * 8, [0, 0, 3, 0, 0, 0, 0, 0], [4, 3, 2, 1, 0, 0, 0, 0]]))
    np.testing.assert_allclose(out["effective_fraction"][:2], [1.0, 1 / 8])
    np.testing.assert_allclose(out["effective_n"][1], 1.0)
    assert out["heads_for_90"].tolist() == [8, 1, 3]
    entropy = -sum(s * np.log(s) for s in (0.4, 0.3, 0.2, 0.1))
    np.testing.assert_allclose(out["effective_n"][2], np.exp(entropy))
    np.testing.assert_allclose(out["top25_share"], [0.25, 1.0, 0.7])
    np.testing.assert_allclose(out["bottom25_share"], [0.25, 0.0, 0.0])
    np.testing.assert_allclose(out["normalised_concentration"][:2], [0.0, 1.0], atol=1e-12)
    assert np.isnan(concentration(np.zeros((1, 4)))["effective_n"]).all()
    with pytest.raises(ValueError, match="non-negative"):
        concentration(np.array([1.0, -1.0]))


def _reference(model, tokens, up, heads, positions):
    """Effects on layer up+1 from a plain full forward with the heads zeroed (no prefix reuse, no batching)."""
    info = model_info(model)
    q_role, k_role = effective_qk_roles(info)
    names = [hook_name(up + 1, r) for r in (q_role, k_role, "v", "pattern")]
    runs = []
    for edits in ([], [HeadEdit("zero", up, heads)]):
        with torch.inference_mode(), apply_edits(model, edits):
            _, cache = model.run_with_cache(tokens, names_filter=names)
        runs.append([cache[n].double() for n in names])
    (q, k, v, pat), (q2, k2, v2, pat2) = runs
    g = info.group_size
    k, v, k2, v2 = (t.repeat_interleave(g, dim=2) for t in (k, v, k2, v2))
    num = ((q2 - q) ** 2 + (k2 - k) ** 2 + (v2 - v) ** 2).sum(-1)
    den = (q**2 + k**2 + v**2).sum(-1)
    combined = (num / den).sqrt()[:, positions]
    js = geometry.js_divergence(pat2.transpose(1, 2), pat.transpose(1, 2))[:, positions]
    rel_q = geometry.relative_change(q2, q)[:, positions]
    return combined.numpy(), js.numpy(), rel_q.numpy()


@pytest.mark.parametrize("spec", ["toy-gpt2", "toy-qwen3", "toy-pythia"])
def test_dominance_matches_an_independent_full_forward(spec):
    model = get_model(spec)
    info = model_info(model)
    blocks = token_blocks(model, "wikipedia-en", n_docs=3, seq_len=16, seed=4)
    result = head_dominance(model, blocks, query_positions=slice(7, None), progress=False)
    positions = list(range(7, 16))
    assert result.query_positions == tuple(positions) and result.layer_pairs == ((0, 1), (1, 2))
    assert result.rel_k.shape[-1] == info.n_kv_heads and result.combined.shape == (2, 3, info.n_heads, 9, info.n_heads)
    for p, up in enumerate((0, 1)):
        for u in (0, info.n_heads - 1):
            combined, js, rel_q = _reference(model, blocks.tokens, up, (u,), positions)
            np.testing.assert_allclose(result.combined[p, :, u], combined, rtol=1e-4, atol=1e-7)
            np.testing.assert_allclose(result.js[p, :, u], js, rtol=1e-3, atol=1e-9)
            np.testing.assert_allclose(result.rel_q[p, :, u], rel_q, rtol=1e-4, atol=1e-7)
    # joint controls: the strong half is the receiving head's top half of single-head effects
    p, text, g, half = 1, 2, 1, info.n_heads // 2
    strong = tuple(np.argsort(result.combined[p, text].mean(1)[:, g])[-half:].tolist())
    combined, _, _ = _reference(model, blocks.tokens, 1, strong, positions)
    np.testing.assert_allclose(result.joint[p, text, g, 1], combined[text, :, g].mean(), rtol=1e-4)
    # texts in batches of 2: the same numbers, random halves included (drawn per text, not per batch)
    batched = head_dominance(model, blocks, query_positions=slice(7, None), batch_size=2, progress=False)
    for field in ("rel_q", "rel_k", "rel_v", "combined", "js", "joint"):
        np.testing.assert_allclose(getattr(batched, field), getattr(result, field), rtol=1e-5, atol=1e-8, err_msg=field)


def test_dataframe_figure_save_and_errors(tmp_path):
    model = get_model("toy-llama")
    blocks = token_blocks(model, "austen", n_docs=2, seq_len=12)
    result = head_dominance(model, blocks, query_positions=[3, 11], upstream_layers=[1], progress=False)
    df = result.to_dataframe()
    assert len(df) == 2 * 6 and set(df.receiving_type) == {"softmax"} and df.label.iloc[0] == "L2H0"
    assert df.effective_fraction.between(0, 1 + 1e-12).all() and (df.heads_for_90 >= 1).all()
    assert np.allclose(df.strong_weak_ratio, df.joint_strong / df.joint_weak)
    fig = result.figure()
    assert fig.layout.annotations[0].text == "effective fraction of upstream heads"
    result.save(tmp_path / "dom")
    pd.testing.assert_frame_equal(DominanceResult.load(tmp_path / "dom").to_dataframe(), df)
    with pytest.raises(ValueError, match=r"query_positions \[12\] out of range: sequences have 12 tokens"):
        head_dominance(model, blocks, query_positions=[3, 12])
    with pytest.raises(ValueError, match=r"selects no position of sequences of 12 tokens"):
        head_dominance(model, blocks, query_positions=slice(20, None))
    with pytest.raises(ValueError, match=r"upstream layers \[2\] out of range"):
        head_dominance(model, blocks, upstream_layers=[2])


def test_hybrid_model_skips_linear_upstream_layers_and_handles_linear_receivers():
    """toy-qwen3.5: layers (linear, softmax, linear, softmax). Only (1, 2) has a softmax upstream layer; its
    receiving layer is linear attention: receiving heads are value heads, q and k from their key head."""
    model = get_model("toy-qwen3.5")
    blocks = token_blocks(model, "wikipedia-en", n_docs=2, seq_len=12)
    with pytest.warns(UserWarning, match=r"skipped upstream linear-attention layers \[0, 2\]"):
        result = head_dominance(model, blocks, query_positions=slice(4, None), progress=False)
    assert result.layer_pairs == ((1, 2),) and result.receiving_types == ("linear",)
    names = [f"blocks.2.linear_attn.hook_{x}" for x in "qkv"]
    runs = []
    for edits in ([], [HeadEdit("zero", 1, (4,))]):
        with torch.inference_mode(), apply_edits(model, edits):
            _, cache = model.run_with_cache(blocks.tokens, names_filter=names)
        runs.append([cache[n][:, 4:].double() for n in names])
    (q, k, v), (q2, k2, v2) = runs
    group = v.shape[2] // q.shape[2]  # 4 value heads read 2 key heads
    q, k, q2, k2 = (t.repeat_interleave(group, dim=2) for t in (q, k, q2, k2))
    num = ((q2 - q) ** 2 + (k2 - k) ** 2 + (v2 - v) ** 2).sum(-1)
    expected = (num / (q**2 + k**2 + v**2).sum(-1)).sqrt().numpy()
    np.testing.assert_allclose(result.combined[0, :, 4, :, :4], expected, rtol=1e-4, atol=1e-7)
    assert np.isnan(result.js).all() and np.isnan(result.combined[0, :, :, :, 4:]).all()  # padding past 4 heads
    df = result.to_dataframe()
    assert len(df) == 2 * 4 and set(df.receiving_type) == {"linear"}
    assert "skipped upstream linear-attention layers [0, 2]" in result.provenance.settings["skipped"]
