"""The checks every analysis rests on, on real pretrained weights.

smollm2-135m runs in the suite (``slow``); Qwen2.5-Coder-1.5B (GQA 12/2, q/k/v biases) and Gemma-3-270m (one kv
head, sliding-window layers, post-norms) carry the ``real`` marker, which the suite deselects: they are run by
``benchmarks/real_models.py`` (``pytest -m real``), one model per process.
"""

from __future__ import annotations

import contextlib
import gc

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from lens_parallel.analyses.ablation import run_ablations
from lens_parallel.analyses.evaluate import document_losses
from lens_parallel.data import token_blocks
from lens_parallel.edits import ComponentScale, DiagonalEdit, HeadEdit, apply_edits
from lens_parallel.hooks import hook_name
from lens_parallel.models import model_info
from lens_parallel.spaces import SPACE_NAMES
from lens_parallel.sweep import AblationJob
from lens_parallel.weights import real_model_folder

from .conftest import get_model

REAL = [
    pytest.param("smollm2-135m", id="smollm2", marks=pytest.mark.slow),
    pytest.param("qwen2.5-coder-1.5b", id="qwen", marks=pytest.mark.real),
    pytest.param("qwen2.5-coder-0.5b", id="qwen-0.5b", marks=pytest.mark.real),
    pytest.param("gemma-3-270m", id="gemma", marks=pytest.mark.real),
]


def blocks_for(spec):
    return token_blocks(get_model(spec), "wikipedia-en", n_docs=2, seq_len=40, seed=5)


def probe_layers(spec) -> list[int]:
    n = model_info(get_model(spec)).n_layers
    return [0, n // 2, n - 1]


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("spec", REAL)
def test_loss_and_hook_v_equal_the_hugging_face_model_outside_transformer_lens(spec):
    model, tokens, layers = get_model(spec), blocks_for(spec).tokens, probe_layers(spec)
    with torch.inference_mode():
        loss = model(tokens, return_type="loss").item()
        _, cache = model.run_with_cache(tokens, names_filter=[hook_name(layer, "v") for layer in layers])
    # an independent copy of the same weights, run by transformers alone
    hf = AutoModelForCausalLM.from_pretrained(real_model_folder(spec), dtype=torch.float32).eval()
    v_proj, handles = {}, []
    for layer in layers:
        proj = hf.model.layers[layer].self_attn.v_proj
        handles.append(proj.register_forward_hook(lambda mod, inp, out, layer=layer: v_proj.__setitem__(layer, out)))
    with torch.inference_mode():
        logits = hf(tokens).logits
    has_bias = hf.model.layers[0].self_attn.v_proj.bias is not None
    del hf
    gc.collect()
    hf_loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).item()
    assert loss == pytest.approx(hf_loss, abs=1e-4)
    # a trained model on English text (uniform: ln 151,936 = 11.9 nats); qwen2.5-coder-0.5b, the smallest, has 5.46
    # on these two 40-token snippets (3.75 on 8 x 128 tokens)
    assert 0.5 < hf_loss < 6
    assert has_bias == (model_info(model).family == "qwen2")  # Qwen2's v_proj has a bias: hook_v must include it
    for layer in layers:
        v = cache[hook_name(layer, "v")]
        assert v.shape[2] == model_info(model).n_kv_heads
        torch.testing.assert_close(v.flatten(2), v_proj[layer], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec", REAL)
def test_no_op_edit_in_every_space_changes_no_logit(spec):
    model, tokens = get_model(spec), blocks_for(spec).tokens
    info = model_info(model)
    noops = [ComponentScale(space) for space in SPACE_NAMES] + [
        DiagonalEdit("value", s_par=1.0),
        DiagonalEdit("value-exclude-self", s_par=1.0),
    ]
    head_writes = [ComponentScale("residual-attn", heads=[0, 1]), DiagonalEdit("residual-attn", s_par=1.0)]
    with torch.inference_mode():
        bare = model(tokens)
        for edit in noops + ([] if info.post_norm else head_writes):  # float32's rounding of the split and sum:
            with apply_edits(model, edit):  # 1.2e-5 of the largest logit on qwen2.5-coder-0.5b, 0 in float64
                assert rel(model(tokens), bare) <= 4e-5, edit
    for edit in head_writes if info.post_norm else []:  # Gemma: one head's residual write is undefined
        with pytest.raises(ValueError, match="undefined on gemma-3-270m"), apply_edits(model, edit):
            model(tokens)


@pytest.mark.parametrize("spec", REAL)
@pytest.mark.parametrize("space", ["value", "value-exclude-self"])
def test_diagonal_edit_equals_component_scale(spec, space):
    model, tokens = get_model(spec), blocks_for(spec).tokens
    layers = probe_layers(spec)
    with torch.inference_mode():
        base = model(tokens)
        with apply_edits(model, ComponentScale(space, s_par=0.3, layers=layers)):
            scaled = model(tokens)
        with apply_edits(model, DiagonalEdit(space, s_par=0.3, layers=layers)):
            diagonal = model(tokens)
    assert rel(scaled, base) > 1e-3  # the edit does something
    assert rel(diagonal, scaled) <= 1e-4


@pytest.mark.parametrize("spec", REAL)
def test_ablation_engine_equals_the_naive_loop(spec):
    model, blocks = get_model(spec), blocks_for(spec)
    info = model_info(model)
    a, b, c = probe_layers(spec)
    jobs = [AblationJob(a, (1,)), AblationJob(b, (0,)), AblationJob(c, (2,)), AblationJob(b, (0, 3))]
    kinds = ["zero", "parallel-value"] + ([] if info.post_norm else ["parallel-residual"])
    for kind in kinds:
        run = run_ablations(model, blocks, jobs, ablation=kind, batch_size=2, tokens_per_forward=64, progress=False)
        np.testing.assert_allclose(run.base.loss_sum, document_losses(model, blocks).loss_sum, atol=1e-4)
        for job in jobs:
            naive = document_losses(model, blocks, HeadEdit(kind, job.layer, job.heads))
            np.testing.assert_allclose(run[job].loss_sum, naive.loss_sum, atol=1e-4, err_msg=f"{kind} {job.key}")
            assert np.abs(naive.loss_sum - run.base.loss_sum).max() > 1e-4, f"{kind} {job.key} does nothing"


@pytest.mark.parametrize("spec", REAL)
def test_zero_ablating_a_head_sets_exactly_its_hook_z_to_zero(spec):
    model, tokens = get_model(spec), blocks_for(spec).tokens
    layer = probe_layers(spec)[1]
    name = hook_name(layer, "z")
    with torch.inference_mode():
        _, bare = model.run_with_cache(tokens, names_filter=[name])
        with apply_edits(model, HeadEdit("zero", layer, [1])):
            _, edited = model.run_with_cache(tokens, names_filter=[name])
    z, z0 = edited[name], bare[name]
    assert (z[:, :, 1] == 0).all() and z0[:, :, 1].abs().max() > 0
    others = [h for h in range(z.shape[2]) if h != 1]
    assert torch.equal(z[:, :, others], z0[:, :, others])  # same layer, upstream untouched: bit-identical


@pytest.mark.parametrize("spec", REAL)
def test_every_analysis_runs_and_says_what_is_undefined(spec, tmp_path):
    from lens_parallel.analyses.compression import compression_error
    from lens_parallel.analyses.decompose import decompose
    from lens_parallel.analyses.diagonal import diagonal_view
    from lens_parallel.analyses.dominance import head_dominance, study_texts
    from lens_parallel.analyses.nulls import causal_null, gqa_alignment
    from lens_parallel.analyses.reliability import split_half_reliability

    model, blocks = get_model(spec), blocks_for(spec)
    info = model_info(model)
    mid = probe_layers(spec)[1]
    with pytest.warns(UserWarning, match="undefined") if info.post_norm else contextlib.nullcontext():
        dec = decompose(model, blocks, space="all", progress=False)
    spaces = set(dec.to_dataframe().query("level == 'head'")["space"])
    assert spaces == ({"value", "value-exclude-self"} | (set() if info.post_norm else {"residual-attn"}))
    null = causal_null(model, blocks, seed=0, n_resamples=100).summary().iloc[0]
    assert null["cos_self"] > null["cos_null"]  # trained heads align with their own value beyond the null
    if info.n_kv_heads == 1:
        with pytest.raises(ValueError, match="share one kv head"):
            gqa_alignment(model, blocks)
    else:
        gqa = gqa_alignment(model, blocks, seed=0, n_resamples=100).summary().iloc[0]
        assert gqa["within_excess"] > gqa["across_excess"]
    view = diagonal_view(model, blocks, layer=mid, head=0, space=["value", "value-exclude-self"])
    assert np.isfinite(view.to_dataframe()[["dA_mean", "dA_min", "dA_max"]].to_numpy()).all()
    dominance = head_dominance(model, study_texts(model), upstream_layers=[mid], query_positions=[7], progress=False)
    assert dominance.summary().iloc[0]["n_pairs"] == 1
    error = compression_error(model, blocks, method="int8").to_dataframe()
    assert len(error) and np.isfinite(error.select_dtypes("number")).all().all()
    halves = token_blocks(model, "wikipedia-en", n_docs=4, seq_len=16, seed=1)
    # one forward per head: Gemma's 72 heads here; smollm2's 270 in benchmarks/sanity_checks.py (too long for the suite)
    if info.n_layers * info.n_heads <= 100:
        split = split_half_reliability(model, halves, batch_size=4, progress=False).summary().iloc[0]
        assert -1 <= split["r_delta_cos_self"] <= 1


@pytest.mark.parametrize("spec", REAL)
def test_choices_sharing_a_long_context_score_as_the_whole_sequence(spec):
    """A context longer than Gemma-3's sliding window (512): its cached run (sliding-window layers keep the last
    keys only) and then the continuations score as the whole sequence's logits under an edit do."""
    from lm_eval.api.instance import Instance

    from lens_parallel.downstream.lm import EditedLM
    from tests.test_downstream import _own_loglikelihood

    model = get_model(spec)
    context = " ".join(f"word{i} is number {i}." for i in range(80))
    pairs = [(context, " word3"), (context, " 81 and more words to come")]
    edits = (ComponentScale("value", s_par=0.0),)
    lm = EditedLM(model, edits, progress=False)
    assert len(lm.tok_encode(context)) > 600
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    for (ctx, continuation), (ll, greedy) in zip(pairs, got, strict=True):
        want_ll, want_greedy = _own_loglikelihood(model, lm, edits, ctx, continuation)
        assert ll == pytest.approx(want_ll, abs=1e-3, rel=1e-5)
        assert greedy == want_greedy
