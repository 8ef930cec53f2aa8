"""Documents of different lengths, right-padded into one batch, give each document exactly what it gives alone
(to float32 rounding: the batch's shape changes the kernels' summation order): per-token losses, edited losses,
a decomposition's statistics (pooled over documents) and the causal null's per-document values, on every family."""

from __future__ import annotations

import numpy as np
import pytest

import lens_parallel as lp
from lens_parallel.data import token_blocks
from lens_parallel.documents import Documents
from lens_parallel.models import TOY_MODELS, model_info
from lens_parallel.sweep import EditJob, TokenNLL, run_sweep

from .conftest import LINEAR_VALUE_NOISE, get_model, noisy_linear_value

LENGTHS = (24, 13, 7)


def _rows(model) -> list[list[int]]:
    tokens = token_blocks(model, "wikipedia-en", n_docs=3, seq_len=max(LENGTHS), seed=1).tokens
    return [tokens[i, :n].tolist() for i, n in enumerate(LENGTHS)]


@pytest.mark.parametrize("spec", list(TOY_MODELS))
def test_each_document_of_a_padded_batch_equals_the_document_alone(spec):
    model = get_model(spec)
    rows = _rows(model)
    docs = Documents.padded(rows, {"corpus": "test"})
    assert docs.ragged and list(docs.n_tokens) == [n - 1 for n in LENGTHS]
    edits = {"unedited": (), "scaled": (lp.ComponentScale("residual-mlp", s_par=0.0, s_perp=0.5),)}
    for key, edit in edits.items():
        job = EditJob(key, edit)
        padded = run_sweep(model, docs, [job], metric=TokenNLL(max(LENGTHS)), batch_size=3, progress=False)
        nll = padded.value(job)["nll"]
        for i, row in enumerate(rows):
            alone = run_sweep(model, [row], [job], metric=TokenNLL(len(row)), progress=False).value(job)["nll"][0]
            np.testing.assert_allclose(nll[i, : len(row) - 1], alone, rtol=1e-5, atol=1e-6, err_msg=f"{key} {i}")
            assert np.isnan(nll[i, len(row) - 1 :]).all()  # nothing scored past the document's end
        sums = lp.document_losses(model, docs, edit, batch_size=3)
        np.testing.assert_allclose(sums.loss_sum, np.nansum(nll, axis=1), rtol=1e-6)


@pytest.mark.parametrize("spec", list(TOY_MODELS))
def test_a_padded_decomposition_and_null_equal_their_documents_pooled(spec):
    """Each statistic of the padded batch is the position-weighted mean of the documents' own statistics."""
    model = get_model(spec)
    info, rows = model_info(model), _rows(model)
    docs = Documents.padded(rows, {"corpus": "test"})
    kw = {"space": "all", "progress": False}
    together = lp.decompose(model, docs, **kw)
    alone = [lp.decompose(model, [row], **kw) for row in rows]
    for table in together.tables:
        parts = [a.table(table.space, table.level) for a in alone]
        valid = np.stack([p.n_positions - p.n_degenerate for p in parts])
        np.testing.assert_array_equal(table.n_positions, sum(p.n_positions for p in parts))
        for field in ("self_cos", "par_frac", "perp_frac", "par_coef"):
            pooled = (np.stack([np.nan_to_num(getattr(p, field)) for p in parts]) * valid).sum(0) / valid.sum(0)
            for i, layer in enumerate(table.layers):
                noisy = noisy_linear_value(info, table.space, layer)
                tol = (
                    {"rtol": LINEAR_VALUE_NOISE, "atol": LINEAR_VALUE_NOISE} if noisy else {"rtol": 1e-5, "atol": 1e-6}
                )
                np.testing.assert_allclose(getattr(table, field)[i], pooled[i], err_msg=field, **tol)
    null = lp.causal_null(model, docs, null="exact", n_resamples=50, progress=False)
    for i, row in enumerate(rows):
        one = lp.causal_null(model, [row], null="exact", n_resamples=50, progress=False)
        np.testing.assert_allclose(null.cos_self[i], one.cos_self[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(null.cos_null[i], one.cos_null[0], rtol=1e-5, atol=1e-6)


def test_documents_of_every_form_and_their_provenance():
    model = get_model("toy-gpt2")
    blocks = token_blocks(model, "austen", n_docs=2, seq_len=8)
    assert Documents.of(blocks).digest() == Documents.of(blocks.tokens).digest()
    assert not Documents.of(blocks).ragged
    docs = lp.whole_documents(model, "austen", n_docs=3, max_len=40, min_len=10)
    assert docs.ragged or int(docs.lengths.min()) == 40
    assert int(docs.lengths.max()) <= 40 and int(docs.lengths.min()) >= 10 and docs.tokens[0, 0] == 50256
    described = lp.decompose(model, docs, progress=False).provenance.texts
    assert described["corpus"] == "austen" and described["tokens_sha256_16"] == docs.digest()
    with pytest.raises(lp.LensParallelError, match="document lengths must be 2"):
        Documents.of([[1, 2, 3], [4]])
    with pytest.raises(lp.LensParallelError, match="lists of token ids"):
        Documents.of([[1, 2], ["a", "b"]])
