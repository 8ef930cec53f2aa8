"""Word perplexity of whole texts (the directional-decomposition paper's Fig. 3 metric): lm-eval's rolling windows
run by the sweep engine equal a hand computation and lm-eval's own ``loglikelihood_rolling``, edited or not."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from lm_eval.api.instance import Instance

import lens_parallel as lp
from lens_parallel.data import load_texts, token_blocks
from lens_parallel.documents import Documents
from lens_parallel.downstream.lm import EditedLM
from lens_parallel.downstream.perplexity import text_windows, word_count
from lens_parallel.losses import token_nll

from .conftest import get_model

TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Attention heads write back their own value vectors, in large part, and the rest is context.",
    "Short text here.",
]


def _rolling(lm: EditedLM, texts: list[str]) -> np.ndarray:
    requests = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    return np.array(lm.loglikelihood_rolling(requests))


@pytest.fixture(scope="module")
def model():
    return get_model("toy-llama")


def test_one_window_equals_the_hand_computation(model):
    texts = text_windows(model, TEXTS, window=60)
    assert len(texts.windows) == len(TEXTS) and not texts.windows.first.any()  # every text fits one window
    result = lp.scale_sweep(model, texts, metric="word_perplexity", s_par=(0.0,), s_perp=(), n_resamples=10)
    lm = EditedLM(model, (), progress=False)
    nll = 0.0
    for text in TEXTS:  # the prefix token, then the text: every token scored
        tokens = torch.tensor([[lm.prefix_token_id, *lm.tok_encode(text)]])
        with torch.no_grad():
            nll += float(token_nll(model(tokens), tokens).double().sum())
    words = sum(len(t.split()) for t in TEXTS)
    assert texts.n_words.tolist() == [word_count(t) for t in TEXTS] == [len(t.split()) for t in TEXTS]
    point = result.points[0].effect
    assert point.loss_noop == pytest.approx(nll / words, rel=1e-5)
    assert point.ppl_noop == pytest.approx(math.exp(nll / words), rel=1e-5)
    assert point.n_tokens == words and point.n_docs == len(TEXTS)
    assert "n_words" in result.to_dataframe() and result.unit == "word"


@pytest.mark.parametrize("edit", [None, lp.ComponentScale("value", s_par=0.0, layers=(1, 2))])
def test_short_windows_equal_lm_evals_rolling_loglikelihoods(model, edit):
    window = 5  # several disjoint windows per text, the last one predicting fewer tokens than its context
    texts = text_windows(model, TEXTS, window=window)
    assert len(texts.windows) > 2 * len(TEXTS) and texts.windows.first.any()
    edits = () if edit is None else (edit,)
    run = lp.run_sweep(model, texts, [lp.EditJob("job", edits)], batch_size=4)
    want = -_rolling(EditedLM(model, edits, max_length=window, progress=False), TEXTS)
    np.testing.assert_allclose(texts.per_text(run.value(lp.EditJob("job", edits))["loss_sum"]), want, rtol=2e-5)
    assert run.n_tokens.sum() == sum(len(EditedLM(model, progress=False).tok_encode(t)) for t in TEXTS)


def test_the_sweep_scores_each_window_once_and_the_edit_against_lm_eval(model):
    texts = text_windows(model, TEXTS, window=6)
    result = lp.scale_sweep(
        model, texts, metric="word_perplexity", space="value", s_par=(0.0,), s_perp=(0.5,), n_resamples=10
    )
    words = texts.n_words.sum()
    edited = -_rolling(
        EditedLM(model, (lp.ComponentScale("value", s_par=0.0),), max_length=6, progress=False), TEXTS
    ).sum()
    unedited = -_rolling(EditedLM(model, (), max_length=6, progress=False), TEXTS).sum()
    effect = result.points[0].effect
    assert effect.loss_edited == pytest.approx(edited / words, rel=2e-5)
    assert effect.loss_noop == pytest.approx(unedited / words, rel=2e-5)
    assert effect.delta_ppl == pytest.approx(math.exp(edited / words) - math.exp(unedited / words), rel=1e-3)


def test_word_perplexity_is_refused_without_word_boundaries_or_windows(model):
    with pytest.raises(lp.LensParallelError, match="no word boundaries"):
        text_windows(model, load_texts("lunyu"), window=32)
    with pytest.raises(lp.LensParallelError, match="rolling windows: pass"):
        lp.scale_sweep(model, token_blocks(model, "austen", n_docs=2, seq_len=8), metric="word_perplexity")
    with pytest.raises(lp.LensParallelError, match="below the model's context"):
        text_windows(model, TEXTS, window=model.cfg.n_ctx)
    with pytest.raises(lp.LensParallelError, match=r"unknown metric 'bits'; accepted: token_perplexity"):
        lp.ScaleSettings(metric="bits")


def test_first_scored_positions_are_context_only(model):
    docs = Documents.padded([[1, 2, 3, 4, 5], [6, 7, 8]], {}, first_scored=torch.tensor([2, 0]))
    assert docs.n_tokens.tolist() == [2, 2]
    plain = Documents.padded([[1, 2, 3, 4, 5], [6, 7, 8]], {})
    assert docs.digest() != plain.digest()
    full = lp.run_sweep(model, plain, [lp.EditJob("u", ())], metric=lp.TokenNLL(5)).value(lp.EditJob("u", ()))["nll"]
    got = lp.run_sweep(model, docs, [lp.EditJob("u", ())]).value(lp.EditJob("u", ()))["loss_sum"]
    np.testing.assert_allclose(got, [full[0, 2:4].sum(), full[1, :2].sum()], rtol=1e-6)
    with pytest.raises(lp.LensParallelError, match="first_scored must be"):
        Documents.padded([[1, 2, 3]], {}, first_scored=torch.tensor([2]))


def test_the_protocol_scores_word_perplexity_of_whole_texts(model):
    texts = text_windows(model, TEXTS, window=8, n_docs=2)
    result = lp.scale_sweep(model, texts, protocol="directional-decomposition", n_resamples=20)
    df = result.to_dataframe()
    assert result.unit == "word" and (df.n_words == texts.n_words.sum()).all() and (df.n_docs == 2).all()
    assert len(df) == 3 * 11 + 9 + 2 * 7  # the paper's grids in its three spaces
    assert "nats/word" in result.figure().layout.yaxis.title.text


def test_the_command_line_scores_word_perplexity_of_whole_texts(tmp_path, capsys):
    from lens_parallel.cli import main

    argv = [
        "scale",
        "--model",
        "toy-llama",
        "--metric",
        "word_perplexity",
        "--texts",
        "austen",
        "--n-docs",
        "2",
        "--seq-len",
        "16",
        "--space",
        "value",
        "--s-par",
        "0",
        "--s-perp",
        "0.5",
        "--n-resamples",
        "10",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    assert "nats/word" in capsys.readouterr().out
    df = __import__("pandas").read_csv(tmp_path / "scale.csv")
    want = text_windows(get_model("toy-llama"), "austen", window=16, n_docs=2).n_words.sum()
    assert (df.n_words == want).all() and len(df) == 2
    assert main([*argv[:6], "lunyu", *argv[7:]]) == 2  # no word boundaries: one line, status 2
