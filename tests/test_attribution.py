"""Attribution screening: first-order estimates and scale derivatives against finite differences and the exact
engine. Toys run in float64; the rotary families' attention still computes partly in float32, so the loss carries
float32-sized noise and both steps are 1e-2: forward differences (error O(eps): within 2 eps of the largest
effect, measured 0.02-0.8 eps) and central differences (error O(eps^2))."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lens_parallel import confirm, head_attribution, load_model
from lens_parallel.analyses.evaluate import document_losses
from lens_parallel.data import token_blocks
from lens_parallel.edits import ComponentScale, HeadEdit
from lens_parallel.models import TOY_MODELS, model_info

EPS = 1e-2  # forward-difference step
CENTRAL = 1e-2  # central-difference step


def float64_toy(spec: str):
    return load_model(spec, dtype=torch.float64)


def blocks_of(model, n_docs=3, seq_len=14):
    return token_blocks(model, "wikipedia-en", n_docs=n_docs, seq_len=seq_len, seed=4)


def loss_change(model, blocks, edit) -> np.ndarray:
    """Per-document change of the loss sum (nats) under ``edit``."""
    return document_losses(model, blocks, edit).loss_sum - document_losses(model, blocks).loss_sum


@pytest.mark.parametrize("spec", TOY_MODELS)
def test_estimates_and_derivatives_equal_finite_differences(spec):
    model = float64_toy(spec)
    info, blocks = model_info(model), blocks_of(model)
    layer, head = info.softmax_layers[-1], 1
    result = head_attribution(model, blocks, ablation="parallel-value", n_resamples=10, progress=False)
    zero = head_attribution(model, blocks, ablation="zero", n_resamples=10, progress=False)
    residual = head_attribution(model, blocks, ablation="parallel-residual", n_resamples=10, progress=False)
    assert result.spaces == ("value", "value-exclude-self", "residual-attn")
    # the edit's first-order estimate: the loss change of a tiny step of the same edit, per unit of step
    cases = [
        (result, ComponentScale("value", s_par=1 - EPS, layers=[layer], heads=[head])),
        (zero, ComponentScale("value", s_par=1 - EPS, s_perp=1 - EPS, layers=[layer], heads=[head])),
        (residual, ComponentScale("residual-attn", s_par=1 - EPS, layers=[layer], heads=[head])),
    ]
    for res, step in cases:
        fd = loss_change(model, blocks, step) / EPS
        scale = np.abs(fd).max()
        li = res.layers.index(layer)  # parallel-residual screens softmax layers only, the others every layer
        np.testing.assert_allclose(res.estimate[:, li, head], fd, rtol=0, atol=2 * EPS * scale, err_msg=res.ablation)
        assert np.abs(fd).max() > 1e-4  # the head matters: the comparison is not 0 = 0
    # exact derivatives at s = 1: central differences, O(eps^2)
    for s, space in enumerate(result.spaces):
        for scale, arr in (("s_par", result.d_s_par), ("s_perp", result.d_s_perp)):
            up, down = ({scale: 1 + CENTRAL}, {scale: 1 - CENTRAL})
            plus = ComponentScale(space, layers=[layer], heads=[head], **up)
            minus = ComponentScale(space, layers=[layer], heads=[head], **down)
            central = document_losses(model, blocks, plus).loss_sum - document_losses(model, blocks, minus).loss_sum
            np.testing.assert_allclose(
                arr[s, :, result.layers.index(layer), head],
                central / (2 * CENTRAL),
                rtol=1e-3,
                atol=1e-5,
                err_msg=space,
            )
    np.testing.assert_allclose(result.estimate, -result.d_s_par[0], rtol=0, atol=0)  # parallel-value = -d/ds_par


def test_a_head_whose_edit_changes_nothing_gets_exactly_zero():
    model = float64_toy("toy-llama")  # GQA 6/2, no value bias: zeroing kv head 0's values zeroes query heads 0-2
    with torch.no_grad():
        model.blocks[1].attn.v.original_component.weight[:16] = 0.0
    blocks = blocks_of(model)
    for edit in ("zero", "parallel-value"):
        result = head_attribution(model, blocks, ablation=edit, n_resamples=10, progress=False)
        assert (result.estimate[:, 1, :3] == 0).all(), edit  # exactly: the edit's change dz is 0
        assert (result.d_s_par[:2, :, 1, :3] == 0).all() and (result.d_s_perp[:2, :, 1, :3] == 0).all()
        assert np.abs(result.estimate[:, 1, 3:]).max() > 0
        exact = loss_change(model, blocks, HeadEdit(edit, 1, [0]))
        assert (exact == 0).all()


def test_results_identical_across_batch_sizes():
    model = float64_toy("toy-qwen3")
    blocks = blocks_of(model, n_docs=5)
    one = head_attribution(model, blocks, batch_size=1, n_resamples=10, progress=False)
    many = head_attribution(model, blocks, batch_size=4, n_resamples=10, progress=False)
    for field in ("estimate", "d_s_par", "d_s_perp", "loss_sum"):
        np.testing.assert_allclose(getattr(one, field), getattr(many, field), rtol=1e-10, atol=1e-13, err_msg=field)
    np.testing.assert_allclose(one.loss_sum, document_losses(model, blocks).loss_sum, rtol=1e-12)


def test_after_first_leaves_position_zero_out_and_joint_is_the_sum():
    model = float64_toy("toy-gpt2")
    blocks = blocks_of(model)
    after = head_attribution(model, blocks, ablation="zero", positions="after-first", n_resamples=10, progress=False)
    step = ComponentScale("value", 1 - EPS, 1 - EPS, layers=[2], heads=[0], positions="after-first")
    fd = loss_change(model, blocks, step) / EPS
    np.testing.assert_allclose(after.estimate[:, 2, 0], fd, rtol=0, atol=2 * EPS * np.abs(fd).max())
    df = after.to_dataframe()
    joint = df[df["head"].isna()].set_index("layer")["estimate"]
    np.testing.assert_allclose(joint.to_numpy(), after.head_estimate().sum(1), rtol=1e-12)
    assert list(df.columns) == ["model", "ablation", "layer", "head", "kv_head", "label", "estimate", "ci_lo", "ci_hi"]
    assert (df["ci_lo"] <= df["estimate"]).all() and (df["estimate"] <= df["ci_hi"]).all()


@pytest.mark.parametrize("edit", ["zero", "mean", "parallel-value", "parallel-residual"])
def test_confirm_runs_the_exact_engine_on_the_top_and_random_heads(edit):
    model = float64_toy("toy-gpt2")
    blocks = blocks_of(model, n_docs=4)
    screen = head_attribution(model, blocks, ablation=edit, n_resamples=50, progress=False)
    checked = confirm(model, blocks, screen, top_k=4, n_random=3, seed=1, progress=False)
    df = checked.to_dataframe()
    assert list(df["chosen"]) == ["top"] * 4 + ["random"] * 3
    assert [(r.layer, r.head) for r in df.iloc[:4].itertuples()] == screen.top_heads(4)
    for r in df.itertuples():  # the exact column is the exact engine's effect, the estimate the screen's
        exact = loss_change(model, blocks, HeadEdit(edit, r.layer, [r.head], _means(model, blocks, edit, r.layer)))
        assert r.exact == pytest.approx(exact.sum() / screen.n_tokens.sum(), abs=1e-12)
        assert r.estimate == screen.head_estimate()[r.layer, r.head]
    assert checked.spearman > 0.5  # random toy weights: small, nearly linear effects
    assert "linearisation" in checked.summary()["note"].iloc[0] or edit == "mean"


def _means(model, blocks, edit, layer):
    from lens_parallel.sweep import head_means

    return head_means(model, blocks.tokens, [layer])[layer] if edit == "mean" else None


def test_bad_input_is_refused_before_any_forward():
    model = float64_toy("toy-gpt2")
    blocks = blocks_of(model)
    with pytest.raises(ValueError, match="unknown ablation 'scale'; accepted: zero, mean, parallel-value"):
        head_attribution(model, blocks, ablation="scale")
    with pytest.raises(ValueError, match="positions"):
        head_attribution(model, blocks, positions="last")
    screen = head_attribution(model, blocks, n_resamples=10, progress=False)
    with pytest.raises(ValueError, match="not the ones the screen ran on"):
        confirm(model, blocks.tokens[:2], screen)
    with pytest.raises(ValueError, match="top_k"):
        confirm(model, blocks, screen, top_k=10, n_random=10)
