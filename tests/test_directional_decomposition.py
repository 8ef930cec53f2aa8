"""The directional-decomposition paper's frozen-model protocol: layers skipped, the reference clamp, its grids and
its scale-1 canary, against hand computations and the unedited model."""

from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np
import pytest
import torch

import lens_parallel as lp
from lens_parallel import geometry
from lens_parallel.analyses import scaling
from lens_parallel.data import token_blocks
from lens_parallel.edits import compile_hooks, describe_edit, noop
from lens_parallel.losses import DocLosses
from lens_parallel.models import model_info
from lens_parallel.protocols import DIRECTIONAL_DECOMPOSITION
from lens_parallel.sweep import EditJob

from .conftest import get_model

SETTINGS = DIRECTIONAL_DECOMPOSITION.settings_for(lp.ScaleSettings)


@pytest.fixture(scope="module")
def setup():
    model = get_model("toy-qwen2")
    return model, token_blocks(model, "austen", n_docs=3, seq_len=16, seed=2)


def _run(model, tokens, hooks, names):
    """The activations ``names`` and the logits of one forward under ``hooks``."""
    seen = {}

    def keep(tensor, hook, *, name):
        seen[name] = tensor.detach().clone()

    with torch.inference_mode(), model.hooks(fwd_hooks=[*hooks, *((n, partial(keep, name=n)) for n in names)]):
        logits = model(tokens, return_type="logits")
    return seen, logits


def test_the_protocol_never_edits_layer_0(setup):
    model, blocks = setup
    info = model_info(model)
    noops, points = scaling._jobs(SETTINGS, scaling._space_layers(info, SETTINGS.space, None, 1))
    jobs = [*noops.values(), *(job for job, _ in points.values())]
    assert len(points) == 11 + 9 + 2 * (11 + 7)  # the paper's grids: value s_perp 0..2, residual 0..1.5
    for job in jobs:
        hooks = compile_hooks(model, job.edits)
        assert hooks and not [name for name, _ in hooks if name.startswith("blocks.0.")], job.key
    names = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    plain, plain_logits = _run(model, blocks.tokens, [], names)
    for sp in SETTINGS.space:
        job = points[f"{sp}|s_par|s_par=0.0|s_perp=1.0|layer=None"][0]
        seen, logits = _run(model, blocks.tokens, compile_hooks(model, job.edits), names)
        assert torch.equal(seen[names[0]], plain[names[0]]), sp  # layer 0 bit-identical
        assert not torch.equal(seen[names[1]], plain[names[1]]), sp  # layer 1 is edited
        assert (logits - plain_logits).abs().max() > 1e-4


def test_skip_first_layers_wraps_any_edit(setup):
    model, blocks = setup
    n = model_info(model).n_layers
    for edit, explicit in (
        (lp.ZeroDiagonal(), lp.ZeroDiagonal(layers=range(1, n))),
        (lp.ComponentScale("residual-mlp", s_par=0.0), lp.ComponentScale("residual-mlp", 0.0, layers=range(1, n))),
        (lp.RandomDirectionRemoval(seed=2), lp.RandomDirectionRemoval(seed=2, layers=range(1, n))),
    ):
        wrapped = lp.SkipFirstLayers(edit)
        _, got = _run(model, blocks.tokens, compile_hooks(model, wrapped), [])
        _, want = _run(model, blocks.tokens, compile_hooks(model, explicit), [])
        assert torch.equal(got, want), type(edit).__name__
        assert wrapped.layers is None
    scale = lp.SkipFirstLayers(lp.ComponentScale("value", s_par=0.0, layers=(0, 2)), n=1)
    assert scale.layers == (2,)
    assert noop(scale) == (lp.SkipFirstLayers(lp.ComponentScale("value", layers=(0, 2)), n=1),)
    assert noop(lp.SkipFirstLayers(lp.ZeroDiagonal())) == ()  # no matched no-op: compared with the unedited model
    assert describe_edit(scale)["edit"]["space"] == "value"
    with pytest.raises(lp.LensParallelError, match="leaves no layer"):
        compile_hooks(model, lp.SkipFirstLayers(lp.ZeroDiagonal(), n=n))
    with pytest.raises(lp.LensParallelError, match="edits only layers before 2"):
        compile_hooks(model, lp.SkipFirstLayers(lp.ZeroDiagonal(layers=(0, 1)), n=2))
    with pytest.raises(lp.LensParallelError, match="positive integer"):
        lp.SkipFirstLayers(lp.ZeroDiagonal(), n=0)

    @dataclasses.dataclass(frozen=True)
    class Unlayered:  # a user edit that does not say which layers it edits
        def hooks(self, model, info):
            return lp.ZeroDiagonal().hooks(model, info)

    assert not hasattr(lp.SkipFirstLayers(Unlayered()), "layers")


def test_the_clamp_projects_every_position_as_a_hand_computation():
    m = torch.tensor([[1.0, 2.0, 0.0], [3.0, -1.0, 2.0]], dtype=torch.float64)
    r = torch.tensor([[1e-4, 0.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    excluded = geometry.project(m, r, eps=1e-3)
    clamped = geometry.project(m, r, eps=1e-3, clamp=True)
    # |r|^2 = 1e-8 < 1e-6: excluded leaves m whole; the clamp divides by 1e-6
    assert excluded.valid.tolist() == [False, True] and clamped.valid.tolist() == [True, True]
    assert excluded.coef[0] == 0.0 and clamped.coef[0] == pytest.approx(1e-4 / 1e-6)
    np.testing.assert_allclose(clamped.par[0].numpy(), [1e-4 * 100.0, 0.0, 0.0])
    assert clamped.coef[1] == excluded.coef[1] == pytest.approx(2.0 / 2.0)
    np.testing.assert_array_equal((clamped.par + clamped.perp).numpy(), m.numpy())


def test_the_clamp_changes_nothing_where_no_reference_is_tiny(setup):
    model, blocks = setup
    for space in ("value-exclude-self", "residual-attn"):
        plain = lp.ComponentScale(space, s_par=0.0, eps=1e-3)
        _, want = _run(model, blocks.tokens, compile_hooks(model, plain), [])
        _, got = _run(model, blocks.tokens, compile_hooks(model, dataclasses.replace(plain, guard="clamp")), [])
        assert torch.equal(got, want), space
    with pytest.raises(lp.LensParallelError, match="unknown guard 'floor'"):
        lp.ComponentScale("value", guard="floor")


def test_the_protocol_sweep_runs_its_grids_and_canary(setup):
    model, blocks = setup
    result = lp.scale_sweep(model, blocks, protocol="directional-decomposition", n_resamples=50, progress=False)
    df = result.to_dataframe()
    counts = df.groupby(["space", "vary"]).size().to_dict()
    assert counts[("value-exclude-self", "s_perp")] == 9 and counts[("residual-mlp", "s_perp")] == 7
    assert counts[("residual-attn", "s_par")] == 11
    at_one = df[(df.s_par == 1.0) & (df.s_perp == 1.0)]
    assert len(at_one) == 6 and (at_one.delta_loss == 0.0).all()  # the scale-1 points of both axes, exactly 0
    layers = range(1, model_info(model).n_layers)
    bare = lp.evaluate(model, blocks, lp.ComponentScale("residual-mlp", s_par=0.0, layers=layers))
    row = df[(df.space == "residual-mlp") & (df.vary == "s_par") & (df.s_par == 0.0)].iloc[0]
    assert row.delta_loss == pytest.approx(bare.delta_loss, abs=5e-6)  # float32 forwards batched differently
    excluded = lp.scale_sweep(
        model, blocks, protocol="directional-decomposition", guard="exclude", n_resamples=50, progress=False
    ).to_dataframe()
    np.testing.assert_array_equal(excluded.delta_loss, df.delta_loss)  # the clamp never binds on this toy


def test_the_canary_refuses_a_no_op_that_moves_the_loss():
    noop_job, unedited = EditJob("noop", ()), EditJob("unedited", ())
    n_tokens = np.array([10, 10])
    run = {noop_job: DocLosses(np.array([5.0, 6.0]), n_tokens), unedited: DocLosses(np.array([5.0, 6.0]), n_tokens)}
    scaling._check_unedited(run, {"value": noop_job}, unedited)  # equal: passes
    run[noop_job] = DocLosses(np.array([5.0, 6.0 + 1e-6]), n_tokens)
    with pytest.raises(lp.LibraryError, match="differs from the unedited model by 1e-06"):
        scaling._check_unedited(run, {"value": noop_job}, unedited)
