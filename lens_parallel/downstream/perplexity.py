"""Perplexity per word of whole documents, as lm-eval's ``wikitext`` task computes it (the directional-decomposition
paper's Fig. 3 metric).

lm-eval scores a ``loglikelihood_rolling`` request by cutting the text's tokens into disjoint rolling windows
(its ``get_rolling_token_windows`` with ``context_len=1`` and ``make_disjoint_window``): the first window predicts
the first ``max_length`` tokens from the prefix token, each further one the next ``max_length`` tokens (the last
window the remaining ones, from the ``max_length`` tokens before its end). The text's log-likelihood is the sum
over its windows; ``word_perplexity = exp(-sum_docs loglik / sum_docs words)``, the words counted on the original
text as ``len(re.split(r"\\s+", text))`` (lm-eval's ``wikitext`` ``process_results``: the page before
detokenisation).

:func:`text_windows` makes exactly those windows, with :class:`~lens_parallel.downstream.lm.EditedLM`'s
tokenisation (lm-eval's ``hf`` model's), as :class:`~lens_parallel.documents.TextWindows`: the sweep engine runs
them as ragged documents, each window's context positions unscored, and
``scale_sweep(..., metric="word_perplexity")`` sums each text's windows. Texts: lm-eval's own ``wikitext`` task
(WikiText-2 raw, document level, its test split of 62 documents; online: the data set comes from the hub), or a
bundled English corpus / the caller's texts offline (the same word count on the text itself). Texts without word
boundaries (Chinese) are refused: a word count there is not a number of words.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.data import load_texts
from lens_parallel.documents import Documents, TextWindows
from lens_parallel.downstream.lm import EditedLM
from lens_parallel.errors import LensParallelError
from lens_parallel.validate import check_positive_int

WIKITEXT = "wikitext"
"""The name of lm-eval's task whose test documents :func:`text_windows` scores (online)."""

MAX_CHARS_PER_WORD = 20.0
"""Mean characters between whitespace above which texts are taken to have no word boundaries (English: about 5)."""


def word_count(text: str) -> int:
    """Words as lm-eval's ``wikitext`` task counts them: ``len(re.split(r"\\s+", text))``."""
    return len(re.split(r"\s+", text))


def check_word_boundaries(texts: Sequence[str], corpus: str) -> None:
    """Refuse texts whose whitespace does not separate words (e.g. Chinese), in one line."""
    chars = sum(len(re.sub(r"\s+", "", t)) for t in texts)
    per_word = chars / max(1, sum(word_count(t) for t in texts))
    if per_word > MAX_CHARS_PER_WORD:
        raise LensParallelError(
            f"the texts of {corpus!r} have no word boundaries ({per_word:.0f} characters between spaces on average; "
            "e.g. Chinese): word perplexity is undefined there; use metric='token_perplexity'"
        )


def wikitext_documents(split: str = "test") -> tuple[list[str], list[str]]:
    """lm-eval's ``wikitext`` task's documents of ``split``: the detokenised texts it scores and the original pages
    it counts words on (online: the data set ``EleutherAI/wikitext_document_level`` comes from the hub)."""
    from lens_parallel.downstream.data import task_manager

    task = task_manager(None).load([WIKITEXT])["tasks"][WIKITEXT]
    docs = list({"test": task.test_docs, "validation": task.validation_docs}[split]())
    return [task.doc_to_target(d) for d in docs], [d["page"] for d in docs]


def text_windows(
    model: TransformerBridge,
    texts: str | Sequence[str] = "wikipedia-en",
    *,
    window: int,
    n_docs: int | None = None,
    tokenizer: Any = None,
) -> TextWindows:
    """Whole texts as lm-eval's rolling windows of ``window`` tokens (its ``max_length``; at most the model's
    context - 1: the engine's forward also reads the last predicted token), and each text's word count.

    ``texts``: ``"wikitext"`` (lm-eval's task: its 62 WikiText-2 test documents, detokenised, words counted on the
    original pages; online), a bundled corpus name, or a list of texts (words counted on each text); the first
    ``n_docs`` of them when given. ``tokenizer``: as :class:`~lens_parallel.downstream.lm.EditedLM`'s."""
    check_positive_int("window", window)
    if window >= model.cfg.n_ctx:
        raise LensParallelError(
            f"window={window} must be below the model's context ({model.cfg.n_ctx}): each window's forward reads "
            f"window + 1 tokens"
        )
    corpus = texts if isinstance(texts, str) else "user-texts"
    if texts == WIKITEXT:
        scored, counted = wikitext_documents()
    else:
        scored = load_texts(texts) if isinstance(texts, str) else [str(t) for t in texts]
        counted = scored
    limit = None if n_docs is None else check_positive_int("n_docs", n_docs)
    keep = [i for i, t in enumerate(scored) if t.strip()][:limit]
    if not keep:
        raise LensParallelError(f"{corpus!r} has no text to score")
    check_word_boundaries([counted[i] for i in keep], corpus)
    lm = EditedLM(model, max_length=window, tokenizer=tokenizer, progress=False)
    rows, first, text_of = [], [], []
    for k, i in enumerate(keep):
        for context, continuation in lm.rolling_windows(scored[i]):
            rows.append(context + continuation)
            first.append(len(context) - 1)
            text_of.append(k)
    source = {
        "corpus": corpus,
        "doc_indices": keep,
        "window": window,
        "prefix_token_id": lm.prefix_token_id,
        "words": "len(re.split(r'\\s+', text)) of the text"
        + (" before lm-eval's wikitext detokenisation" if texts == WIKITEXT else ""),
    }
    windows = Documents.padded(rows, source, first_scored=torch.tensor(first, dtype=torch.long, device="cpu"))
    words = np.array([word_count(counted[i]) for i in keep], dtype=np.int64)
    return TextWindows(windows.to(model.cfg.device or "cpu"), np.array(text_of, dtype=np.int64), words)
