"""Non-finite is never a number: a model whose forward produces NaN or infinity (a NaN weight; a half-precision
overflow) is refused by every analysis in one line naming the first hook point, the parameter and the likely cause,
never reported as a loss of 0 or an effect of 0."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import lens_parallel as lp
from lens_parallel import NonFiniteError
from lens_parallel.losses import scored_sums
from lens_parallel.models import load_model


def _parameter(model, layer: int, *parts: str) -> torch.nn.Parameter:
    """The Hugging Face parameter of ``layer`` whose (bridge-wrapped) name holds every one of ``parts``."""
    (found,) = [
        p
        for n, p in model.original_model.named_parameters()
        if f".h.{layer}." in n and all(part in n for part in parts)
    ]
    return found


def nan_weight_toy():
    """toy-gpt2 with one NaN in layer 1's query/key/value weights: a plain forward gives NaN logits from layer 1."""
    model = load_model("toy-gpt2")
    with torch.no_grad():
        _parameter(model, 1, "attn.qkv", "weight")[0, 0] = float("nan")
    return model


def overflowing_toy(dtype: torch.dtype):
    """toy-gpt2 in ``dtype`` whose layer-1 MLP LayerNorm scale is just below the dtype's largest value: every weight
    is finite, but the normalised activations overflow to infinity."""
    model = load_model("toy-gpt2", dtype=dtype)
    with torch.no_grad():
        _parameter(model, 1, "ln_2", "weight").fill_(torch.finfo(dtype).max * 0.9)
    return model


def _task_effects(model, docs):
    return lp.task_effects(model, lp.ComponentScale("value", s_par=0.0), [("copa", 0)], limit=2, progress=False)


ANALYSES = {
    "evaluate": lambda m, d: lp.evaluate(m, d, lp.ComponentScale("value", s_par=0.0), n_resamples=50),
    "sensitivity": lambda m, d: lp.head_sensitivity(m, d, layers=[1], n_resamples=50, progress=False),
    "decompose": lambda m, d: lp.decompose(m, d, progress=False),
    "null": lambda m, d: lp.causal_null(m, d),
    "attribution": lambda m, d: lp.head_attribution(m, d, layers=[1], n_resamples=50, progress=False),
    "scaling": lambda m, d: lp.scale_sweep(m, d, s_par=(0.0,), s_perp=(1.0,), n_resamples=50, progress=False),
    "task_effects": _task_effects,
}


@pytest.mark.parametrize("name", list(ANALYSES))
def test_a_nan_weight_is_refused_by_every_analysis_naming_where_it_starts(name):
    model = nan_weight_toy()
    docs = lp.token_blocks(model, n_docs=4, seq_len=16)
    with pytest.raises(NonFiniteError) as refused:
        ANALYSES[name](model, docs)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("toy-gpt2: the forward produced non-finite activations")
    assert "first at blocks.1.attn" in message, message  # layer 0 is finite: the NaN enters at layer 1's attention
    # the bridge holds GPT-2's fused c_attn as q / k / v views of one tensor: the NaN is in each view's first column
    assert re.search(r"the parameter transformer\.h\.1\.attn\.(q|qkv)\.weight holds NaN or infinity", message), message


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["evaluate", "decompose", "attribution"])
def test_a_half_precision_overflow_is_refused_with_its_cause(dtype, name):
    model = overflowing_toy(dtype)
    assert all(torch.isfinite(p).all() for p in model.parameters())  # no weight is the problem
    docs = lp.token_blocks(model, n_docs=4, seq_len=16)
    with pytest.raises(NonFiniteError) as refused:
        ANALYSES[name](model, docs)
    kind = str(dtype).removeprefix("torch.")
    message = str(refused.value)
    assert f"first at blocks.1.ln2.hook_out ({kind}); likely a {kind} overflow: load the model in float32" in message


def test_the_same_toys_are_finite_without_the_fault():
    """The faults above are what the refusals are about: the same toy, untouched, runs every analysis."""
    model = load_model("toy-gpt2")
    docs = lp.token_blocks(model, n_docs=4, seq_len=16)
    effect = ANALYSES["evaluate"](model, docs)
    assert np.isfinite(effect.loss_edited) and effect.delta_loss != 0.0


def test_scored_sums_keep_a_nan_at_a_scored_position_and_leave_out_the_rest():
    nll = torch.tensor([[1.0, 2.0, float("nan")], [float("nan"), 4.0, float("nan")]])
    lengths = torch.tensor([3, 3])  # each document scores positions 0-1 (position 2 is past its end)
    sums = scored_sums(nll, lengths)
    assert sums[0].item() == 3.0 and torch.isnan(sums[1])  # document 1's NaN at position 0 is a scored token
    assert scored_sums(nll, lengths, torch.tensor([0, 1]))[1].item() == 4.0  # position 0 not scored
