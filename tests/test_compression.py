"""Compression methods and the directional decomposition of their error."""

from __future__ import annotations

import gc
import weakref
from functools import partial

import einops
import numpy as np
import pytest
import torch

from lens_parallel.analyses.compression import AUTHORS_PROMPTS, compression_error, compression_prompts
from lens_parallel.compression import Compression, _as_out_in, block_linears, compress, nm_mask, quantize_rtn
from lens_parallel.data import boundary_token
from lens_parallel.models import export_hf_model
from lens_parallel.tokenizers import BUNDLED_TOKENIZERS, load_bundled_tokenizer
from tests.conftest import Killed, KillSwitch, get_model

METHODS = (
    "int8",
    "int4-g16",
    "magnitude-50%",
    "wanda-50%",
    "magnitude-2:4",
    "wanda-4:8",
    "wanda-seq-50%",
    "wanda-seq-2:4",
)


def _tokens(model, n=4, seq=24):
    return torch.randint(1, 1000, (n, seq), generator=torch.Generator().manual_seed(0))


def test_parse_specs_and_names():
    assert Compression.parse("int4-g128") == Compression("int", bits=4, group_size=128)
    assert Compression.parse("wanda-50%") == Compression("wanda", sparsity=0.5)
    assert Compression.parse("magnitude-2:4") == Compression("magnitude", n=2, m=4)
    assert Compression.parse("wanda-seq-2:4") == Compression("wanda-seq", n=2, m=4)
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


@pytest.mark.parametrize("collect_bytes", [0, 1 << 40])
def test_a_big_compressed_copy_is_freed_before_the_next_is_built(monkeypatch, collect_bytes):
    """A copy of at least COLLECT_BYTES is collected before the next method's copy is built (never two beside the
    dense model); a smaller one is left to Python's collector (the bridge's reference cycles keep it until then)."""
    from lens_parallel.analyses import compression as analysis

    built: list[weakref.ref] = []

    def recording(*args, **kwargs):
        alive = sum(ref() is not None for ref in built)
        assert alive == (0 if collect_bytes == 0 else len(built)), f"{alive} of {len(built)} copies alive"
        built.append(weakref.ref(compress(*args, **kwargs)))
        return built[-1]()

    monkeypatch.setattr(analysis, "COLLECT_BYTES", collect_bytes)
    monkeypatch.setattr(analysis, "compress", recording)
    gc.disable()  # the collector must not run between the methods on its own
    try:
        model = get_model("toy-gpt2")
        compression_error(model, _tokens(model, n=2), method=["int8", "int4-g16", "wanda-50%"])
    finally:
        gc.enable()
    assert len(built) == 3


def test_compression_error_on_toy_models_table_and_figure():
    model = get_model("toy-qwen2")
    toks = _tokens(model, n=6)
    result = compression_error(model, toks, method=["int8", "int4-g16", "wanda-50%"])
    df = result.layer_table()
    assert result.sublayers == ("attn", "mlp", "block")
    assert len(df) == 3 * 3 * model.cfg.n_layers
    tidy = result.to_dataframe()  # one row per (method, sublayer, layer, prompt)
    assert len(tidy) == 3 * 3 * model.cfg.n_layers * 6
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
        monkeypatch, analysis._CompressionMetric, "measure", at=2, record=lambda self, ctx, plan, jobs, b: jobs[0].key
    )
    with pytest.raises(Killed):
        compression_error(model, toks, method=methods, store=store, progress=False)
    assert len(store.read_text().splitlines()) == 1 + 1
    switch.disarm()
    resumed = compression_error(model, toks, method=methods, store=store, progress=False)
    assert switch.calls == ["wanda-2:4", "int4-g128"]
    for name in ("par", "perp", "coef", "delta_loss", "delta_loss_ci"):
        np.testing.assert_array_equal(getattr(resumed, name), getattr(fresh, name), err_msg=name)


def _independent_errors(model, compressed, tokens, mode: str, lengths=None) -> dict[str, np.ndarray]:
    """par, perp, coef ``[sublayer, layer, prompt]`` at each prompt's last position and the input drift ``[layer,
    prompt]`` (the last real token: ``lengths - 1``, right padding), from TransformerLens caches alone: the
    compressed block fed the dense resid_pre (a hook replacing it)
    in local mode, the compressed model on its own in global mode; e = out_c - out_dense, delta = the dense update
    (attn_out, mlp_out, resid_post - resid_pre)."""
    n = model.cfg.n_layers
    rows = torch.arange(len(tokens))
    last = torch.full((len(tokens),), tokens.shape[1] - 1) if lengths is None else lengths - 1
    names = [
        f"blocks.{layer}.{h}"
        for layer in range(n)
        for h in ("hook_resid_pre", "hook_attn_out", "hook_mlp_out", "hook_resid_post")
    ]
    with torch.inference_mode():
        _, dense = model.run_with_cache(tokens, names_filter=names)
        caches = []
        if mode == "global":
            caches = [compressed.run_with_cache(tokens, names_filter=names)[1]] * n
        else:
            for layer in range(n):
                feed = dense[f"blocks.{layer}.hook_resid_pre"]
                hook = (f"blocks.{layer}.hook_resid_pre", lambda t, hook, feed=feed: feed.clone())
                with compressed.hooks(fwd_hooks=[hook]):
                    caches.append(compressed.run_with_cache(tokens, names_filter=names)[1])
    out = {k: np.zeros((3, n, len(tokens))) for k in ("par", "perp", "coef")}
    drift = np.zeros((n, len(tokens)))
    for layer in range(n):
        got = caches[layer]
        x = dense[f"blocks.{layer}.hook_resid_pre"][rows, last].double()
        pairs = [
            (
                got[f"blocks.{layer}.hook_{r}"][rows, last].double()
                - dense[f"blocks.{layer}.hook_{r}"][rows, last].double(),
                d,
            )
            for r, d in (
                ("attn_out", dense[f"blocks.{layer}.hook_attn_out"][rows, last].double()),
                ("mlp_out", dense[f"blocks.{layer}.hook_mlp_out"][rows, last].double()),
                ("resid_post", dense[f"blocks.{layer}.hook_resid_post"][rows, last].double() - x),
            )
        ]
        for j, (e, d) in enumerate(pairs):
            coef = (e * d).sum(-1) / (d * d).sum(-1)
            e_par = coef[:, None] * d
            out["par"][j, layer] = (e_par.norm(dim=-1) / d.norm(dim=-1)).numpy()
            out["perp"][j, layer] = ((e - e_par).norm(dim=-1) / d.norm(dim=-1)).numpy()
            out["coef"][j, layer] = coef.numpy()
        x_c = got[f"blocks.{layer}.hook_resid_pre"][rows, last].double()
        drift[layer] = ((x_c - x).norm(dim=-1) / x.norm(dim=-1)).numpy()
    return out | {"drift": drift}


@pytest.mark.parametrize("spec", ["toy-llama", "toy-gpt2"])
def test_local_and_global_modes_and_the_block_against_an_independent_computation(spec):
    """Every sublayer's and the whole block's errors equal a computation from TransformerLens caches alone, in both
    modes. Local: every block's input is the dense one bit for bit (drift exactly 0). Global: the first compressed
    layer's errors equal local mode's, later layers' differ (errors compound), and the drift grows from 0."""
    model = get_model(spec)
    toks = _tokens(model, n=3, seq=16)
    compressed = compress(model, "int4-g16")
    results = {}
    for mode in ("local", "global"):
        result = compression_error(model, toks, method="int4-g16", mode=mode, scored="last")
        results[mode] = result
        expected = _independent_errors(model, compressed, toks, mode)
        for field in ("par", "perp", "coef"):
            np.testing.assert_allclose(getattr(result, field)[0], expected[field], rtol=2e-4, atol=1e-6, err_msg=field)
        np.testing.assert_allclose(result.input_drift[0], expected["drift"], rtol=1e-4, atol=1e-7)
        assert result.mode == mode and mode in result.figure(sublayer="block").layout.title.text
        inner = result.figure(sublayer="block", drop_ends=True)  # the paper's Fig. 6 leaves out the end layers
        line = next(t for t in inner.data if t.mode == "lines+markers")  # the mean line, not its band
        assert list(line.x) == list(result.layers[1:-1]) and "first and last left out" in inner.layout.title.text
    local, glob = results["local"], results["global"]
    assert (local.input_drift == 0).all()  # the dense input, bit for bit
    assert (glob.input_drift[0, 0] == 0).all() and (glob.input_drift[0, 1:] > 1e-4).all()
    for field in ("par", "perp", "coef"):
        np.testing.assert_allclose(getattr(glob, field)[:, :, 0], getattr(local, field)[:, :, 0], rtol=1e-6)
        assert not np.allclose(getattr(glob, field)[:, :, -1], getattr(local, field)[:, :, -1], rtol=1e-3)
    # in a sequential block the block's error is the attention's plus the MLP's (local mode, last position)
    np.testing.assert_allclose(local.coef[0, 2], _block_coef(model, compressed, toks), rtol=2e-4, atol=1e-6)


def _block_coef(model, compressed, tokens) -> np.ndarray:
    """e . delta / |delta|^2 of the block with e = e_attn + e_mlp and delta = attn_out + mlp_out (dense), each
    compressed block fed the dense input: the sum of the sublayers' errors, for a sequential block."""
    n = model.cfg.n_layers
    coefs = np.zeros((n, len(tokens)))
    with torch.inference_mode():
        _, dense = model.run_with_cache(tokens)
        for layer in range(n):
            feed = dense[f"blocks.{layer}.hook_resid_pre"]
            hook = (f"blocks.{layer}.hook_resid_pre", lambda t, hook, feed=feed: feed.clone())
            with compressed.hooks(fwd_hooks=[hook]):
                _, got = compressed.run_with_cache(tokens)
            a_d, m_d = (dense[f"blocks.{layer}.hook_{r}"][:, -1].double() for r in ("attn_out", "mlp_out"))
            a_c, m_c = (got[f"blocks.{layer}.hook_{r}"][:, -1].double() for r in ("attn_out", "mlp_out"))
            e, d = (a_c - a_d) + (m_c - m_d), a_d + m_d
            coefs[layer] = ((e * d).sum(-1) / (d * d).sum(-1)).numpy()
    return coefs


def test_a_saved_compressed_checkpoint_equals_the_in_place_method(tmp_path):
    """compressed= a folder holding the same compression gives exactly the in-place method's numbers; another
    architecture, another tokenizer, or both method= and compressed= are refused in one line."""
    model = get_model("toy-llama")
    toks = _tokens(model, n=3, seq=16)
    folder = tmp_path / "int8"
    copy = compress(model, "int8")
    export_hf_model(copy.original_model).save_pretrained(folder)
    model.tokenizer.save_pretrained(folder)
    in_place = compression_error(model, toks, method="int8", progress=False)
    loaded = compression_error(model, toks, compressed=str(folder), progress=False)
    for field in ("par", "perp", "coef", "input_drift", "delta_loss"):
        assert np.array_equal(getattr(loaded, field), getattr(in_place, field), equal_nan=True), field
    assert loaded.methods == (str(folder),) and loaded.provenance.settings["compressed"] == str(folder)
    with pytest.raises(ValueError, match=r"is not toy-llama's architecture: its config differs in"):
        compression_error(model, toks, compressed=get_model("toy-qwen3"))
    other_tok = tmp_path / "other-tokenizer"
    export_hf_model(copy.original_model).save_pretrained(other_tok)
    vocab = model.tokenizer.get_vocab()
    other = next(t for t in map(load_bundled_tokenizer, BUNDLED_TOKENIZERS) if t.get_vocab() != vocab)
    other.save_pretrained(other_tok)
    with pytest.raises(ValueError, match="has another tokenizer than toy-llama"):
        compression_error(model, toks, compressed=str(other_tok))
    with pytest.raises(ValueError, match=r"give either method= \(compress a copy\) or compressed="):
        compression_error(model, toks, compressed=str(folder), method="int8")


def _reference_sequential_wanda(hf, tokens, sparsity: float):
    """Wanda layer by layer, written out: for each block in order, a full forward of the model as pruned so far with
    pre-hooks summing x^2 of each of the block's linear inputs, then each output row's lowest-scoring
    ``sparsity`` fraction (score |w| sqrt(sum x^2), sorted) set to 0."""
    blocks: dict[int, list] = {}
    for name, module in block_linears(hf):
        blocks.setdefault(int(name.split(".")[2]), []).append(module)
    sums: dict = {}

    def add(module, args):
        sums[module] = sums.get(module, 0) + (args[0].double() ** 2).sum((0, 1))

    for index in sorted(blocks):
        sums.clear()
        handles = [m.register_forward_pre_hook(add) for m in blocks[index]]
        with torch.no_grad():
            hf(tokens)
        for h in handles:
            h.remove()
        with torch.no_grad():
            for m in blocks[index]:
                w = _as_out_in(m)
                score = w.abs().double() * sums[m].sqrt()[None, :]
                k = int(w.shape[1] * sparsity)
                order = score.argsort(dim=1)
                keep = torch.ones_like(w, dtype=torch.bool)
                keep.scatter_(1, order[:, :k], False)
                new = w * keep
                if isinstance(m, torch.nn.Linear):
                    m.weight.copy_(new)
                else:
                    m.weight.copy_(new.T)


def test_sequential_wanda_equals_a_layer_by_layer_reference_and_differs_from_one_pass():
    model = get_model("toy-llama")
    calib = _tokens(model, n=4, seq=16)
    seq, ref, one = (export_hf_model(model.original_model) for _ in range(3))
    Compression.parse("wanda-seq-50%").apply(seq, calib)
    _reference_sequential_wanda(ref, calib, 0.5)
    Compression.parse("wanda-50%").apply(one, calib)
    masks = {}
    for (name, a), (_, b), (_, c) in zip(block_linears(seq), block_linears(ref), block_linears(one), strict=True):
        assert torch.equal(_as_out_in(a) != 0, _as_out_in(b) != 0), name  # the same masks as the reference
        torch.testing.assert_close(_as_out_in(a), _as_out_in(b), rtol=0, atol=0)
        masks[name] = bool(torch.equal(_as_out_in(a) != 0, _as_out_in(c) != 0))
    first = [name for name in masks if ".layers.0." in name]
    later = [name for name in masks if ".layers.0." not in name]
    assert all(masks[name] for name in first)  # layer 0's inputs are the dense model's either way
    assert not all(masks[name] for name in later)  # later inputs come from pruned layers: other masks


@pytest.mark.parametrize("spec", ["wanda-seq-50%", "torchao-awq-int8"])
def test_wanda_seq_and_awq_calibrate_apart_from_the_prompts_by_default(spec):
    model = get_model("toy-llama")
    toks = _tokens(model, n=3, seq=16)
    default = compression_error(model, toks, method=spec, progress=False)
    on_prompts = compression_error(model, toks, method=spec, calibration=toks, progress=False)
    assert "apart" in default.provenance.settings["calibration"]
    assert not np.allclose(default.perp, on_prompts.perp, equal_nan=True)


def test_the_papers_prompt_protocol_scores_each_ragged_prompts_last_token():
    """compression_prompts: 12 prompts, the authors' two defaults first, no boundary token, ragged lengths; under
    the directional-decomposition protocol each prompt is scored at its own last real token."""
    model = get_model("toy-llama")
    prompts = compression_prompts(model)
    assert len(prompts) == 12 and len(set(prompts.lengths.tolist())) > 1
    texts = [model.tokenizer.decode(prompts.tokens[i, : prompts.lengths[i]]) for i in range(12)]
    assert texts[:2] == list(AUTHORS_PROMPTS)
    boundary = boundary_token(model.tokenizer)[1]
    assert all(int(prompts.tokens[i, 0]) != boundary for i in range(12))
    assert int(compression_prompts(model, max_tokens=8).lengths.max()) == 8
    result = compression_error(model, prompts, protocol="directional-decomposition", method="int4-g16", progress=False)
    assert result.positions == "last" and result.mode == "local"
    expected = _independent_errors(model, compress(model, "int4-g16"), prompts.tokens, "local", prompts.lengths)
    for field in ("par", "perp", "coef"):
        np.testing.assert_allclose(getattr(result, field)[0], expected[field], rtol=2e-4, atol=1e-6, err_msg=field)


def _assert_forward(compressed, *, equals, differs_from, by: float) -> None:
    """The compressed bridge's logits equal those of ``equals`` (a plain Hugging Face model) to 1e-4 and differ from
    those of ``differs_from`` (a bridge) by more than ``by`` somewhere: its forward runs the weights under test."""
    tokens = _tokens(compressed, n=2, seq=12)
    with torch.inference_mode():
        got = compressed(tokens, return_type="logits")
        reference = equals(tokens).logits
        other = differs_from(tokens, return_type="logits")
    torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)
    assert (got - other).abs().max() > by


@pytest.mark.parametrize(
    ("spec", "block", "qmin", "qmax"), [("torchao-int8", None, -128, 127), ("torchao-intx4-g16", 16, -8, 7)]
)
def test_torchao_weights_are_its_quantized_tensors_and_the_forward_uses_them(spec, block, qmin, qmax):
    """Each block linear keeps its nn.Linear with torchao's quantized tensor subclass as the weight, whose values
    equal torchao's own quantize-dequantize primitives of the dense weight; the compressed forward equals the forward
    with those dequantized weights in plain tensors, and differs from the dense one."""
    from torchao.quantization import Int8Tensor
    from torchao.quantization.quant_primitives import (
        MappingType,
        choose_qparams_affine,
        dequantize_affine,
        quantize_affine,
    )
    from torchao.quantization.quantize_.workflows import IntxUnpackedToInt8Tensor

    model = get_model("toy-llama")
    compressed = compress(model, spec)
    dense = dict(block_linears(export_hf_model(model.original_model)))
    plain = export_hf_model(model.original_model)
    subclass = Int8Tensor if spec == "torchao-int8" else IntxUnpackedToInt8Tensor
    for (name, module), (_, into) in zip(block_linears(compressed.original_model), block_linears(plain), strict=True):
        assert type(module) is torch.nn.Linear and isinstance(module.weight, subclass), name
        w = dense[name.replace("._original_component", "")].weight.detach()
        size = (1, block or w.shape[1])
        scale, zp = choose_qparams_affine(w, MappingType.SYMMETRIC, size, torch.int8, quant_min=qmin, quant_max=qmax)
        q = quantize_affine(w, size, scale, zp, torch.int8, quant_min=qmin, quant_max=qmax)
        expected = dequantize_affine(q, size, scale, zp, torch.int8, quant_min=qmin, quant_max=qmax)
        assert torch.equal(module.weight.dequantize(), expected), name
        with torch.no_grad():
            into.weight.copy_(expected)
    _assert_forward(compressed, equals=plain, differs_from=model, by=1e-3)


def test_torchao_refusals_are_one_line():
    with pytest.raises(
        ValueError, match=r"torchao's quantize_ takes nn.Linear layers, and this model's blocks use GPT-2's Conv1D"
    ):
        compress(get_model("toy-gpt2"), "torchao-int8")
    with pytest.raises(ValueError, match=r"runs on CUDA only and this model is on cpu; on CPU use torchao-intx4-g128"):
        compress(get_model("toy-llama"), "torchao-int4-g128")
    with pytest.raises(ValueError, match=r"torchao's groups must divide every input width, and this model has widths"):
        compress(get_model("toy-llama"), "torchao-intx4-g64")  # widths 96, 192
    with pytest.raises(ValueError, match=r"torchao's intx takes 1..8 bits, got 9"):
        Compression.parse("torchao-intx9-g32")
    assert Compression.parse("torchao-intx4-g128").name == "torchao-intx4-g128"


def _linear_inputs(hf, tokens) -> dict:
    """Each block linear's input over ``tokens`` (one forward of ``hf``), flattened to [tokens, d_in]."""
    inputs: dict = {}

    def keep(module, args, *, name):
        inputs[name] = args[0].reshape(-1, args[0].shape[-1])

    handles = [m.register_forward_pre_hook(partial(keep, name=name)) for name, m in block_linears(hf)]
    with torch.no_grad():
        hf(tokens, use_cache=False)
    for h in handles:
        h.remove()
    return inputs


def test_torchao_awq_equals_torchaos_own_recipe_and_never_raises_the_output_error():
    """torchao-awq-int8 gives bit for bit the weights of torchao's own AWQ recipe (observe the whole model, then
    convert it): Int8Tensor weights carrying the activation pre-scale 1/s, which the compressed forward uses. The
    searched scale includes s = 1 (plain int8), so on the calibration inputs every linear's output error is at most
    torchao-int8's, and smaller in total."""
    from torchao.prototype.awq import AWQConfig
    from torchao.quantization import Int8Tensor, Int8WeightOnlyConfig, quantize_

    model = get_model("toy-llama")
    calib = _tokens(model, n=4, seq=24)
    awq = compress(model, "torchao-awq-int8", calibration=calib)
    plain = compress(model, "torchao-int8")
    reference = export_hf_model(model.original_model)
    dense = dict(block_linears(export_hf_model(model.original_model)))
    inputs = _linear_inputs(export_hf_model(model.original_model), calib)
    names = set(dense)
    quantize_(reference, AWQConfig(Int8WeightOnlyConfig(), step="prepare"), filter_fn=lambda _, fqn: fqn in names)
    with torch.no_grad():
        reference(calib, use_cache=False)
    quantize_(reference, AWQConfig(Int8WeightOnlyConfig(), step="convert"), filter_fn=lambda _, fqn: fqn in names)
    errors = {"awq": 0.0, "plain": 0.0}
    triples = zip(
        block_linears(awq.original_model), block_linears(plain.original_model), block_linears(reference), strict=True
    )
    for (name, got), (_, rtn), (ref_name, ref) in triples:
        assert name.replace("._original_component", "") == ref_name
        w = got.weight
        assert type(got) is torch.nn.Linear and isinstance(w, Int8Tensor) and w.act_pre_scale is not None, name
        for part in ("qdata", "scale", "act_pre_scale"):
            assert torch.equal(getattr(w, part), getattr(ref.weight, part)), (name, part)
        x = inputs[ref_name]
        with torch.no_grad():
            exact = torch.nn.functional.linear(x, dense[ref_name].weight)
            awq_err = (torch.nn.functional.linear(x, w) - exact).pow(2).sum().item()
            rtn_err = (torch.nn.functional.linear(x, rtn.weight) - exact).pow(2).sum().item()
        assert awq_err <= rtn_err * (1 + 1e-5), name
        errors["awq"] += awq_err
        errors["plain"] += rtn_err
    assert errors["awq"] < errors["plain"], errors  # random toy weights have no salient channels: ~5% here
    _assert_forward(awq, equals=reference, differs_from=plain, by=1e-4)  # the pre-scaled weights are used


def test_torchao_awq_names_and_refusals():
    assert Compression.parse("torchao-awq-int8").name == "torchao-awq-int8"
    assert Compression.parse("torchao-awq-int4-g128").name == "torchao-awq-int4-g128"
    assert Compression.parse("torchao-int4-g64").name == "torchao-int4-g64"
    assert Compression.parse("torchao-awq-int8").calibrated_apart
    assert not Compression.parse("wanda-50%").calibrated_apart
    model = get_model("toy-llama")
    with pytest.raises(ValueError, match=r"^torchao-awq-int8 needs calibration tokens \(calibration=\)"):
        compress(model, "torchao-awq-int8")
    calib = _tokens(model, n=1, seq=8)
    with pytest.raises(ValueError, match=r"runs on CUDA only and this model is on cpu; on CPU use torchao-awq-int8"):
        compress(model, "torchao-awq-int4-g32", calibration=calib)
    with pytest.raises(ValueError, match=r"torchao's quantize_ takes nn.Linear layers"):
        compress(get_model("toy-gpt2"), "torchao-awq-int8", calibration=calib)
    with pytest.raises(ValueError, match=r"unknown compression 'torchao-awq-intx4-g32'; accepted forms: .*awq"):
        Compression.parse("torchao-awq-intx4-g32")
