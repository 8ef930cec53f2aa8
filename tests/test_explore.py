"""The notebook explorer's state, in Python: every control updates the views to what the analyses return."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from plotly.callbacks import Points

import lens_parallel as lp
from lens_parallel import geometry
from lens_parallel.data import token_blocks
from lens_parallel.explore import Explorer, explore
from lens_parallel.explore_widget import ExplorerWidget
from lens_parallel.losses import token_nll

from .conftest import get_model

SPEC = "toy-qwen2"


@pytest.fixture(scope="module")
def _explorer():
    model = get_model(SPEC)
    blocks = token_blocks(model, "wikipedia-en", n_docs=3, seq_len=16)
    ex = explore(model, blocks)
    return model, blocks, ex, dict(ex.state)


@pytest.fixture
def setup(_explorer):
    """The module's explorer (built once), back in its initial state: tests change it, and none may depend on
    what another left (the suite runs in any order: ``make test-shuffled``)."""
    model, blocks, ex, initial = _explorer
    ex.update(**initial)
    return model, blocks, ex


def _full_forward_token_losses(model, tokens, edit) -> np.ndarray:
    """Per-token NLL of one document under ``edit``, from the tokens (no prefix reuse), independently of the
    explorer."""
    with torch.inference_mode(), model.hooks(fwd_hooks=lp.edits.compile_hooks(model, [edit])):
        logits = model(tokens, return_type="logits")
    return token_nll(logits, tokens)[0].double().numpy()


def _check_view(model, blocks, view):
    """The view equals the analyses' own numbers for its settings."""
    tokens = blocks.tokens[view.doc : view.doc + 1]
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern") or n.endswith("hook_v"))
    pattern = cache[f"blocks.{view.layer}.attn.hook_pattern"][0, view.head]
    np.testing.assert_allclose(view.pattern, pattern.numpy(), atol=1e-6)
    np.testing.assert_allclose(view.diag, torch.diagonal(pattern).numpy(), atol=1e-6)
    dv = lp.diagonal_view(
        model, blocks, layer=view.layer, head=view.head, s_par=view.s_par, space=view.space, doc=view.doc
    )
    np.testing.assert_allclose(view.diag_edited, np.diagonal(dv.edited(view.space)), atol=1e-6)
    heads = None if view.all_heads else (view.head,)
    edit = lp.ComponentScale(view.space, s_par=view.s_par, s_perp=view.s_perp, layers=(view.layer,), heads=heads)
    noop = lp.ComponentScale(view.space, s_par=1.0, s_perp=1.0, layers=(view.layer,), heads=heads)
    expected = _full_forward_token_losses(model, tokens, edit) - _full_forward_token_losses(model, tokens, noop)
    np.testing.assert_allclose(view.loss_change, expected, atol=2e-5)


def test_the_default_view_is_the_most_self_aligned_head_and_matches_the_analyses(setup):
    model, blocks, ex = setup
    decomposition = lp.decompose(model, blocks, space=["value", "value-exclude-self", "residual-attn"], progress=False)
    for space in ("value", "value-exclude-self", "residual-attn"):
        np.testing.assert_allclose(ex.heatmaps[space], decomposition.table(space, "head").self_cos)
    v = ex.view
    assert (v.layer, v.head) == np.unravel_index(np.argmax(ex.heatmaps["value"]), ex.heatmaps["value"].shape)
    _check_view(model, blocks, v)
    # the per-token parallel coefficient averages (t >= 1) to decompose's par_coef of that head on that document
    one = lp.decompose(model, blocks.tokens[v.doc : v.doc + 1], space="value", progress=False)
    assert v.coef[1:].mean() == pytest.approx(one.table("value", "head").par_coef[v.layer, v.head], abs=1e-6)


def test_selecting_a_head_changing_space_scales_and_document_update_every_view(setup):
    model, blocks, ex = setup
    for changes in (
        {"layer": 0, "head": 3},
        {"space": "value-exclude-self"},
        {"s_par": 0.5, "s_perp": 0.75},
        {"doc": 2},
        {"space": "residual-attn", "s_par": 1.5},
        {"all_heads": True, "s_par": 0.0},
    ):
        before = ex.view
        view = ex.update(**changes)
        assert view != before
        _check_view(model, blocks, view)
        assert view.heatmap is ex.heatmaps[view.space]
    # the coefficient of residual-attn is m.x / |x|^2 with m = o W_O[h]
    ex.update(all_heads=False, layer=1, head=2, doc=0)
    t = ex._capture(1, 0)
    o = geometry.value_aggregate(t["pattern_full"], lp.hooks.expand_kv(t["v"], 6))[0, :, 2]
    m = o @ model.blocks[1].attn.W_O.detach().double()[2]
    x = t["resid_pre"][0]
    np.testing.assert_allclose(ex.view.coef, ((m * x).sum(-1) / (x * x).sum(-1)).numpy(), rtol=1e-6, atol=1e-9)


def test_scales_of_one_change_nothing(setup):
    _, _, ex = setup
    view = ex.update(space="value", s_par=1.0, s_perp=1.0, all_heads=False)
    np.testing.assert_array_equal(view.loss_change, np.zeros_like(view.loss_change))
    np.testing.assert_allclose(view.diag_edited, view.diag, atol=1e-12)


@pytest.mark.parametrize("edit", ["zero-diagonal", "random-direction", "random-direction-norm-matched"])
def test_the_comparison_edits_are_measured_against_the_unedited_model(setup, edit):
    model, blocks, ex = setup
    try:
        view = ex.update(edit=edit, seed=3, layer=1, head=2, doc=1, all_heads=False)
        heads = (2,)
        made = {
            "zero-diagonal": lambda: lp.ZeroDiagonal(layers=(1,), heads=heads),
            "random-direction": lambda: lp.RandomDirectionRemoval(seed=3, layers=(1,), heads=heads),
            "random-direction-norm-matched": lambda: lp.RandomDirectionRemoval(
                seed=3, norm_matched=True, layers=(1,), heads=heads
            ),
        }[edit]()
        tokens = blocks.tokens[1:2]
        with torch.inference_mode():
            unedited = token_nll(model(tokens, return_type="logits"), tokens)[0].double().numpy()
        expected = _full_forward_token_losses(model, tokens, made) - unedited
        np.testing.assert_allclose(view.loss_change, expected, atol=2e-5)
        assert np.abs(view.loss_change).max() > 1e-4  # the edit changes the losses
        if edit == "zero-diagonal":  # A'_tt = 0 except the first query, whose row has only itself
            np.testing.assert_array_equal(view.diag_edited, np.r_[1.0, np.zeros(len(view.diag) - 1)])
        else:
            assert np.isnan(view.diag_edited).all()
        figs = ex.figures()
        assert "unedited model" in figs["loss"].layout.yaxis.title.text
        assert ("seed 3" in figs["loss"].layout.title.text) == edit.startswith("random")
    finally:
        ex.update(edit="scale", seed=0)


def test_the_widget_follows_its_controls_and_a_heatmap_click(setup, tmp_path):
    _, _, ex = setup
    ex.update(space="value", layer=2, head=0, doc=0, s_par=0.0, s_perp=1.0, all_heads=False)
    widget = ExplorerWidget(ex, save_to=tmp_path)
    figs = widget.figures
    widget.s_par.value = 0.5  # a slider move
    assert ex.view.s_par == 0.5
    np.testing.assert_array_equal(figs["diagonal"].data[1].y, ex.view.diag_edited)
    np.testing.assert_array_equal(figs["loss"].data[0].y, ex.view.loss_change)
    heat = figs["heatmap"].data[0]
    widget._clicked(heat, Points(point_inds=[[1, 4]], xs=[4], ys=[1], trace_name="", trace_index=0), None)
    assert (ex.view.layer, ex.view.head) == (1, 4)
    np.testing.assert_array_equal(figs["pattern"].data[0].z, ex.view.pattern)
    assert "L1H4" in figs["pattern"].layout.title.text
    widget.space.value = "value-exclude-self"
    np.testing.assert_array_equal(figs["heatmap"].data[0].z, ex.heatmaps["value-exclude-self"])
    widget.doc.value = 1
    np.testing.assert_array_equal(figs["pattern"].data[0].z, ex.view.pattern)
    assert ex.view.doc == 1 and "updated in" in widget.status.value
    widget.edit.value = "zero-diagonal"
    assert ex.view.edit == "zero-diagonal" and widget.s_par.disabled and widget.seed.disabled
    assert "hard diagonal removal" in figs["loss"].layout.title.text
    widget.edit.value = "scale"
    assert not widget.s_par.disabled
    widget.save.click()
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert any(n.endswith("_pattern.html") for n in saved) and any(n.endswith("_view.json") for n in saved)


def test_the_generation_panel_shows_the_prompt_continued_unedited_and_under_the_views_edit(setup, tmp_path):
    model, _, ex = setup
    ex.update(space="value", layer=1, s_par=-1.0, s_perp=1.0, all_heads=True)
    widget = ExplorerWidget(ex, save_to=tmp_path)
    widget.prompt.value, widget.new_tokens.value = "Once upon a time", 8
    widget.run_generation.click()
    edit = lp.ComponentScale("value", s_par=-1.0, layers=(1,), heads="all")
    expected = lp.generate(model, "Once upon a time", {"edited": edit}, max_new_tokens=8, progress=False)
    assert expected.texts[1] != expected.texts[0]  # the edit changes the continuation: something to mark
    shown = widget.generated.value
    assert "s_par=-1, s_perp=1 on layer 1" in shown and "<mark" in shown
    assert all(text[0] and text[0][:4] in shown for text in expected.texts)
    assert widget.generated.value == ex.generate("Once upon a time", max_new_tokens=8)._repr_html_()
    widget.prompt.value = ""
    widget.run_generation.click()
    assert "not generated" in widget.generated.value and "non-empty string" in widget.generated.value


def test_bad_settings_are_refused_and_leave_the_state(setup):
    _, _, ex = setup
    state = dict(ex.state)
    for changes, match in (
        ({"space": "query"}, "unknown space 'query'"),
        ({"head": 6}, "head"),
        ({"doc": 3}, "doc"),
        ({"s_par": float("nan")}, "s_par must be a finite number"),
        ({"zoom": 2}, "unknown explorer setting .zoom.; accepted: space, layer, head"),
        ({"edit": "mean"}, "unknown edit 'mean'"),
        ({"seed": -1}, "seed"),
    ):
        with pytest.raises(lp.LensParallelError, match=match):
            ex.update(**changes)
        assert ex.state == state


def test_the_exported_page_holds_every_precomputed_view(setup, tmp_path):
    _, _, ex = setup
    state = dict(ex.state)
    path = ex.to_html(tmp_path / "explorer.html", heads=[(0, 1), (2, 5)], s_par=(0.0, 1.5))
    assert ex.state == state  # exporting leaves the live state as it was
    page = path.read_text()
    assert page.count('class="plotly-graph-div"') == 4 and "plotly.js" in page.lower()
    assert "L2H5, s_par=1.5" in page and page.count("<script") >= 4
    try:  # a comparison edit has no s_par grid: one view per head
        ex.update(edit="zero-diagonal")
        page = ex.to_html(tmp_path / "zero.html", heads=[(0, 1), (2, 5)], s_par=(0.0, 1.5)).read_text()
        assert "L2H5, hard diagonal removal" in page and "s_par=1.5" not in page
    finally:
        ex.update(edit="scale")


def test_an_explorer_shows_linear_attention_layers_per_value_head():
    """A linear layer's map is its delta-rule mixing weights M (a_tt on the diagonal, M v = o); what is built on
    softmax heads only is refused there in one line."""
    from lens_parallel.hooks import forward, hook_name
    from lens_parallel.layers import linear_mixing_weights

    model = get_model("toy-qwen3.5")
    blocks = token_blocks(model, "austen", n_docs=2, seq_len=12)
    ex = Explorer(model, blocks)
    view = ex.update(layer=3, head=2, space="value-exclude-self", s_par=0.0)
    assert ex.heatmaps["value"].shape == (5, 6) and np.isnan(ex.heatmaps["value"][3, 4:]).all()
    captured: dict = {}
    roles = ("lin_q", "lin_k", "lin_v", "lin_beta", "lin_decay")
    hooks = [(hook_name(3, r), lambda t, hook, r=r: captured.__setitem__(r, t.double())) for r in roles]
    forward(model, blocks.tokens[:1], hooks)
    m = linear_mixing_weights(captured, 4)[0, 2].numpy()
    np.testing.assert_allclose(view.pattern, m, rtol=1e-6, atol=1e-9)
    assert np.allclose(view.diag, np.diag(m)) and np.isfinite(view.loss_change).all()
    assert np.abs(view.loss_change).max() > 0
    with pytest.raises(lp.LensParallelError, match="residual-attn has no diagonal view there"):
        ex.update(space="residual-attn")
    with pytest.raises(lp.LensParallelError, match=r"heads \[4\] out of range.*linear-attention layer"):
        ex.update(space="value", head=4)
