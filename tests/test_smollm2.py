"""The real pretrained model (SmolLM2-135M-Instruct, from a PyPI wheel, cached after the first run)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lens_parallel.analyses.decompose import decompose
from lens_parallel.data import token_blocks
from lens_parallel.models import model_info

from .conftest import get_model

pytestmark = pytest.mark.slow


def test_smollm2_loads_offline_predicts_english_and_decomposes_all_layers():
    model = get_model("smollm2-135m")
    info = model_info(model)
    assert (info.family, info.n_layers, info.n_heads, info.n_kv_heads, info.d_model) == ("llama", 30, 9, 3, 576)
    blocks = token_blocks(model, "wikipedia-en", n_docs=4, seq_len=64)
    with torch.inference_mode():
        loss = model(blocks.tokens, return_type="loss").item()
    assert loss < 0.4 * math.log(info.d_vocab), loss  # log(49152) = 10.8; a trained model is near 3
    result = decompose(model, blocks, space="value", batch_size=4, progress=False).table("value")
    assert result.layers == tuple(range(30)) and result.self_cos.shape == (30, 9)
    assert (result.n_degenerate == 0).all() and np.isfinite(result.self_cos).all()
    assert 0.05 < result.self_cos.mean() < 0.95


def test_smollm2_causal_null_and_gqa_groups():
    from lens_parallel.analyses.nulls import gqa_alignment

    model = get_model("smollm2-135m")
    blocks = token_blocks(model, "wikipedia-en", n_docs=4, seq_len=48)
    result = gqa_alignment(model, blocks, seed=0, n_resamples=200)
    assert result.cos_self.shape == (4, 30, 9) and result.reconstruction_error < 1e-4
    summary = result.summary().iloc[0]
    assert summary["cos_self"] > summary["cos_null"] > 0  # trained heads: above the null, and the null is not 0
    assert summary["across_excess"] < summary["within_excess"]


def test_smollm2_chunked_loss_equals_full_logits_and_its_gradient():
    """Tied embeddings, a 49,152-token vocabulary: values and gradients equal the full-logits path."""
    from lens_parallel.hooks import forward
    from lens_parallel.losses import Unembedding, chunked_token_nll, token_nll, unembedding

    model = get_model("smollm2-135m")
    blocks = token_blocks(model, "wikipedia-en", n_docs=2, seq_len=40)
    unembed = unembedding(model)
    assert unembed.W_U is model.original_model.model.embed_tokens.weight  # tied
    with torch.inference_mode():
        final = forward(model, blocks.tokens, grad=True)
        logits = model(blocks.tokens, return_type="logits")
    torch.testing.assert_close(
        chunked_token_nll(final, unembed, blocks.tokens, chunk_bytes=7 * 4 * 49152),
        token_nll(logits, blocks.tokens),
        rtol=0,
        atol=5e-5,
    )
    x_full, x_chunk = final.clone().requires_grad_(True), final.clone().requires_grad_(True)
    W = unembed.W_U.detach().clone()
    token_nll(torch.nn.functional.linear(x_full, W), blocks.tokens).sum().backward()
    chunked_token_nll(x_chunk, Unembedding(W, None, None), blocks.tokens, chunk_bytes=9 * 4 * 49152).sum().backward()
    # each gradient sums 49,152 float32 terms (softmax - onehot) W_U, blocked differently: 7e-5 seen, on gradients
    # of magnitude up to ~1
    torch.testing.assert_close(x_chunk.grad, x_full.grad, rtol=1e-3, atol=2e-4)
    assert x_full.grad.abs().max() > 0.1


def test_smollm2_bfloat16_statistics_within_the_stated_tolerance_of_float32():
    """The models guide's bfloat16 tolerances (benchmarks/precision.py on 4 x 64 tokens): per head, median |diff| of
    cosines under 0.005 and max under 0.06; of loss effects (nats) median under 0.005 and max under 0.1."""
    from lens_parallel import causal_null, head_attribution, head_sensitivity, load_model

    stats = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = get_model("smollm2-135m") if dtype == torch.float32 else load_model("smollm2-135m", dtype=dtype)
        blocks = token_blocks(model, "wikipedia-en", n_docs=2, seq_len=48, seed=0)
        kw = {"batch_size": 2, "progress": False}
        null = causal_null(model, blocks, **kw)
        sens = head_sensitivity(
            model, blocks, ablation="zero", layers=[0, 10, 20, 29], n_resamples=20, n_permutations=20, **kw
        )
        attr = head_attribution(model, blocks, ablation="parallel-value", **kw)
        stats[dtype] = {
            "cos": np.stack([null.cos_self.mean(0), null.excess]),
            "nats": np.concatenate([sens.head_delta.ravel(), (attr.estimate.sum(0) / attr.n_tokens.sum()).ravel()]),
        }
    for kind, (median, largest) in {"cos": (0.005, 0.06), "nats": (0.005, 0.1)}.items():
        diff = np.abs(stats[torch.bfloat16][kind] - stats[torch.float32][kind])
        assert np.median(diff) < median and diff.max() < largest, (kind, np.median(diff), diff.max())


def test_smollm2_analyses_and_edits_are_the_same_on_every_attention_path():
    """The own attention path on the real model: decompose (three spaces), the exact causal null and evaluate of
    the pattern edits and of the value scaling give eager's numbers on the diagonal and blocked paths (which one
    ``auto`` takes is test_attention's, on the toys),
    over whole documents of different lengths (a padded batch) with blocks of 13 queries (dividing none of them)."""
    import pandas as pd

    from lens_parallel import ComponentScale, DiagonalEdit, ZeroDiagonal, causal_null, evaluate, whole_documents
    from lens_parallel.attention import attention_path

    model = get_model("smollm2-135m")
    texts = [
        "The river rose in the night and by morning the mill stood in water to its first windows.",
        "She read the letter twice, folded it, and put it in the drawer with the others.",
        "Attention heads write back, in large part, their own token's value vector; the rest of each head's output "
        "comes from the tokens before it, weighted by how much the head attends to each of them.",
    ]
    docs = whole_documents(model, texts, n_docs=3)
    assert len(set(docs.lengths.tolist())) > 1  # ragged: the batch is padded
    edits = {
        "zero-diagonal": ZeroDiagonal(),
        "diagonal-exclude-self": DiagonalEdit("value-exclude-self", s_par=0.0),
        "value": ComponentScale("value", s_par=0.0),
    }
    spaces = ["value", "value-exclude-self", "residual-attn"]
    frames: dict[str, list[pd.DataFrame]] = {}
    for path in ("eager", "diagonal", "blocked"):
        with attention_path(path, block_size=13):
            frames[path] = [
                decompose(model, docs, space=spaces, batch_size=3, progress=False).to_dataframe(),
                causal_null(model, docs, null="exact", batch_size=3, progress=False).to_dataframe(),
                *(evaluate(model, docs, e, batch_size=3, n_resamples=20).to_dataframe() for e in edits.values()),
            ]
    for path in ("diagonal", "blocked"):
        for got, reference in zip(frames[path], frames["eager"], strict=True):
            numeric = [c for c in reference.select_dtypes("number").columns if "ppl" not in c]
            pd.testing.assert_frame_equal(got[numeric], reference[numeric], atol=2e-5, rtol=1e-4, obj=path)
