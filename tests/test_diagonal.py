from __future__ import annotations

import numpy as np
import pytest
import torch

from lens_parallel.analyses.diagonal import DiagonalView, diagonal_view
from lens_parallel.data import token_blocks
from lens_parallel.edits import ComponentScale, apply_edits
from lens_parallel.models import model_info

from .conftest import get_model


def _z(model, tokens, layer, edits=()):
    with torch.inference_mode(), apply_edits(model, edits):
        names = [f"blocks.{layer}.attn.hook_z", f"blocks.{layer}.attn.hook_v", f"blocks.{layer}.hook_resid_pre"]
        _, cache = model.run_with_cache(tokens, names_filter=names)
    return cache


@pytest.mark.parametrize("spec", ["toy-gpt2", "toy-qwen3"])
def test_view_reproduces_the_scaling_in_each_space(spec):
    model = get_model(spec)
    info = model_info(model)
    blocks = token_blocks(model, "wikipedia-en", n_docs=3, seq_len=20, seed=5)
    layer, head, doc, s_par = 1, info.n_heads - 1, 2, 0.25
    view = diagonal_view(model, blocks, layer=layer, head=head, s_par=s_par, doc=doc)
    base = _z(model, blocks.tokens, layer)
    v = base[f"blocks.{layer}.attn.hook_v"].repeat_interleave(info.group_size, dim=2)[doc, :, head].double()
    for space in ("value", "value-exclude-self"):
        edited = _z(model, blocks.tokens, layer, [ComponentScale(space, s_par=s_par, layers=[layer], heads=[head])])
        change = (edited[f"blocks.{layer}.attn.hook_z"] - base[f"blocks.{layer}.attn.hook_z"])[doc, :, head].double()
        d_a = torch.from_numpy(view.d_a[view.spaces.index(space)])
        torch.testing.assert_close(d_a[:, None] * v, change, atol=1e-5, rtol=1e-4)
    # residual view: its change along x_t is the per-head residual scaling's change (s_par - 1) |m_par|
    x = base[f"blocks.{layer}.hook_resid_pre"][doc].double()
    m = (
        base[f"blocks.{layer}.attn.hook_z"][doc, :, head].double()
        @ model.blocks[layer].attn.W_O[head].detach().double()
    )
    expected = (1 - s_par) * (m * x).sum(-1).abs() / x.norm(dim=-1)
    np.testing.assert_allclose(view.residual_par[1:], expected[1:].numpy(), rtol=1e-4)
    assert (view.residual_perp[1:] > 0).all()  # a view, not an identity
    np.testing.assert_allclose(np.diag(view.edited("value")), np.diag(view.pattern) + view.d_a[0], atol=1e-12)
    df = view.to_dataframe()
    assert len(df) == 3 * info.n_heads and df.share_negative.between(0, 1).all()
    assert (df.dA_min <= df.dA_mean).all() and (df.dA_mean <= df.dA_max).all()
    assert df.label.iloc[0] == f"L{layer}H0"
    # batches of documents: the same view, summaries accumulated batch by batch (the doc lives in the 2nd batch)
    one = diagonal_view(model, blocks, layer=layer, head=head, s_par=s_par, doc=doc, batch_size=2)
    for field in ("pattern", "d_a", "residual_par", "da_mean", "da_min", "da_max"):  # float32 rounding by batch shape
        np.testing.assert_allclose(getattr(one, field), getattr(view, field), rtol=1e-5, atol=1e-9, err_msg=field)
    for field in ("da_negative_share", "da_guarded"):
        np.testing.assert_array_equal(getattr(one, field), getattr(view, field), err_msg=field)
    expected_mean = torch.stack(
        [
            torch.from_numpy(diagonal_view(model, blocks.tokens[i : i + 1], layer=layer, head=head, s_par=s_par).d_a)[
                :, 1:
            ]
            for i in range(3)
        ]
    )  # the view of each document alone: the shown head's mean over documents and positions
    np.testing.assert_allclose(view.da_mean[:, head], expected_mean.mean((0, 2)).numpy(), rtol=1e-5, atol=1e-9)


def test_figure_save_load_and_errors(tmp_path):
    model = get_model("toy-pythia")
    blocks = token_blocks(model, "austen", n_docs=2, seq_len=16)
    view = diagonal_view(model, blocks, layer=2, head=0)
    fig = view.figure()
    heatmaps = [t for t in fig.data if t.type == "heatmap"]
    assert len(heatmaps) == 5 and heatmaps[0].y[0].startswith("0:'<|endoftext|>'")  # 4 maps and the strip
    assert "one δ for every head" in fig.layout.annotations[2].text
    assert fig.layout.annotations[0].text == "empirical A"
    view.save(tmp_path / "view")
    again = DiagonalView.load(tmp_path / "view")
    np.testing.assert_array_equal(again.d_a, view.d_a)
    np.testing.assert_array_equal(again.layer_delta, view.layer_delta)
    assert again.spaces == view.spaces and again.token_labels == view.token_labels
    with pytest.raises(
        ValueError, match=r"unknown diagonal space 'residual-mlp' \(did you mean 'residual-attn'\?\); accepted: value"
    ):
        diagonal_view(model, blocks, layer=0, head=0, space="residual-mlp")
    with pytest.raises(ValueError, match=r"heads \[4\] out of range: this model has heads 0..3"):
        diagonal_view(model, blocks, layer=0, head=4)
    with pytest.raises(ValueError, match=r"layers \[3\] out of range"):
        diagonal_view(model, blocks, layer=3, head=0)
    with pytest.raises(ValueError, match=r"doc 2 out of range: there are 2 documents"):
        diagonal_view(model, blocks, layer=0, head=0, doc=2)
    with pytest.raises(ValueError, match=r"s_par must be a finite number"):
        diagonal_view(model, blocks, layer=0, head=0, s_par=float("inf"))


def test_gated_attention_view_matches_the_pre_gate_scaling():
    """Qwen3.5 (gated): the value-space dA_tt changes z by sigmoid(gate) * dA_tt v_t, like ComponentScale."""
    model = get_model("toy-qwen3.5")
    blocks = token_blocks(model, "wikipedia-en", n_docs=2, seq_len=16)
    with pytest.warns(UserWarning, match="residual-attn diagonal view is skipped"):
        view = diagonal_view(model, blocks, layer=2, head=2, s_par=0.0, doc=1)
    assert view.spaces == ("value", "value-exclude-self")
    names = ["blocks.2.attn.hook_z", "blocks.2.attn.hook_v", "blocks.2.attn.hook_q_gate"]
    caches = []
    for edits in ([], [ComponentScale("value", s_par=0.0, layers=[2], heads=[2])]):
        with torch.inference_mode(), apply_edits(model, edits):
            caches.append(model.run_with_cache(blocks.tokens, names_filter=names)[1])
    base, edited = caches
    z = base["blocks.2.attn.hook_z"]
    gate = torch.sigmoid(base["blocks.2.attn.hook_q_gate"].reshape(z.shape))[1, :, 2].double()
    v = base["blocks.2.attn.hook_v"].repeat_interleave(3, dim=2)[1, :, 2].double()
    change = (edited["blocks.2.attn.hook_z"] - z)[1, :, 2].double()
    torch.testing.assert_close(gate * torch.from_numpy(view.d_a[0])[:, None] * v, change, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match=r"heads \[4\] out of range.*at layer 3, a linear-attention layer"):
        diagonal_view(model, blocks, layer=3, head=4)
