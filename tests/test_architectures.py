"""The support matrix (:mod:`lens_parallel.support`, ``docs/guides/architectures.md``): a toy of every architecture
lens_parallel knows, built from its own config, checked against TransformerLens's own eager hooks and Hugging Face.

Each row of the guide's table is what its toy gives (layers, features, attention path, status); a refused row's toy
is refused in one line saying why; every other row's claims hold: decompose in every space equals the statistics of
TransformerLens's hooks, the diagonal view's pattern is hook_pattern, a head zeroed by HeadEdit is a head whose
hook_z is zeroed, a no-op edit's loss is Hugging Face's, greedy generation is Hugging Face's ``generate``, the null
and GQA analyses run (or say why not), and a loglikelihood task runs."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import lens_parallel as lp
from lens_parallel import architectures, support
from lens_parallel.attention import attention_path
from lens_parallel.attention.features import Alibi
from lens_parallel.errors import LensParallelError
from lens_parallel.models import ModelSpecError, model_info, toy_folder
from lens_parallel.tokenizers import hf_tokenizer

from .conftest import LINEAR_VALUE_NOISE, get_model, noisy_linear_value
from .references import decompose_reference

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "architectures.md"
MODEL_TYPES = support.matrix_model_types()
TOKENS = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
PROMPT = "The capital of France is"


def test_the_guide_lists_every_architecture_once_and_the_features_as_defined():
    rows = support.read_matrix(GUIDE.read_text())
    assert list(rows) == list(MODEL_TYPES)
    assert set(MODEL_TYPES) | set(architectures.EXCLUDED) == set(architectures.bridged_causal_lms())
    assert set(architectures.REFUSED) <= set(MODEL_TYPES)
    guide = GUIDE.read_text()
    assert support.features_markdown() in guide, "python scripts/architecture_matrix.py rewrites the guide's tables"


def _load(spec: str):
    """The toy of ``spec``, loaded once per test process (:func:`tests.conftest.get_model`): the matrix row and the
    decoding tests read the same toys, and no test here changes one."""
    return get_model(spec)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _check_decompose(model, info) -> None:
    result = lp.decompose(model, TOKENS, space="all", progress=False)
    reference = decompose_reference(model, TOKENS)
    got = {(t.space, t.level, layer): (t, i) for t in result.tables for i, layer in enumerate(t.layers)}
    assert set(got) == set(reference)
    for key, expected in reference.items():
        table, i = got[key]
        n = info.output_heads(key[2]) if key[1] == "head" else 1
        noisy = noisy_linear_value(info, key[0], key[2])
        tol = {"rtol": LINEAR_VALUE_NOISE, "atol": LINEAR_VALUE_NOISE} if noisy else {"atol": 1e-6, "rtol": 0}
        for stat in ("self_cos", "self_cos_std", "par_frac", "perp_frac", "par_coef"):
            scale = 1.0 if stat != "par_coef" else max(1.0, float(expected[stat].abs().max()))  # a coefficient
            got_stat, want = getattr(table, stat)[i, :n] / scale, expected[stat].numpy() / scale
            np.testing.assert_allclose(got_stat, want, err_msg=f"{key} {stat}", **tol)


def _check_heads(model, info) -> None:
    layer = info.softmax_layers[-1]
    view = lp.diagonal_view(model, TOKENS, layer=layer, head=0, space="value", progress=False)
    with torch.inference_mode():
        _, cache = model.run_with_cache(TOKENS)
    np.testing.assert_allclose(view.pattern, cache[f"blocks.{layer}.attn.hook_pattern"][0, 0].numpy(), atol=1e-5)

    def zero(z, hook):
        z = z.clone()
        z[:, :, 0] = 0.0
        return z

    with torch.inference_mode():
        hooked = model.run_with_hooks(TOKENS, return_type="loss", fwd_hooks=[(f"blocks.{layer}.attn.hook_z", zero)])
    edited = lp.evaluate(model, TOKENS, lp.HeadEdit("zero", layer, [0]))
    assert _rel(edited.loss_edited, float(hooked)) < 1e-5 and edited.delta_loss != 0.0
    diagonal = lp.ZeroDiagonal(layers=[layer])
    if layer in info.patterns_after:  # an edit of the pattern would change nothing there: refused
        with pytest.raises(LensParallelError, match="fires hook_pattern after the attention has run"):
            lp.evaluate(model, TOKENS, diagonal)
    else:
        assert abs(lp.evaluate(model, TOKENS, diagonal).delta_loss) > 1e-6


def _check_against_hugging_face(model, spec: str, info) -> None:
    hf = AutoModelForCausalLM.from_pretrained(toy_folder(spec), dtype=torch.float32).eval()
    with torch.inference_mode():
        loss = float(hf(TOKENS, labels=TOKENS).loss)
    noop = lp.evaluate(model, TOKENS, lp.ComponentScale("residual-block", s_par=1.0))
    assert _rel(noop.loss_noop, loss) < 1e-5 and noop.delta_loss == 0.0
    encoded = hf_tokenizer(model)(PROMPT, return_tensors="pt")
    eos = hf.generation_config.eos_token_id
    ends = eos if isinstance(eos, list) else [eos]
    with torch.inference_mode():
        out = hf.generate(**encoded, max_new_tokens=6, do_sample=False, pad_token_id=ends[0])
    expected = out[0, encoded["input_ids"].shape[1] :].tolist()
    expected = expected[: next((i for i, t in enumerate(expected) if t in ends), len(expected))]
    assert list(lp.generate(model, PROMPT, max_new_tokens=6, progress=False).tokens[0][0]) == expected


def _check_nulls(model, info) -> None:
    null = lp.causal_null(model, TOKENS, progress=False)  # its gate: hook_z reproduced by A v (and the gate)
    assert null.reconstruction_error < 1e-4 and np.isfinite(null.summary()["excess"]).all()
    if lp.analyses.nulls.is_grouped(info):
        assert np.isfinite(lp.gqa_alignment(model, TOKENS, progress=False).summary()["within_excess"]).all()
    else:
        with pytest.raises(LensParallelError, match="contrast is undefined"):
            lp.gqa_alignment(model, TOKENS, progress=False)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_the_matrix_row_holds(model_type):
    expected = support.read_matrix(GUIDE.read_text())[model_type]
    spec = support.toy_of(model_type)
    if expected.refused:
        with pytest.raises(ModelSpecError) as refused:
            _load(spec)
        assert expected.status.removeprefix("refused: ") in str(refused.value) and "\n" not in str(refused.value)
        assert support.support_row(model_type) == expected
        return
    model = _load(spec)
    info = model_info(model)
    assert support.support_row(model_type, model) == expected
    _check_decompose(model, info)
    _check_against_hugging_face(model, spec, info)
    if info.softmax_layers:
        _check_heads(model, info)
    if info.head_layers:
        _check_nulls(model, info)
    else:  # the residual spaces only: whatever is built on heads says so in one line
        for run in (
            lambda: lp.causal_null(model, TOKENS, progress=False),
            lambda: lp.run_battery(model, TOKENS, progress=False),
            lambda: lp.explore(model, TOKENS),
        ):
            with pytest.raises(LensParallelError, match=r"needs heads.*but no layer of") as refused:
                run()
            assert "\n" not in str(refused.value)
    edit = lp.ComponentScale("value" if info.head_layers else "residual-block", s_par=0.5)
    tasks = lp.task_effects(model, {"half": edit}, [("copa", 0)], limit=2, progress=False)
    assert np.isfinite(tasks.values["copa|acc"]).all()


DECODING = (
    *("toy-mistral", "toy-gemma2", "toy-gpt-oss", "toy-mixtral", "toy-bloom"),
    *("toy-opt", "toy-gptj", "toy-llama4-text", "toy-jamba", "toy-gpt-neo", "toy-olmo3"),
)
"""Features that reach decoding: a sliding window shorter than prompt + continuation (Mistral), soft caps and
alternating windows (Gemma 2), sinks on the eager path (gpt-oss), routing (Mixtral: the router reads the edited
residual at every step), ALiBi (Bloom), learned positions at an offset (OPT), and the attention-interface route
(OPT, GPT-J, Llama 4's chunked attention, Jamba beside its Mamba layers' own cache; OLMo 3's norms before the head
split and sliding windows, through its module); GPT-Neo's bridge, which fires the pattern after the attention, keeps
TransformerLens's forward."""
DECODING_EDITS = {
    "value s_par=0": lp.ComponentScale("value", s_par=0.0),
    "zero diagonal": lp.ZeroDiagonal(),
    "residual-block": lp.ComponentScale("residual-block", s_par=0.5),
}


PATTERN_AFTER = ("toy-gpt-neo",)
"""Of :data:`DECODING`, the toys whose bridge fires hook_pattern after the attention (ZeroDiagonal refused there)."""


@pytest.mark.parametrize(
    ("spec", "name"),
    [(s, n) for s in DECODING for n in DECODING_EDITS if not (n == "zero diagonal" and s in PATTERN_AFTER)],
)
def test_cached_generation_under_an_edit_equals_recomputing_on_every_feature(spec, name, monkeypatch):
    """The key/value cache (and a Mamba layer's state) under an edit gives each step's logits as a whole-sequence
    forward does, past a sliding window, with sinks, soft caps and routing."""
    from lens_parallel.edits import compile_hooks

    from .test_generation import _cached, _recomputed

    model = _load(spec)
    assert bool(model_info(model).patterns_after) == (spec in PATTERN_AFTER)
    hooks = compile_hooks(model, DECODING_EDITS[name])
    prompt = hf_tokenizer(model).encode(PROMPT)
    assert len(prompt) + 6 > 8  # past the toys' window of 8
    tokens, logits = _cached(model, prompt, hooks, 6, monkeypatch)
    expected, expected_logits = _recomputed(model, prompt, hooks, 6)
    assert tokens == expected
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
    assert not torch.equal(expected_logits, _recomputed(model, prompt, [], 6)[1])  # the edit changes something


def test_zero_diagonal_with_sinks_masks_the_self_key_and_keeps_the_sink():
    """gpt-oss's sinks: a pattern row sums to 1 - sink. ZeroDiagonal divides the rest of the row by 1 - A_tt, which
    is the softmax with the query's own key masked out and the sink kept in it (the sink's share grows in
    proportion): equal to a forward whose own-key scores are -inf (TransformerLens's scores hook, before the sink
    joins the softmax), for every query after the first."""
    model = _load("toy-gpt-oss")
    with torch.inference_mode():
        _, cache = model.run_with_cache(TOKENS)
    sums = cache["blocks.0.attn.hook_pattern"].sum(-1)
    assert (sums < 1 - 1e-3).all()  # the sink takes a share of every row

    def mask_self(scores, hook):
        n = scores.shape[-1]
        own = torch.eye(n, dtype=torch.bool)
        own[0, 0] = False  # position 0 sees only itself: left as it is
        return scores.masked_fill(own, float("-inf"))

    n_layers = model_info(model).n_layers
    hooks = [(f"blocks.{layer}.attn.hook_attn_scores", mask_self) for layer in range(n_layers)]
    with torch.inference_mode():
        masked = float(model.run_with_hooks(TOKENS, return_type="loss", fwd_hooks=hooks))
    zeroed = lp.evaluate(model, TOKENS, lp.ZeroDiagonal())
    assert _rel(zeroed.loss_edited, masked) < 1e-5
    assert abs(zeroed.delta_loss) > 1e-3  # against the unedited model: the edit does something
    # the diagonal form adds dA_tt v_t whatever a row sums to (the sink holds no value): the parallel scaling itself
    diagonal = lp.evaluate(model, TOKENS, lp.DiagonalEdit("value", s_par=0.0))
    scaled = lp.evaluate(model, TOKENS, lp.ComponentScale("value", s_par=0.0))
    assert _rel(diagonal.loss_edited, scaled.loss_edited) < 1e-5 and abs(scaled.delta_loss) > 1e-3


SCORES_AFTER_SOFTMAX = dict.fromkeys(
    ("gptj", "jamba", "jetmoe", "llama4_text", "modernbert-decoder", "nanochat", "olmo_hybrid", "opt"),
    "TransformerLens's generic AttentionBridge fires hook_attn_scores with the softmaxed weights its module returns "
    "(its hook_attn_scores equals its hook_pattern); lens_parallel's attention fires the scores",
)
"""Rows whose untouched bridge's ``hook_attn_scores`` is wrong, and lens_parallel's right (GPT-Neo's and XGLM's are
wrong too, and stay so: their layers keep TransformerLens's forward)."""
_DROPPED_CACHE = (
    "TransformerLens's cached generate drops the key/value cache that transformers 5 hands its attention as cache= "
    "(each new token attends to itself alone); on the analysed bridge the Hugging Face module keeps its cache, or the "
    "joint-QKV route hands it on"
)
GENERATE_WRONG = dict.fromkeys(
    (
        *("apertus", "arcee", "cohere", "cohere2", "ernie4_5", "exaone4", "falcon_h1", "flex_olmo", "gemma2"),
        *("gemma3_text", "glm", "glm4", "glm4_moe", "gpt_oss", "granite", "granitemoe", "granitemoehybrid"),
        *("hunyuan_v1_dense", "jais2", "llama", "minimax_m2", "ministral3", "mistral", "mixtral", "mpt", "nemotron"),
        *("olmo", "olmo2", "olmo3", "olmoe", "phi", "phi3", "qwen2", "qwen2_moe", "qwen3_moe", "qwen3_next"),
        *("seed_oss", "smollm3", "stablelm"),
    ),
    _DROPPED_CACHE,
) | {"bamba": _DROPPED_CACHE + "; its uncached generate is wrong too"}
"""Rows whose untouched bridge's greedy ``generate`` gives other tokens than Hugging Face's ``generate`` on the same
token ids, and the analysed bridge's equals Hugging Face's."""
GENERATE_LEFT = {
    "qwen3_5_moe_text": "TransformerLens's linear-attention bridge takes Hugging Face's cached path only for a cache "
    "handed as cache_params, which lens_parallel's attention (the softmax layers) does not route; lp.generate equals "
    "Hugging Face's (test_the_matrix_row_holds)",
    "olmo_hybrid": "TransformerLens's generate fails to build the model's cache (an ImportError) on either bridge",
}
"""Rows whose generate TransformerLens gets wrong (or cannot run) on the analysed bridge as on the untouched one."""


def _tl_generate(model, tokens):
    """TransformerLens's greedy generate of 6 tokens after ``tokens`` (or the name of what it raised)."""
    try:
        with torch.inference_mode():
            out = model.generate(tokens, max_new_tokens=6, do_sample=False, verbose=False, stop_at_eos=False)
    except Exception as error:  # TransformerLens's own failure: compared between the two bridges
        return type(error).__name__
    return out[0, tokens.shape[1] :].tolist()


@pytest.mark.parametrize(
    "model_type", [t for t, row in support.read_matrix(GUIDE.read_text()).items() if not row.refused]
)
def test_transformer_lens_answers_as_before_after_an_analysis(model_type):
    """After an analysis, TransformerLens's own calls on the user's bridge (run_with_cache, run_with_hooks with an
    edit of hook_z and a reader of hook_pattern, generate) give what an untouched bridge of the same weights gives,
    except on the rows named above, where TransformerLens's own is wrong and the analysed bridge's equals Hugging
    Face's (or both are wrong alike)."""
    from transformer_lens.model_bridge import TransformerBridge

    spec = support.toy_of(model_type)
    model = _load(spec)
    info = model_info(model)
    lp.decompose(model, TOKENS, space="value" if info.head_layers else "residual-block", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bare = TransformerBridge.boot_transformers(str(toy_folder(spec)), device="cpu", dtype=torch.float32).eval()
    with torch.inference_mode():
        got, want = dict(model.run_with_cache(TOKENS)[1].items()), dict(bare.run_with_cache(TOKENS)[1].items())
    assert set(got) == set(want)
    for name, value in want.items():
        if name.endswith("hook_attn_scores") and model_type in SCORES_AFTER_SOFTMAX:
            pattern = name.replace("hook_attn_scores", "hook_pattern")
            torch.testing.assert_close(value, want[pattern])  # TransformerLens's: the weights
            torch.testing.assert_close(torch.softmax(got[name], -1), got[pattern])  # lens_parallel's: the scores
            continue
        scale = max(1.0, float(value.abs().max()))
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5 * scale, msg=name)
    if info.softmax_layers:
        layer, seen = info.softmax_layers[-1], {}

        def zero(z, hook):
            return torch.cat([torch.zeros_like(z[:, :, :1]), z[:, :, 1:]], dim=2)

        def read(pattern, hook):
            seen.setdefault(hook.name, []).append(pattern.clone())

        for hooks in ([(f"blocks.{layer}.attn.hook_z", zero)], [(f"blocks.{layer}.attn.hook_pattern", read)]):
            with torch.inference_mode():
                edited, untouched = (
                    model.run_with_hooks(TOKENS, fwd_hooks=hooks),
                    bare.run_with_hooks(TOKENS, fwd_hooks=hooks),
                )
            torch.testing.assert_close(edited, untouched, rtol=0, atol=1e-5, msg=str(hooks))
        (ours, theirs), *_ = seen.values()
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    tokens = model.to_tokens(PROMPT)
    generated, expected = _tl_generate(model, tokens), _tl_generate(bare, tokens)
    if model_type in GENERATE_WRONG or model_type in GENERATE_LEFT:
        hf = AutoModelForCausalLM.from_pretrained(toy_folder(spec), dtype=torch.float32).eval()
        with torch.inference_mode():
            out = hf.generate(
                tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=6, do_sample=False, eos_token_id=None
            )
        reference = out[0, tokens.shape[1] :].tolist()
        assert expected != reference, f"{model_type}: TransformerLens's generate is right here: unname the row"
        assert (generated == reference) == (model_type in GENERATE_WRONG)
    else:
        assert generated == expected


MODULE_ROUTE = {
    "toy-olmo2": "a query/key norm before the head split",
    "toy-hunyuan-v1-dense": "a query/key norm after rotary",
    "toy-cohere": "interleaved rotary",
    "toy-falcon-h1": "a key multiplier",
    "toy-ministral3": "llama-4 query scaling",
    "toy-smollm3": "a bridge subclass of TransformerLens's own",
    "toy-qwen3.5": "an output gate split off the query projection, between linear-attention layers",
    "toy-gemma2": "soft-capped scores and sliding windows",
}
"""One toy per reason a layer once kept TransformerLens's eager forward or lens_parallel's copy of its steps that
the route through its module now serves: the Hugging Face module makes its queries, keys and values (and gates its
output), lens_parallel computes the attention."""


@pytest.mark.parametrize("spec", MODULE_ROUTE)
def test_the_module_route_fires_every_hook_as_transformer_lens_does(spec):
    """On the route through the module, each hook point TransformerLens's own forward fires carries the same value
    (a bare bridge TransformerLens booted from the same folder is the reference), on the fused path (no hook on the
    pattern: hook_q, hook_k, hook_v, hook_z, hook_rot_q, hook_rot_k, hook_cos, hook_sin, hook_in, hook_out and every
    residual hook) and with a whole cache (a hook on a point the route does not fire, hook_q_normed, hook_q_gate, the
    norms' own, runs that layer on TransformerLens's forward); the logits are Hugging Face's."""
    from transformer_lens.model_bridge import TransformerBridge

    model = _load(spec)
    info = model_info(model)
    assert {info.attention_paths[layer] for layer in info.softmax_layers} == {"lens_parallel: the module's q, k, v"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bare = TransformerBridge.boot_transformers(str(toy_folder(spec)), device="cpu", dtype=torch.float32).eval()
    hf = AutoModelForCausalLM.from_pretrained(toy_folder(spec), dtype=torch.float32).eval()
    with torch.inference_mode():
        _, want = bare.run_with_cache(TOKENS)
        _, whole = model.run_with_cache(TOKENS)
        expected_logits = hf(TOKENS).logits
    assert set(whole) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(whole[name], value, rtol=0, atol=1e-5, msg=name)
    fused = {
        name
        for name in want
        if not name.endswith(("hook_pattern", "hook_attn_scores", "_normed", "hook_q_gate"))
        and not any(f"attn.{norm}." in name for norm in ("q_norm", "k_norm"))  # their modules see another layout
        and not (spec == "toy-hunyuan-v1-dense" and ".hook_rot_" in name)  # its rot hooks precede its norm
        and not (spec == "toy-falcon-h1" and name.endswith("attn.hook_k"))  # fired after its key multiplier
    }
    seen = {}

    def keep(name):
        def hook(tensor, hook):
            seen[name] = tensor.clone()

        return hook

    with torch.inference_mode(), lp.attention.recorded_paths() as paths:
        logits = model.run_with_hooks(TOKENS, fwd_hooks=[(name, keep(name)) for name in fused])
    assert paths == {"fused": len(info.softmax_layers)} and set(seen) == fused
    assert {name.split(".")[-1] for name in fused} >= {"hook_q", "hook_v", "hook_z", "hook_cos", "hook_attn_out"}
    for name in fused:  # fused and eager attention round differently: 1e-5 of the tensor's scale (Gemma's is ~5)
        scale = max(1.0, float(want[name].abs().max()))
        torch.testing.assert_close(seen[name], want[name], rtol=0, atol=1e-5 * scale, msg=name)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=1e-5)


def test_bloom_builds_no_square_mask_and_its_eager_forward_gets_eagers_back(monkeypatch):
    """Under lens_parallel, Bloom's Hugging Face model builds SDPA's masks (none for an unpadded batch, so no
    float32 square of the length, 1 GiB at 16k tokens; a boolean one with padding), and TransformerLens's own forward
    (the eager path: a whole-pattern hook) gets eager's additive square back: on every path the logits equal Hugging
    Face's eager forward, and the cached pattern is a distribution that hides the pads."""
    model = _load("toy-bloom")
    alibi = lp.attention.site_of(model.blocks[0].attn).spec.find(Alibi)
    read = type(alibi).bias
    handed: list[object] = []

    def spy(self, call, batch, n_key):
        mask = call.get("attention_mask")
        handed.append(None if mask is None else mask.dtype)
        return read(self, call, batch, n_key)

    monkeypatch.setattr(type(alibi), "bias", spy)
    hf = AutoModelForCausalLM.from_pretrained(toy_folder("toy-bloom"), dtype=torch.float32).eval()
    tokens = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(1))
    padded = torch.ones_like(tokens)
    padded[0, :5] = 0
    for mask in (None, padded):
        with torch.inference_mode():
            expected = hf(tokens, attention_mask=mask).logits
        live = torch.ones_like(tokens, dtype=torch.bool) if mask is None else mask.bool()
        for path in ("eager", "fused", "diagonal", "blocked"):
            handed.clear()
            with torch.inference_mode(), attention_path(path):
                got = model(tokens, attention_mask=mask)
            torch.testing.assert_close(got[live], expected[live], rtol=0, atol=2e-6, msg=f"{path}, mask={mask}")
            assert handed == ([] if path == "eager" else [None if mask is None else torch.bool] * 2)
    with torch.inference_mode():
        _, cache = model.run_with_cache(tokens, attention_mask=padded)
    pattern = cache["blocks.1.attn.hook_pattern"]
    torch.testing.assert_close(pattern[0, :, 5:].sum(-1), torch.ones(pattern.shape[1], 19), rtol=0, atol=1e-6)
    assert float(pattern[0, :, 5:, :5].abs().max()) == 0.0  # the pads hidden from every real query
