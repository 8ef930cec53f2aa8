from __future__ import annotations

import threading

import pytest
import torch

from lens_parallel import compat
from lens_parallel.errors import LibraryError
from lens_parallel.hooks import (
    FINAL_HOOK,
    HookShapeError,
    LayerStream,
    check_shape,
    expand_kv,
    expected_shape,
    forward,
    hook_name,
    skip_blocks_before,
)
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
    stream = LayerStream(info, [0, 1], ["v", "pattern_diag", "z"], lambda layer, t: seen.append((layer, sorted(t))))
    stream.run(model, TOKENS)
    assert seen == [(0, ["pattern_diag", "v", "z"]), (1, ["pattern_diag", "v", "z"])]
    with torch.inference_mode():
        assert torch.equal(model(TOKENS), before)
    with pytest.raises(ValueError, match="has no resid_mid"):
        LayerStream(model_info(get_model("toy-pythia")), [0], ["resid_mid"], lambda *_: None)


def test_prefix_reuse_is_exact_and_skips_the_earlier_blocks(toy):
    """The engine resumes a forward at block k from the cached residual, the earlier blocks not computed. This fails
    if the installed TransformerLens stops swapping the residual in at block k (start_at_layer): the skipped blocks
    would then hand block k the embeddings."""
    model = toy
    tokens = torch.randint(1, 1000, (2, 10), generator=torch.Generator().manual_seed(0))
    k = model.cfg.n_layers - 1
    with torch.inference_mode():
        _, cache = model.run_with_cache(tokens, names_filter=[hook_name(k, "resid_pre"), FINAL_HOOK])
    full = cache[FINAL_HOOK]  # the final normalised residual: what every forward here returns
    outputs = []
    probe = model.blocks[0].original_component.register_forward_hook(lambda m, i, o: outputs.append(o is i[0]))
    try:
        resumed = forward(model, tokens, resid=cache[hook_name(k, "resid_pre")], start_at_layer=k)
    finally:
        probe.remove()
    assert outputs == [True]  # block 0 ran as a pass-through: its output is its input
    torch.testing.assert_close(resumed, full, rtol=0, atol=1e-5)
    assert "forward" not in vars(model.blocks[0].original_component)  # restored afterwards


def test_prefix_skipping_is_reentrant_thread_safe_and_version_checked(monkeypatch):
    model = get_model("toy-qwen2")
    blocks = [model.blocks[i].original_component for i in range(3)]
    with skip_blocks_before(model, 2):
        with skip_blocks_before(model, 1):
            assert all("forward" in vars(b) for b in blocks[:2])
        assert all("forward" in vars(b) for b in blocks[:2])  # the outer context still skips both
    assert not any("forward" in vars(b) for b in blocks)
    tokens = torch.randint(1, 1000, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        _, cache = model.run_with_cache(
            tokens, names_filter=[hook_name(1, "resid_pre"), hook_name(2, "resid_pre"), FINAL_HOOK]
        )
    full = cache[FINAL_HOOK]
    results: dict[int, torch.Tensor] = {}

    def resume(k: int) -> None:
        for _ in range(5):
            results[k] = forward(model, tokens, resid=cache[hook_name(k, "resid_pre")], start_at_layer=k)

    threads = [threading.Thread(target=resume, args=(k,)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in (1, 2):
        torch.testing.assert_close(results[k], full, rtol=0, atol=1e-5)
    monkeypatch.setattr(compat.importlib.metadata, "version", lambda name: "5.1.0")
    compat.check.cache_clear()
    try:
        with pytest.raises(LibraryError, match=r"transformer-lens 5\.1\.0 is installed"):
            forward(model, tokens, resid=cache[hook_name(1, "resid_pre")], start_at_layer=1)
    finally:
        compat.check.cache_clear()


@pytest.mark.parametrize("family", ["toy-llama", "toy-pythia"])
def test_norms_skip_the_statistics_nobody_reads_and_compute_them_for_a_hook(family, monkeypatch):
    """lens_parallel's norm forward (:mod:`lens_parallel.norms`) gives TransformerLens's output to the bit without
    computing the statistics of hook_scale / hook_normalized when nothing hooks them; a hook on either takes
    TransformerLens's own forward, which computes them."""
    import hashlib
    import inspect

    from lens_parallel import norms

    model = get_model(family)
    norm = compat.bridge_classes().norm
    statistics = compat.bridge_attribute(norm, "norm_statistics")
    calls: list[int] = []
    monkeypatch.setattr(norm, compat.PRIVATE["norm_statistics"], lambda self, x: calls.append(1) or statistics(self, x))
    tokens = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ours = model(tokens)
    assert calls == []
    components = [m for m in model.modules() if isinstance(m, norm) and "forward" in vars(m)]
    try:
        for component in components:  # TransformerLens's own forward, as on a bridge lens_parallel never saw
            del vars(component)["forward"]
        with torch.inference_mode():
            theirs = model(tokens)
    finally:
        assert norms.install(model) == len(components) > 0
    assert torch.equal(ours, theirs) and len(calls) == len(components)
    with torch.inference_mode():
        model.run_with_cache(tokens, names_filter="blocks.1.ln1.hook_scale")
    assert len(calls) == len(components) + 1  # the hooked norm alone computed its statistics
    functions = (norm.forward, statistics)
    sources = {f.__qualname__: hashlib.sha256(inspect.getsource(f).encode()).hexdigest()[:16] for f in functions}
    assert sources == norms.NORM_SOURCES
