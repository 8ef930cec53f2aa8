from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
import torch

from lens_parallel.analyses.decompose import DecompositionResult, decompose
from lens_parallel.data import token_blocks
from lens_parallel.errors import LensParallelError
from lens_parallel.models import model_info
from lens_parallel.spaces import SPACE_NAMES

from .conftest import LINEAR_VALUE_NOISE, get_model, noisy_linear_value
from .references import decompose_reference


def test_streamed_statistics_equal_full_cache(toy):
    blocks = token_blocks(toy, "wikipedia-en", n_docs=5, seq_len=24, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = decompose(toy, blocks, space="all", batch_size=2, progress=False)
    info = model_info(toy)
    linear = [i for i, t in enumerate(info.layer_types) if t == "linear"]
    assert linear == [] or not caught  # every space on every layer: nothing skipped
    reference = decompose_reference(toy, blocks.tokens)
    assert {(t.space, t.level) for t in result.tables} == {(s, lvl) for s, lvl, _ in reference}
    for table in result.tables:
        assert {(table.space, table.level, layer) for layer in table.layers} <= set(reference)
        for i, layer in enumerate(table.layers):
            n = info.output_heads(layer) if table.level == "head" else 1  # past a layer's own heads: no head
            assert (table.n_positions[i, :n] == 5 * 23).all()  # degenerate ones too (toy-qwen3.5's c_t: rounding)
            assert (table.n_positions[i, n:] == 0).all() and np.isnan(table.self_cos[i, n:]).all()
            noisy = noisy_linear_value(info, table.space, layer)
            for stat, expected in reference[table.space, table.level, layer].items():
                tol = {"rtol": LINEAR_VALUE_NOISE, "atol": LINEAR_VALUE_NOISE} if noisy else {"atol": 1e-6}
                got, what = getattr(table, stat)[i, :n], f"{table.space} {layer} {stat}"
                np.testing.assert_allclose(got, expected.numpy(), err_msg=what, **tol)
    assert {key[2] for key in reference if key[:2] == ("value", "head")} == set(range(info.n_layers))


def test_gqa_value_space_uses_kv_group_of_each_query_head():
    """Against a reference that tiles kv heads (``repeat``) the per-head statistics differ: the test can fail."""
    model = get_model("toy-qwen2")
    info = model_info(model)
    tokens = token_blocks(model, "austen", n_docs=2, seq_len=24).tokens
    result = decompose(model, tokens, space="value", layers=[1], progress=False).table("value")
    with torch.inference_mode():
        _, cache = model.run_with_cache(tokens)
    z, v = cache["blocks.1.attn.hook_z"][:, 1:].double(), cache["blocks.1.attn.hook_v"][:, 1:].double()

    def cos(v_expanded):
        return torch.nn.functional.cosine_similarity(z, v_expanded, dim=-1).mean((0, 1)).numpy()

    right = cos(v.repeat_interleave(info.group_size, dim=2))
    wrong = cos(v.repeat(1, 1, info.group_size, 1))
    np.testing.assert_allclose(result.self_cos[0], right, atol=1e-6)
    assert np.abs(result.self_cos[0] - wrong).max() > 1e-3


def test_batch_size_and_layer_subsets_do_not_change_results():
    model = get_model("toy-pythia")
    tokens = token_blocks(model, "moby-dick", n_docs=4, seq_len=20).tokens
    full = decompose(model, tokens, space=["value", "residual-mlp"], batch_size=4, progress=False)
    one = decompose(model, tokens, space=["value", "residual-mlp"], batch_size=1, layers=[2, 0], progress=False)
    for space, level in (("value", "head"), ("residual-mlp", "sublayer")):
        a, b = full.table(space, level), one.table(space, level)
        assert b.layers == (0, 2)
        # the same documents in batches of another shape: float32 products may round otherwise (MKL on AVX2 blocks
        # them by shape: 6e-7 of a cosine there, 0 on AVX-512); float64 accumulation keeps the rest exact
        np.testing.assert_allclose(b.self_cos, a.self_cos[[0, 2]], rtol=1e-5, atol=1e-9)
        np.testing.assert_allclose(b.perp_frac, a.perp_frac[[0, 2]], rtol=1e-5, atol=1e-9)


def test_dataframe_figure_and_save_load(tmp_path):
    model = get_model("toy-qwen3")
    blocks = token_blocks(model, "wikipedia-en", n_docs=2, seq_len=16)
    result = decompose(model, blocks, space=["value", "residual-attn", "residual-block"], progress=False)
    df = result.to_dataframe()
    heads = df[df.level == "head"]
    assert len(heads) == 2 * 3 * 6 and len(df[df.level == "sublayer"]) == 2 * 3
    assert heads.label.iloc[7] == "L1H1" and heads.kv_head.iloc[:6].tolist() == [0, 0, 0, 1, 1, 1]
    assert df[df.level == "sublayer"]["head"].isna().all()
    assert (df.par_frac >= df.self_cos.abs() - 1e-12).all()  # mean |cos| >= |mean cos|
    fig = result.figure()
    assert "toy-qwen3" in fig.layout.title.text and fig.layout.xaxis.title.text == "layer"
    assert any("min-max over heads" in (t.name or "") for t in fig.data)
    result.save(tmp_path / "dec")
    again = DecompositionResult.load(tmp_path / "dec")
    pd.testing.assert_frame_equal(again.to_dataframe(), df)
    assert again.provenance.texts["corpus"] == "wikipedia-en" and again.provenance.texts["n_docs"] == 2
    assert again.provenance.weight_processing.startswith("unprocessed")


def test_bad_arguments_fail_before_any_forward():
    model = get_model("toy-gpt2")
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"unknown space 'values' \(did you mean 'value'\?\); accepted: value, "):
        decompose(model, tokens, space="values")
    with pytest.raises(ValueError, match=r"layers \[3\] out of range: this model has layers 0..2"):
        decompose(model, tokens, layers=[0, 3])
    with pytest.raises(ValueError, match="batch_size must be a positive integer or 'auto', got 0"):
        decompose(model, tokens, batch_size=0)
    with pytest.raises(
        ValueError, match=r"tokens must be \[batch, pos\] \(or \[pos\]: one document\), got a torch.int64"
    ):
        decompose(model, torch.zeros(2, 2, 8, dtype=torch.long))
    with pytest.raises(
        ValueError, match=r"tokens must be integer token ids \[batch, pos\], got a torch.float32 tensor"
    ):
        decompose(model, torch.zeros(2, 8))
    with pytest.raises(
        ValueError, match=r"unknown option 'spaces' \(did you mean 'space'\?\); accepted: space, layers"
    ):
        decompose(model, tokens, spaces=["value"])
    every = ("value", "value-exclude-self", "value-merged", "residual-attn", "residual-mlp", "residual-block")
    assert every == SPACE_NAMES


def test_load_refuses_another_result_type(tmp_path):
    from lens_parallel.analyses.scaling import ScalingResult

    model = get_model("toy-gpt2")
    decompose(model, token_blocks(model, "austen", n_docs=1, seq_len=8), progress=False).save(tmp_path / "d")
    with pytest.raises(LensParallelError, match="holds a DecompositionResult, not a ScalingResult"):
        ScalingResult.load(tmp_path / "d")
