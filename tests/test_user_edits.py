"""An edit defined outside the package (the Edit protocol: a frozen dataclass with ``hooks(model, info)`` and a
``noop()``) runs wherever the built-in ones do: evaluate, the sweep engine (with a store), and the report."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import lens_parallel as lp
from lens_parallel.data import token_blocks
from lens_parallel.edits import as_edits
from lens_parallel.hooks import hook_name
from lens_parallel.losses import token_nll
from lens_parallel.sweep import EditJob, run_sweep

from .conftest import get_model


@dataclass(frozen=True)
class DampResidual:
    """Scale the residual stream entering ``layer`` by ``factor`` (a user's own intervention)."""

    layer: int
    factor: float = 0.5

    @property
    def layers(self) -> tuple[int]:  # optional: lets the engine resume a job at this layer
        return (self.layer,)

    def hooks(self, model, info):
        if not 0 <= self.layer < info.n_layers:
            raise lp.LensParallelError(f"layer {self.layer} out of range")
        return [(hook_name(self.layer, "resid_pre"), lambda x, hook: x * self.factor)]

    def noop(self) -> DampResidual:
        return dataclasses.replace(self, factor=1.0)


def _by_hand(model, tokens, factor: float) -> np.ndarray:
    """Per-document NLL sums with the residual entering layer 1 scaled, hooks written here."""
    with torch.inference_mode(), model.hooks(fwd_hooks=[(hook_name(1, "resid_pre"), lambda x, hook: x * factor)]):
        return token_nll(model(tokens, return_type="logits"), tokens).sum(-1).double().numpy()


def test_a_user_defined_edit_runs_in_evaluate_a_sweep_and_the_report(tmp_path):
    model = get_model("toy-gpt2")
    blocks = token_blocks(model, "wikipedia-en", n_docs=4, seq_len=12)
    edit = DampResidual(1, 0.5)
    expected = (_by_hand(model, blocks.tokens, 0.5).sum() - _by_hand(model, blocks.tokens, 1.0).sum()) / (4 * 11)
    effect = lp.evaluate(model, blocks, edit)
    # the engine's chunked loss and the full logits here round differently in float32 (per-document sums ~1e-6)
    assert effect.delta_loss == pytest.approx(expected, abs=1e-6) and abs(effect.delta_loss) > 1e-3
    assert effect.provenance.settings["edits"][0]["type"].endswith("DampResidual")
    jobs = [EditJob("damp", (edit,), start_layer=1), EditJob("noop", (edit.noop(),), start_layer=1)]
    run = run_sweep(model, blocks, jobs, store=tmp_path / "store.jsonl", progress=False)
    np.testing.assert_allclose(run[jobs[0]].loss_sum, _by_hand(model, blocks.tokens, 0.5), rtol=1e-5)
    again = run_sweep(model, blocks, jobs, store=tmp_path / "store.jsonl", progress=False)  # read from the store
    np.testing.assert_array_equal(again[jobs[0]].loss_sum, run[jobs[0]].loss_sum)
    report = lp.run_battery(model, blocks, edits=(edit,), progress=False)
    assert report.edit_effects[0].delta_loss == pytest.approx(effect.delta_loss, rel=1e-9)
    page = lp.write_report([report], tmp_path / "report").read_text()
    table = (tmp_path / "report" / "tables" / "toy-gpt2_edits.csv").read_text()
    assert '<section id="edits">' in page and "DampResidual(layer=1, factor=0.5)" in table
    with pytest.raises(lp.LensParallelError, match="layer 9 out of range"):
        lp.evaluate(model, blocks, DampResidual(9))
    with pytest.raises(lp.LensParallelError, match="an edit has a hooks"):
        as_edits(object())  # what evaluate, sweeps and the report check every edit with
