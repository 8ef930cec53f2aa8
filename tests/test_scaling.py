from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from lens_parallel.analyses.evaluate import document_losses, evaluate
from lens_parallel.analyses.scaling import ScalingResult, scale_sweep
from lens_parallel.data import token_blocks
from lens_parallel.edits import ComponentScale

from .conftest import get_model


@pytest.fixture(scope="module")
def setup():
    model = get_model("toy-llama")
    return model, token_blocks(model, "austen", n_docs=4, seq_len=24, seed=1)


def test_sweep_matches_independent_evaluations(setup):
    model, blocks = setup
    result = scale_sweep(
        model,
        blocks,
        space=["value", "residual-mlp"],
        s_par=[0.0, 2.0],
        s_perp=[0.5],
        batch_size=3,
        n_resamples=500,
        progress=False,
    )
    df = result.to_dataframe()
    assert len(df) == 2 * 3 and set(df.vary) == {"s_par", "s_perp"} and df.layer.isna().all()
    bare = document_losses(model, blocks).loss
    np.testing.assert_allclose(df.loss_noop, bare, rtol=0, atol=1e-7)  # the matched no-op is exact
    for row in df.itertuples():
        ref = evaluate(model, blocks, ComponentScale(row.space, row.s_par, row.s_perp), n_resamples=500)
        assert row.delta_loss == pytest.approx(ref.delta_loss, abs=1e-6)
        assert row.delta_loss_lo <= row.delta_loss <= row.delta_loss_hi
        assert row.delta_ppl == pytest.approx(np.exp(row.loss_edited) - np.exp(row.loss_noop), rel=1e-9)
    assert (df.delta_loss.abs() > 1e-6).all()


def test_per_layer_sweep_reuses_the_prefix_and_equals_the_naive_loop(setup):
    model, blocks = setup
    result = scale_sweep(
        model,
        blocks,
        space="value-exclude-self",
        s_par=[0.0],
        s_perp=[0.0],
        layers=[1, 2],
        per_layer=True,
        batch_size=4,
        progress=False,
    )
    df = result.to_dataframe()
    assert sorted(df.layer.tolist()) == [1, 1, 2, 2]
    for row in df.itertuples():
        naive = document_losses(
            model, blocks, ComponentScale(row.space, row.s_par, row.s_perp, layers=[int(row.layer)])
        )
        assert row.loss_edited == pytest.approx(naive.loss, abs=1e-5)


def test_figure_and_save_load(setup, tmp_path):
    model, blocks = setup
    result = scale_sweep(
        model, blocks, space=["value", "residual-attn"], s_par=[0.0], s_perp=[0.5], n_resamples=200, progress=False
    )
    fig = result.figure()
    assert [a.text for a in fig.layout.annotations][:2] == ["vary s_par (s_perp = 1)", "vary s_perp (s_par = 1)"]
    assert {t.name for t in fig.data} == {"value", "residual-attn"}
    assert fig.layout.yaxis.title.text == "Δ loss vs no-op (nats/token)"
    result.save(tmp_path / "sweep")
    pd.testing.assert_frame_equal(ScalingResult.load(tmp_path / "sweep").to_dataframe(), result.to_dataframe())


def test_sweep_rejects_bad_input_before_running(setup):
    model, blocks = setup
    with pytest.raises(ValueError, match=r"s_par must be a finite number, got nan"):
        scale_sweep(model, blocks, s_par=[0.0, float("nan")])
    with pytest.raises(ValueError, match=r"unknown space 'value-space'"):
        scale_sweep(model, blocks, space="value-space")
    with pytest.raises(ValueError, match=r"space 'residual-block' has no heads"):
        scale_sweep(model, blocks, space="residual-block", heads=[0])
    with pytest.raises(ValueError, match=r"layers \[9\] out of range"):
        scale_sweep(model, blocks, layers=[9])


def test_hybrid_model_sweeps_every_layer_and_softmax_ones_where_only_they_have_the_edit():
    """Qwen3.5's linear-attention layers are scaled as the others (value heads), except where a scaling is built on
    softmax layers only: the post-gate site (and per-head residual-attn) skips them with layers=None."""
    model = get_model("toy-qwen3.5")
    blocks = token_blocks(model, "wikipedia-en", n_docs=2, seq_len=12)
    per_layer = scale_sweep(
        model,
        blocks,
        space=["value", "residual-mlp"],
        s_par=[0.0],
        s_perp=[],
        per_layer=True,
        n_resamples=100,
        progress=False,
    )
    df = per_layer.to_dataframe()
    assert sorted(df[df.space == "value"].layer) == [0, 1, 2, 3, 4]
    assert sorted(df[df.space == "residual-mlp"].layer) == [0, 1, 2, 3, 4]
    post = scale_sweep(
        model,
        blocks,
        space="value",
        site="post-gate",
        s_par=[0.0],
        s_perp=[],
        per_layer=True,
        n_resamples=100,
        progress=False,
    )
    assert sorted(post.to_dataframe().layer) == [1, 2]
    for row in df.itertuples():
        edit = ComponentScale(row.space, row.s_par, row.s_perp, layers=[int(row.layer)])
        naive = document_losses(model, blocks, edit)
        assert row.loss_edited == pytest.approx(naive.loss, abs=1e-5)
