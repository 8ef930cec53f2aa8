"""The directional-decomposition paper's frozen-model protocol: layers skipped, the reference clamp, its grids and
its scale-1 canary, against hand computations and the unedited model."""

from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np
import pytest
import torch

import lens_parallel as lp
from lens_parallel import geometry
from lens_parallel.analyses import scaling
from lens_parallel.data import token_blocks
from lens_parallel.edits import compile_hooks, describe_edit, edit_layers, noop
from lens_parallel.losses import DocLosses
from lens_parallel.models import model_info
from lens_parallel.protocols import DIRECTIONAL_DECOMPOSITION
from lens_parallel.sweep import EditJob

from .conftest import get_model

SETTINGS = DIRECTIONAL_DECOMPOSITION.settings_for(lp.ScaleSettings)


@pytest.fixture(scope="module")
def setup():
    model = get_model("toy-qwen2")
    return model, token_blocks(model, "austen", n_docs=3, seq_len=16, seed=2)


def _run(model, tokens, hooks, names):
    """The activations ``names`` and the logits of one forward under ``hooks``."""
    seen = {}

    def keep(tensor, hook, *, name):
        seen[name] = tensor.detach().clone()

    with torch.inference_mode(), model.hooks(fwd_hooks=[*hooks, *((n, partial(keep, name=n)) for n in names)]):
        logits = model(tokens, return_type="logits")
    return seen, logits


def test_the_protocol_never_edits_layer_0(setup):
    model, blocks = setup
    info = model_info(model)
    noops, points = scaling._jobs(SETTINGS, scaling._space_layers(SETTINGS, info))
    jobs = [*noops.values(), *(job for job, _ in points.values())]
    assert len(points) == 11 + 9 + 2 * (11 + 7)  # the paper's grids: value s_perp 0..2, residual 0..1.5
    for job in jobs:
        hooks = compile_hooks(model, job.edits)
        assert hooks and not [name for name, _ in hooks if name.startswith("blocks.0.")], job.key
    names = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    plain, plain_logits = _run(model, blocks.tokens, [], names)
    for sp in SETTINGS.space:
        job = points[f"{sp}|s_par|s_par=0.0|s_perp=1.0|layer=None"][0]
        seen, logits = _run(model, blocks.tokens, compile_hooks(model, job.edits), names)
        assert torch.equal(seen[names[0]], plain[names[0]]), sp  # layer 0 bit-identical
        assert not torch.equal(seen[names[1]], plain[names[1]]), sp  # layer 1 is edited
        assert (logits - plain_logits).abs().max() > 1e-4


def test_skip_first_layers_wraps_any_edit(setup):
    model, blocks = setup
    n = model_info(model).n_layers
    for edit, explicit in (
        (lp.ZeroDiagonal(), lp.ZeroDiagonal(layers=range(1, n))),
        (lp.ComponentScale("residual-mlp", s_par=0.0), lp.ComponentScale("residual-mlp", 0.0, layers=range(1, n))),
        (lp.RandomDirectionRemoval(seed=2), lp.RandomDirectionRemoval(seed=2, layers=range(1, n))),
    ):
        wrapped = lp.SkipFirstLayers(edit)
        _, got = _run(model, blocks.tokens, compile_hooks(model, wrapped), [])
        _, want = _run(model, blocks.tokens, compile_hooks(model, explicit), [])
        assert torch.equal(got, want), type(edit).__name__
        assert wrapped.layers is None
    scale = lp.SkipFirstLayers(lp.ComponentScale("value", s_par=0.0, layers=(0, 2)), n=1)
    assert scale.layers == (2,)
    assert noop(scale) == (lp.SkipFirstLayers(lp.ComponentScale("value", layers=(0, 2)), n=1),)
    assert noop(lp.SkipFirstLayers(lp.ZeroDiagonal())) == ()  # no matched no-op: compared with the unedited model
    assert describe_edit(scale)["edit"]["space"] == "value"
    with pytest.raises(lp.LensParallelError, match="leaves no layer"):
        compile_hooks(model, lp.SkipFirstLayers(lp.ZeroDiagonal(), n=n))
    with pytest.raises(lp.LensParallelError, match="edits only layers before 2"):
        compile_hooks(model, lp.SkipFirstLayers(lp.ZeroDiagonal(layers=(0, 1)), n=2))
    with pytest.raises(lp.LensParallelError, match="positive integer"):
        lp.SkipFirstLayers(lp.ZeroDiagonal(), n=0)

    @dataclasses.dataclass(frozen=True)
    class Unlayered:  # a user edit that does not say which layers it edits
        def hooks(self, model, info):
            return lp.ZeroDiagonal().hooks(model, info)

    assert edit_layers(lp.SkipFirstLayers(Unlayered())) == "undeclared"  # the engine runs it from layer 0 only
    assert edit_layers(lp.SkipFirstLayers(lp.ZeroDiagonal(layers=[0, 2]))) == (2,)


def test_the_clamp_projects_every_position_as_a_hand_computation():
    m = torch.tensor([[1.0, 2.0, 0.0], [3.0, -1.0, 2.0]], dtype=torch.float64)
    r = torch.tensor([[1e-4, 0.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    excluded = geometry.project(m, r, eps=1e-3)
    clamped = geometry.project(m, r, eps=1e-3, clamp=True)
    # |r|^2 = 1e-8 < 1e-6: excluded leaves m whole; the clamp divides by 1e-6
    assert excluded.valid.tolist() == [False, True] and clamped.valid.tolist() == [True, True]
    assert excluded.coef[0] == 0.0 and clamped.coef[0] == pytest.approx(1e-4 / 1e-6)
    np.testing.assert_allclose(clamped.par[0].numpy(), [1e-4 * 100.0, 0.0, 0.0])
    assert clamped.coef[1] == excluded.coef[1] == pytest.approx(2.0 / 2.0)
    np.testing.assert_array_equal((clamped.par + clamped.perp).numpy(), m.numpy())


def test_the_clamp_changes_nothing_where_no_reference_is_tiny(setup):
    model, blocks = setup
    for space in ("value-exclude-self", "residual-attn"):
        plain = lp.ComponentScale(space, s_par=0.0, eps=1e-3)
        _, want = _run(model, blocks.tokens, compile_hooks(model, plain), [])
        _, got = _run(model, blocks.tokens, compile_hooks(model, dataclasses.replace(plain, guard="clamp")), [])
        assert torch.equal(got, want), space
    with pytest.raises(lp.LensParallelError, match="unknown guard 'floor'"):
        lp.ComponentScale("value", guard="floor")


def test_the_protocol_sweep_runs_its_grids_and_canary(setup):
    model, blocks = setup
    assert SETTINGS.metric == "word_perplexity"  # the paper's; here on token blocks, per token
    result = lp.scale_sweep(
        model, blocks, protocol="directional-decomposition", metric="token_perplexity", n_resamples=50, progress=False
    )
    df = result.to_dataframe()
    counts = df.groupby(["space", "vary"]).size().to_dict()
    assert counts[("value-exclude-self", "s_perp")] == 9 and counts[("residual-mlp", "s_perp")] == 7
    assert counts[("residual-attn", "s_par")] == 11
    assert "layers 1-2 edited (layer 0 left alone)" in result.figure().layout.title.text
    at_one = df[(df.s_par == 1.0) & (df.s_perp == 1.0)]
    assert len(at_one) == 6 and (at_one.delta_loss == 0.0).all()  # the scale-1 points of both axes, exactly 0
    layers = range(1, model_info(model).n_layers)
    bare = lp.evaluate(model, blocks, lp.ComponentScale("residual-mlp", s_par=0.0, layers=layers))
    row = df[(df.space == "residual-mlp") & (df.vary == "s_par") & (df.s_par == 0.0)].iloc[0]
    assert row.delta_loss == pytest.approx(bare.delta_loss, abs=5e-6)  # float32 forwards batched differently
    excluded = lp.scale_sweep(
        model,
        blocks,
        protocol="directional-decomposition",
        metric="token_perplexity",
        guard="exclude",
        n_resamples=50,
        progress=False,
    ).to_dataframe()
    np.testing.assert_array_equal(excluded.delta_loss, df.delta_loss)  # the clamp never binds on this toy


def test_the_canary_refuses_a_no_op_that_moves_the_loss_beyond_rounding():
    """Equal passes; a float32 model's rounding (16 eps of a document's 600 nats: 1.1e-3) passes; the same
    difference in float64 (allowed: 1e-9) and a move beyond float32's rounding are refused, naming the document."""
    noop_job, unedited = EditJob("noop", ()), EditJob("unedited", ())
    n_tokens = np.array([100, 100])
    f32, f64 = float(np.finfo(np.float32).eps), float(np.finfo(np.float64).eps)
    run = {
        noop_job: DocLosses(np.array([500.0, 600.0]), n_tokens),
        unedited: DocLosses(np.array([500.0, 600.0]), n_tokens),
    }
    scaling._check_unedited(run, {"value": noop_job}, unedited, eps=f64)  # equal: passes
    run[noop_job] = DocLosses(np.array([500.0, 600.0 + 4e-6]), n_tokens)  # MKL on AVX2's rounding, as measured
    scaling._check_unedited(run, {"value": noop_job}, unedited, eps=f32)
    with pytest.raises(lp.LibraryError, match=r"by 4e-06 nats on document 1 \(more than the 1e-09 its rounding"):
        scaling._check_unedited(run, {"value": noop_job}, unedited, eps=f64)
    run[noop_job] = DocLosses(np.array([500.0, 600.0 + 0.01]), n_tokens)
    with pytest.raises(lp.LibraryError, match=r"by 0\.01 nats on document 1 \(more than the 0\.00114 its rounding"):
        scaling._check_unedited(run, {"value": noop_job}, unedited, eps=f32)


def _by_hand(model, tokens, ablation: str, layer: int, *, first: bool = True) -> np.ndarray:
    """The four statistics of every head of ``layer`` from a cache, in numpy (float64)."""
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith(("hook_z", "hook_v")))
    z = cache[f"blocks.{layer}.attn.hook_z"].double().numpy()
    v = cache[f"blocks.{layer}.attn.hook_v"].double().numpy()
    v = np.repeat(v, z.shape[2] // v.shape[2], axis=2)  # GQA: each query head's kv head
    if not first:
        z, v = z[:, 1:], v[:, 1:]
    dot, yy, vv = (z * v).sum(-1), (z * z).sum(-1), (v * v).sum(-1)
    par = (dot / np.maximum(vv, 1e-6))[..., None] * v
    edit_vec = -par if ablation == "parallel-value" else -z
    norm = lambda x: np.sqrt((x * x).sum(-1))  # noqa: E731
    per_pos = [
        (par * par).sum(-1) / np.maximum(yy, 1e-6),
        norm(par) / np.sqrt(np.maximum(vv, 1e-6)),
        norm(edit_vec) / np.sqrt(np.maximum(yy, 1e-6)),
        norm(edit_vec) / np.sqrt(np.maximum(vv, 1e-6)),
    ]
    return np.stack([x.mean((0, 1)) for x in per_pos])  # [statistic, head]


@pytest.mark.parametrize("ablation", ["parallel-value", "zero"])
def test_the_four_statistics_equal_a_hand_computation(setup, ablation):
    model, blocks = setup
    stats = lp.head_statistics(model, blocks, ablation=ablation, batch_size=2)
    for i, layer in enumerate(stats.layers):
        np.testing.assert_allclose(stats.values[:, i], _by_hand(model, blocks.tokens, ablation, layer), rtol=1e-5)
    para_ratio, para_over_ref, edit_over_y, edit_over_ref = stats.values
    if ablation == "parallel-value":  # the edit is -y_par: |edit|/|v| is |y_par|/|v|, and |edit|/|y| the mean |cos|
        np.testing.assert_allclose(edit_over_ref, para_over_ref, rtol=1e-12)
        assert (edit_over_y >= para_ratio).all()  # |cos| >= cos^2
    else:
        np.testing.assert_allclose(edit_over_y, 1.0, rtol=1e-6)
    later = lp.head_statistics(model, blocks, ablation=ablation, positions="after-first")
    np.testing.assert_allclose(later.values[:, 0], _by_hand(model, blocks.tokens, ablation, 0, first=False), rtol=1e-5)
    assert stats.n_positions == blocks.tokens.numel() and later.n_positions == blocks.tokens.numel() - 3
    assert list(stats.to_dataframe().columns[-4:]) == ["para_ratio", "para_over_ref", "edit_over_y", "edit_over_ref"]
    with pytest.raises(lp.LensParallelError, match="unknown ablation 'mean'"):
        lp.head_statistics(model, blocks, ablation="mean")


def test_correlations_and_global_bh_equal_scipy_and_statsmodels(setup):
    from scipy import stats as sps
    from statsmodels.stats.multitest import multipletests

    model, blocks = setup
    other = get_model("toy-llama")
    other_blocks = token_blocks(other, "austen", n_docs=3, seq_len=16, seed=2)
    kw = {"n_resamples": 50, "n_permutations": 200, "progress": False}
    sens = {"qwen2": lp.head_sensitivity(model, blocks, **kw), "llama": lp.head_sensitivity(other, other_blocks, **kw)}
    stats = {"qwen2": lp.head_statistics(model, blocks), "llama": lp.head_statistics(other, other_blocks)}
    table = lp.sensitivity_correlations({k: (sens[k], stats[k]) for k in sens})
    row = table[(table.model == "llama") & (table.statistic == "para_ratio")].iloc[0]
    expected = sps.pearsonr(stats["llama"].values[0].ravel(), sens["llama"].head_delta.ravel())
    assert row.pearson_r == pytest.approx(expected.statistic) and row.pearson_p == pytest.approx(expected.pvalue)
    assert row.spearman_rho == pytest.approx(
        sps.spearmanr(stats["llama"].values[0].ravel(), sens["llama"].head_delta.ravel()).statistic
    )
    heads = lp.compare_sensitivity(sens)
    pooled = np.concatenate([sens["qwen2"].head_p.ravel(), sens["llama"].head_p.ravel()])
    np.testing.assert_allclose(heads.q_global, multipletests(pooled, method="fdr_bh")[1])
    mine = heads[heads.model == "llama"]
    np.testing.assert_allclose(mine.q_model, multipletests(sens["llama"].head_p.ravel(), method="fdr_bh")[1])
    assert set(heads.class_global) <= {"decrease", "increase", "not significant"}
    fig = lp.head_ratio_figure({k: (sens[k], stats[k]) for k in sens}, statistic="edit_over_y")
    assert len(fig.data) == 2 and f"Pearson r {table.pearson_r[2]:.2f}" in fig.data[0].name
    np.testing.assert_array_equal(fig.data[1].y, sens["llama"].head_delta.ravel())
    with pytest.raises(lp.LensParallelError, match="unknown statistic 'cos'"):
        lp.head_ratio_figure({k: (sens[k], stats[k]) for k in sens}, statistic="cos")
    with pytest.raises(lp.LensParallelError, match="covers layers"):
        lp.sensitivity_correlations({"x": (sens["qwen2"], dataclasses.replace(stats["qwen2"], layers=(0, 1)))})
    assert table.rho_max_split_half.isna().all()  # 3 documents: no two halves of 2
    with pytest.raises(lp.LensParallelError, match="other documents"):
        lp.sensitivity_correlations({"x": (sens["qwen2"], stats["llama"])})


def test_the_split_half_ceiling_equals_each_half_run_alone():
    from lens_parallel.stats import spearman

    model = get_model("toy-qwen2")
    blocks = token_blocks(model, "austen", n_docs=8, seq_len=12, seed=3)
    kw = {"n_resamples": 20, "n_permutations": 20, "progress": False}
    row = lp.sensitivity_correlations(
        {"m": (lp.head_sensitivity(model, blocks, **kw), lp.head_statistics(model, blocks))}, seed=5
    ).iloc[1]  # para_over_ref
    order = np.random.default_rng(5).permutation(8)
    halves = [blocks.tokens[np.sort(idx)] for idx in (order[:4], order[4:])]
    stat = [lp.head_statistics(model, h).values[1].ravel() for h in halves]
    delta = [lp.head_sensitivity(model, h, **kw).head_delta.ravel() for h in halves]
    assert row.statistic == "para_over_ref"
    assert row.r_stat_split_half == pytest.approx(spearman(stat[0], stat[1]), abs=1e-9)
    assert row.r_delta_split_half == pytest.approx(spearman(delta[0], delta[1]), abs=1e-9)
    product = row.r_stat_split_half * row.r_delta_split_half
    assert (
        row.rho_max_split_half == pytest.approx(np.sqrt(product)) if product > 0 else np.isnan(row.rho_max_split_half)
    )


def test_token_weighted_sign_flips_flip_each_documents_delta_sum(setup):
    model, blocks = setup
    kw = {"layers": [1], "n_resamples": 50, "n_permutations": 500, "progress": False}
    weighted = lp.head_sensitivity(model, blocks, sign_flip_weights="tokens", **kw)
    run = lp.run_sweep(model, blocks, [lp.AblationJob(1, (0,))], ablation="parallel-value", progress=False)
    delta_sums = run[lp.AblationJob(1, (0,))].loss_sum - run.base.loss_sum
    from lens_parallel.stats import sign_flip_pvalue

    assert weighted.head_p[0, 0] == sign_flip_pvalue(delta_sums, n_resamples=500, seed=0)
    assert DIRECTIONAL_DECOMPOSITION.settings_for(lp.SensitivitySettings).sign_flip_weights == "tokens"


def test_the_text_selection_filters_dedups_and_follows_the_seeded_shuffle():
    import datasets

    from lens_parallel.selection import TextSelection, sample_texts, select_texts

    sizes = [159, 160, 1200, 1201, 500, 20, 700, 300]
    texts = [f"{i:03d}" + "x" * (n - 3) for i, n in enumerate(sizes)]
    stream = [*texts, texts[1], "  " + texts[4] + "\n", *[f"{i:04d}" + "y" * 300 for i in range(40)]]
    selection = TextSelection(max_texts=30, shuffle_seed=7, shuffle_buffer=16)
    sample = sample_texts(stream, selection)
    # the order is datasets' own buffer shuffle of the stream, with that seed and buffer
    order = datasets.IterableDataset.from_generator(lambda: ({"text": t} for t in stream)).shuffle(
        seed=7, buffer_size=16
    )
    shuffled = [row["text"] for row in order]
    kept, seen = [], set()
    for t in shuffled:
        s = t.strip() if isinstance(t, str) else None
        if s is not None and 160 <= len(s) <= 1200 and s not in seen:
            seen.add(s)
            kept.append(s)
    assert list(sample.texts) == kept[:30] and shuffled != stream
    assert [shuffled[i].strip() for i in sample.source_indices] == list(sample.texts)
    assert len(sample.texts) == len(set(sample.texts))  # the repeated (and the padded) text kept once
    lengths = {len(t) for t in sample.texts}
    assert {160, 1200} <= lengths and not lengths & {159, 1201, 20}  # bounds inclusive
    assert sample_texts(stream, TextSelection(max_texts=30, shuffle_seed=8, shuffle_buffer=16)).texts != sample.texts
    # the rule alone: stops at max_texts, or after max_to_scan texts read
    assert select_texts(texts, TextSelection(max_texts=2))[0] == [texts[1], texts[2]]
    assert select_texts(texts, TextSelection(max_to_scan=2)) == ([texts[1]], [1], 2)
    assert select_texts([None, 7, texts[1]], TextSelection()) == ([texts[1]], [2], 3)  # a row without text is read
    assert sample.describe()["n_texts"] == 30 and sample.describe()["datasets_version"] == datasets.__version__
    with pytest.raises(lp.LensParallelError, match="must not exceed"):
        TextSelection(min_chars=500, max_chars=100)
    with pytest.raises(lp.LensParallelError, match="no text of 'austen' has 160-1200"):
        sample_texts("austen", TextSelection(max_to_scan=5))


def test_the_layer_level_delta_reproduces_the_updates_component_along_x():
    g = torch.Generator().manual_seed(0)
    y, x = (
        torch.randn(2, 5, 8, generator=g, dtype=torch.float64),
        torch.randn(2, 5, 8, generator=g, dtype=torch.float64),
    )
    v, W_O = (
        torch.randn(2, 5, 3, 4, generator=g, dtype=torch.float64),
        torch.randn(3, 4, 8, generator=g, dtype=torch.float64),
    )
    for s_par in (0.0, 0.5, 2.0):
        view = geometry.layer_diagonal_change(y, x, v, W_O, s_par=s_par)
        w = torch.einsum("bphd,hdm->bpm", v, W_O)  # W_O applied to the concatenated values
        edited = y + view.delta[..., None] * w
        want = s_par * geometry.project(y, x).par
        torch.testing.assert_close(geometry.project(edited, x).par, want, rtol=0, atol=1e-12)
        torch.testing.assert_close(view.change_perp, geometry.project(view.delta[..., None] * w, x).perp)
        assert view.valid.all() and view.change_perp.norm(dim=-1).min() > 0  # w is not parallel to x


def test_the_layer_view_matches_the_model_with_delta_added_to_every_heads_diagonal():
    model = get_model("toy-llama")
    prompt = "Echo the final code exactly once: AX7Q-19"
    view = lp.diagonal_view(model, prompt, layer=1, head=2, s_par=0.0)
    ids = model.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert len(view.token_labels) == len(ids) and "endoftext" not in view.token_labels[0]  # no boundary token
    with_boundary = lp.diagonal_view(model, prompt, layer=1, head=2, prompt_boundary=True)
    assert len(with_boundary.token_labels) == len(ids) + 1
    tokens = torch.tensor([ids])
    delta = torch.tensor(view.layer_delta, dtype=torch.float32)

    def add_delta(pattern, hook):
        return pattern + torch.diag_embed(delta)[None, None]

    names = ["blocks.1.hook_resid_pre", "blocks.1.hook_attn_out"]
    plain, _ = _run(model, tokens, [], names)
    edited, _ = _run(model, tokens, [("blocks.1.attn.hook_pattern", add_delta)], names)
    x = plain[names[0]][0].double()
    par = geometry.project(edited[names[1]][0].double(), x).par  # s_par = 0: nothing of the update along x is left
    assert par.norm(dim=-1).max() < 1e-4 * plain[names[1]][0].norm(dim=-1).max()
    change = (edited[names[1]] - plain[names[1]])[0].double()
    np.testing.assert_allclose(
        geometry.project(change, x).perp.norm(dim=-1).numpy(), view.layer_perp, rtol=1e-3, atol=1e-6
    )
    assert np.isfinite(view.layer_side_effect) and view.layer_side_effect > 0 and view.layer_guarded == 0
    assert view.layer_delta_min <= view.layer_delta_mean <= view.layer_delta_max


def test_the_merged_value_projection_equals_a_hand_computation_and_differs_per_head(setup):
    model, blocks = setup
    tokens, layer = blocks.tokens, 1
    names = [f"blocks.{layer}.attn.hook_z", f"blocks.{layer}.attn.hook_v"]
    plain, _ = _run(model, tokens, [], names)
    o = plain[names[0]].double()
    v = plain[names[1]].double().repeat_interleave(3, dim=2)  # GQA: 6 query heads read 2 kv heads, kv-major
    o_cat, v_cat = o.flatten(2), v.flatten(2)
    coef = (o_cat * v_cat).sum(-1) / (v_cat * v_cat).sum(-1)  # one coefficient per position, shared by the heads
    for s_par, s_perp in ((0.0, 1.0), (0.5, 1.5)):
        want = s_par * coef[..., None, None] * v + s_perp * (o - coef[..., None, None] * v)
        edit = lp.ComponentScale("value-merged", s_par=s_par, s_perp=s_perp, layers=(layer,))
        edited, _ = _run(model, tokens, compile_hooks(model, edit), names[:1])
        torch.testing.assert_close(edited[names[0]].double(), want, rtol=1e-4, atol=1e-5)
    per_head, _ = _run(model, tokens, compile_hooks(model, lp.ComponentScale("value", s_par=0.0, layers=(1,))), names)
    merged, _ = _run(
        model, tokens, compile_hooks(model, lp.ComponentScale("value-merged", s_par=0.0, layers=(1,))), names
    )
    assert (
        per_head[names[0]] - merged[names[0]]
    ).abs().max() > 1e-3  # per-head coefficients differ from the shared one
    # the merged edit leaves the concatenation with nothing along the concatenated values (position 0: o_0 = v_0,
    # nothing is left at all)
    m = merged[names[0]].double().flatten(2)
    assert m[:, 0].abs().max() < 1e-6
    cos_left = (m * v_cat).sum(-1)[:, 1:].abs() / (m.norm(dim=-1) * v_cat.norm(dim=-1))[:, 1:]
    assert cos_left.max() < 1e-4
    # decomposition: one unit per layer, its mean self-cosine and |m_par|/|m| = |cos| over t >= 1 by hand
    table = lp.decompose(model, blocks, space="value-merged").table("value-merged", "sublayer")
    cos = ((o_cat * v_cat).sum(-1) / (o_cat.norm(dim=-1) * v_cat.norm(dim=-1)))[:, 1:]
    row = table.layers.index(layer)
    assert table.self_cos[row, 0] == pytest.approx(float(cos.mean()), rel=1e-5)
    assert table.par_frac[row, 0] == pytest.approx(float(cos.abs().mean()), rel=1e-5)
    with pytest.raises(lp.LensParallelError, match="value-merged"):
        lp.ComponentScale("value-merged", heads=(0, 1))
    noop = lp.scale_sweep(model, blocks, space="value-merged", s_par=(0.0,), s_perp=(), unedited_check=True)
    assert noop.points[0].effect.delta_loss != 0.0


def test_the_paper_layout_of_the_diagonal_view():
    model = get_model("toy-llama")
    view = lp.diagonal_view(model, "Echo the final code exactly once: AX7Q-19", layer=1, head=2, s_par=0.0)
    fig = view.figure(layout="paper")
    assert len(fig.data) == 3 and "L1H2" in fig.layout.title.text
    names = [a.text for a in fig.layout.annotations]
    assert names[1].startswith("residual space, one δ per layer") and names[2].startswith("value space (value)")
    np.testing.assert_allclose(np.diag(fig.data[1].z), np.diag(view.pattern) + view.layer_delta)
    np.testing.assert_allclose(np.diag(fig.data[2].z), np.diag(view.pattern) + view.d_a[view.spaces.index("value")])
    only = lp.diagonal_view(model, "Echo the final code", layer=1, head=2, space="value-exclude-self")
    with pytest.raises(lp.LensParallelError, match="layout='paper' needs the residual-attn"):
        only.figure(layout="paper")
    with pytest.raises(lp.LensParallelError, match="unknown layout 'poster'"):
        view.figure(layout="poster")


def test_the_post_gate_site_projects_z_itself_on_gated_attention():
    model = get_model("toy-qwen3.5")
    info = model_info(model)
    layer = info.softmax_layers[0]
    tokens = token_blocks(model, "austen", n_docs=2, seq_len=10, seed=1).tokens
    names = [f"blocks.{layer}.attn.hook_z", f"blocks.{layer}.attn.hook_v"]
    plain, _ = _run(model, tokens, [], names)
    z = plain[names[0]].double()
    v = plain[names[1]].double().repeat_interleave(info.group_size, dim=2)
    coef = (z * v).sum(-1, keepdim=True) / (v * v).sum(-1, keepdim=True)
    post = lp.ComponentScale("value", s_par=0.0, layers=(layer,), site="post-gate")
    edited, _ = _run(model, tokens, compile_hooks(model, post), names[:1])
    torch.testing.assert_close(edited[names[0]].double(), z - coef * v, rtol=1e-4, atol=1e-5)
    pre, _ = _run(model, tokens, compile_hooks(model, dataclasses.replace(post, site="pre-gate")), names[:1])
    assert (pre[names[0]] - edited[names[0]]).abs().max() > 1e-3  # the gate makes the two sites differ
    noop = lp.scale_sweep(
        model, tokens, space="value-exclude-self", site="post-gate", s_par=(0.0,), s_perp=(), unedited_check=True
    )
    assert noop.points[0].effect.delta_loss != 0.0
    with pytest.raises(lp.LensParallelError, match="has no output gate"):
        compile_hooks(get_model("toy-llama"), dataclasses.replace(post, layers=None))
    with pytest.raises(lp.LensParallelError, match="value-space option"):
        lp.ComponentScale("residual-mlp", site="post-gate")
