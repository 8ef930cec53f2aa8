from __future__ import annotations

import einops
import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from lens_parallel import geometry
from lens_parallel.analyses import dominance
from lens_parallel.analyses.dominance import DominanceResult, _measure, _Receiver, head_dominance, study_texts
from lens_parallel.data import token_blocks
from lens_parallel.documents import Documents, document_batches
from lens_parallel.edits import HeadEdit, apply_edits
from lens_parallel.hooks import effective_qk_roles, hook_name
from lens_parallel.models import model_info
from lens_parallel.stats import concentration
from lens_parallel.sweep import Batch

from .conftest import Killed, KillSwitch, get_model


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


@torch.inference_mode()
def _head_outputs(model, tokens, layer, edits=()):
    """Each head's projected output ``[batch, pos, head, d_model]``, the projection bias and the layer's attention
    output, rebuilt from the HF weights (softmax: W_O z_h; linear attention: W_out[:, h] of the gated RMSNorm of
    head h's recurrence output, norm(o_h) * silu(z_h))."""
    info = model_info(model)
    if info.layer_types[layer] == "softmax":
        names = [hook_name(layer, "z"), hook_name(layer, "attn_out")]
        with apply_edits(model, edits):
            _, cache = model.run_with_cache(tokens, names_filter=names)
        attn = model.blocks[layer].attn
        per_head = torch.einsum("bphd,hdm->bphm", cache[names[0]], attn.W_O)
        bias = torch.zeros(info.d_model) if attn.b_O is None else attn.b_O
        return per_head, bias, cache[names[1]]
    prefix = f"blocks.{layer}.linear_attn"
    names = [f"{prefix}.hook_recurrence_out", f"{prefix}.hook_gate_input", f"{prefix}.hook_out"]
    with apply_edits(model, edits):
        _, cache = model.run_with_cache(tokens, names_filter=names)
    hf = model.blocks[layer].original_component.linear_attn
    o, z = cache[names[0]], cache[names[1]]
    x = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + hf.norm.variance_epsilon) * hf.norm.weight * F.silu(z)
    w_out = einops.rearrange(hf.out_proj.weight, "m (h d) -> h d m", h=o.shape[2])
    return torch.einsum("bphd,hdm->bphm", x, w_out), torch.zeros(info.d_model), cache[names[2]]


@pytest.mark.parametrize(("spec", "layers"), [("toy-qwen3.5", (0, 2, 4)), ("toy-gpt2", (1,)), ("toy-qwen3", (0,))])
def test_head_outputs_sum_to_the_attention_output_and_removal_drops_exactly_one(spec, layers):
    """The study's decomposition check, for every layer type: sum_h (projected output of h) + bias = the attention
    output; and zeroing head u (HeadEdit("zero")) removes exactly u's projected output."""
    model = get_model(spec)
    tokens = token_blocks(model, "wikipedia-en", n_docs=2, seq_len=12).tokens
    for layer in layers:
        per_head, bias, out = _head_outputs(model, tokens, layer)
        torch.testing.assert_close(per_head.sum(2) + bias, out, rtol=1e-5, atol=1e-5)
        u = per_head.shape[2] - 1
        _, _, removed = _head_outputs(model, tokens, layer, [HeadEdit("zero", layer, (u,))])
        torch.testing.assert_close(removed, out - per_head[:, :, u], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", ["toy-qwen3.5", "toy-qwen3"])
def test_removing_no_head_gives_zero(spec):
    model = get_model(spec)
    info = model_info(model)
    tokens = token_blocks(model, "austen", n_docs=2, seq_len=10).tokens
    for up in range(info.n_layers - 1):
        receive = _Receiver(model, info, up)
        with torch.inference_mode():
            resid = model(tokens, stop_at_layer=up)
        batch = Batch(next(document_batches(Documents.of(tokens), 2)), prefix={up: resid})
        masks = torch.zeros(3, receive.n_up, dtype=torch.bool)
        for length, at in ((10, list(range(10))), (6, [5])):
            owners = torch.tensor([0, 1, 1])
            eff = _measure(receive, batch, owners, masks, length=length, at=at, tokens_per_forward=4 * length)
            for key, value in eff.items():
                if key == "js" and not receive.softmax:
                    assert np.isnan(value).all()  # no softmax row
                else:  # exactly 0 on most CPUs; some give equal rows of one batch different float32 rounding
                    np.testing.assert_allclose(value, 0.0, atol=1e-6, err_msg=f"{up} {key}")


def test_joint_rows_are_run_once_per_distinct_mask():
    """Masks repeated across receiving heads, halves and tokens are one row each, run at least to the last token
    that reads them; every observation equals its own row run alone (one row per request, cut to its own token)."""
    model = get_model("toy-qwen3")
    info = model_info(model)
    tokens = token_blocks(model, "austen", n_docs=2, seq_len=12).tokens
    receive = _Receiver(model, info, 0)
    with torch.inference_mode():
        resid = model(tokens, stop_at_layer=0)
    batch = Batch(next(document_batches(Documents.of(tokens), 2)), prefix={0: resid})
    positions, h, n_recv = [3, 7, 11], receive.n_up, receive.n_recv
    g = torch.Generator().manual_seed(0)
    choices = torch.rand(3, h, generator=g) < 0.5  # three distinct masks, reused everywhere
    choices[:, 0] = True
    pick = torch.randint(0, 3, (2, len(positions), n_recv, 2), generator=g)
    pick[1] = 0  # text 1: one mask for every observation
    masks = choices[pick]  # [text, pos, recv, half, upstream]
    runs = []
    plain = dominance.run_rows

    def counted(*args, rows, length, **kw):
        runs.append((len(rows) - len(torch.unique(rows)), length))  # each forward leads with its texts' unedited rows
        return plain(*args, rows=rows, length=length, **kw)

    dominance.run_rows = counted
    try:
        got = dominance._joint_effects(receive, batch, positions, masks, tokens_per_forward=4096)
    finally:
        dominance.run_rows = plain
    distinct = [len(torch.unique(einops.rearrange(masks[t], "p r k u -> (p r k) u"), dim=0)) for t in range(2)]
    assert sum(n for n, _ in runs) == sum(distinct)
    assert max(length for _, length in runs) == 12 and distinct[1] == 1
    for text, j, r, k in [(0, 0, 0, 0), (0, 2, n_recv - 1, 1), (1, 1, 2, 0)]:
        t = positions[j]
        alone = _measure(
            receive,
            batch,
            torch.tensor([text]),
            masks[text, j, r, k][None],
            length=t + 1,
            at=[t],
            tokens_per_forward=64,
        )
        np.testing.assert_allclose(got["qkv"][text, j, r, k], alone["qkv"][0, 0, r], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(got["js"][text, j, r, k], alone["js"][0, 0, r], rtol=1e-4, atol=1e-9)


def _plain(model, tokens, up, heads):
    """Effective q, k, v and attention pattern of layer up+1 from one plain forward from the tokens (no prefix reuse,
    no batching of rows), with ``heads`` of layer ``up`` zeroed over the whole sequence."""
    info = model_info(model)
    recv = up + 1
    if info.layer_types[recv] == "softmax":
        roles = (*effective_qk_roles(info), "v", "pattern_full")
    else:
        roles = ("lin_q", "lin_k", "lin_v")
    names = [hook_name(recv, role) for role in roles]
    edits = [HeadEdit("zero", up, heads)] if heads else []
    with torch.inference_mode(), apply_edits(model, edits):
        _, cache = model.run_with_cache(tokens, names_filter=names)
    q, k, v = (cache[n].double() for n in names[:3])
    if info.layer_types[recv] == "linear":
        norm = lambda x: x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
        q, k = norm(q) / q.shape[-1] ** 0.5, norm(k)
    pattern = cache[names[3]].double() if len(names) == 4 else None
    return q, k, v, pattern


def _expected(base, new, t, g):
    """rel_q, qkv and js of receiving head g at token t (its key/value head by repeat_interleave)."""
    (q, k, v, pat), (q2, k2, v2, pat2) = base, new
    n_recv = pat.shape[1] if pat is not None else v.shape[2]
    k, k2 = (x.repeat_interleave(n_recv // x.shape[2], dim=2)[:, t, g] for x in (k, k2))
    v, v2 = (x.repeat_interleave(n_recv // x.shape[2], dim=2)[:, t, g] for x in (v, v2))
    q, q2 = (x.repeat_interleave(n_recv // x.shape[2], dim=2)[:, t, g] for x in (q, q2))
    qkv = torch.sqrt(((q2 - q) ** 2 + (k2 - k) ** 2 + (v2 - v) ** 2).sum(-1) / (q**2 + k**2 + v**2).sum(-1))
    js = geometry.js_divergence(pat2[:, g, t], pat[:, g, t]) if pat is not None else torch.full_like(qkv, np.nan)
    return (q2 - q).norm(dim=-1) / q.norm(dim=-1), qkv, js


@pytest.mark.parametrize("spec", ["toy-qwen3.5", "toy-qwen3"])
def test_observation_path_equals_a_plain_forward_on_every_pair_type(spec):
    """toy-qwen3.5's pairs are linear->linear, linear->softmax, softmax->softmax, softmax->linear; toy-qwen3 is
    GQA softmax. Single-head effects at every token, and token-adaptive joint effects (rows cut to t + 1 tokens),
    equal full forwards from the tokens with the same heads removed over the whole sequence."""
    model = get_model(spec)
    info = model_info(model)
    blocks = token_blocks(model, "wikipedia-en", n_docs=2, seq_len=12, seed=3)
    result = head_dominance(model, blocks, query_positions=slice(4, 12), mask_scales=("qkv", "js"), progress=False)
    assert result.layer_pairs == tuple((up, up + 1) for up in range(info.n_layers - 1))
    if spec == "toy-qwen3.5":
        assert set(result.layer_types) == {(a, b) for a in ("linear", "softmax") for b in ("linear", "softmax")}
    tokens = blocks.tokens
    for p, (up, _) in enumerate(result.layer_pairs):
        base = _plain(model, tokens, up, ())
        n_up, n_recv = result.upstream_heads[p], result.receiving_heads[p]
        for u in (0, n_up - 1):
            new = _plain(model, tokens, up, (u,))
            for j, t in ((0, 4), (7, 11)):
                for g in (0, n_recv - 1):
                    rel_q, qkv, js = _expected(base, new, t, g)
                    qh = g * result.query_heads[p] // n_recv  # the query head g reads
                    np.testing.assert_allclose(result.rel_q[p, :, u, j, qh], rel_q, rtol=1e-4, atol=1e-7)
                    np.testing.assert_allclose(result.qkv[p, :, u, j, g], qkv, rtol=1e-4, atol=1e-7)
                    np.testing.assert_allclose(result.js[p, :, u, j, g], js, rtol=1e-3, atol=1e-10)
        # joint: the strong half of observation (text 1, token 9, last receiving head) on each mask scale, and all
        text, j, t, g = 1, 5, 9, n_recv - 1
        for m, scale in enumerate(result.mask_scales):
            if scale == "js" and result.receiving_types[p] == "linear":
                assert np.isnan(result.joint_qkv[p, :, :, :n_recv, m, :2]).all()
                continue
            strong = tuple(np.argsort(result.effects(p, scale)[text, j, g], kind="stable")[n_up - n_up // 2 :].tolist())
            _, qkv, js = _expected(base, _plain(model, tokens, up, strong), t, g)
            np.testing.assert_allclose(result.joint_qkv[p, text, j, g, m, 1], qkv[text], rtol=1e-4, atol=1e-7)
            np.testing.assert_allclose(result.joint_js[p, text, j, g, m, 1], js[text], rtol=1e-3, atol=1e-10)
        _, qkv, _ = _expected(base, _plain(model, tokens, up, tuple(range(n_up))), t, g)
        np.testing.assert_allclose(result.joint_qkv[p, text, j, g, :, 3], qkv[text], rtol=1e-4, atol=1e-7)
        # the random half: default_rng([seed, up, text]), one draw per (token, receiving head) in that order
        rng = np.random.default_rng([0, up, 0])
        draws = [rng.choice(n_up, size=n_up // 2, replace=False) for _ in range(len(result.query_positions) * n_recv)]
        _, qkv, _ = _expected(base, _plain(model, tokens, up, tuple(sorted(draws[0].tolist()))), 4, 0)
        np.testing.assert_allclose(result.joint_qkv[p, 0, 0, 0, 0, 2], qkv[0], rtol=1e-4, atol=1e-7)


def test_study_protocol_on_toy_qwen35(tmp_path):
    model = get_model("toy-qwen3.5")
    info = model_info(model)
    blocks = study_texts(model)
    assert blocks.tokens.shape == (4, 32) and "lunyu" in blocks.corpus
    result = head_dominance(model, blocks, progress=False)
    n_pairs = info.n_layers - 1
    assert len(result.layer_pairs) == n_pairs and result.query_positions == tuple(range(7, 32))
    for p, recv in enumerate(result.receiving_types):
        js = result.js[p, :, : result.upstream_heads[p], :, : result.receiving_heads[p]]
        assert np.isfinite(js).all() if recv == "softmax" else np.isnan(js).all()
    df = result.to_dataframe()
    per_scale = df.groupby("scale").size()
    assert per_scale["qkv"] == sum(4 * 25 * n for n in result.receiving_heads)
    heads = zip(result.receiving_heads, result.receiving_types, strict=True)
    assert per_scale["js"] == per_scale["js_distance"] == sum(4 * 25 * n for n, r in heads if r == "softmax")
    assert np.isfinite(df.effective_fraction).all() and df.effective_fraction.between(0, 1 + 1e-12).all()
    # the tables' concentration is stats.concentration of that observation's single-head effects
    row = df[(df.scale == "js_distance") & (df.receiving_layer == 2) & (df.position == 20)].iloc[0]
    p, text, j, g = 1, row.text, 20 - 7, row.receiving_head
    expected = concentration(np.sqrt(result.js[p, text, :, j, g]))
    assert row.effective_fraction == pytest.approx(expected["effective_fraction"])
    effects, kv = result.effects_table(), result.projection_table()
    assert len(effects) == sum(100 * r * u for r, u in zip(result.receiving_heads, result.upstream_heads, strict=True))
    one = effects[(effects.receiving_layer == 2) & (effects.position == 9) & (effects.upstream_label == "L1H3")]
    np.testing.assert_allclose(one.qkv, result.qkv[1, one.text, 3, 2, one.receiving_head])
    k_rows = kv[(kv.role == "k") & (kv.receiving_layer == 2)]
    assert k_rows["head"].max() == info.n_kv_heads - 1 and len(k_rows) == 4 * 25 * 2 * 6  # 2 kv heads, once each
    v_rows = kv[(kv.role == "v") & (kv.receiving_layer == 4)]
    assert v_rows["head"].max() == 3 and len(v_rows) == 4 * 25 * 4 * 4  # linear receiver: 4 value heads
    q_rows = kv[(kv.role == "q") & (kv.receiving_layer == 4)]
    assert q_rows["head"].max() == 1 and len(q_rows) == 4 * 25 * 2 * 4  # ... reading 2 query/key heads
    joint = result.joint_table()
    assert set(joint.columns) >= {"joint_weak", "joint_strong", "joint_random", "joint_all", "strong_weak_ratio"}
    assert (joint.joint_all > 0).all() and np.allclose(joint.strong_weak_ratio, joint.joint_strong / joint.joint_weak)
    table = result.group_table()
    assert set(table.level) == {"pair", "receiving_type", "all"}
    overall = table[(table.level == "all") & (table.scale == "qkv") & (table.metric == "effective_fraction")]
    assert overall["median"].item() == pytest.approx(df[df.scale == "qkv"].effective_fraction.median())
    summary = result.summary()
    assert summary.n_pairs.item() == n_pairs
    assert summary.qkv_weak_smaller.item() == pytest.approx(
        joint[(joint.scale == "qkv") & (joint.mask_scale == "qkv")].weak_smaller.mean()
    )
    fig = result.figure()
    assert fig.layout.annotations[0].text.startswith("(a) effective fraction")
    assert "toy-qwen3.5" in fig.layout.title.text
    # batching does not change a number beyond float32's rounding by batch shape (1.4e-5 of a ratio with MKL on AVX2;
    # tokens 28-31: random halves are drawn per window, so they are left out)
    small = head_dominance(
        model, blocks, query_positions=slice(28, 32), batch_size=3, tokens_per_forward=7 * 32, progress=False
    )
    for field in ("rel_q", "rel_k", "rel_v", "qkv", "js"):
        np.testing.assert_allclose(
            getattr(small, field), getattr(result, field)[:, :, :, 21:], rtol=1e-4, atol=1e-6, err_msg=field
        )
    for field in ("joint_qkv", "joint_js"):
        kinds = [0, 1, 3]  # weak, strong, all
        np.testing.assert_allclose(
            getattr(small, field)[..., kinds], getattr(result, field)[:, :, 21:][..., kinds], rtol=1e-5, atol=1e-8
        )
    result.save(tmp_path / "dom")
    pd.testing.assert_frame_equal(DominanceResult.load(tmp_path / "dom").to_dataframe(), df)


def test_bad_input_is_refused_before_any_forward():
    model = get_model("toy-llama")
    blocks = token_blocks(model, "austen", n_docs=2, seq_len=12)
    with pytest.raises(ValueError, match=r"query_positions \[12\] out of range: sequences have 12 tokens"):
        head_dominance(model, blocks, query_positions=[3, 12])
    with pytest.raises(ValueError, match=r"query positions 20:12 must satisfy 0 <= start < stop <= 12"):
        head_dominance(model, blocks, query_positions=slice(20, None))
    with pytest.raises(ValueError, match=r"query positions -3:12 must satisfy 0 <= start < stop <= 12"):
        head_dominance(model, blocks, query_positions=slice(-3, None))  # not Python's count from the end
    with pytest.raises(ValueError, match=r"query positions 7:32 must satisfy 0 <= start < stop <= 12"):
        head_dominance(model, blocks, query_positions=slice(7, 32))  # an explicit window is not cut silently
    short = token_blocks(model, "austen", n_docs=2, seq_len=6)
    with pytest.raises(ValueError, match=r"the study's query window starts at token 7, but the sequences have 6"):
        head_dominance(model, short)
    with pytest.raises(ValueError, match=r"upstream layers \[2\] out of range"):
        head_dominance(model, blocks, upstream_layers=[2])
    with pytest.raises(ValueError, match=r"mask_scales must be \('qkv',\) or \('qkv', 'js'\)"):
        head_dominance(model, blocks, mask_scales=("js",))
    with pytest.raises(ValueError, match=r"tokens_per_forward must be a positive integer, got 0"):
        head_dominance(model, blocks, tokens_per_forward=0)
    with pytest.raises(ValueError, match=r"unknown scale 'kl'"):
        head_dominance(model, blocks, query_positions=[11], progress=False).effects(0, "kl")


def test_a_killed_dominance_run_resumes_to_identical_results(tmp_path, monkeypatch):
    """head_dominance keeps each finished layer pair in its store: a run killed after two of four pairs resumes,
    computes only the other two, and equals an uninterrupted run exactly."""
    model = get_model("toy-qwen3.5")
    blocks = token_blocks(model, "wikipedia-en", n_docs=2, seq_len=12)
    kw = {"query_positions": slice(4, 10), "mask_scales": ("qkv", "js"), "progress": False}
    fresh = head_dominance(model, blocks, **kw)
    store = tmp_path / "dominance.jsonl"
    switch = KillSwitch(
        monkeypatch, dominance._DominanceMetric, "measure", at=3, record=lambda self, ctx, plan, jobs, b: jobs[0].key
    )
    with pytest.raises(Killed):
        head_dominance(model, blocks, store=store, **kw)
    assert len(store.read_text().splitlines()) == 1 + 2  # the header and two finished pairs
    switch.disarm()
    resumed = head_dominance(model, blocks, store=store, **kw)
    assert switch.calls == ["L2->L3", "L3->L4"]
    for name in ("rel_q", "rel_k", "rel_v", "qkv", "js", "joint_qkv", "joint_js"):
        np.testing.assert_array_equal(getattr(resumed, name), getattr(fresh, name), err_msg=name)
