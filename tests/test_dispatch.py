"""Launch overhead, measured without a GPU: the operations each analysis dispatches (PyTorch's dispatch mode) with
the work sizes a GPU chooses, against Hugging Face's own SDPA forward on the same input, and no tensor read on the
host inside a forward (each such read makes a GPU's host wait for it)."""

from __future__ import annotations

import traceback
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

import lens_parallel as lp
from lens_parallel import devices
from lens_parallel.devices import sized_as
from lens_parallel.documents import Documents
from lens_parallel.models import load_model, toy_folder

LENGTHS = (128, 1024)
CASES = {
    "decompose(value)": lambda m, d: lp.decompose(m, d, space="value", progress=False),
    "decompose(value-exclude-self)": lambda m, d: lp.decompose(m, d, space="value-exclude-self", progress=False),
    "decompose(residual-attn)": lambda m, d: lp.decompose(m, d, space="residual-attn", progress=False),
    "evaluate": lambda m, d: lp.evaluate(m, d, lp.ComponentScale("value", s_par=0.0), n_resamples=20),
    "causal_null(exact)": lambda m, d: lp.causal_null(m, d, null="exact"),
}
PER_LAYER_OVER_HF = {
    "decompose(value)": 2.5,
    "decompose(value-exclude-self)": 3.0,
    "decompose(residual-attn)": 3.5,
    "evaluate": 10.0,
    "causal_null(exact)": 4.0,
}
"""Each case's kernels per layer over HF's SDPA forward's (as measured: 2.43, 2.76, 3.38, 9.74 and 3.85 on
toy-qwen3; ``benchmarks/dispatch_counts.py``): a rise above these is a regression to look at."""


@pytest.fixture(scope="module")
def setup():
    folder = toy_folder("toy-qwen3", n_ctx=max(LENGTHS))
    model = load_model(str(folder))
    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    docs = {}
    for n in LENGTHS:
        ids = torch.randint(model.cfg.d_vocab, (n,), generator=torch.Generator().manual_seed(n))
        docs[n] = Documents.padded([ids.tolist()], {"source": "random token ids"})
    return model, hf, docs


def _kernels(fn) -> int:
    fn()  # lazy initialisation dispatches once
    with devices.dispatch_counts() as counts:
        fn()
    return sum(counts.kernels.values())


def test_no_analysis_dispatches_more_as_documents_grow_and_each_stays_near_hf(setup):
    """With a GPU's work sizes, no count grows with the length (HF's does not), and each stays within its recorded
    multiple of HF's per layer. Before the diagonal path ran on CUDA, value-exclude-self's count grew with the
    length (the blocked path: 154.7 -> 394.7 kernels per layer from 1,024 to 8,192 tokens) and evaluate's 7.6-fold
    (a vocabulary scan in cache-sized blocks)."""
    model, hf, docs = setup
    with sized_as("cuda"), torch.inference_mode():
        hf_counts = {n: _kernels(lambda n=n: hf.model(docs[n].tokens)) for n in LENGTHS}
    assert hf_counts[LENGTHS[0]] == hf_counts[LENGTHS[1]]
    for name, case in CASES.items():
        with sized_as("cuda"):
            counts = {n: _kernels(lambda n=n, case=case: case(model, docs[n])) for n in LENGTHS}
        assert counts[LENGTHS[0]] == counts[LENGTHS[1]], (name, counts)
        assert counts[LENGTHS[1]] <= PER_LAYER_OVER_HF[name] * hf_counts[LENGTHS[1]], (name, counts, hf_counts)


def test_the_cpu_scan_is_cache_sized_and_the_gpu_scan_is_not(setup):
    """The same evaluate dispatches more on a CPU's sizes (blocks of 1,024 positions x 2,048 vocabulary columns, 8 MB
    of logits) than on a GPU's: the sizes are chosen per device, and the numbers do not depend on them."""
    model, _, docs = setup
    found = {}
    for kind in ("cpu", "cuda"):
        with sized_as(kind):
            counts = _kernels(lambda: CASES["evaluate"](model, docs[LENGTHS[1]]))
            found[kind] = (counts, CASES["evaluate"](model, docs[LENGTHS[1]]))
    assert found["cpu"][0] > 2 * found["cuda"][0]  # 4,129 against 1,609 here (the scan: 4x the steps)
    assert found["cpu"][1].delta_loss == pytest.approx(found["cuda"][1].delta_loss, rel=1e-6, abs=1e-9)


READS = ("item", "cpu", "tolist", "numpy", "__bool__", "__int__", "__float__")
"""What reads a tensor on the host (on a GPU: the host waits for every kernel queued before it)."""


def test_no_analysis_reads_a_tensor_on_the_host_inside_a_forward(setup, monkeypatch):
    """Every read of a tensor on the host while the model's forward runs, wherever it comes from: only Hugging Face's
    own mask check (transformers' masking_utils, once per forward, as in its own SDPA forward) may do it."""
    model, _, docs = setup
    inside, found = [0], Counter()
    real_forward = type(model).forward

    def forward(self, *args, **kwargs):
        inside[0] += 1
        try:
            return real_forward(self, *args, **kwargs)
        finally:
            inside[0] -= 1

    def spy(name: str):
        real = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if inside[0]:
                frames = [
                    f for f in traceback.extract_stack()[:-1] if "site-packages" in f.filename or "lens_" in f.filename
                ]
                found[f"{name} at {frames[-1].filename.rsplit('/', 2)[-2:]}:{frames[-1].lineno}"] += 1
            return real(self, *args, **kwargs)

        return read

    monkeypatch.setattr(type(model), "forward", forward)
    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, spy(name))
    blocks = docs[LENGTHS[0]]
    for name, case in {
        **CASES,
        "head_sensitivity": lambda m, d: lp.head_sensitivity(m, d, layers=[1], n_resamples=20, progress=False),
        "head_attribution": lambda m, d: lp.head_attribution(m, d, layers=[1], n_resamples=20, progress=False),
        "residual-attn head edit": lambda m, d: lp.evaluate(
            m, d, lp.ComponentScale("residual-attn", s_par=0.0, heads=(0, 1)), n_resamples=20
        ),
    }.items():
        found.clear()
        case(model, blocks)
        ours = {where: n for where, n in found.items() if "masking_utils" not in where}
        assert ours == {}, (name, ours)


def test_what_decompose_adds_at_linear_attention_layers_does_not_grow_with_the_length():
    """toy-qwen3.5 (3 Gated DeltaNet layers, 2 gated softmax): with a GPU's work sizes, the operations decompose
    dispatches beyond the forward (three spaces, every layer: the captures, a_tt, the reductions) are as many at
    1,024 tokens as at 256. The forward's own count grows: transformers' chunked delta rule (its fallback without
    flash-linear-attention) loops over chunks of 64 positions in Python, a loop of the model, not of lens_parallel."""
    from lens_parallel.hooks import forward

    model = load_model(str(toy_folder("toy-qwen3.5", n_ctx=1024)))
    added, own = {}, {}
    spaces = ["value", "value-exclude-self", "residual-attn"]
    for n in (256, 1024):
        ids = torch.randint(5000, (n,), generator=torch.Generator().manual_seed(n))
        docs = Documents.padded([ids.tolist()], {"source": "random token ids"})
        with sized_as("cuda"):
            own[n] = _kernels(lambda docs=docs: forward(model, docs.tokens))
            added[n] = _kernels(lambda docs=docs: lp.decompose(model, docs, space=spaces, progress=False)) - own[n]
    assert added[256] == added[1024] > 0, added
    assert own[1024] > own[256], own  # the model's chunk loop: what the comparison above takes out
