"""Models larger than one device: layers placed by ``device_map`` (here part of them offloaded to disk) give the same
numbers as the model in memory, in every analysis that reads activations, weights or gradients."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import lens_parallel as lp
from lens_parallel.data import token_blocks
from lens_parallel.models import ModelSpecError, weights_digest

from .conftest import get_model

# embeddings and block 0 in memory, blocks 1 and 2 read from disk as they run
MAPS = {
    "toy-gpt2": {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.h.0": "cpu"}
    | {"transformer.h.1": "disk", "transformer.h.2": "disk", "transformer.ln_f": "cpu", "lm_head": "cpu"},
    "toy-qwen2": {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu"}
    | {"model.layers.1": "disk", "model.layers.2": "disk", "model.norm": "cpu", "lm_head": "cpu"},
}


@pytest.mark.parametrize("spec", list(MAPS))
def test_layers_offloaded_to_disk_give_the_same_numbers_as_in_memory(spec, tmp_path):
    memory = get_model(spec)
    disk = lp.load_model(spec, device_map=MAPS[spec], offload_folder=tmp_path / "offload")
    assert set(disk.original_model.hf_device_map.values()) == {"cpu", "disk"}
    for block in ("1", "2"):  # not in memory: read from disk as the block runs (TransformerLens keeps its split q/k/v)
        devices = {p.device.type for n, p in disk.original_model.named_parameters() if f".{block}." in n}
        assert "meta" in devices
    assert weights_digest(disk) == weights_digest(memory)  # offloaded weights are hashed from their files, exactly
    blocks = token_blocks(memory, "wikipedia-en", n_docs=3, seq_len=24)
    results = {}
    for name, model in (("memory", memory), ("disk", disk)):
        edits = [
            lp.ComponentScale("residual-attn", s_par=0.0, heads=(1,), layers=(2,)),
            lp.DiagonalEdit("residual-attn", s_par=0.5, layers=(1,)),
            lp.HeadEdit("parallel-residual", 2, (0, 1)),
        ]
        results[name] = {
            "decompose": lp.decompose(model, blocks, space="all", progress=False).to_dataframe(),
            "edited": [lp.evaluate(model, blocks, e).delta_loss for e in edits],
            "sweep": lp.head_sensitivity(
                model, blocks, layers=[1, 2], n_resamples=50, n_permutations=50, progress=False
            ).to_dataframe(),
            "attribution": lp.head_attribution(model, blocks, n_resamples=50).to_dataframe(),
            "diagonal": lp.diagonal_view(model, blocks, layer=2, head=1, s_par=0.0).to_dataframe(),
        }
    for key in ("decompose", "sweep", "attribution", "diagonal"):
        pd.testing.assert_frame_equal(results["memory"][key], results["disk"][key], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(results["memory"]["edited"], results["disk"]["edited"], rtol=1e-6, atol=1e-9)
    assert np.abs(results["memory"]["edited"]).min() > 1e-6  # the edits change the loss


def test_placement_options_are_checked_before_loading():
    with pytest.raises(ModelSpecError, match="give either device"):
        lp.load_model("toy-gpt2", device="cuda", device_map="auto")
    with pytest.raises(ModelSpecError, match="give device_map too"):
        lp.load_model("toy-gpt2", offload_folder="/tmp/x")
    with pytest.raises(ModelSpecError, match="device_map 'everywhere' unknown; accepted: auto, balanced"):
        lp.load_model("toy-gpt2", device_map="everywhere")
    with pytest.raises(lp.LensParallelError, match="a model placed by device_map over several devices"):
        model = lp.load_model("toy-gpt2", device_map=MAPS["toy-gpt2"])
        lp.head_sensitivity(model, token_blocks(model, "austen", n_docs=2, seq_len=8), workers=2)
