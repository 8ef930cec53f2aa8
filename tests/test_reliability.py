from __future__ import annotations

import numpy as np
import pytest
import torch

from lens_parallel.analyses.evaluate import document_losses
from lens_parallel.analyses.nulls import causal_null
from lens_parallel.analyses.reliability import (
    SanityReport,
    SplitHalfResult,
    sanity_report,
    split_half_reliability,
    verdict,
)
from lens_parallel.data import token_blocks
from lens_parallel.edits import HeadEdit
from lens_parallel.models import model_info
from lens_parallel.results import Provenance

from .conftest import get_model


def test_verdict_thresholds():
    assert [verdict(r) for r in (0.9, 0.6, 0.59, 0.3, 0.29, float("nan"))] == [
        "reliable",
        "reliable",
        "attenuated",
        "attenuated",
        "unresolvable",
        "unresolvable",
    ]


def test_identical_halves_give_r_one():
    rng = np.random.default_rng(0)
    stat, delta = rng.normal(size=(3, 4)), rng.normal(size=(3, 4))
    provenance = Provenance.of(
        model_info(get_model("toy-gpt2")), torch.zeros(4, 10, dtype=torch.long), "test", {}, None
    )
    same = SplitHalfResult(
        ablation="zero",
        layers=(0, 1, 2),
        halves=((0, 1), (2, 3)),
        cos_self=np.stack([stat, stat]),
        excess=np.stack([stat, stat]),
        delta=np.stack([delta, delta]),
        provenance=provenance,
    )
    c = same.correlations("excess")
    assert c["r_stat"] == 1.0 and c["r_delta"] == 1.0 and c["rho_max"] == 1.0 and c["verdict"] == "reliable"
    assert c["rho_disattenuated"] == pytest.approx(c["rho_raw"])


def test_split_half_uses_disjoint_halves_and_the_ablation_effects():
    model = get_model("toy-qwen3")
    blocks = token_blocks(model, "wikipedia-en", n_docs=6, seq_len=16)
    result = split_half_reliability(model, blocks, ablation="zero", seed=3, progress=False)
    a, b = result.halves
    assert sorted(a + b) == list(range(6)) and not set(a) & set(b) and len(a) == 3
    half = blocks.tokens[list(b)]
    base = document_losses(model, half)
    # the paper's frozen protocol: the head is removed at every position but the first
    naive = document_losses(model, half, HeadEdit("zero", 2, (4,), positions="after-first"))
    assert result.delta[1, 2, 4] == pytest.approx(naive.loss - base.loss, abs=1e-6)
    everywhere = document_losses(model, half, HeadEdit("zero", 2, (4,)))
    assert abs(everywhere.loss - naive.loss) > 1e-4  # position 0 matters
    assert result.provenance.settings["positions"] == "after-first"
    alone = causal_null(model, half, seed=0, n_resamples=100)  # cos_self does not depend on the null draws
    np.testing.assert_allclose(result.cos_self[1], alone.cos_self.mean(0), atol=1e-6)
    excess = result.excess.mean(0)  # the halves' mean excess is the whole null's excess (equal halves)
    np.testing.assert_allclose(excess, causal_null(model, blocks, seed=3, n_resamples=100).excess, atol=1e-12)
    df = result.correlation_table()
    assert list(df.statistic) == ["cos_self", "cos_self", "excess", "excess"]
    assert list(df.method) == ["pooled", "cross-half"] * 2
    tidy = result.to_dataframe()  # one row per (half, layer, head)
    assert len(tidy) == result.delta.size
    np.testing.assert_array_equal(tidy.delta_loss, result.delta.ravel())
    assert set(df.verdict) <= {"reliable", "attenuated", "unresolvable"}
    with pytest.raises(ValueError, match="at least 4 documents"):
        split_half_reliability(model, blocks.tokens[:3])


def test_sanity_report_row_and_figure():
    model = get_model("toy-llama")
    blocks = token_blocks(model, "austen", n_docs=4, seq_len=12)
    report = sanity_report(model, blocks, progress=False)
    alone = split_half_reliability(model, blocks, progress=False)  # same seed: the report reuses its null pass
    for field in ("cos_self", "excess", "delta"):
        np.testing.assert_array_equal(getattr(report.split_half, field), getattr(alone, field))
    row = report.summary()
    assert len(row) == 1
    for column in (
        "cos_self",
        "cos_null",
        "excess",
        "self_specific_fraction",
        "within_excess",
        "across_excess",
        "r_stat_excess",
        "r_delta_excess",
        "verdict_excess",
    ):
        assert column in row.columns
    titles = [a.text for a in report.figure().layout.annotations]
    assert titles[:2] == ["self-cosine vs earlier-position null", "GQA: within- vs across-group excess"]
    assert titles[2].startswith("excess: r_stat") and titles[3].startswith("Δ loss (parallel-value): r_delta")
    heads = [t for t in report.figure().data if t.name == "one head"]  # bottom row: the split-half scatters
    assert [t.xaxis for t in heads] == ["x3", "x4"]
    assert len(heads[0].x) == len(report.split_half.layers) * model_info(model).n_heads
    # one kv head (no GQA panel): the null panel spans the top row, the scatters stay in the bottom row
    single = SanityReport(
        null=causal_null(model, blocks, n_resamples=100), split_half=report.split_half, provenance=report.provenance
    )
    fig = single.figure()
    assert [a.text for a in fig.layout.annotations][:2] == ["self-cosine vs earlier-position null", titles[2]]
    assert fig.layout.xaxis.domain == (0.0, 1.0)
    assert [t.xaxis for t in fig.data if t.name == "one head"] == ["x2", "x3"]
