"""Compression methods and the directional decomposition of their error."""

from __future__ import annotations

import einops
import numpy as np
import pytest
import torch

from lens_parallel.analyses.compression import compression_error
from lens_parallel.compression import Compression, _as_out_in, block_linears, compress, nm_mask, quantize_rtn
from lens_parallel.models import export_hf_model
from tests.conftest import Killed, KillSwitch, get_model

METHODS = ("int8", "int4-g16", "magnitude-50%", "wanda-50%", "magnitude-2:4", "wanda-4:8")


def _tokens(model, n=4, seq=24):
    return torch.randint(1, 1000, (n, seq), generator=torch.Generator().manual_seed(0))


def test_parse_specs_and_names():
    assert Compression.parse("int4-g128") == Compression("int", bits=4, group_size=128)
    assert Compression.parse("wanda-50%") == Compression("wanda", sparsity=0.5)
    assert Compression.parse("magnitude-2:4") == Compression("magnitude", n=2, m=4)
    for spec in METHODS:
        assert Compression.parse(spec).name == spec
    for bad in ("int1", "wanda-100%", "magnitude-4:2", "gptq", "int4-gx"):
        with pytest.raises(ValueError, match=r"accepted|needs|must"):
            Compression.parse(bad)


def test_quantize_rtn_by_hand():
    w = torch.tensor([[1.0, -0.4, 0.25, 0.1], [0.0, 0.0, 0.0, 0.0]])
    q = quantize_rtn(w, bits=2, group_size=None)  # qmax 1: scale = 1 for row 0; round(w) in [-2, 1]
    assert torch.equal(q, torch.tensor([[1.0, -0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    q = quantize_rtn(w, bits=4, group_size=2)  # qmax 7; groups [1, -.4] (scale 1/7), [.25, .1] (scale .25/7)
    expected = torch.tensor([[1.0, -3 / 7, 0.25, 0.25 * 3 / 7], [0, 0, 0, 0]])  # -2.8 -> -3; 2.8 -> 3
    torch.testing.assert_close(q, expected)
    q = quantize_rtn(w, bits=4, group_size=3)  # ragged: groups [1, -.4, .25] and [.1] (its own scale: exact)
    torch.testing.assert_close(q[0], torch.tensor([1.0, -3 / 7, 2 / 7, 0.1]))


@pytest.mark.parametrize("spec", ["magnitude-2:4", "wanda-2:4", "wanda-4:8"])
def test_nm_pruning_leaves_exactly_n_nonzeros_per_group(spec):
    model = get_model("toy-qwen3")
    method = Compression.parse(spec)
    hf = export_hf_model(model.original_model)
    method.apply(hf, _tokens(model))
    for name, module in block_linears(hf):
        groups = einops.rearrange(_as_out_in(module), "o (g m) -> o g m", m=method.m)
        counts = (groups != 0).sum(-1)
        assert (counts == method.n).all(), name


def test_unstructured_sparsity_and_wanda_rows():
    score = torch.rand(6, 8, generator=torch.Generator().manual_seed(1))
    from lens_parallel.compression import sparsity_mask

    assert (sparsity_mask(score, 0.5, per_row=True).sum(1) == 4).all()
    assert sparsity_mask(score, 0.5, per_row=False).sum() == 24
    keep = nm_mask(score, 1, 4)
    assert torch.equal(keep[:, :4].float().argmax(1), score[:, :4].argmax(1))


@pytest.mark.parametrize("spec", ["toy-gpt2", "toy-pythia", "toy-qwen3"])
def test_original_weights_unchanged_by_every_method(spec):
    model = get_model(spec)
    before = {k: v.clone() for k, v in model.original_model.state_dict().items()}
    for method in METHODS:
        compressed = compress(model, method, calibration=_tokens(model))
        changed = sum(
            not torch.equal(a, b)
            for a, b in zip(before.values(), compressed.original_model.state_dict().values(), strict=False)
        )
        assert changed > 0, method
    for k, v in model.original_model.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("spec", ["toy-gpt2", "toy-pythia", "toy-qwen3", "toy-llama"])
def test_no_compression_gives_zero_error_exactly(spec):
    model = get_model(spec)
    result = compression_error(model, _tokens(model), method="none", scored="all")
    assert np.all(result.par == 0) and np.all(result.perp == 0)
    assert result.delta_loss[0] == 0


@pytest.mark.parametrize("spec", ["toy-qwen3", "toy-llama"])  # no attention output bias: W_O carries the update
def test_scaling_w_o_is_pure_parallel_error(spec):
    model = get_model(spec)
    c = 0.1

    def scale_w_o(hf):
        for name, module in block_linears(hf):
            if name.endswith("o_proj"):
                module.weight.mul_(1 + c)

    result = compression_error(model, _tokens(model), method=scale_w_o, scored="all")
    attn, mlp = 0, 1
    np.testing.assert_allclose(result.par[0, attn], c, rtol=1e-4)
    assert np.nanmax(result.perp[0, attn]) < 1e-4
    np.testing.assert_allclose(result.coef[0, attn], c, rtol=1e-4)
    assert np.nanmax(result.perp[0, mlp]) > 1e-4  # the MLP sees the changed attention output: not a pure rescaling
    assert result.methods == ("scale_w_o",)


def test_compression_error_on_toy_models_table_and_figure():
    model = get_model("toy-qwen2")
    toks = _tokens(model, n=6)
    result = compression_error(model, toks, method=["int8", "int4-g16", "wanda-50%"])
    df = result.layer_table()
    assert len(df) == 3 * 2 * model.cfg.n_layers
    tidy = result.to_dataframe()  # one row per (method, sublayer, layer, prompt)
    assert len(tidy) == 3 * 2 * model.cfg.n_layers * 6
    np.testing.assert_allclose(
        tidy.groupby(["method", "sublayer", "layer"], sort=False).par.mean(), df.par_mean, equal_nan=True
    )
    summary = result.method_table().set_index(["method", "sublayer"])
    assert summary.loc[("int8", "attn"), "perp_mean"] < summary.loc[("int4-g16", "attn"), "perp_mean"]
    assert (summary["perp_mean"] > 0).all() and (summary["par_mean"] > 0).all()
    fig = result.figure()
    assert len([t for t in fig.data if t.mode == "lines+markers"]) == 6
    batched = compression_error(model, toks, method=["int8", "int4-g16", "wanda-50%"], batch_size=4)  # 4 + 2 prompts
    for field in ("par", "perp", "coef", "delta_loss"):
        np.testing.assert_allclose(getattr(batched, field), getattr(result, field), rtol=1e-4, atol=1e-6, err_msg=field)
    with pytest.raises(ValueError, match=r"unknown scored positions 'first'"):
        compression_error(model, toks, method="int8", scored="first")
    with pytest.raises(ValueError, match="accepted forms"):
        compression_error(model, toks, method=["int8", "gptq"])


def test_a_killed_compression_run_resumes_to_identical_results(tmp_path, monkeypatch):
    """compression_error keeps each finished method in its store: a run killed during the second of three methods
    resumes with the other two only and equals an uninterrupted run exactly."""
    from lens_parallel.analyses import compression as analysis

    model = get_model("toy-qwen2")
    toks = _tokens(model)
    methods = ["int8", "wanda-2:4", "int4-g128"]
    fresh = compression_error(model, toks, method=methods, progress=False)
    store = tmp_path / "compress.jsonl"
    switch = KillSwitch(
        monkeypatch, analysis._CompressionMetric, "evaluate", at=2, record=lambda self, ctx, plan, jobs, b: jobs[0].key
    )
    with pytest.raises(Killed):
        compression_error(model, toks, method=methods, store=store, progress=False)
    assert len(store.read_text().splitlines()) == 1 + 1
    switch.disarm()
    resumed = compression_error(model, toks, method=methods, store=store, progress=False)
    assert switch.calls == ["wanda-2:4", "int4-g128"]
    for name in ("par", "perp", "coef", "delta_loss", "delta_loss_ci"):
        np.testing.assert_array_equal(getattr(resumed, name), getattr(fresh, name), err_msg=name)
