"""lens_parallel's own attention path (fused / blocked) against TransformerLens's eager attention: the same logits,
hook values, analyses and edits, on every toy family, padded documents and blocks that do not divide the length."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pandas as pd
import pytest
import torch
from transformer_lens.hook_points import HookPoint

from lens_parallel import attention, geometry
from lens_parallel.analyses.decompose import decompose
from lens_parallel.analyses.evaluate import evaluate
from lens_parallel.attention import ScoreSpec, attention_path, chosen_path, kernels, paths, routes, rows_hook
from lens_parallel.attention.features import Alibi, Feature, Sinks, SlidingWindow, SoftCap
from lens_parallel.attention.fused import diagonal_rows, fused
from lens_parallel.data import token_blocks
from lens_parallel.edits import ComponentScale, DiagonalEdit, ZeroDiagonal
from lens_parallel.errors import LensParallelError, LibraryError
from lens_parallel.models import model_info

from .conftest import LINEAR_VALUE_NOISE, get_model, noisy_linear_value

ATOL = 2e-5
"""Float32 logits of the toys (|logit| < 5): the paths sum the same products in another order."""

PATHS = ("fused", "blocked")
WATCHED = ("hook_q", "hook_k", "hook_v", "hook_z", "hook_attn_out")


def _tokens(model, n_docs: int = 2, seq_len: int = 29):
    return token_blocks(model, "austen", n_docs=n_docs, seq_len=seq_len).tokens


def _run(model, tokens, mask, path):
    captured: dict[str, torch.Tensor] = {}

    def keep(tensor, hook):
        captured[hook.name] = tensor.detach().clone()

    watched = [(name, keep) for name in model.hook_dict if name.rsplit(".", 1)[-1] in WATCHED]
    with attention_path(path, block_size=6), torch.inference_mode(), model.hooks(fwd_hooks=watched):
        logits = model(tokens, attention_mask=mask, return_type="logits")
    return logits, captured


def _assert_paths_match_eager(model, tokens, mask):
    """The logits at real positions and every watched hook of the fused and blocked paths equal eager's."""
    reference, hooks = _run(model, tokens, mask, "eager")
    real = mask.bool()
    for path in PATHS:
        logits, got = _run(model, tokens, mask, path)
        np.testing.assert_allclose(logits[real].numpy(), reference[real].numpy(), atol=ATOL, err_msg=path)
        assert got.keys() == hooks.keys() and len(got) >= len(WATCHED)
        for name, tensor in got.items():
            np.testing.assert_allclose(tensor.numpy(), hooks[name].numpy(), atol=ATOL, err_msg=f"{path} {name}")


@pytest.mark.parametrize("padded", [False, True])
def test_paths_reproduce_eager_logits_and_hooks(toy, padded):
    tokens = _tokens(toy)
    mask = torch.ones_like(tokens)
    if padded:
        mask[1, :7] = 0  # a left-padded row: its pads attend to nothing
    _assert_paths_match_eager(toy, tokens, mask)


def test_bridge_matches_hugging_face_on_the_fused_path():
    model = get_model("toy-qwen2")
    tokens = _tokens(model)
    with torch.inference_mode():
        ours = model(tokens, return_type="logits")
        hf = model.original_model(tokens).logits
    np.testing.assert_allclose(ours.numpy(), hf.numpy(), atol=ATOL)


def test_path_follows_the_hooks_attached():
    model = get_model("toy-llama")
    component = model.blocks[1].attn
    name = "blocks.1.attn.hook_pattern"

    def plain(tensor, hook):
        return None

    assert chosen_path(component).name == "fused"
    with model.hooks(fwd_hooks=[(name, rows_hook(plain))]):
        assert chosen_path(component).name == "blocked"
        with model.hooks(fwd_hooks=[(name, rows_hook(plain, diagonal=lambda rows, hook: None))]):
            assert chosen_path(component).name == "blocked"  # one hook without a diagonal form
    with model.hooks(fwd_hooks=[(name, rows_hook(plain, diagonal=lambda rows, hook: None))]):
        assert chosen_path(component).name == "diagonal"
        with attention_path("blocked"):
            assert chosen_path(component).name == "blocked"
        with model.hooks(fwd_hooks=[(name, plain)]):
            assert chosen_path(component).name == "eager"  # a user's hook sees the whole square
    with model.hooks(fwd_hooks=[("blocks.1.attn.hook_attn_scores", plain)]):
        assert chosen_path(component).name == "eager"
    with attention_path("eager"):
        assert chosen_path(component).name == "eager"
    with attention_path("diagonal"):  # hooked or not, every layer forms z alike (a sweep's forwards round alike)
        assert chosen_path(component).name == "diagonal"


def _spec(scale, n_heads, n_kv, *, window=None, sinks=None, softcap=None, extra=()):
    """A score spec of these features (each as a layer would have it recognised)."""
    found = (SlidingWindow(window) if window else None, Sinks(sinks) if sinks is not None else None)
    found += (SoftCap(softcap) if softcap else None, *extra)
    return ScoreSpec(scale, n_heads, n_kv, tuple(f for f in found if f is not None))


def _softmax_rows(q, k, v, mask, scale, sinks=None, softcap=None):
    """Float64 reference: A = softmax(scale q k^T + mask) (soft-capped, c tanh(scale q k^T / c) + mask; with
    ``sinks``: a column of logit b_h per head joins the softmax and is dropped), own weight, 1 - own weight, the
    other keys' output, z."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    n_query, n_key = q.shape[2], k.shape[2]
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        column = sinks.double()[None, :, None, None].expand(*scores.shape[:-1], 1)
        pattern = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1]
    else:
        pattern = torch.softmax(scores, -1)
    own = torch.arange(n_key - n_query, n_key)[:, None] == torch.arange(n_key)
    weight = geometry.self_weights(pattern)
    others = pattern.masked_fill(own, 0.0)
    return weight, 1 - weight, others @ v, pattern @ v


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["uncapped", "capped"])
@pytest.mark.parametrize("sinks", [None, torch.tensor([-1.0, 0.0, 0.5, 2.0, -3.0, 1.0])], ids=["plain", "sinks"])
@pytest.mark.parametrize("n_query", [31, 5, 1])
@pytest.mark.parametrize("mask_kind", ["causal", "padded", "window"])
def test_diagonal_rows_from_the_kernel_equal_the_softmax_rows(n_query, mask_kind, sinks, softcap):
    """A_tt, 1 - A_tt, sum_{s != t} A_ts v_s and z from the fused kernel's log-sum-exp equal the rows of an explicit
    float64 softmax: grouped heads, a padded row, a sliding window, queries fewer than keys (a decoding step), blocks
    of 7 queries (not dividing 31), attention sinks (a logit per head in the normaliser: rows sum to less than 1);
    with sinks, z from the kernel scaled by each row's sum (:meth:`Sinks.scaled`) too. Soft-capped scores (a cap of
    2, which every score of these reaches: tanh far from linear) come from the cap's own kernel
    (:meth:`SoftCap.blocks`) on both."""
    torch.manual_seed(0)
    n_key = 31
    q, k, v = torch.randn(2, 6, n_query, 8), torch.randn(2, 2, n_key, 8), torch.randn(2, 2, n_key, 8)
    allowed = torch.ones(2, 1, n_key, n_key, dtype=torch.bool).tril()
    if mask_kind == "padded":
        allowed[1, :, :, :4] = False  # row 1 left-padded: its first four queries see nothing
    if mask_kind == "window":
        allowed &= ~torch.ones(n_key, n_key, dtype=torch.bool).tril(-9)
    allowed = allowed[..., n_key - n_query :, :]
    given = None if mask_kind == "causal" else allowed
    window = 8 if mask_kind == "window" else None
    spec = _spec(0.4, 6, 2, window=window, sinks=sinks, softcap=softcap)
    with attention_path("auto", block_size=7):
        rows = diagonal_rows(q, k, v, given, spec)
        kernel = fused(q, k, v, given, spec)
    live = allowed.any(-1).expand(2, 6, n_query)
    expected = _softmax_rows(q, k, v, allowed, 0.4, sinks, softcap)
    got = (rows.weight, rows.others, rows.rest, rows.z)
    for name, value, reference in zip(("weight", "others", "rest", "z"), got, expected, strict=True):
        np.testing.assert_allclose(value[live].numpy(), reference[live].numpy(), atol=1e-6, err_msg=name)
    np.testing.assert_allclose(kernel[live].numpy(), expected[3][live].numpy(), atol=1e-6)
    assert rows.first_key == n_key - n_query and rows.dtype == torch.float32
    np.testing.assert_allclose((rows.weight + rows.others)[live].numpy(), 1.0, atol=1e-6)  # others = 1 - A_tt
    if sinks is not None:  # the sink holds weight and no value: each row's output shrinks
        plain = _softmax_rows(q, k, v, allowed, 0.4, softcap=softcap)[3]
        assert (expected[3][live].norm(dim=-1) < plain[live].norm(dim=-1)).all()
    if mask_kind == "padded" and n_query == n_key and sinks is None:  # a fully masked row: eager's uniform row
        np.testing.assert_allclose(rows.weight[1, :, :4].numpy(), 1 / n_key)
    if mask_kind == "padded" and n_query == n_key and sinks is not None:  # the sink takes a fully masked row
        assert rows.weight[1, :, :4].abs().max() < 1e-30 and kernel[1, :, :4].abs().max() < 1e-30


class _HandedBias(Alibi):
    """ALiBi as a block hands it in ``call`` (the bias and the mask), as Bloom's does."""

    def bias(self, call, batch, n_key):
        return call["bias"], call["attention_mask"]


@pytest.mark.parametrize("n_query", [31, 5])
@pytest.mark.parametrize("mask_kind", ["causal", "padded"])
def test_an_alibi_bias_rides_in_the_keys_on_every_path(n_query, mask_kind):
    """ALiBi's score term b_hs (a slope per head times the key's position, :meth:`Alibi.prepare`: one more column of
    the queries and keys): z on the fused, diagonal and blocked paths, the diagonal rows and the blocked pattern equal
    an explicit float64 softmax(scale q k^T + b + mask); Bloom's slopes, a left-padded row, a decoding step's 5
    queries, blocks of 7 queries."""
    torch.manual_seed(0)
    n_key, heads, scale = 31, 4, 0.4
    q, k, v = torch.randn(2, heads, n_query, 8), torch.randn(2, heads, n_key, 8), torch.randn(2, heads, n_key, 8)
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / heads) for h in range(heads)])
    bias = (slopes[:, None] * torch.arange(n_key))[None]  # [1, head, key], broadcast over the batch
    allowed = torch.ones(2, 1, n_key, n_key, dtype=torch.bool).tril()
    if mask_kind == "padded":
        allowed[1, :, :, :4] = False
    allowed = allowed[..., n_key - n_query :, :]
    given = None if mask_kind == "causal" else allowed
    scores = q.double() @ k.double().transpose(-1, -2) * scale + bias.double()[:, :, None, :]
    pattern = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    live = allowed.any(-1).expand(2, heads, n_query)
    blocks: list[torch.Tensor] = []
    component = SimpleNamespace(hook_pattern=HookPoint(), hook_attn_scores=HookPoint())
    alibi = _HandedBias(grouped=False)
    spec, call = ScoreSpec(scale, heads, heads, (alibi,)), {"bias": bias, "attention_mask": given}
    for path in (paths.FUSED, paths.DIAGONAL, paths.BLOCKED):
        if path is paths.BLOCKED:  # a reader of the pattern's rows, block by block
            component.hook_pattern.add_hook(rows_hook(lambda tensor, hook: blocks.append(tensor.clone())))
        with attention_path("auto", block_size=7):
            z = paths.attend(component, q, k, v, None, spec=spec, path=path, layer=None, call=call)
        want = (pattern @ v.double())[live].numpy()
        np.testing.assert_allclose(z[live].numpy(), want, atol=1e-5, err_msg=path.name)
    seen = torch.cat([torch.nn.functional.pad(b, (0, n_key - b.shape[-1])) for b in blocks], dim=2)
    np.testing.assert_allclose(seen[live].numpy(), pattern[live].numpy(), atol=1e-6)
    wide_q, wide_k, mask = alibi.prepare(q, k, None, call, scale=scale)
    assert wide_q.shape[-1] == wide_k.shape[-1] == 16 and mask is given  # 8 + 1 rounded up to a multiple of 8
    with attention_path("auto", block_size=7):
        rows = diagonal_rows(wide_q, wide_k, v, given, ScoreSpec(scale, heads, heads))
    own = torch.diagonal(pattern, offset=n_key - n_query, dim1=-2, dim2=-1)
    np.testing.assert_allclose(rows.weight[live].numpy(), own[live].numpy(), atol=1e-6)
    with pytest.raises(LibraryError, match="a key per query head"):  # grouped-query keys cannot carry a slope per head
        alibi.prepare(q, k[:, :2], None, call, scale=scale)


def test_diagonal_rows_keep_the_rest_exact_where_a_row_is_almost_all_its_own():
    """Own score 16, every other 0: 1 - A_tt = t / (e^16 + t) ~ t 1e-7, which 1 - A_tt in float32 would round to
    a multiple of 6e-8; the kernel's row without its own key gives it to float32's relative precision, and the
    rest's output (the mean of the earlier values) exactly."""
    eye = torch.eye(12)[None, None]  # query t and key t: the t-th unit vector, so s_ts = 16 [s = t]
    v = torch.randn(1, 1, 12, 12, generator=torch.Generator().manual_seed(1))
    rows = diagonal_rows(eye * 4, eye * 4, v, None, ScoreSpec(1.0, 1, 1))
    t = torch.arange(12, dtype=torch.float64)
    np.testing.assert_allclose(rows.others[0, 0].double().numpy(), (t / (np.exp(16) + t)).numpy(), rtol=1e-5)
    earlier_mean = (v[0, 0].double().cumsum(0) - v[0, 0].double())[1:] / t[1:, None]
    np.testing.assert_allclose((rows.rest[0, 0, 1:] / rows.others[0, 0, 1:, None]).numpy(), earlier_mean, atol=1e-5)


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["uncapped", "capped"])
def test_diagonal_rows_do_not_depend_on_the_batch_they_come_in(softcap):
    """Bit for bit: a sweep's reference, matched no-op and stacked edited forwards run the same documents in batches
    of other sizes, and a float64 model's scale-1 canary allows 1e-9 nats (an elementwise sigmoid rounded the last
    elements of a batch of 5 one ulp apart from the same elements in a batch of 15); soft-capped scores too (their
    own kernel, one batch row at a time)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 4, 9, 16), torch.randn(5, 2, 9, 16), torch.randn(5, 2, 9, 16)
    spec = _spec(0.25, 4, 2, softcap=softcap)
    alone = diagonal_rows(q, k, v, None, spec)
    tiled = diagonal_rows(*(t.repeat(3, 1, 1, 1) for t in (q, k, v)), None, spec)
    for name in ("weight", "others", "rest", "z"):
        torch.testing.assert_close(getattr(tiled, name)[10:], getattr(alone, name), rtol=0, atol=0, msg=name)


def test_blocked_hooks_see_rows_with_their_keys():
    model = get_model("toy-qwen3")
    tokens = _tokens(model, seq_len=23)
    shapes: list[tuple[int, ...]] = []

    def keep(tensor, hook):
        shapes.append((*tensor.shape[-2:], attention.QUERY_BLOCK.get().start))

    with (
        attention_path("blocked", block_size=10),
        model.hooks(fwd_hooks=[("blocks.0.attn.hook_pattern", rows_hook(keep))]),
    ):
        model(tokens, return_type=None)
    assert shapes == [(10, 10, 0), (10, 20, 10), (3, 23, 20)]


@pytest.mark.parametrize("family", ["toy-gpt2", "toy-qwen2", "toy-qwen3.5"])
def test_decompose_is_the_same_on_every_path(family):
    model = get_model(family)
    tokens = _tokens(model, n_docs=3, seq_len=21)
    spaces = ["value", "value-exclude-self", "residual-attn"]
    if model_info(model).post_norm or model_info(model).gated_attention:
        spaces = ["value", "value-exclude-self"]
    results = {}
    for path in ("eager", "auto", "diagonal", "blocked"):
        with attention_path(path, block_size=8), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results[path] = decompose(model, tokens, space=spaces, progress=False).to_dataframe()
    numeric = results["eager"].select_dtypes("number").columns
    eager = results["eager"]
    noisy = np.array(
        [noisy_linear_value(model_info(model), s, layer) for s, layer in zip(eager.space, eager.layer, strict=True)]
    )
    for path in ("auto", "diagonal", "blocked"):
        got = results[path]
        pd.testing.assert_frame_equal(got[~noisy][numeric], eager[~noisy][numeric], atol=1e-6, rtol=1e-5)
        noise = {"atol": LINEAR_VALUE_NOISE, "rtol": LINEAR_VALUE_NOISE}
        stable = [c for c in numeric if c != "par_perp_ratio"]  # par_frac / perp_frac: perp_frac is rounding there
        pd.testing.assert_frame_equal(got[noisy][stable], eager[noisy][stable], **noise)


EDITS = {
    "zero-diagonal": ZeroDiagonal(),
    "diagonal-value": DiagonalEdit("value", s_par=0.0),
    "diagonal-residual": DiagonalEdit("residual-attn", s_par=0.0, positions="after-first"),
    "value-exclude-self": ComponentScale("value-exclude-self", s_par=0.0),
    "value": ComponentScale("value", s_par=0.0),
}


@pytest.mark.parametrize("edit", EDITS)
def test_edits_give_the_same_losses_on_every_path(edit, monkeypatch):
    model = get_model("toy-llama")
    tokens = _tokens(model, n_docs=3, seq_len=25)
    kernel_calls = []
    with_lse = kernels.attention_with_lse
    monkeypatch.setattr(kernels, "attention_with_lse", lambda *a, **kw: kernel_calls.append(1) or with_lse(*a, **kw))
    frames = {}
    for path in ("eager", "auto", "diagonal", "blocked"):
        with attention_path(path, block_size=7):
            frames[path] = evaluate(model, tokens, EDITS[edit], n_resamples=50).to_dataframe()
        if path == "auto":  # every edit of the pattern here has a diagonal form: auto took the diagonal path
            assert bool(kernel_calls) == (edit != "value")
    # perplexities exp(loss) of a random-weight toy are ~5e4: compare the losses and the shift they come from
    numeric = [c for c in frames["eager"].select_dtypes("number").columns if "ppl" not in c]
    assert len(numeric) >= 4
    for path in ("auto", "diagonal", "blocked"):  # float32 losses of ~11 nats: one rounding step is 1e-6
        pd.testing.assert_frame_equal(frames[path][numeric], frames["eager"][numeric], atol=1e-5, rtol=1e-5)


def test_installed_on_every_softmax_layer():
    for family in ("toy-gpt2", "toy-pythia", "toy-qwen2", "toy-qwen3", "toy-llama", "toy-qwen3.5"):
        model = get_model(family)
        assert attention.install(model) == len(model_info(model).softmax_layers), family


def test_wrapped_forwards_are_the_ones_checked():
    """The own path mirrors TransformerLens 4.3's attention forwards step for step; a release that changes them
    must be checked again (the hashes of their source, :data:`lens_parallel.attention.routes.ATTENTION_SOURCES`)."""
    assert routes.attention_sources() == routes.ATTENTION_SOURCES


def test_bad_path_and_block_size_are_refused():
    with (
        pytest.raises(LensParallelError, match="accepted: auto, fused, diagonal, blocked, eager"),
        attention_path("flash"),  # type: ignore[arg-type]
    ):
        pass
    with pytest.raises(LensParallelError, match="positive integer"), attention_path("blocked", block_size=0):
        pass
    assert "block_size" in inspect.signature(attention_path).parameters


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_gemma_sliding_windows_norms_and_soft_capping(family):
    """A Gemma 3 and a Gemma 2 built here (no toy of either is bundled): sliding-window layers with a window of 8 on 29
    tokens, grouped heads, a padded row, Gemma 3's query/key norms and Gemma 2's soft-capped scores (a cap of 20),
    which no fused kernel computes: the cap's own (:meth:`SoftCap.blocks`) serves the fused and diagonal paths.
    Gemma 3's module keeps a cap its config names and never hands it to the attention (its scores are not capped):
    lens_parallel recognises what the module hands."""
    import transformers

    from lens_parallel.models import wrap_hf_model
    from lens_parallel.tokenizers import load_bundled_tokenizer

    config_class = {"gemma3": transformers.Gemma3TextConfig, "gemma2": transformers.Gemma2Config}[family]
    config = config_class(
        num_hidden_layers=3,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=151936,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        attn_logit_softcapping=20.0,
        max_position_embeddings=512,
        architectures=[config_class.__name__.replace("Config", "ForCausalLM").replace("Text", "")],
    )
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model = wrap_hf_model(hf_model, load_bundled_tokenizer("qwen3"), name=f"toy-{family}")
    specs = [site.spec for site in attention.sites(model)]
    assert [spec.window for spec in specs] == [8, 8, None]
    assert [spec.softcap for spec in specs] == [SoftCap(20.0) if family == "gemma2" else None] * 3
    assert attention.install(model) == 3
    tokens = torch.randint(100, 5000, (2, 29))
    mask = torch.ones_like(tokens)
    mask[1, :4] = 0
    _assert_paths_match_eager(model, tokens, mask)
    component = model.blocks[0].attn
    assert chosen_path(component).name == "fused"  # soft-capped scores too: their own kernel, no square
    spans = list(kernels.spans(29, 29, 6, 8))  # blocks of 6 queries (forced above) read the window's keys only
    assert spans[0] == (0, 6, 0, 6) and spans[2] == (12, 18, 4, 18) and spans[-1] == (24, 29, 16, 29)

    @rows_hook
    def uniform(pattern, hook):  # writes left of the window: the blocked path must then read every key
        n_query, n_key = pattern.shape[-2:]
        seen = torch.ones(n_query, n_key).tril(n_key - n_query)
        return (seen / seen.sum(-1, keepdim=True)).expand_as(pattern)

    hooks = [(f"blocks.{layer}.attn.hook_pattern", uniform) for layer in range(3)]
    with model.hooks(fwd_hooks=hooks):
        reference = _run(model, tokens, torch.ones_like(tokens), "eager")[0]
        blocked = _run(model, tokens, torch.ones_like(tokens), "blocked")[0]
    np.testing.assert_allclose(blocked.numpy(), reference.numpy(), atol=ATOL)
    info = model_info(model)  # edits of the diagonal through the windows, a padded row, GQA: diagonal = eager
    edits = [*ZeroDiagonal(layers=[0, 2]).hooks(model, info), *DiagonalEdit("value", s_par=0.5).hooks(model, info)]
    with model.hooks(fwd_hooks=edits):
        reference = _run(model, tokens, mask, "eager")[0]
        diagonal = _run(model, tokens, mask, "diagonal")[0]
    np.testing.assert_allclose(diagonal[mask.bool()].numpy(), reference[mask.bool()].numpy(), atol=ATOL)


def _loss_with_gradient(model, tokens, path, *, diagonal_form=False):
    """Loss, its gradient at the residual entering block 0, the diagonal a detached row reader captured in every
    layer, and the shapes of the 4-d tensors saved for the backward whose last axis is every key."""
    diagonals, leaves, saved = [], [], []

    def leaf(resid, hook):
        leaves.append(resid.detach().requires_grad_(True))
        return leaves[-1]

    def pack(tensor):
        saved.append(tuple(tensor.shape))
        return tensor

    reader = rows_hook(
        lambda pattern, hook: diagonals.append(geometry.self_weights(pattern)),
        detached=True,
        diagonal=(lambda rows, hook: diagonals.append(rows.weight)) if diagonal_form else None,
    )
    hooks = [("blocks.0.hook_resid_pre", leaf)]
    hooks += [(f"blocks.{layer}.attn.hook_pattern", reader) for layer in range(model_info(model).n_layers)]
    with (
        attention_path(path, block_size=16),
        model.hooks(fwd_hooks=hooks),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
    ):
        loss = model(tokens, return_type="loss")
    (grad,) = torch.autograd.grad(loss, leaves)
    patterns = [shape for shape in saved if len(shape) == 4 and shape[-1] == tokens.shape[1] and shape[-2] > 1]
    return loss.detach(), grad, torch.cat(diagonals, -1).detach(), patterns


@pytest.mark.parametrize("diagonal_form", [False, True])
def test_gradients_with_detached_row_readers_keep_no_pattern_for_the_backward(diagonal_form):
    """With gradients flowing and only detached readers of the pattern's rows (the captures of the diagonal), the
    blocked path (or, for readers with a diagonal form, the diagonal path) takes its output from the fused kernel
    and forms the rows without a graph: the same diagonal, loss and gradient as eager, and nothing saved for the
    backward is a [batch, head, query, key] pattern."""
    model = get_model("toy-qwen2")
    tokens = _tokens(model, n_docs=1, seq_len=40)
    loss, grad, diagonal, patterns = _loss_with_gradient(model, tokens, "eager")
    loss_auto, grad_auto, diagonal_auto, patterns_auto = _loss_with_gradient(
        model, tokens, "auto", diagonal_form=diagonal_form
    )
    assert patterns and not patterns_auto  # eager keeps every layer's pattern for the backward; the own path none
    np.testing.assert_allclose(diagonal_auto.numpy(), diagonal.numpy(), atol=ATOL)
    np.testing.assert_allclose(loss_auto.item(), loss.item(), atol=ATOL)
    np.testing.assert_allclose(grad_auto.numpy(), grad.numpy(), atol=ATOL)


@dataclasses.dataclass(frozen=True)
class _Temperature(Feature):
    """A toy feature, added here as one object: each query multiplied by ``t`` before the scores (s_ts = scale t
    q_t . k_s), recognised from a module attribute ``toy_temperature``."""

    t: float

    name: ClassVar[str] = "toy-temperature"
    title: ClassVar[str] = "queries multiplied by a temperature before the scores"
    handling: ClassVar[str] = "in the queries, before every path"

    @classmethod
    def recognise(cls, source):
        t = getattr(source.module, "toy_temperature", None)
        return cls(float(t)) if t else None

    def prepare(self, q, k, mask, call, *, scale):
        return q * self.t, k, mask


def test_a_feature_is_one_object_seen_in_the_matrix_and_in_the_kernel(monkeypatch):
    """A feature added to the registry (:data:`lens_parallel.attention.features.FEATURES`) as one object is recognised
    on the layers that have it, named in the support matrix's row and the guide's table of features, and applied on
    every path: the logits equal a Hugging Face model whose query projection is multiplied by the temperature."""
    import transformers

    from lens_parallel import support
    from lens_parallel.attention import features as feature_kinds
    from lens_parallel.models import toy_folder, wrap_hf_model

    monkeypatch.setattr(feature_kinds, "FEATURES", (*feature_kinds.FEATURES, _Temperature))
    folder = toy_folder("toy-llama")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for layer in (0, 2):
        hf_model.model.layers[layer].self_attn.toy_temperature = 1.5
        with torch.no_grad():
            reference.model.layers[layer].self_attn.q_proj.weight.mul_(1.5)
    model = wrap_hf_model(hf_model, transformers.AutoTokenizer.from_pretrained(folder), name="toy-llama-warm")
    specs = [site.spec for site in attention.sites(model)]
    assert [spec.find(_Temperature) for spec in specs] == [_Temperature(1.5), None, _Temperature(1.5)]
    assert "toy-temperature" in model_info(model).features
    assert "toy-temperature" in support.support_row("llama", model).features.split(", ")
    assert (
        "| `toy-temperature` | queries multiplied by a temperature before the scores |" in support.features_markdown()
    )
    tokens = _tokens(model)
    with torch.inference_mode():
        expected = reference(tokens).logits
    for path in ("fused", "diagonal", "blocked", "eager"):
        with torch.inference_mode(), attention_path(path, block_size=8):
            got = model(tokens, return_type="logits")
        np.testing.assert_allclose(got.numpy(), expected.numpy(), atol=ATOL, err_msg=path)
    plain = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        assert float((plain(tokens).logits - expected).abs().max()) > 1e-3  # the feature changes what is computed
