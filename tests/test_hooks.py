from __future__ import annotations

import pytest
import torch

from lens_parallel.hooks import HookShapeError, LayerStream, check_shape, expand_kv, expected_shape
from lens_parallel.models import model_info

from .conftest import get_model

TOKENS = torch.randint(0, 1000, (2, 20), generator=torch.Generator().manual_seed(0))


def test_hook_z_is_pattern_times_expanded_v(toy):
    """hook_z = A @ expand(v); under gated attention (Qwen3.5) hook_z = sigmoid(hook_q_gate) * (A @ expand(v))."""
    info = model_info(toy)
    with torch.inference_mode():
        _, cache = toy.run_with_cache(TOKENS)
    for layer in info.softmax_layers:
        v = cache[f"blocks.{layer}.attn.hook_v"]
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
        z = cache[f"blocks.{layer}.attn.hook_z"]
        assert v.shape[2] == info.n_kv_heads
        rebuilt = torch.einsum("bhqk,bkhd->bqhd", pattern, expand_kv(v, info.n_heads))
        if info.gated_attention:
            gate = cache[f"blocks.{layer}.attn.hook_q_gate"].reshape(z.shape)
            rebuilt = torch.sigmoid(gate) * rebuilt
        assert torch.allclose(rebuilt, z, atol=1e-5)


def test_attn_out_is_sum_of_head_outputs_plus_bias(toy):
    info = model_info(toy)
    with torch.inference_mode():
        _, cache = toy.run_with_cache(TOKENS)
    for layer in info.softmax_layers:
        attn = toy.blocks[layer].attn
        heads = torch.einsum("bphd,hdm->bphm", cache[f"blocks.{layer}.attn.hook_z"], attn.W_O.detach())
        b_O = attn.b_O.detach() if attn.b_O is not None else 0.0
        assert torch.allclose(heads.sum(2) + b_O, cache[f"blocks.{layer}.hook_attn_out"], atol=1e-5)


def test_check_shape_names_hook_expected_and_actual():
    info = model_info(get_model("toy-qwen3"))
    with pytest.raises(
        HookShapeError,
        match=r"hook blocks.1.attn.hook_v: expected shape \[batch, pos, n_kv_heads=2, "
        r"d_head=16\], got \(2, 5, 6, 16\)",
    ):
        check_shape("blocks.1.attn.hook_v", torch.zeros(2, 5, 6, 16), expected_shape("v", info))


def test_stream_stops_early_and_leaves_no_hooks():
    model = get_model("toy-llama")
    info = model_info(model)
    with torch.inference_mode():
        before = model(TOKENS)
    seen = []
    stream = LayerStream(info, [0, 1], ["v", "pattern", "z"], lambda layer, t: seen.append((layer, sorted(t))))
    stream.run(model, TOKENS)
    assert seen == [(0, ["pattern", "v", "z"]), (1, ["pattern", "v", "z"])]
    with torch.inference_mode():
        assert torch.equal(model(TOKENS), before)
    with pytest.raises(ValueError, match="has no resid_mid"):
        LayerStream(model_info(get_model("toy-pythia")), [0], ["resid_mid"], lambda *_: None)
