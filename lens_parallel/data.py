"""Bundled evaluation text and deterministic token blocks.

Bundled corpora (provenance in ``assets/SOURCES.md``): ``wikipedia-en``, ``austen``, ``moby-dick`` (English),
``lunyu``, ``tang-poems`` (Chinese). A user's own documents (a list of strings) work everywhere a corpus does.

**BOS policy, the same for every family.** Each block is one document's first ``seq_len - 1`` tokens after a
document-boundary token at position 0: ``<|endoftext|>`` where the vocabulary has it (GPT-2, Pythia, Qwen,
SmolLM2 were all pretrained with it between documents), else the tokenizer's BOS, else its EOS. The tokenizer's
own special tokens are never added. Position 0 is therefore comparable across families, and analyses exclude it.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import einops
import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor
from transformer_lens.model_bridge import TransformerBridge
from transformers import PreTrainedTokenizerBase

from lens_parallel.errors import LensParallelError
from lens_parallel.paths import ASSETS

CORPORA = ("wikipedia-en", "austen", "moby-dick", "lunyu", "tang-poems")
BOUNDARY_TOKEN = "<|endoftext|>"


def hub_spec(name: str) -> tuple[str, str | None, str | None]:
    """``hf:DATASET[:CONFIG[:SPLIT]]`` as (dataset, config or None, split or None)."""
    dataset, config, split = ([*name.removeprefix("hf:").split(":"), None, None])[:3]
    return str(dataset), config, split


def _load_hub_texts(name: str) -> list[str]:
    """``hf:DATASET[:CONFIG[:SPLIT]]`` through ``datasets.load_dataset`` (online, or from the local HF cache)."""
    import datasets

    dataset, config, split = hub_spec(name)
    try:
        rows = datasets.load_dataset(dataset, config, split=split or "test")
    except (OSError, ConnectionError, ValueError) as exc:
        raise LensParallelError(
            f"cannot load hub data set {name!r} (offline, or no such data set: {str(exc).splitlines()[0][:160]}); "
            f"bundled corpora work offline: {', '.join(CORPORA)}"
        ) from exc
    return [t for t in rows["text"] if t.strip()]


def check_corpus(name: str) -> str:
    """``name`` if it names texts :func:`load_texts` can read (a bundled corpus, or ``hf:DATASET...``), else a
    :class:`LensParallelError` listing them (nothing is read)."""
    if not isinstance(name, str) or not (name in CORPORA or (name.startswith("hf:") and len(name) > 3)):
        raise LensParallelError(
            f"unknown corpus {name!r}; bundled corpora: {', '.join(CORPORA)}, or hf:DATASET[:CONFIG]"
        )
    return name


def load_texts(name: str = "wikipedia-en", *, n_docs: int | None = None) -> list[str]:
    """The documents of a bundled corpus, in their stored order (the first ``n_docs`` if given).

    ``name`` is a bundled corpus (:data:`CORPORA`) or, online, ``hf:DATASET[:CONFIG[:SPLIT]]``
    (e.g. ``hf:Salesforce/wikitext:wikitext-103-raw-v1:test``) read from its ``text`` column.
    """
    if check_corpus(name).startswith("hf:"):
        docs = _load_hub_texts(name)
    else:
        with gzip.open(ASSETS / "corpora" / f"{name}.json.gz", "rt", encoding="utf-8") as f:
            docs = json.load(f)
    if n_docs is not None:
        if n_docs < 1:
            raise LensParallelError(f"n_docs must be >= 1, got {n_docs}")
        docs = docs[:n_docs]
    return docs


@dataclass(frozen=True)
class TokenBlocks:
    """Fixed-length token blocks, one per document, and how they were made."""

    tokens: Int[Tensor, "batch pos"]
    corpus: str
    doc_indices: tuple[int, ...]
    seq_len: int
    seed: int
    boundary_token: str
    boundary_token_id: int

    @property
    def bos_policy(self) -> str:
        return f"position 0 is the document-boundary token {self.boundary_token!r} (id {self.boundary_token_id})"

    def describe(self) -> dict[str, Any]:
        """JSON-ready provenance (no tensor)."""
        out = {k: v for k, v in asdict(self).items() if k != "tokens"}
        out["doc_indices"] = list(self.doc_indices)
        out["n_docs"] = len(self.doc_indices)
        out["bos_policy"] = self.bos_policy
        return out


def boundary_token(tokenizer: PreTrainedTokenizerBase) -> tuple[str, int]:
    """The document-boundary token for position 0 (see the module docstring)."""
    vocab = tokenizer.get_vocab()
    if BOUNDARY_TOKEN in vocab:
        return BOUNDARY_TOKEN, vocab[BOUNDARY_TOKEN]
    for token, token_id in (
        (tokenizer.bos_token, tokenizer.bos_token_id),
        (tokenizer.eos_token, tokenizer.eos_token_id),
    ):
        if token_id is not None:
            return token, token_id
    raise LensParallelError("the tokenizer has neither <|endoftext|>, a BOS nor an EOS token to start a block with")


def token_blocks(
    model: TransformerBridge,
    texts: str | Sequence[str] = "wikipedia-en",
    *,
    n_docs: int = 16,
    seq_len: int = 128,
    seed: int = 0,
) -> TokenBlocks:
    """``n_docs`` blocks of ``seq_len`` tokens: documents chosen in a seeded order among those long enough.

    ``texts`` is a bundled corpus name or a list of documents. Raises ``ValueError`` before tokenizing anything
    if ``seq_len`` exceeds the model's context or is < 2, or the corpus is empty; after, if fewer than ``n_docs``
    documents have ``seq_len - 1`` tokens.
    """
    corpus = texts if isinstance(texts, str) else "user-texts"
    docs = load_texts(texts) if isinstance(texts, str) else list(texts)
    n_ctx = model.cfg.n_ctx
    if seq_len < 2:
        raise LensParallelError(f"seq_len must be >= 2 (a boundary token and one text token), got {seq_len}")
    if seq_len > n_ctx:
        raise LensParallelError(
            f"seq_len={seq_len} exceeds the model's context length n_ctx={n_ctx}; use seq_len <= {n_ctx}"
        )
    if n_docs < 1:
        raise LensParallelError(f"n_docs must be >= 1, got {n_docs}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise LensParallelError(f"seed must be an integer >= 0, got {seed!r}")
    if not docs or not any(d.strip() for d in docs):
        raise LensParallelError(f"corpus {corpus!r} is empty: no document has any text")
    token, token_id = boundary_token(model.tokenizer)
    order = np.random.default_rng(seed).permutation(len(docs))
    rows, chosen, longest = [], [], 0
    for i in order:
        ids = model.tokenizer(docs[i], add_special_tokens=False)["input_ids"]
        longest = max(longest, len(ids))
        if len(ids) >= seq_len - 1:
            rows.append([token_id, *ids[: seq_len - 1]])
            chosen.append(int(i))
            if len(rows) == n_docs:
                break
    if len(rows) < n_docs:
        raise LensParallelError(
            f"only {len(rows)} of {len(docs)} documents in {corpus!r} have the {seq_len - 1} tokens a block of "
            f"seq_len={seq_len} needs (longest: {longest} tokens); lower seq_len or n_docs, or give longer texts"
        )
    return TokenBlocks(
        tokens=torch.tensor(rows, dtype=torch.long, device=model.cfg.device),
        corpus=corpus,
        doc_indices=tuple(chosen),
        seq_len=seq_len,
        seed=seed,
        boundary_token=token,
        boundary_token_id=token_id,
    )


def stream_blocks(tokenizer: PreTrainedTokenizerBase, docs: Sequence[str], *, seq_len: int) -> Int[Tensor, "batch pos"]:
    """Every document, each preceded by the boundary token, concatenated and cut into consecutive blocks of
    ``seq_len`` tokens (the remainder is dropped). For training: blocks cross document boundaries, as in
    pretraining."""
    if seq_len < 2:
        raise LensParallelError(f"seq_len must be >= 2, got {seq_len}")
    _, token_id = boundary_token(tokenizer)
    ids: list[int] = []
    for doc in docs:
        ids.append(token_id)
        ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
    n = len(ids) // seq_len
    if n == 0:
        raise LensParallelError(f"the texts hold {len(ids)} tokens, fewer than one block of seq_len={seq_len}")
    return einops.rearrange(torch.tensor(ids[: n * seq_len], dtype=torch.long), "(batch pos) -> batch pos", pos=seq_len)
