"""Qwen3.5's linear-attention (gated delta rule) layers in the decompositions and the edits, against a reference
computed by transformers alone: an independent copy of the weights whose delta-rule kernel is wrapped to record, or
edit, each linear layer's output o_t, with transformers' recurrent or chunked rule underneath. The self term of o_t
is found without the diagonal's formula: the rule is linear in the values, so the recurrent rule run with every
value but v_t zeroed gives, at t, exactly the part of o_t that v_t writes (a_tt v_t).

The weights are toy-qwen3.5's with a slower decay (A_log = log 0.05 in every linear layer, exp(g) about 0.97):
at transformers' initial decay (A up to 16) the state forgets within a token, o_t is its self term to float32's
rounding and c_t = o_t - a_tt v_t is rounding noise, which would test nothing."""

from __future__ import annotations

import contextlib
import math
import shutil
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5
from torch import Tensor
from transformers import AutoModelForCausalLM

import lens_parallel as lp
from lens_parallel import geometry
from lens_parallel.hooks import forward, hook_name
from lens_parallel.models import model_info, toy_folder

RULES = {"chunk": qwen3_5.torch_chunk_gated_delta_rule, "recurrent": qwen3_5.torch_recurrent_gated_delta_rule}
LINEAR = (0, 3, 4)  # toy-qwen3.5's linear-attention layers
TOKENS = torch.randint(0, 5000, (2, 11), generator=torch.Generator().manual_seed(3))

Edit = Callable[[int, Tensor, Tensor, Tensor], Tensor]
"""A reference edit of one linear layer's output: (layer, o, v, self term) -> o'  (each [batch pos head d])."""


def _self_term(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """At each t, the output of the recurrent rule whose only nonzero value is v_t: the part of o_t that v_t
    writes (one batch row per position)."""
    b, t = value.shape[:2]
    onehot = torch.eye(t, dtype=value.dtype)[:, None, :, None, None] * value[None]  # [t_kept, b, t, h, d]

    def rows(x: Tensor) -> Tensor:
        return x[None].expand(t, *x.shape).reshape(t * b, *x.shape[1:])

    out, _ = RULES["recurrent"](
        rows(query),
        rows(key),
        onehot.reshape(t * b, *value.shape[1:]),
        g=rows(g),
        beta=rows(beta),
        use_qk_l2norm_in_kernel=True,
    )
    out = out.reshape(t, b, *value.shape[1:])
    return torch.stack([out[i, :, i] for i in range(t)], dim=1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """toy-qwen3.5 with a slower decay in its linear layers, saved as a Hugging Face folder."""
    out = tmp_path_factory.mktemp("slow-decay")
    shutil.copytree(toy_folder("toy-qwen3.5"), out, dirs_exist_ok=True)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        for layer in LINEAR:
            hf.model.layers[layer].linear_attn.A_log.fill_(math.log(0.05))
    hf.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def model(folder: Path):
    return lp.load_model(str(folder))


@contextlib.contextmanager
def reference(
    folder: Path, rule: str, edit: Edit | None = None
) -> Iterator[tuple[torch.nn.Module, dict[int, dict[str, Tensor]]]]:
    """transformers' own toy-qwen3.5 with each linear layer's kernel replaced by ``rule`` (recording o, v, the self
    term, and the layer's input and output), ``edit`` applied to o."""
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    seen: dict[int, dict[str, Tensor]] = {}
    calls = iter(LINEAR * 1000)

    def kernel(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, **kw: object) -> tuple:
        kw.pop("cu_seqlens", None)
        layer = next(calls)
        if query.shape[2] != value.shape[2]:  # key heads shared by consecutive value heads
            group = value.shape[2] // query.shape[2]
            query, key = query.repeat_interleave(group, 2), key.repeat_interleave(group, 2)
        o, state = RULES[rule](query, key, value, g=g, beta=beta, **kw)
        d = _self_term(query, key, value, g, beta)
        seen.setdefault(layer, {}).update(o=o, v=value, self=d)
        return (o if edit is None else edit(layer, o, value, d).to(o.dtype)), state

    def keep(layer: int, name: str) -> Callable[..., None]:
        def fn(module: torch.nn.Module, args: tuple, kwargs: dict, out: object = None) -> None:
            x = kwargs.get("hidden_states", args[0] if args else None)
            seen.setdefault(layer, {})[name] = (out[0] if isinstance(out, tuple) else out) if name == "out" else x

        return fn

    handles = []
    for layer in LINEAR:
        block = hf.model.layers[layer]
        handles.append(block.register_forward_pre_hook(keep(layer, "resid_pre"), with_kwargs=True))
        handles.append(block.linear_attn.register_forward_hook(keep(layer, "out"), with_kwargs=True))
        projection = block.linear_attn.out_proj  # its input: every value head's norm(o) * silu(z), concatenated
        handles.append(projection.register_forward_pre_hook(keep(layer, "projected"), with_kwargs=True))
    original = qwen3_5.torch_chunk_gated_delta_rule
    qwen3_5.torch_chunk_gated_delta_rule = kernel
    try:
        yield hf, seen
    finally:
        qwen3_5.torch_chunk_gated_delta_rule = original
        for h in handles:
            h.remove()


def _nll_sums(hf: torch.nn.Module, tokens: Tensor) -> Tensor:
    with torch.inference_mode():
        logits = hf(tokens).logits.double()
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")
    return nll.sum(-1)


def _mean_cos(m: Tensor, r: Tensor) -> Tensor:
    """Mean over documents and positions t >= 1 of cos(m, r), per head."""
    return torch.cosine_similarity(m[:, 1:].double(), r[:, 1:].double(), dim=-1).mean((0, 1))


@pytest.mark.parametrize("rule", ["chunk", "recurrent"])
def test_decompose_on_linear_layers_equals_the_reference(rule, folder, model):
    with reference(folder, rule) as (hf, seen), torch.inference_mode():
        hf(TOKENS)
    result = lp.decompose(model, TOKENS, space="all")
    df = result.to_dataframe()
    writes = {}  # each value head's write to the residual: its slice of out_proj's input through its slice of W_out
    for layer in LINEAR:
        module = hf.model.layers[layer].linear_attn
        u = seen[layer]["projected"].unflatten(-1, (module.num_v_heads, module.head_v_dim))
        w = module.out_proj.weight.unflatten(1, (module.num_v_heads, module.head_v_dim))  # [d_model, head, d_v]
        writes[layer] = torch.einsum("bphd,mhd->bphm", u.double(), w.detach().double())
    assert set(df.layer_type) == {"linear", "softmax"}
    for layer in LINEAR:
        ref = seen[layer]
        rows = df[(df.layer == layer)]
        assert set(rows.layer_type) == {"linear"}
        expected = {
            ("value", "head"): _mean_cos(ref["o"], ref["v"]),
            ("value-exclude-self", "head"): _mean_cos(ref["o"] - ref["self"], ref["v"]),
            ("value-merged", "sublayer"): _mean_cos(ref["o"].flatten(2), ref["v"].flatten(2))[None],
            ("residual-attn", "sublayer"): _mean_cos(ref["out"], ref["resid_pre"])[None],
            ("residual-attn", "head"): _mean_cos(writes[layer], ref["resid_pre"][:, :, None]),
        }
        for (space, level), want in expected.items():
            got = rows[(rows.space == space) & (rows.level == level)].sort_values("head").self_cos.to_numpy()
            assert got.shape == want.shape, (space, level)
            torch.testing.assert_close(torch.from_numpy(got), want, rtol=0, atol=2e-5)
        assert rows[rows.space == "value"]["head"].tolist() == [0, 1, 2, 3]  # its 4 value heads, not 6 query heads
        assert rows[rows.space == "value"].kv_head.tolist() == [0, 0, 1, 1]
    for layer in LINEAR:  # the heads' writes are terms of the layer's update
        torch.testing.assert_close(writes[layer].sum(2).double(), seen[layer]["out"].double(), rtol=1e-5, atol=1e-7)


def test_the_diagonal_a_tt_is_the_self_term_of_the_reference(folder, model):
    info = model_info(model)
    captured: dict[str, Tensor] = {}

    def keep(role: str) -> Callable[..., None]:
        return lambda t, hook: captured.__setitem__(role, t.detach().double())

    hooks = [(hook_name(3, role), keep(role)) for role in ("lin_q", "lin_k", "lin_beta", "lin_v")]
    forward(model, TOKENS, hooks)
    a = geometry.linear_self_weights(captured["lin_q"], captured["lin_k"], captured["lin_beta"])
    assert a.shape == (2, info.n_linear_heads, TOKENS.shape[1])
    with reference(folder, "recurrent") as (hf, seen), torch.inference_mode():
        hf(TOKENS)
    d, v = seen[3]["self"].double(), seen[3]["v"].double()
    torch.testing.assert_close(a.transpose(1, 2)[..., None] * v, d, rtol=1e-5, atol=1e-9)
    assert (a.abs() > 1e-3).float().mean() > 0.5  # a real diagonal, not zeros


def _proj(m: Tensor, r: Tensor) -> Tensor:
    """m's part along r (the reference's own three lines)."""
    return (m * r).sum(-1, keepdim=True) / (r * r).sum(-1, keepdim=True) * r


EDITS: dict[str, tuple[object, Edit]] = {
    "value s_par=0": (
        lp.ComponentScale("value", s_par=0.0, layers=list(LINEAR)),
        lambda layer, o, v, d: o - _proj(o, v),
    ),
    "value-exclude-self s_par=0 s_perp=0.5": (
        lp.ComponentScale("value-exclude-self", s_par=0.0, s_perp=0.5, layers=[0, 4]),
        lambda layer, o, v, d: o if layer == 3 else d + 0.5 * ((o - d) - _proj(o - d, v)),
    ),
    "value-merged s_par=2": (
        lp.ComponentScale("value-merged", s_par=2.0, layers=[3]),
        lambda layer, o, v, d: o if layer != 3 else o + _proj(o.flatten(2), v.flatten(2)).reshape(o.shape),
    ),
    "DiagonalEdit value s_par=0.5": (
        lp.DiagonalEdit("value", s_par=0.5, layers=[0, 3]),
        lambda layer, o, v, d: o if layer == 4 else o - 0.5 * _proj(o, v),
    ),
    "ZeroDiagonal": (lp.ZeroDiagonal(layers=list(LINEAR)), lambda layer, o, v, d: o - d),
    "HeadEdit parallel-value head 1": (
        lp.HeadEdit("parallel-value", 3, [1]),
        lambda layer, o, v, d: (
            o if layer != 3 else torch.cat([o[:, :, :1], (o - _proj(o, v))[:, :, 1:2], o[:, :, 2:]], 2)
        ),
    ),
}


@pytest.mark.parametrize("name", list(EDITS))
def test_each_edit_on_linear_layers_gives_the_reference_loss(name, folder, model):
    edit, ref_edit = EDITS[name]
    with reference(folder, "chunk", ref_edit) as (hf, _):
        want = _nll_sums(hf, TOKENS)
    with reference(folder, "chunk") as (hf, _):
        clean = _nll_sums(hf, TOKENS)
    got = lp.document_losses(model, TOKENS, edit)
    assert got.n_tokens.tolist() == [TOKENS.shape[1] - 1] * 2
    torch.testing.assert_close(torch.from_numpy(got.loss_sum).double(), want, rtol=0, atol=2e-4)
    assert (want - clean).abs().max() > 1e-2  # the edit moves the loss far more than the tolerance


def _captured(model, roles: tuple[str, ...], layer: int) -> dict[str, Tensor]:
    captured: dict[str, Tensor] = {}

    def keep(role: str) -> Callable[..., None]:
        return lambda t, hook: captured.__setitem__(role, t.detach().double())

    forward(model, TOKENS, [(hook_name(layer, role), keep(role)) for role in roles])
    return captured


def test_the_mixing_weights_rebuild_the_output_and_hold_a_tt_on_their_diagonal(model):
    from lens_parallel.layers import linear_mixing_weights

    t = _captured(model, ("lin_q", "lin_k", "lin_v", "lin_beta", "lin_decay", "lin_o"), 4)
    m = linear_mixing_weights(t, model_info(model).n_linear_heads).double()
    o = torch.einsum("bhts,bshd->bthd", m, t["lin_v"])
    torch.testing.assert_close(o, t["lin_o"], rtol=1e-4, atol=1e-7)
    a = geometry.linear_self_weights(t["lin_q"], t["lin_k"], t["lin_beta"])
    torch.testing.assert_close(torch.diagonal(m, dim1=-2, dim2=-1), a, rtol=1e-4, atol=1e-8)
    assert torch.equal(torch.triu(m, diagonal=1), torch.zeros_like(m))  # causal
    assert (m.tril(-1).abs().sum() / torch.diagonal(m, dim1=-2, dim2=-1).abs().sum()) > 0.1  # memory, not only a_tt


def test_the_causal_null_and_the_groups_of_a_linear_layer_equal_a_direct_computation(model):
    info = model_info(model)
    result = lp.gqa_alignment(model, TOKENS, null="exact", groups="neighbour", progress=False)
    t = _captured(model, ("lin_o", "lin_v"), 3)
    o, v = t["lin_o"], t["lin_v"]
    group = info.n_linear_heads // info.n_linear_key_heads
    for h in range(info.n_linear_heads):
        for doc in range(2):
            own, null, across = [], [], []
            for pos in range(1, TOKENS.shape[1]):
                cos = torch.cosine_similarity(o[doc, pos, h], v[doc, : pos + 1, h], dim=-1)
                own.append(cos[pos])
                null.append(cos[:pos].mean())
                other = v[doc, pos, (h - group) % info.n_linear_heads]
                across.append(torch.cosine_similarity(o[doc, pos, h], other, dim=0))
            i = result.layers.index(3)
            # float32 forwards of other batch shapes round alike to about 1e-7
            assert result.cos_self[doc, i, h] == pytest.approx(float(torch.stack(own).mean()), abs=1e-6)
            assert result.cos_null[doc, i, h] == pytest.approx(float(torch.stack(null).mean()), abs=1e-6)
            assert result.cos_across[doc, i, h] == pytest.approx(float(torch.stack(across).mean()), abs=1e-6)
    assert np.isnan(result.cos_self[:, 3, info.n_linear_heads :]).all()  # layer 3 has 4 heads of a 6-wide axis
    table = result.head_table()
    assert len(table) == 3 * info.n_linear_heads + 2 * info.n_heads
    assert set(result.summary().columns) >= {"excess[linear]", "excess[softmax]", "across_excess[linear]"}


def test_sensitivity_and_attribution_reach_linear_heads(model):
    """A linear head's sensitivity is its ablation's exact effect, and its attribution's dloss/ds_par is the slope
    of the loss under ComponentScale on that head alone (a central difference)."""
    docs = torch.randint(0, 5000, (4, 10), generator=torch.Generator().manual_seed(5))
    sens = lp.head_sensitivity(model, docs, n_resamples=50, n_permutations=50, progress=False)
    assert sens.layers == (0, 1, 2, 3, 4)
    base = lp.document_losses(model, docs)
    edited = lp.document_losses(model, docs, lp.HeadEdit("parallel-value", 3, (2,)))
    want = (edited.loss_sum.sum() - base.loss_sum.sum()) / base.n_tokens.sum()
    assert sens.head_delta[3, 2] == pytest.approx(want, abs=1e-9)
    assert np.isnan(sens.head_delta[3, 4:]).all() and np.isfinite(sens.head_delta[1]).all()
    rows = sens.to_dataframe()
    assert rows[(rows.layer == 3) & rows["head"].notna()]["head"].tolist() == [0, 1, 2, 3]
    attribution = lp.head_attribution(model, docs, progress=False)
    h, step = 1, 0.1  # float32 loss sums of about 400 nats round at 3e-5: a smaller step would measure rounding
    losses = [
        lp.document_losses(model, docs, lp.ComponentScale("value", s_par=1 + d, layers=[0], heads=[h])).loss_sum.sum()
        for d in (step, -step)
    ]
    slope = (losses[0] - losses[1]) / (2 * step)
    assert attribution.d_s_par[0, :, 0, h].sum() == pytest.approx(slope, rel=3e-3)
    assert abs(slope) > 1e-5
    every = lp.ComponentScale("residual-attn", layers=[0], heads="all")  # each value head's own write, all at once
    residual = [lp.document_losses(model, docs, replace(every, s_par=1 + d)).loss_sum.sum() for d in (step, -step)]
    slope = (residual[0] - residual[1]) / (2 * step)  # first order: the sum of the heads' derivatives
    assert attribution.d_s_par[2, :, 0, :4].sum() == pytest.approx(slope, rel=1e-2)
    assert abs(slope) > 1e-3
    assert np.isnan(attribution.d_s_par[:, :, 0, 4:]).all()  # layer 0 has 4 heads of a 6-wide axis
