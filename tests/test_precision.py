"""Half precision end to end: every analysis runs on a bfloat16 model (its reductions in float64) and gives what
the float32 model gives, to bfloat16's rounding of the weights and activations (toy-qwen3: GQA, q/k norms).

The tolerances are loose on purpose: a random-weight toy in bfloat16 carries 8 mantissa bits through every
layer; what is tested is that each path runs, stays finite, and lands where float32 does. The real model's
measured differences are in the models guide (``benchmarks/precision.py``) and asserted in ``tests/test_smollm2.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lens_parallel as lp
from lens_parallel.edits import ComponentScale
from lens_parallel.models import load_model

from .conftest import get_model

SPEC = "toy-qwen3"


@pytest.fixture(scope="module")
def models():
    return {"float32": get_model(SPEC), "bfloat16": load_model(SPEC, dtype=torch.bfloat16)}


def _docs(model):
    return lp.token_blocks(model, "wikipedia-en", n_docs=4, seq_len=24, seed=0)


ANALYSES = {
    "decompose": (lambda m, d: lp.decompose(m, d, space="value", progress=False).table("value").self_cos, 0.03),
    "causal_null": (lambda m, d: lp.causal_null(m, d, progress=False).excess, 0.03),
    "head_sensitivity": (
        lambda m, d: (
            lp.head_sensitivity(m, d, ablation="zero", n_resamples=50, n_permutations=50, progress=False).head_delta
        ),
        0.02,
    ),
    "head_attribution": (
        lambda m, d: lp.head_attribution(m, d, ablation="parallel-value", progress=False).estimate,
        0.02,
    ),
    "evaluate": (lambda m, d: lp.evaluate(m, d, ComponentScale("value", s_par=0.0)).delta_loss, 0.02),
    "scale_sweep": (
        lambda m, d: np.array(
            [p.effect.delta_loss for p in lp.scale_sweep(m, d, s_par=(0.0, 2.0), s_perp=(), progress=False).points]
        ),
        0.02,
    ),
    # the value spaces only: the residual view's dA divides by a component that can be near 0 (ill-conditioned in
    # any precision; in bfloat16 its per-head means move by up to 0.4 on this random toy)
    "diagonal_view": (lambda m, d: lp.diagonal_view(m, d, layer=1, head=0, progress=False).da_mean[:2], 0.03),
    "head_dominance": (
        lambda m, d: lp.head_dominance(m, d, query_positions=[8, 16], progress=False).qkv,
        0.05,
    ),
    "compression_error": (
        lambda m, d: (
            lp.compression_error(m, d, method=("int8",), progress=False)
            .to_dataframe()
            .select_dtypes("number")
            .to_numpy()
        ),
        0.05,
    ),
}


@pytest.mark.parametrize("name", list(ANALYSES))
def test_every_analysis_runs_in_bfloat16_close_to_float32(models, name):
    run, atol = ANALYSES[name]
    got = {dtype: np.asarray(run(model, _docs(model)), dtype=np.float64) for dtype, model in models.items()}
    assert got["bfloat16"].shape == got["float32"].shape
    finite = np.isfinite(got["float32"])
    assert (np.isfinite(got["bfloat16"]) == finite).all()
    np.testing.assert_allclose(got["bfloat16"][finite], got["float32"][finite], rtol=0.1, atol=atol, err_msg=name)
