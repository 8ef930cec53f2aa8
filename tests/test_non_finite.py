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


def _faulty(fault: str):
    """toy-gpt2 with one NaN in layer 1's attention output projection (``nan``), or an infinite final LayerNorm
    scale (``inf``): the battery's two faults, both of which used to decode into text ('!!!!!', '#####')."""
    model = load_model("toy-gpt2")
    with torch.no_grad():
        if fault == "nan":
            _parameter(model, 1, "attn.o", "weight")[0, 0] = float("nan")
        else:
            next(p for n, p in model.original_model.named_parameters() if "ln_f" in n).fill_(float("inf"))
    return model


EXPECTED = {
    "nan": ("first at blocks.1.attn.o.hook_out", "transformer.h.1.attn.o.weight"),
    "inf": ("first at ln_final.hook_out", "transformer.ln_f.weight"),
}


def _decoding_paths(model):
    """Every path that turns logits into text or a score, each under the unedited model and a decode-safe edit."""
    from lens_parallel.downstream.lm import EditedLM

    class Request:
        args = ("Question: what is two plus two?\nAnswer:", {"until": ["\n"], "max_gen_toks": 4})

    return {
        "greedy": lambda: lp.generate(model, ["Hello", "Once upon a time"], max_new_tokens=5, progress=False),
        "sampling": lambda: lp.generate(model, ["Hello"], lp.ZeroDiagonal(), max_new_tokens=5, do_sample=True),
        "generate_until": lambda: EditedLM(model, (lp.ZeroDiagonal(),), progress=False).generate_until([Request()]),
        "task": lambda: lp.task_effects(model, lp.ZeroDiagonal(), ["gsm8k_cot"], limit=1, max_gen_toks=4),
    }


@pytest.mark.parametrize("fault", ["nan", "inf"])
@pytest.mark.parametrize("path", ["greedy", "sampling", "generate_until", "task"])
def test_non_finite_logits_are_refused_by_every_decoding_path_naming_where_they_start(fault, path):
    model = _faulty(fault)
    with pytest.raises(NonFiniteError) as refused:
        _decoding_paths(model)[path]()
    message = str(refused.value)
    hook, parameter = EXPECTED[fault]
    assert "\n" not in message and message.startswith("toy-gpt2: the forward produced non-finite activations")
    assert hook in message and f"the parameter {parameter} holds NaN or infinity" in message, message


def test_the_decoding_loop_reads_its_non_finite_flag_once_per_batch(monkeypatch):
    """The per-row flag stays on the device while decoding (a GPU never waits for it per step): its one read is
    ``bool(non_finite.any())`` after the batch; a finite batch returns its texts."""
    from lens_parallel.generation import decode

    reads = []
    real_any = torch.Tensor.any

    def counted(self, *args, **kwargs):
        out = real_any(self, *args, **kwargs)
        if self.dtype == torch.bool and self.dim() == 1 and not args and not kwargs:
            reads.append(self.shape[0])
        return out

    monkeypatch.setattr(torch.Tensor, "any", counted)
    model = load_model("toy-gpt2")
    result = lp.generate(model, ["Hello", "Once upon a time", "1, 2"], max_new_tokens=6, batch_size=2, progress=False)
    assert reads == [2, 1]  # one read per batch (batches of 2 and 1 prompts), none per step
    assert all(len(t) == 6 for t in result.tokens[0]) and decode.Decoded  # six steps each, finite


def test_the_explorer_panel_shows_the_refusal_instead_of_a_text(tmp_path):
    from lens_parallel.explore import Explorer
    from lens_parallel.explore_widget import ExplorerWidget

    model = load_model("toy-gpt2")
    explorer = Explorer(model, lp.token_blocks(model, "wikipedia-en", n_docs=2, seq_len=12))
    widget = ExplorerWidget(explorer, save_to=tmp_path)
    with torch.no_grad():
        _parameter(model, 1, "attn.o", "weight")[0, 0] = float("nan")
    widget.prompt.value, widget.new_tokens.value = "Once upon a time", 4
    widget.run_generation.click()
    shown = widget.generated.value
    assert shown.startswith("<b>not generated</b>") and "first at blocks.1.attn.o.hook_out" in shown, shown
