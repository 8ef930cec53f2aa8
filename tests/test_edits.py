from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lens_parallel import geometry
from lens_parallel.analyses.evaluate import evaluate
from lens_parallel.data import token_blocks
from lens_parallel.edits import ComponentScale, DiagonalEdit, HeadEdit, apply_edits, noop
from lens_parallel.hooks import expand_kv
from lens_parallel.models import model_info
from lens_parallel.spaces import SPACE_NAMES

from .conftest import get_model

NAMES = ("hook_z", "hook_attn_out")


def tokens_for(model, n=2, seq_len=20):
    return token_blocks(model, "wikipedia-en", n_docs=n, seq_len=seq_len, seed=2).tokens


def run(model, tokens, edits=()):
    """Logits and a cache of hook_z / attn_out / resid_pre under ``edits``."""
    keep = lambda name: name.endswith(  # noqa: E731
        ("attn.hook_z", "hook_attn_out", "hook_resid_pre", "attn.hook_v", "attn.hook_pattern", "attn.hook_q_gate")
    )
    with torch.inference_mode(), apply_edits(model, edits):
        return model.run_with_cache(tokens, names_filter=keep)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


EVERY_NOOP = [ComponentScale(space) for space in SPACE_NAMES] + [
    ComponentScale("residual-attn", heads=[0, 2]),
    DiagonalEdit("value", s_par=1.0),
    DiagonalEdit("value-exclude-self", s_par=1.0),
    DiagonalEdit("residual-attn", s_par=1.0),
]


def test_unit_scales_leave_logits_unchanged(toy):
    tokens = tokens_for(toy)
    with torch.inference_mode():
        bare = toy(tokens)
    for edit in EVERY_NOOP:
        if edit == DiagonalEdit("residual-attn", s_par=1.0) and model_info(toy).gated_attention:
            with pytest.raises(ValueError, match="not defined for gated attention"):
                run(toy, tokens, [edit])
            continue
        logits, _ = run(toy, tokens, [edit])
        assert (logits - bare).abs().max().item() <= 1e-5, edit
    assert noop([ComponentScale("value", 0.0, 2.0, layers=[1])]) == (ComponentScale("value", 1.0, 1.0, layers=(1,)),)


@pytest.mark.parametrize("space", ["value", "value-exclude-self"])
@pytest.mark.parametrize("layers", [[1], None])
def test_diagonal_edit_equals_component_scale(toy, space, layers):
    tokens = tokens_for(toy)
    scaled_logits, scaled = run(toy, tokens, [ComponentScale(space, s_par=0.3, layers=layers)])
    diag_logits, diag = run(toy, tokens, [DiagonalEdit(space, s_par=0.3, layers=layers)])
    base_logits, _ = run(toy, tokens)
    assert rel(scaled_logits, base_logits) > 1e-3  # the edit does something
    assert rel(diag_logits, scaled_logits) <= 1e-4
    for layer in model_info(toy).softmax_layers:
        for name in NAMES:
            key = f"blocks.{layer}.attn.{name}" if name == "hook_z" else f"blocks.{layer}.{name}"
            assert rel(diag[key], scaled[key]) <= 1e-4, key


def test_residual_diagonal_view_reproduces_the_component_along_x(toy):
    """A view, not an identity: same component along x_t as the per-head scaling, plus a perpendicular change."""
    tokens, layer, head, s_par = tokens_for(toy), 1, 1, 0.0
    if model_info(toy).gated_attention:
        with pytest.raises(ValueError, match=r"DiagonalEdit\('residual-attn'\) is not defined for gated attention"):
            run(toy, tokens, [DiagonalEdit("residual-attn", s_par=s_par, layers=[layer], heads=[head])])
        return
    _, base = run(toy, tokens)
    _, scaled = run(toy, tokens, [ComponentScale("residual-attn", s_par=s_par, layers=[layer], heads=[head])])
    _, diag = run(toy, tokens, [DiagonalEdit("residual-attn", s_par=s_par, layers=[layer], heads=[head])])
    key = f"blocks.{layer}.hook_attn_out"
    x = base[f"blocks.{layer}.hook_resid_pre"].double()
    d_scale = (scaled[key] - base[key]).double()
    d_diag = (diag[key] - base[key]).double()
    along = geometry.project(d_diag, x)
    assert rel(along.par[:, 1:], d_scale[:, 1:]) <= 1e-4
    # the per-head scaling is purely along x; the diagonal view adds a perpendicular change
    assert geometry.project(d_scale, x).perp[:, 1:].norm() <= 1e-4 * d_scale[:, 1:].norm()
    assert along.perp[:, 1:].norm() > 1e-2 * along.par[:, 1:].norm()


def test_zero_perp_leaves_exactly_the_parallel_component(toy):
    tokens, layer = tokens_for(toy), 1
    info = model_info(toy)
    _, base = run(toy, tokens)
    _, edited = run(toy, tokens, [ComponentScale("value", s_par=1.0, s_perp=0.0, layers=[layer])])
    v = expand_kv(base[f"blocks.{layer}.attn.hook_v"], info.n_heads)
    z = base[f"blocks.{layer}.attn.hook_z"]
    if info.gated_attention:  # z = gate * o: the edit keeps gate * o_par
        o = torch.einsum("bhqk,bkhd->bqhd", base[f"blocks.{layer}.attn.hook_pattern"], v)
        gate = torch.sigmoid(base[f"blocks.{layer}.attn.hook_q_gate"].reshape(z.shape))
        expected = gate * geometry.project(o, v).par
    else:
        expected = geometry.project(z, v).par
    assert torch.allclose(edited[f"blocks.{layer}.attn.hook_z"], expected, atol=1e-6)


@pytest.mark.parametrize("spec", ["toy-qwen2", "toy-qwen3", "toy-llama", "toy-qwen3.5"])
@pytest.mark.parametrize(
    "make",
    [
        lambda: ComponentScale("value", s_par=0.0, layers=[1], heads=[0]),
        lambda: ComponentScale("value-exclude-self", s_par=-1.0, layers=[1], heads=[0]),
        lambda: DiagonalEdit("value", s_par=0.0, layers=[1], heads=[0]),
    ],
)
def test_gqa_edit_of_one_query_head_leaves_its_group_mates_bit_identical(spec, make):
    model = get_model(spec)
    info = model_info(model)
    tokens = tokens_for(model)
    _, base = run(model, tokens)
    _, edited = run(model, tokens, [make()])
    z0, z1 = base["blocks.1.attn.hook_z"], edited["blocks.1.attn.hook_z"]
    assert info.group_size == 3
    assert not torch.allclose(z1[:, 1:, 0], z0[:, 1:, 0])
    assert torch.equal(z1[:, :, 1:], z0[:, :, 1:])  # heads 1, 2 share kv head 0 with head 0; the rest too


def test_edits_compose_in_order():
    model = get_model("toy-gpt2")
    tokens = tokens_for(model)
    both, _ = run(
        model, tokens, [ComponentScale("value", s_par=0.5, layers=[0]), ComponentScale("value", s_par=0.5, layers=[0])]
    )
    once, _ = run(model, tokens, [ComponentScale("value", s_par=0.25, layers=[0])])
    assert rel(both, once) <= 1e-5  # scaling the parallel part twice by 1/2 is scaling it by 1/4


def test_bad_edits_fail_before_any_forward():
    model = get_model("toy-qwen3")
    tokens = tokens_for(model)
    forwards = []  # counted by a torch hook on the first block (a TransformerLens hook would be refused)
    cases = [
        (lambda: ComponentScale("values"), r"unknown space 'values' \(did you mean 'value'\?\); accepted: value, "),
        (lambda: ComponentScale("value", layers=[3]), r"layers \[3\] out of range: this model has layers 0..2"),
        (lambda: ComponentScale("value", heads=[6]), r"heads \[6\] out of range: this model has heads 0..5"),
        (lambda: ComponentScale("residual-mlp", heads=[0]), r"space 'residual-mlp' has no heads"),
        (lambda: ComponentScale("value", s_par=math.nan), r"s_par must be a finite number, got nan"),
        (lambda: ComponentScale("value", s_perp=math.inf), r"s_perp must be a finite number, got inf"),
        (lambda: DiagonalEdit("residual-mlp"), r"unknown diagonal space 'residual-mlp'"),
        (lambda: ComponentScale("value", eps=-1.0), r"eps must be above 0"),
    ]
    count = model.blocks[0].register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        for make, message in cases:
            with pytest.raises(ValueError, match=message):
                evaluate(model, tokens, make())
    finally:
        count.remove()
    assert forwards == []


def test_softmax_only_edits_refuse_linear_attention_layers_in_one_line():
    """What is built on softmax layers only refuses a linear layer named, and with layers=None leaves them alone;
    everything else edits them (tests/test_linear_attention.py checks the values)."""
    model = get_model("toy-qwen3.5")
    tokens = tokens_for(model)
    cases = [
        (ComponentScale("value", s_par=0.0, layers=[0], site="post-gate"), "site='post-gate' needs softmax"),
        (DiagonalEdit("residual-attn", layers=[4]), r"DiagonalEdit\('residual-attn'\) needs softmax"),
        (HeadEdit("mean", 0, [0], means=torch.zeros(6, 16)), r"HeadEdit\('mean'\) needs softmax"),
    ]
    for edit, message in cases:
        expected = message + r".*\(linear-attention\) have none; layers that have it: \[1, 2\]"
        with pytest.raises(ValueError, match=expected):
            run(model, tokens, [edit])
    base, _ = run(model, tokens)
    for edit in (ComponentScale("value", s_par=0.0, layers=[0]), DiagonalEdit("value", layers=[4])):
        logits, _ = run(model, tokens, [edit])
        assert rel(logits, base) > 1e-4, edit
    post, _ = run(model, tokens, [ComponentScale("value", s_par=0.0, site="post-gate")])  # layers=None: 1 and 2
    softmax_only, _ = run(model, tokens, [ComponentScale("value", s_par=0.0, site="post-gate", layers=[1, 2])])
    torch.testing.assert_close(post, softmax_only, rtol=0, atol=0)


def test_after_first_leaves_the_boundary_token_alone():
    """At t = 0 a causal head attends only to itself, so o_0 = v_0: value-space s_par = 0 removes its whole output
    there, exclude-self leaves it untouched. ``positions="after-first"`` keeps position 0 as it is and edits the rest
    exactly as ``all`` does (hook_z of the edited layer; the diagonal form and a head ablation alike)."""
    model = get_model("toy-qwen3")
    tokens = tokens_for(model)
    _, base = run(model, tokens)
    z = "blocks.1.attn.hook_z"
    _, value_all = run(model, tokens, [ComponentScale("value", s_par=0.0, layers=[1])])
    assert value_all[z][:, 0].abs().max() < 1e-6 < base[z][:, 0].abs().max()
    _, exclude_all = run(model, tokens, [ComponentScale("value-exclude-self", s_par=0.0, layers=[1])])
    torch.testing.assert_close(exclude_all[z][:, 0], base[z][:, 0])
    for edit in (
        ComponentScale("value", s_par=0.0, layers=[1]),
        DiagonalEdit("value", s_par=0.0, layers=[1]),
        HeadEdit("zero", 1, (2,)),
        HeadEdit("parallel-residual", 1, (2,)),
    ):
        _, every = run(model, tokens, [edit])
        _, after = run(model, tokens, [dataclasses.replace(edit, positions="after-first")])
        torch.testing.assert_close(after[z][:, 0], base[z][:, 0], msg=str(edit))
        torch.testing.assert_close(after[z][:, 1:], every[z][:, 1:], msg=str(edit))
    with pytest.raises(ValueError, match="unknown positions 'first'"):
        ComponentScale("value", positions="first")
