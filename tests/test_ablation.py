from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from lens_parallel import sweep
from lens_parallel.analyses.ablation import run_ablations
from lens_parallel.analyses.evaluate import document_losses
from lens_parallel.analyses.sensitivity import SensitivityResult, head_sensitivity
from lens_parallel.data import token_blocks
from lens_parallel.edits import ABLATIONS, HeadEdit
from lens_parallel.losses import edit_effect
from lens_parallel.models import model_info
from lens_parallel.sweep import AblationJob, head_means

from .conftest import Killed, KillSwitch, get_model

ENGINE_CASES = [("toy-qwen3.5", kind) for kind in ABLATIONS] + [
    (("toy-gpt2", "toy-qwen3")[i % 2], kind) for i, kind in enumerate(ABLATIONS)
]
"""Every kind on gated GQA with linear-attention layers (toy-qwen3.5), and each kind once more on plain multi-head
(toy-gpt2) or grouped-query attention (toy-qwen3), alternately: every kind on two families, every family on two
kinds or more."""


@pytest.mark.parametrize(("spec", "kind"), ENGINE_CASES)
def test_engine_equals_the_naive_loop(spec, kind):
    model = get_model(spec)
    a, b = model_info(model).softmax_layers[-2:]
    blocks = token_blocks(model, "wikipedia-en", n_docs=5, seq_len=20, seed=3)
    jobs = [
        AblationJob(a, (1,)),
        AblationJob(b, (0,)),
        AblationJob(b, (2,)),
        AblationJob(a, (3,)),
        AblationJob(b, (0, 1, 2)),
        AblationJob(a, (0, 3)),
    ]
    run = run_ablations(model, blocks, jobs, ablation=kind, batch_size=2, tokens_per_forward=96, progress=False)
    means = head_means(model, blocks.tokens, [a, b]) if kind == "mean" else {}
    np.testing.assert_allclose(run.base.loss_sum, document_losses(model, blocks).loss_sum, atol=1e-5)
    for job in jobs:
        naive = document_losses(model, blocks, HeadEdit(kind, job.layer, job.heads, means.get(job.layer)))
        np.testing.assert_allclose(run[job].loss_sum, naive.loss_sum, atol=1e-5, err_msg=job.key)
        assert np.abs(naive.loss_sum - run.base.loss_sum).max() > 1e-4  # the edit does something


def test_mean_of_hook_z_is_the_dataset_mean():
    model = get_model("toy-llama")
    tokens = token_blocks(model, "austen", n_docs=3, seq_len=16).tokens
    with torch.inference_mode():
        _, cache = model.run_with_cache(tokens, names_filter=["blocks.1.attn.hook_z"])
    expected = cache["blocks.1.attn.hook_z"].mean((0, 1))
    torch.testing.assert_close(head_means(model, tokens, [1], batch_size=2)[1], expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ABLATIONS)
def test_removing_no_head_changes_nothing(kind):
    model = get_model("toy-qwen2")
    blocks = token_blocks(model, "wikipedia-en", n_docs=3, seq_len=16)
    means = head_means(model, blocks.tokens, [1]) if kind == "mean" else {}
    empty = HeadEdit(kind, 1, torch.zeros(3, 6, dtype=torch.bool), means.get(1))
    assert np.array_equal(document_losses(model, blocks, empty).loss_sum, document_losses(model, blocks).loss_sum)


def test_interrupted_sweep_resumes_to_identical_results(tmp_path, monkeypatch):
    model = get_model("toy-qwen3")
    blocks = token_blocks(model, "wikipedia-en", n_docs=4, seq_len=16)
    jobs = [AblationJob(layer, (h,)) for layer in range(3) for h in range(6)]
    full = run_ablations(model, blocks, jobs, batch_size=2, tokens_per_forward=64, progress=False)
    store = tmp_path / "sweep.jsonl"
    # 2 reference forwards (a batch each), then 2 per chunk: killed in the 5th chunk
    switch = KillSwitch(monkeypatch, sweep, "run_rows", at=11, record=lambda *a, **k: 1)
    with pytest.raises(Killed):
        run_ablations(model, blocks, jobs, batch_size=2, tokens_per_forward=64, store=store, progress=False)
    written = store.read_text().splitlines()
    assert (
        json.loads(written[0])["fingerprint"]["ablation"] == "parallel-value" and len(written) - 1 == 8
    )  # 4 chunks of 2 jobs
    switch.disarm()
    resumed = run_ablations(model, blocks, jobs, batch_size=2, tokens_per_forward=64, store=store, progress=False)
    assert len(switch.calls) == 2 + (18 - 8) // 2 * 2  # the reference pass, then only the 10 missing jobs: 5 chunks x 2
    for job in jobs:
        np.testing.assert_array_equal(resumed[job].loss_sum, full[job].loss_sum)
    with pytest.raises(ValueError, match="was written by a run whose numbers differ"):
        run_ablations(model, blocks, jobs, ablation="zero", store=store, progress=False)


def test_bad_jobs():
    model = get_model("toy-gpt2")
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="empty head set"):
        run_ablations(model, tokens, [AblationJob(0, ())])
    with pytest.raises(ValueError, match=r"heads \[4\] out of range: this model has heads 0..3"):
        run_ablations(model, tokens, [AblationJob(0, (4,))])
    with pytest.raises(ValueError, match=r"unknown ablation 'delete'; accepted: zero, mean"):
        run_ablations(model, tokens, [AblationJob(0, (0,))], ablation="delete")
    with pytest.raises(ValueError, match="empty head set"):
        HeadEdit("zero", 0, ())
    with pytest.raises(ValueError, match=r"a mean head ablation needs softmax-attention layers.*layers \[3\]"):
        run_ablations(get_model("toy-qwen3.5"), tokens, [AblationJob(3, (0,))], ablation="mean")
    with pytest.raises(ValueError, match=r"heads \[4\] out of range.*at layer 3, a linear-attention layer"):
        run_ablations(get_model("toy-qwen3.5"), tokens, [AblationJob(3, (4,))])


def test_head_sensitivity_statistics_and_figure(tmp_path):
    model = get_model("toy-pythia")
    blocks = token_blocks(model, "moby-dick", n_docs=6, seq_len=20)
    result = head_sensitivity(model, blocks, ablation="zero", layers=[0, 2], n_resamples=500, progress=False)
    df = result.to_dataframe()
    assert len(df) == 2 * (4 + 1) and df.label.tolist()[:5] == ["L0H0", "L0H1", "L0H2", "L0H3", "L0*"]
    heads = df[df["head"].notna()]
    assert (heads.q_bh >= heads.p - 1e-12).all() and heads.p.between(0, 1).all()
    assert (heads.ci_lo <= heads.delta_loss).all() and (heads.delta_loss <= heads.ci_hi).all()
    base = document_losses(model, blocks)
    ref = edit_effect(base, document_losses(model, blocks, HeadEdit("zero", 2, (1,))))
    assert result.head_delta[1, 1] == pytest.approx(ref.delta_loss, abs=1e-6)
    joint = edit_effect(base, document_losses(model, blocks, HeadEdit("zero", 0, (0, 1, 2, 3))))
    assert result.joint_delta[0] == pytest.approx(joint.delta_loss, abs=1e-6)
    fig = result.figure()
    assert any("not a CI" in (t.name or "") for t in fig.data)
    hybrid = get_model("toy-qwen3.5")
    skipped = head_sensitivity(
        hybrid,
        token_blocks(hybrid, "austen", n_docs=3, seq_len=12),
        ablation="mean",
        n_resamples=100,
        n_permutations=100,
        progress=False,
    )
    assert skipped.layers == (1, 2)  # hook_z's mean: softmax layers only (the other ablations cover every layer)
    assert "skipped layers [0, 3, 4] (linear-attention)" in skipped.provenance.settings["skipped"]
    result.save(tmp_path / "sens")
    pd.testing.assert_frame_equal(SensitivityResult.load(tmp_path / "sens").to_dataframe(), df)
