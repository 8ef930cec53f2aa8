"""The input rule (:meth:`Documents.of`): text, token ids, a tokenizer's masked batch (right or left padded) and a
padded tensor without its mask, on every toy family. Padding is never text: every form that is accepted gives the
documents of the unpadded texts, and so the same numbers; a padded tensor without its mask is refused in one line by
every analysis before any forward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import lens_parallel as lp
from lens_parallel.edits import HeadEdit
from lens_parallel.errors import LensParallelError
from tests.conftest import FAMILIES, get_model

TEXTS = ["The cat sat on the mat and looked at the door for a while.", "A dog ran home."]


def _alone(model: Any) -> list[list[int]]:
    """Each text tokenized alone by TransformerLens (no padding anywhere)."""
    return [model.to_tokens(t, truncate=False)[0].tolist() for t in TEXTS]


def _equal(docs: lp.Documents, rows: list[list[int]]) -> None:
    assert docs.lengths.tolist() == [len(r) for r in rows]
    for i, row in enumerate(rows):
        assert docs.tokens[i, : len(row)].tolist() == row


@pytest.mark.parametrize("family", FAMILIES)
def test_every_form_gives_the_unpadded_documents(family):
    model = get_model(family)
    rows = _alone(model)
    _equal(lp.Documents.of(TEXTS, model), rows)
    _equal(lp.Documents.of(TEXTS[1], model), rows[1:])
    _equal(lp.Documents.of(rows, model), rows)
    for side in ("right", "left"):
        padded = model.to_tokens(TEXTS, padding_side=side)
        mask = (padded != -1).long()
        width = padded.shape[1]
        for i, row in enumerate(rows):  # the mask of TransformerLens's own padding, built from the lengths
            pad = width - len(row)
            mask[i] = torch.tensor([0] * pad + [1] * len(row) if side == "left" else [1] * len(row) + [0] * pad)
        docs = lp.Documents.of({"input_ids": padded, "attention_mask": mask}, model)
        _equal(docs, rows)
        assert docs.source["padding"] == f"{side}, masked out"
        batch = model.tokenizer(TEXTS, padding=True, padding_side=side, return_tensors="pt")
        own = [ids[m.bool()].tolist() for ids, m in zip(batch["input_ids"], batch["attention_mask"], strict=True)]
        _equal(lp.Documents.of(batch, model), own)  # a tokenizer's batch: its own tokens, its padding dropped
        with pytest.raises(LensParallelError, match="these tokens look padded") as refused:
            lp.Documents.of(padded, model)
        assert "\n" not in str(refused.value) and "attention_mask" in str(refused.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_losses_of_a_left_padded_batch_are_each_texts_own(family):
    """The no-op loss of each document of a left-padded masked batch equals the model's own loss of that text run
    alone (``model(tokens, return_type="loss")``, TransformerLens's forward, an independent computation)."""
    model = get_model(family)
    batch = model.tokenizer(TEXTS, padding=True, padding_side="left", return_tensors="pt")
    losses = lp.document_losses(model, batch, progress=False)
    for i, (ids, m) in enumerate(zip(batch["input_ids"], batch["attention_mask"], strict=True)):
        tokens = ids[m.bool()][None]
        with torch.no_grad():
            want = float(model(tokens, return_type="loss"))
        assert losses.loss_sum[i] / losses.n_tokens[i] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_statistics_of_text_and_of_a_masked_batch_agree(family):
    model = get_model(family)
    padded = model.to_tokens(TEXTS, padding_side="left")
    mask = torch.zeros_like(padded)
    for i, row in enumerate(_alone(model)):
        mask[i, padded.shape[1] - len(row) :] = 1
    text = lp.decompose(model, TEXTS, space="value", progress=False).table("value", "head")
    masked = lp.decompose(model, {"input_ids": padded, "attention_mask": mask}, space="value", progress=False)
    np.testing.assert_allclose(masked.table("value", "head").self_cos, text.self_cos, rtol=0, atol=1e-6)
    blocks = lp.decompose(model, lp.Documents.of(_alone(model), model), space="value", progress=False)
    np.testing.assert_allclose(blocks.table("value", "head").self_cos, text.self_cos, rtol=0, atol=1e-6)


CALLS: dict[str, Callable[[Any, Any], object]] = {
    "decompose": lambda m, d: lp.decompose(m, d),
    "head_sensitivity": lambda m, d: lp.head_sensitivity(m, d),
    "run_ablations": lambda m, d: lp.run_ablations(m, d, [lp.AblationJob(0, (0,))]),
    "evaluate": lambda m, d: lp.evaluate(m, d, HeadEdit("zero", 0, 0)),
    "document_losses": lambda m, d: lp.document_losses(m, d),
    "causal_null": lambda m, d: lp.causal_null(m, d),
    "scale_sweep": lambda m, d: lp.scale_sweep(m, d),
    "diagonal_view": lambda m, d: lp.diagonal_view(m, d, layer=0, head=0),
    "head_dominance": lambda m, d: lp.head_dominance(m, d),
    "head_attribution": lambda m, d: lp.head_attribution(m, d),
    "compression_error": lambda m, d: lp.compression_error(m, d),
    "split_half_reliability": lambda m, d: lp.split_half_reliability(m, d),
    "sanity_report": lambda m, d: lp.sanity_report(m, d),
    "head_statistics": lambda m, d: lp.head_statistics(m, d),
    "explore": lambda m, d: lp.explore(m, d),
    "generate": lambda m, d: lp.generate(m, d),
    "run_sweep": lambda m, d: lp.run_sweep(m, d, [lp.EditJob("none", ())]),
    "run_battery": lambda m, d: lp.run_battery(m, d),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_every_entry_point_refuses_a_padded_tensor_in_one_line(name):
    model = get_model("toy-gpt2")
    padded = model.to_tokens(TEXTS)
    with pytest.raises(LensParallelError, match="these tokens look padded") as refused:
        CALLS[name](model, padded)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("name", ["diagonal_view", "evaluate", "explore", "generate", "head_sensitivity"])
def test_entry_points_take_a_list_of_strings(name):
    """(Every entry point reads documents through :meth:`Documents.of` with the model, as the refusal above shows;
    these run to the end on text.)"""
    model = get_model("toy-gpt2")
    kwargs: dict[str, Any] = {"progress": False} if name != "explore" else {}
    if name == "generate":
        kwargs["max_new_tokens"] = 2
    calls = {**CALLS, "diagonal_view": lambda m, d: lp.diagonal_view(m, d, layer=0, head=0, **kwargs)}
    calls["head_sensitivity"] = lambda m, d: lp.head_sensitivity(m, d, layers=[0], **kwargs)
    calls["evaluate"] = lambda m, d: lp.evaluate(m, d, HeadEdit("zero", 0, 0), n_resamples=10, **kwargs)
    calls["generate"] = lambda m, d: lp.generate(m, d, **kwargs)
    assert calls[name](model, TEXTS) is not None


def test_bad_token_ids_and_masks_are_refused_in_one_line():
    model = get_model("toy-gpt2")
    cases = [
        ([[1, 2, model.cfg.d_vocab]], "token id 50257 is outside toy-gpt2's vocabulary of 50257 ids"),
        ([[1, 2], [-1, 3]], "token id -1 is outside"),
        ({"input_ids": [[1, 2, 3]], "attention_mask": [[1, 0, 1]]}, "attention_mask row 0 is not one run of 1s"),
        ({"input_ids": [[1, 2, 3]], "attention_mask": [[1, 1]]}, "attention_mask must be 0/1 of the tokens' shape"),
        ({"tokens": [[1, 2, 3]]}, "a mapping as documents needs 'input_ids'"),
        ([""], "text 0 is empty"),
        (
            torch.zeros(2, 3),
            "tokens must be integer token ids \\[batch, pos\\], got a torch.float32 tensor of shape \\(2, 3\\)",
        ),
        (3.5, "documents: got float '3.5'; accepted: a string, a list of strings"),
    ]
    for documents, message in cases:
        with pytest.raises(LensParallelError, match=message) as refused:
            lp.Documents.of(documents, model)
        assert "\n" not in str(refused.value)
    with pytest.raises(LensParallelError, match="text as documents needs the model"):
        lp.Documents.of(TEXTS)


def test_equal_rows_without_padding_are_taken_as_they_are():
    """Rows that all begin with the BOS (GPT-2's pad id too) and end in text are not padding."""
    model = get_model("toy-gpt2")
    rows = [model.to_tokens(t)[0, :5].tolist() for t in TEXTS]
    assert rows[0][0] == rows[1][0] == model.tokenizer.pad_token_id
    docs = lp.Documents.of(torch.tensor(rows), model)
    assert docs.lengths.tolist() == [5, 5]


def test_whole_documents_and_token_blocks_take_all_of_a_users_texts():
    model = get_model("toy-gpt2")
    texts = [f"Document number {i} says something about the weather." for i in range(20)]
    docs = lp.whole_documents(model, texts)
    assert len(docs) == 20 and docs.source["doc_indices"] == list(range(20))  # all, in the order given
    blocks = lp.token_blocks(model, texts, seq_len=6)
    assert blocks.doc_indices == tuple(range(20))
    assert len(lp.token_blocks(model, "austen", seq_len=8).doc_indices) == 16  # a bundled corpus: 16 by default
