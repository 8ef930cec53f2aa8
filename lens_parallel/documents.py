"""Documents of equal or different lengths, as the engine runs them: one right-padded token tensor and the lengths.

Every analysis takes :class:`~lens_parallel.data.TokenBlocks` (the fixed-length default), a ``[batch, pos]`` token
tensor, a list of token-id lists (documents of any length), or :class:`Documents`; :meth:`Documents.of` turns each
into :class:`Documents`. Documents are right-padded: a causal model's real positions never attend to the padding
after them, so every real position's activations equal the document run alone (to float rounding: the batch's
shape changes the kernels' summation order; tested on every toy family), and no attention mask is needed.
Analyses score and reduce only real tokens: position t predicts token t+1 for first_scored <= t < length - 1
(:func:`scored_mask`; ``first_scored`` is 0 but for lm-eval's rolling windows, :class:`TextWindows`, whose last
window of a text predicts only its last tokens from the context before them).

:func:`document_batches` is how every loop over documents batches them: consecutive documents, each batch trimmed
to its longest document.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool, Int
from torch import Tensor
from tqdm.auto import tqdm
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.data import TokenBlocks, boundary_token, texts_of
from lens_parallel.errors import LensParallelError
from lens_parallel.validate import check_non_negative_int, check_positive_int

PAD_ID = 0
"""The token id written after a document's end (never attended to by its real positions, never scored)."""


@dataclass(frozen=True)
class Documents:
    """``tokens [batch, pos]``: each document's tokens, right-padded with :data:`PAD_ID` to the longest;
    ``lengths [batch]``: each document's number of real tokens (>= 2: one scored token at least). ``source``: how
    they were made (plain data, for provenance). ``first_scored [batch]``: the first position whose next token is
    scored (None: 0 everywhere; positions before it are context only)."""

    tokens: Int[Tensor, "batch pos"]
    lengths: Int[Tensor, " batch"]
    source: dict[str, Any] = field(default_factory=dict)
    first_scored: Int[Tensor, " batch"] | None = None

    @classmethod
    def of(cls, documents: object) -> Documents:
        """:class:`Documents` from :class:`TokenBlocks`, a ``[batch, pos]`` integer tensor (every row full), a list
        of token-id lists, or :class:`Documents` itself; refuses anything else, or a document of fewer than 2
        tokens, in one line."""
        if isinstance(documents, Documents):
            return documents
        if isinstance(documents, TextWindows):
            return documents.windows
        if isinstance(documents, TokenBlocks):
            tokens = documents.tokens
            return cls(tokens, _full_lengths(tokens), documents.describe())
        if isinstance(documents, Tensor):
            if documents.ndim != 2 or documents.dtype not in (torch.int32, torch.int64):
                raise LensParallelError(
                    f"tokens must be an integer tensor [batch, pos], got {tuple(documents.shape)} {documents.dtype}"
                )
            return cls(documents, _full_lengths(documents), {"corpus": "caller-supplied token tensor"})
        if isinstance(documents, Sequence) and not isinstance(documents, str) and documents:
            rows = [list(d) for d in documents]
            if not all(rows) or not all(isinstance(t, (int, np.integer)) for row in rows for t in row):
                raise LensParallelError("documents must be lists of token ids (integers), none empty")
            return cls.padded(rows, {"corpus": "caller-supplied token lists"})
        raise LensParallelError(
            "documents must be TokenBlocks, an integer tensor [batch, pos], a list of token-id lists, Documents or "
            "TextWindows; "
            f"got {type(documents).__name__}"
        )

    @classmethod
    def padded(
        cls, rows: Sequence[Sequence[int]], source: dict[str, Any], *, first_scored: Tensor | None = None
    ) -> Documents:
        """Documents from token-id lists of any lengths (right-padded here)."""
        lengths = [len(r) for r in rows]
        tokens = torch.full((len(rows), max(lengths)), PAD_ID, dtype=torch.long, device="cpu")
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long, device="cpu")
        return cls(tokens, torch.tensor(lengths, dtype=torch.long, device="cpu"), source, first_scored)

    def __post_init__(self) -> None:
        if len(self.lengths) != len(self.tokens) or len(self.tokens) == 0:
            raise LensParallelError(f"{len(self.tokens)} documents but {len(self.lengths)} lengths")
        if int(self.lengths.min()) < 2 or int(self.lengths.max()) > self.tokens.shape[1]:
            raise LensParallelError(
                f"document lengths must be 2..{self.tokens.shape[1]} (a first token and one scored token at least), "
                f"got {self.lengths.min().item()}..{self.lengths.max().item()}"
            )
        if self.first_scored is not None and (
            len(self.first_scored) != len(self.lengths)
            or bool((self.first_scored < 0).any() or (self.first_scored > self.lengths - 2).any())
        ):
            raise LensParallelError("first_scored must be 0..length-2 per document (one scored token at least)")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def ragged(self) -> bool:
        """Whether the documents differ in length (or a row is shorter than the tensor)."""
        return bool((self.lengths != self.tokens.shape[1]).any())

    @property
    def n_tokens(self) -> np.ndarray:
        """Scored tokens per document (``lengths - 1 - first_scored``), int64."""
        return (self.lengths - 1 - self.first).cpu().numpy().astype(np.int64)

    @property
    def first(self) -> Int[Tensor, " batch"]:
        """``first_scored``, zeros when None."""
        return torch.zeros_like(self.lengths) if self.first_scored is None else self.first_scored

    def to(self, device: torch.device | str) -> Documents:
        first = None if self.first_scored is None else self.first_scored.to(device)
        return dataclasses.replace(
            self, tokens=self.tokens.to(device), lengths=self.lengths.to(device), first_scored=first
        )

    def digest(self) -> str:
        """A short hash of the tokens, the lengths (padding excluded) and the first scored positions (when any is
        not 0), for fingerprints; computed once per object (it reads every token on the host)."""
        return self._digest

    @functools.cached_property
    def _digest(self) -> str:
        h = hashlib.sha256(self.lengths.cpu().numpy().astype(np.int64).tobytes())
        if bool(self.first.any()):
            h.update(b"first_scored" + self.first.cpu().numpy().astype(np.int64).tobytes())
        for row, n in zip(self.tokens.cpu(), self.lengths.tolist(), strict=True):
            h.update(row[:n].numpy().astype(np.int64).tobytes())
        return h.hexdigest()[:16]

    def describe(self) -> dict[str, Any]:
        """Provenance: the source, the number of documents, their lengths and the tokens' digest."""
        lengths = self.lengths.tolist()
        return self.source | {
            "n_docs": len(self),
            "lengths": lengths if self.ragged else {"all": lengths[0]},
            "tokens_sha256_16": self.digest(),
        }


@dataclass(frozen=True)
class TextWindows:
    """Whole texts cut into lm-eval's disjoint rolling windows, for perplexity per word: ``windows`` (one
    :class:`Documents` row per window, ``first_scored`` set where a window's context is not scored), ``text_of``
    the text each window belongs to (``[windows]``, int64), ``n_words`` each text's word count as lm-eval's
    ``wikitext`` task counts it (``len(re.split(r"\\s+", text))``); the window length is in the windows'
    ``source``. Made by :func:`lens_parallel.downstream.perplexity.text_windows`; every
    analysis takes it as its :attr:`windows` (:meth:`Documents.of`), and ``metric="word_perplexity"`` needs it."""

    windows: Documents
    text_of: np.ndarray
    n_words: np.ndarray

    def __post_init__(self) -> None:
        if len(self.text_of) != len(self.windows) or len(self.n_words) != int(self.text_of.max()) + 1:
            raise LensParallelError(
                f"{len(self.windows)} windows, {len(self.text_of)} text indices, {len(self.n_words)} word counts"
            )

    def __len__(self) -> int:
        return len(self.n_words)

    def per_text(self, per_window: np.ndarray) -> np.ndarray:
        """Sums over each text's windows of a per-window array (``[windows] -> [texts]``)."""
        return np.bincount(self.text_of, weights=per_window, minlength=len(self.n_words))


def _full_lengths(tokens: Tensor) -> Int[Tensor, " batch"]:
    return torch.full((len(tokens),), tokens.shape[1], dtype=torch.long, device=tokens.device)


@dataclass(frozen=True)
class DocBatch:
    """Consecutive documents ``rows`` of a :class:`Documents`: their tokens trimmed to the longest of them, their
    lengths and first scored positions."""

    rows: slice
    tokens: Int[Tensor, "batch pos"]
    lengths: Int[Tensor, " batch"]
    first: Int[Tensor, " batch"]

    @property
    def real(self) -> Bool[Tensor, "batch pos"]:
        """Positions that hold a real token."""
        return torch.arange(self.tokens.shape[1], device=self.tokens.device) < self.lengths[:, None]

    @property
    def scored(self) -> Bool[Tensor, "batch pos"]:
        """Positions t whose next token t + 1 is scored (position t predicts it): first <= t < length - 1."""
        return scored_mask(self.tokens.shape[1], self.lengths, self.first)


def scored_mask(
    width: int, lengths: Int[Tensor, " batch"] | None, first: Int[Tensor, " batch"] | None = None
) -> Bool[Tensor, "batch pos"]:
    """Which of positions 0..width-1 predict a scored token: first <= t < length - 1 (no bound where ``lengths``
    or ``first`` is None; with neither, every position, as one row broadcasting over the batch)."""
    device = next((x.device for x in (lengths, first) if x is not None), None)
    t = torch.arange(width, device=device)[None, :]
    scored = torch.ones_like(t, dtype=torch.bool)
    if lengths is not None:
        scored = scored & (t < lengths.to(t.device)[:, None] - 1)
    if first is not None:
        scored = scored & (t >= first.to(t.device)[:, None])
    return scored


def document_batches(
    documents: Documents, batch_size: int, *, progress: bool = False, desc: str = "batches"
) -> Iterator[DocBatch]:
    """Consecutive batches of ``batch_size`` documents (checked here, before the first forward), each trimmed to its
    longest document."""
    check_positive_int("batch_size", batch_size)
    starts = range(0, len(documents), batch_size)
    bar = tqdm(starts, desc=desc, unit="batch", disable=not progress or len(starts) < 2)
    for s in bar:
        rows = slice(s, min(s + batch_size, len(documents)))
        lengths = documents.lengths[rows]
        yield DocBatch(rows, documents.tokens[rows, : int(lengths.max())], lengths, documents.first[rows])


def prompt_documents(model: TransformerBridge, prompts: str | Sequence[str], *, boundary: bool = False) -> Documents:
    """Each prompt as one sequence of its own tokens (no special token added; with ``boundary`` the
    document-boundary token of :mod:`lens_parallel.data` first), e.g. the directional-decomposition paper's Fig. 4
    prompt ``"Echo the final code exactly once: AX7Q-19"``."""
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not texts or not all(isinstance(t, str) and t for t in texts):
        raise LensParallelError("prompts must be a non-empty string or a list of non-empty strings")
    first = [boundary_token(model.tokenizer)[1]] if boundary else []
    rows = [[*first, *model.tokenizer(t, add_special_tokens=False)["input_ids"]] for t in texts]
    source = {"corpus": "prompts", "n_docs": len(rows), "boundary_token": boundary}
    return Documents.padded(rows, source)


def whole_documents(
    model: TransformerBridge,
    texts: str | Sequence[str] = "wikipedia-en",
    *,
    n_docs: int = 16,
    max_len: int | None = None,
    min_len: int = 2,
    seed: int = 0,
) -> Documents:
    """``n_docs`` whole documents (a seeded choice among those with at least ``min_len`` tokens), each after the
    document-boundary token (the BOS policy of :mod:`lens_parallel.data`), cut at ``max_len`` tokens (default: the
    model's context): documents of different lengths, where :func:`~lens_parallel.data.token_blocks` cuts equal
    blocks. ``texts``: a bundled corpus name, a ``.txt`` / ``.jsonl`` file or a list of documents."""
    check_positive_int("n_docs", n_docs)
    check_non_negative_int("seed", seed)
    limit = model.cfg.n_ctx if max_len is None else check_positive_int("max_len", max_len)
    if limit > model.cfg.n_ctx or limit < 2 or min_len < 2 or min_len > limit:
        raise LensParallelError(
            f"need 2 <= min_len ({min_len}) <= max_len ({limit}) <= the model's context ({model.cfg.n_ctx})"
        )
    corpus, docs = texts_of(texts)
    token, token_id = boundary_token(model.tokenizer)
    rows, chosen = [], []
    for i in np.random.default_rng(seed).permutation(len(docs)):
        ids = [token_id, *model.tokenizer(docs[i], add_special_tokens=False)["input_ids"]][:limit]
        if len(ids) >= min_len:
            rows.append(ids)
            chosen.append(int(i))
            if len(rows) == n_docs:
                break
    if len(rows) < n_docs:
        raise LensParallelError(
            f"only {len(rows)} documents of {corpus!r} have the {min_len} tokens asked for; lower n_docs or min_len"
        )
    source = {
        "corpus": corpus,
        "doc_indices": chosen,
        "seed": seed,
        "max_len": limit,
        "min_len": min_len,
        "bos_policy": f"position 0 is the document-boundary token {token!r} (id {token_id}); whole documents",
    }
    return Documents.padded(rows, source).to(model.cfg.device or "cpu")
