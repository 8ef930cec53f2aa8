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
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias, cast, runtime_checkable

import numpy as np
import torch
from jaxtyping import Bool, Int
from torch import Tensor
from tqdm.auto import tqdm
from transformer_lens import ActivationCache
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.choices import TextBos
from lens_parallel.data import TokenBlocks, boundary_token, check_texts, stored_or_seeded, texts_of, wanted_docs
from lens_parallel.errors import LensParallelError
from lens_parallel.validate import check_choice, check_non_negative_int, check_positive_int

PAD_ID = 0
"""The token id written after a document's end (never attended to by its real positions, never scored)."""

ACCEPTED = (
    "a string, a list of strings, a [batch, pos] token tensor or array or token-id lists, a tokenizer's batch with its "
    "attention_mask (model.tokenizer(texts, padding=True, return_tensors='pt')), a datasets.Dataset with a 'tokens' "
    "column, TokenBlocks, TextWindows or Documents"
)


@dataclass(frozen=True)
class Documents:
    """``tokens [batch, pos]``: each document's tokens, right-padded with :data:`PAD_ID` to the longest;
    ``lengths [batch]``: each document's number of real tokens (>= 2: one scored token at least). ``source``: how
    they were made (plain data, for provenance). ``first_scored [batch]``: the first position whose next token is
    scored (None: 0 everywhere; positions before it are context only).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> batch = model.tokenizer(["The cat sat.", "A dog ran far away."], padding=True, return_tensors="pt")
        >>> lp.Documents.of(batch, model).lengths.tolist()  # the padding dropped
        [5, 7]
    """

    tokens: Int[Tensor, "batch pos"]
    lengths: Int[Tensor, " batch"]
    source: dict[str, Any] = field(default_factory=dict)
    first_scored: Int[Tensor, " batch"] | None = None

    @classmethod
    def of(
        cls, documents: DocumentsLike, model: TransformerBridge | None = None, *, bos: TextBos = "model"
    ) -> Documents:
        """The input rule of every analysis, view, evaluation and the explorer: :class:`Documents` from

        - a string or a list of strings: each text one document, tokenized as TransformerLens's
          ``model.to_tokens(text)`` does (``bos="model"``: the model's BOS first where its ``default_prepend_bos``
          says so: GPT-2 yes, Pythia and Qwen no; ``"none"``: the text's own tokens; ``"boundary"``: the
          document-boundary token first);
        - token ids: a ``[batch, pos]`` tensor or numpy array of any integer dtype (a ``[pos]`` one is one
          document), or token-id lists (each list a document of its own length); a bool tensor is a mask, not ids,
          and is refused;
        - a ``datasets.Dataset`` with a ``tokens`` column (TransformerLens's ``tokenize_and_concatenate``): the
          column's rows, as token-id lists;
        - a tokenizer's batch (a mapping with ``input_ids`` and ``attention_mask``, e.g.
          ``model.tokenizer(texts, padding=True, return_tensors="pt")``): each row's masked-in tokens, right or left
          padding dropped, so every document runs at positions 0, 1, ... as if alone;
        - :class:`~lens_parallel.data.TokenBlocks`, :class:`TextWindows` or :class:`Documents` (as they are).

        Padding is never text, and text is never refused: a tensor (or equal-length lists) whose rows begin or end in
        padding that cannot be text, given without a mask, is refused in one line (pass the mask, or the texts);
        token blocks cut from a corpus (documents joined by the EOS, as TransformerLens's
        ``tokenize_and_concatenate`` makes them, separators at the rows' edges included) are text
        (:func:`_refuse_padding` says how the two are told apart).
        Token ids outside the vocabulary are refused. ``model`` is needed for text, masks and the checks; without it
        only TokenBlocks, TextWindows, Documents and token ids are taken, unchecked.
        """
        if isinstance(documents, ActivationCache):
            raise LensParallelError(
                "documents: an ActivationCache holds a forward already run; lens_parallel runs its own forward (its "
                "hooks reduce inside it), so pass the tokens you cached (model.to_tokens(text)) or the texts"
            )
        if isinstance(documents, TokenDataset):
            documents = _dataset_tokens(documents)
        if isinstance(documents, np.ndarray):
            documents = torch.from_numpy(documents)
        if isinstance(documents, Documents):
            return _checked(documents, model)
        if isinstance(documents, TextWindows):
            return _checked(documents.windows, model)
        if isinstance(documents, TokenBlocks):
            return _checked(cls(documents.tokens, _full_lengths(documents.tokens), documents.describe()), model)
        if isinstance(documents, str) or (
            isinstance(documents, Sequence) and documents and all(isinstance(d, str) for d in documents)
        ):
            return _checked(_text_documents(_need(model, "text"), cast("str | Sequence[str]", documents), bos), model)
        if isinstance(documents, Mapping):
            return _checked(_masked_documents(_need(model, "a tokenizer's batch"), documents), model)
        if isinstance(documents, Tensor):
            tokens = _token_tensor(documents, "tokens")
            _refuse_padding(tokens, model)
            return _checked(cls(tokens, _full_lengths(tokens), {"corpus": "caller-supplied token tensor"}), model)
        if isinstance(documents, Sequence) and documents:
            rows = _token_rows(documents)
            if len({len(r) for r in rows}) == 1:
                _refuse_padding(torch.tensor(rows, dtype=torch.long, device="cpu"), model)
            return _checked(cls.padded(rows, {"corpus": "caller-supplied token lists"}), model)
        raise LensParallelError(f"documents: got {_shown(documents)}; accepted: {ACCEPTED}")

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
        if self.tokens.shape[1] < 2:
            raise LensParallelError(
                f"documents of {self.tokens.shape[1]} token: each needs 2 at least (a first token and one scored)"
            )
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


@runtime_checkable
class TokenDataset(Protocol):
    """A ``datasets.Dataset`` (what TransformerLens's ``tokenize_and_concatenate`` returns), as documents: its
    ``tokens`` column."""

    column_names: list[str]

    def with_format(self, type: str) -> Any: ...


DocumentsLike: TypeAlias = (
    str
    | Sequence[str]
    | Tensor
    | np.ndarray
    | Sequence[Sequence[int]]
    | Mapping[str, Any]
    | TokenDataset
    | TokenBlocks
    | Documents
    | TextWindows
)
"""What every analysis takes as documents (:meth:`Documents.of`)."""


def _full_lengths(tokens: Tensor) -> Int[Tensor, " batch"]:
    return torch.full((len(tokens),), tokens.shape[1], dtype=torch.long, device=tokens.device)


def _shown(value: object) -> str:
    """A value's type and shape for an error line (never a whole tensor; a repr of several lines on one)."""
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {' '.join(str(value).split())[:60]!r}"


def _dataset_tokens(dataset: TokenDataset) -> list[list[int]]:
    """The ``tokens`` column of a ``datasets.Dataset`` (TransformerLens's ``tokenize_and_concatenate`` makes one), its
    rows as token-id lists take them (of one length or several); another dataset is refused naming its columns."""
    if "tokens" not in dataset.column_names:
        raise LensParallelError(
            f"documents: a datasets.Dataset needs a 'tokens' column of token ids (tokenize_and_concatenate makes "
            f"one); this one has {dataset.column_names}"
        )
    return [row.tolist() for row in dataset.with_format("torch")["tokens"]]


def _need(model: TransformerBridge | None, what: str) -> TransformerBridge:
    if model is None:
        raise LensParallelError(f"{what} as documents needs the model (its tokenizer): Documents.of(documents, model)")
    return model


def _token_tensor(value: object, what: str) -> Int[Tensor, "batch pos"]:
    """``value`` as a ``[batch, pos]`` integer tensor (a ``[pos]`` one as one row; lists converted)."""
    tokens = value if isinstance(value, Tensor) else torch.as_tensor(value, device="cpu")
    if tokens.numel() == 0:
        raise LensParallelError(f"{what} are empty ({_shown(tokens)}): give one document of 2 tokens at least")
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.dtype == torch.bool:
        raise LensParallelError(
            f"{what}: {_shown(tokens)} is a mask, not token ids: pass the ids, or the tokenizer's batch (a mapping "
            "with input_ids and attention_mask)"
        )
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex:
        raise LensParallelError(f"{what} must be integer token ids [batch, pos], got {_shown(tokens)}")
    if tokens.ndim != 2:
        raise LensParallelError(f"{what} must be [batch, pos] (or [pos]: one document), got {_shown(tokens)}")
    return tokens.long() if tokens.dtype != torch.int64 else tokens


def _token_rows(documents: Sequence[Any]) -> list[list[int]]:
    """Token-id lists (a flat list of ids is one document), each a list of Python ints; a row may be a list, a 1-D
    tensor or array (a ``datasets`` column in torch or numpy format: ``dataset["tokens"]``)."""
    if all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in documents):
        documents = [documents]
    rows = [
        d.tolist() if isinstance(d, np.ndarray | Tensor) else list(d) if isinstance(d, Sequence) else None
        for d in documents
    ]
    if any(r is None or not r for r in rows) or not all(
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) for row in rows if row for t in row
    ):
        raise LensParallelError(
            f"documents given as lists must be lists of token ids (integers), none empty; accepted: {ACCEPTED}"
        )
    return [[int(t) for t in row] for row in rows if row is not None]


def _text_documents(model: TransformerBridge, texts: str | Sequence[str], bos: TextBos) -> Documents:
    """Each text one document (see :meth:`Documents.of`; ``bos`` checked here)."""
    check_choice("bos", bos, TextBos)
    docs = check_texts([texts] if isinstance(texts, str) else list(texts))
    if empty := [i for i, t in enumerate(docs) if not t]:
        raise LensParallelError(f"text {empty[0]} is empty: every text needs at least one token")
    if bos == "model":
        rows = [model.to_tokens(t, truncate=False, move_to_device=False)[0].tolist() for t in docs]
        prepends = bool(getattr(model.cfg, "default_prepend_bos", True))
        rule = f"TransformerLens's to_tokens (default_prepend_bos={prepends}: {model.tokenizer.bos_token!r} first)"
        rule = rule if prepends else "TransformerLens's to_tokens (default_prepend_bos=False: no BOS)"
    else:
        first = [boundary_token(model.tokenizer)[1]] if bos == "boundary" else []
        rows = [[*first, *model.tokenizer(t, add_special_tokens=False)["input_ids"]] for t in docs]
        rule = "the document-boundary token, then the text's tokens" if first else "the text's own tokens, no BOS"
    if short := [i for i, r in enumerate(rows) if len(r) < 2]:
        raise LensParallelError(
            f"text {short[0]} is {len(rows[short[0]])} token: a document needs 2 (a first token and one scored)"
        )
    return Documents.padded(rows, {"corpus": "caller-supplied texts", "tokenized": rule})


def _masked_documents(model: TransformerBridge, batch: Mapping[str, Any]) -> Documents:
    """A tokenizer's batch: each row's masked-in tokens (one contiguous run: right or left padding)."""
    if "input_ids" not in batch:
        raise LensParallelError(
            f"a mapping as documents needs 'input_ids' (and 'attention_mask'); got keys {list(batch)}"
        )
    tokens = _token_tensor(batch["input_ids"], "input_ids")
    if batch.get("attention_mask") is None:
        _refuse_padding(tokens, model)
        return Documents(tokens, _full_lengths(tokens), {"corpus": "caller-supplied token batch"})
    mask = _token_tensor(batch["attention_mask"], "attention_mask").to(tokens.device)
    if mask.shape != tokens.shape or bool(((mask != 0) & (mask != 1)).any()):
        raise LensParallelError(
            f"attention_mask must be 0/1 of the tokens' shape {tuple(tokens.shape)}, got {_shown(mask)}"
        )
    ones = mask.sum(dim=1)
    first = mask.argmax(dim=1)
    inside = torch.arange(mask.shape[1], device=mask.device)[None]
    contiguous = (mask.bool() == ((inside >= first[:, None]) & (inside < (first + ones)[:, None]))).all(dim=1)
    if bad := (~contiguous | (ones == 0)).nonzero().flatten().tolist():
        raise LensParallelError(
            f"attention_mask row {bad[0]} is not one run of 1s (padding on the left or the right only, and a token)"
        )
    rows = [row[m.bool()].tolist() for row, m in zip(tokens.cpu(), mask.cpu(), strict=True)]
    _warn_other_bos(model, rows)
    side = "left" if bool((first > 0).any()) else "right"
    return Documents.padded(rows, {"corpus": "caller-supplied token batch", "padding": f"{side}, masked out"}).to(
        tokens.device
    )


def _warn_other_bos(model: TransformerBridge, rows: list[list[int]]) -> None:
    """Warn where a tokenizer's batch and the same texts as documents (``bos="model"``: TransformerLens's
    ``to_tokens``) are different documents: every row begins with the BOS the texts do not get (Pythia: its tokenizer
    adds it, ``default_prepend_bos`` is False), or none begins with the BOS the texts get first; the warning says how
    to match them."""
    tokenizer = model.tokenizer
    bos = tokenizer.bos_token_id
    if bos is None:
        return
    prepends = bool(getattr(model.cfg, "default_prepend_bos", True))
    starts = [row[0] == bos for row in rows]
    if (prepends and any(starts)) or (not prepends and not all(starts)):
        return
    name, token = model.cfg.model_name, f"BOS {tokenizer.bos_token!r} (id {bos})"
    if prepends:
        what = f"no row of this tokenizer's batch begins with {token}, which {name}'s texts get first"
        match = "pass the texts, or model.to_tokens(texts) with its padding masked"
    else:
        what = f"every row of this tokenizer's batch begins with {token}, which {name}'s texts do not get"
        match = "tokenize with add_special_tokens=False for the texts' documents"
        if boundary_token(tokenizer)[1] == bos:
            match += ", or pass the texts with bos='boundary' for the batch's"
    warnings.warn(
        f"{what} (TransformerLens's to_tokens, default_prepend_bos={prepends}): the batch and the texts are different "
        f"documents and give other numbers; to match them, {match}",
        stacklevel=4,
    )


def _refuse_padding(tokens: Int[Tensor, "batch pos"], model: TransformerBridge | None) -> None:
    """Refuse, in one line, rows whose edges hold padding that cannot be text (a padded batch given without its mask).

    Text is never refused. Runs of the tokenizer's pad id at the rows' edges are padding only when they differ in
    length across rows and cannot be text. They are text where the pad id also stands inside a row (a packed corpus:
    documents joined by it, empty documents making longer runs); otherwise, where the pad id is the tokenizer's BOS
    or EOS (GPT-2's), the separator packed corpora put between documents, when no longer than text puts at an edge
    (one separator at the end; BOS and a separator at the beginning, as TransformerLens's
    ``tokenize_and_concatenate`` makes rows); a dedicated pad id (Qwen's ``<|endoftext|>`` beside an instruct EOS)
    at an edge alone is padding. So ``to_tokens([...])``'s padding is refused and a corpus cut into blocks is taken
    as given; one token of padding by a pad id that is the EOS cannot be told from a separator: pass the mask."""
    if model is None or (pad := getattr(model.tokenizer, "pad_token_id", None)) is None or len(tokens) < 2:
        return
    is_pad = (tokens == pad).int()
    begin, end = is_pad.cumprod(1).sum(1), is_pad.flip(1).cumprod(1).sum(1)
    position = torch.arange(tokens.shape[1], device=tokens.device)[None]
    inside = (position >= begin[:, None]) & (position < tokens.shape[1] - end[:, None])
    if bool((is_pad.bool() & inside).any()):  # a packed corpus: the pad id separates documents inside a row
        return
    separator = pad in (model.tokenizer.bos_token_id, model.tokenizer.eos_token_id)
    for side, runs, text in (("end", end, int(separator)), ("begin", begin, 2 * int(separator))):
        if int(runs.max()) != int(runs.min()) and int(runs.max()) > text:
            raise LensParallelError(
                f"these tokens look padded: row {int(runs.argmax())} {side}s in {int(runs.max())} pad tokens, row "
                f"{int(runs.argmin())} in {int(runs.min())} ({model.tokenizer.pad_token!r}, id {pad}), which would "
                "be scored as text; pass the texts themselves, or the tokenizer's batch with its mask "
                "(model.tokenizer(texts, padding=True, return_tensors='pt'), or {'input_ids': tokens, "
                "'attention_mask': mask}; an all-ones mask if every token is real)"
            )


def _checked(documents: Documents, model: TransformerBridge | None) -> Documents:
    """``documents``, their token ids checked against ``model``'s vocabulary."""
    if model is not None:
        low, high = int(documents.tokens.min()), int(documents.tokens.max())
        if low < 0 or high >= model.cfg.d_vocab:
            raise LensParallelError(
                f"token id {high if high >= model.cfg.d_vocab else low} is outside {model.cfg.model_name}'s "
                f"vocabulary of {model.cfg.d_vocab} ids (0..{model.cfg.d_vocab - 1}): tokens of another tokenizer?"
            )
    return documents


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


def whole_documents(
    model: TransformerBridge,
    texts: str | Sequence[str] = "wikipedia-en",
    *,
    n_docs: int | None = None,
    max_len: int | None = None,
    min_len: int = 2,
    seed: int = 0,
) -> Documents:
    """``n_docs`` whole documents (a seeded choice among those with at least ``min_len`` tokens), each after the
    document-boundary token (the BOS policy of :mod:`lens_parallel.data`), cut at ``max_len`` tokens (default: the
    model's context): documents of different lengths, where :func:`~lens_parallel.data.token_blocks` cuts equal
    blocks. ``texts``: a bundled corpus name, a ``.txt`` / ``.jsonl`` file or a list of documents.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> whole = lp.whole_documents(model, ["First text, short.", "Second text, a little longer than the first."])
        >>> whole.lengths.tolist()  # the boundary token, then each text's tokens
        [6, 11]
    """
    check_non_negative_int("seed", seed)
    limit = model.cfg.n_ctx if max_len is None else check_positive_int("max_len", max_len)
    if limit > model.cfg.n_ctx or limit < 2 or min_len < 2 or min_len > limit:
        raise LensParallelError(
            f"need 2 <= min_len ({min_len}) <= max_len ({limit}) <= the model's context ({model.cfg.n_ctx})"
        )
    corpus, docs = texts_of(texts)
    n_docs = wanted_docs(texts, n_docs, len(docs))
    token, token_id = boundary_token(model.tokenizer)
    rows, chosen = [], []
    for i in stored_or_seeded(len(docs), n_docs, seed):
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
