"""Bundled evaluation text and deterministic token blocks.

Bundled corpora (provenance in ``assets/SOURCES.md``): ``wikipedia-en``, ``austen``, ``moby-dick`` (English),
``lunyu``, ``tang-poems`` (Chinese). A user's own documents work everywhere a corpus does: a list of strings, or a
file (:func:`read_text_file`: ``.txt``, documents separated by blank lines; ``.jsonl``, one object with a ``text``
field a line), read as UTF-8 and refused in one line at the first byte that is not.

**BOS policy, the same for every family.** Each block is one document's first ``seq_len - 1`` tokens after a
document-boundary token at position 0: ``<|endoftext|>`` where the vocabulary has it (GPT-2, Pythia, Qwen,
SmolLM2 were all pretrained with it between documents), else the tokenizer's BOS, else its EOS. The tokenizer's
own special tokens are never added. Position 0 is therefore comparable across families, and analyses exclude it.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
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


TEXT_FILE_SUFFIXES = (".txt", ".jsonl")


def check_corpus(name: str) -> str:
    """``name`` if it names texts :func:`load_texts` can read (a bundled corpus, ``hf:DATASET...``, or an existing
    ``.txt`` / ``.jsonl`` file), else a :class:`LensParallelError` listing them (nothing is read)."""
    if isinstance(name, str) and name.endswith(TEXT_FILE_SUFFIXES):
        if not Path(name).is_file():
            raise LensParallelError(f"text file {name} does not exist (or is not a file)")
        read_text_file(name)  # all of it checked (UTF-8, .jsonl rows) before any model loads
        return name
    if not isinstance(name, str) or not (name in CORPORA or (name.startswith("hf:") and len(name) > 3)):
        raise LensParallelError(
            f"unknown corpus {name!r}; bundled corpora: {', '.join(CORPORA)}, hf:DATASET[:CONFIG], or a .txt "
            "(documents separated by blank lines) or .jsonl (a text field a line) file"
        )
    return name


def read_text_file(path: str | Path) -> list[str]:
    """The documents of a user's file, read as UTF-8 (a byte-order mark is dropped): ``.txt``, documents separated by
    blank lines (each stripped); ``.jsonl``, each non-empty line a JSON object whose ``text`` is a string. Invalid
    UTF-8 is refused in one line naming its byte offset; a bad ``.jsonl`` line names its line number."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise LensParallelError(f"cannot read text file {path} ({exc.strerror})") from exc
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise LensParallelError(
            f"{path} is not UTF-8: byte offset {exc.start} holds {raw[exc.start : exc.start + 1]!r} ({exc.reason}); "
            "save the file as UTF-8"
        ) from exc
    if path.suffix == ".txt":
        return [doc.strip() for doc in re.split(r"\n[ \t]*\n", text) if doc.strip()]
    docs = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LensParallelError(f"{path} line {number} is not JSON ({exc.msg})") from exc
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise LensParallelError(f"{path} line {number} has no string field 'text' (one object a line)")
        docs.append(row["text"])
    return docs


def check_texts(texts: Sequence[object]) -> list[str]:
    """A user's documents as a list, each checked to be text: ``str`` (bytes are refused: decode them first) that
    encodes as UTF-8 (a lone surrogate, e.g. a byte that ``errors="surrogateescape"`` kept, is refused with its
    position)."""
    docs = []
    for i, doc in enumerate(texts):
        if not isinstance(doc, str):
            raise LensParallelError(
                f"document {i} is {type(doc).__name__}, not str: decode it (as UTF-8) before passing it as text"
            )
        try:
            doc.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise LensParallelError(
                f"document {i} is not valid text: character {exc.start} is an undecoded byte ({doc[exc.start]!r}, "
                "as errors='surrogateescape' leaves it); read the text as UTF-8"
            ) from exc
        docs.append(doc)
    return docs


def load_texts(name: str = "wikipedia-en", *, n_docs: int | None = None) -> list[str]:
    """The documents of a bundled corpus, in their stored order (the first ``n_docs`` if given).

    ``name`` is a bundled corpus (:data:`CORPORA`), a ``.txt`` / ``.jsonl`` file (:func:`read_text_file`) or,
    online, ``hf:DATASET[:CONFIG[:SPLIT]]`` (e.g. ``hf:Salesforce/wikitext:wikitext-103-raw-v1:test``) read from
    its ``text`` column.

    Examples:
        >>> import lens_parallel as lp
        >>> texts = lp.load_texts("austen", n_docs=2)
        >>> len(texts)
        2
    """
    if check_corpus(name).startswith("hf:"):
        docs = _load_hub_texts(name)
    elif name.endswith(TEXT_FILE_SUFFIXES):
        docs = read_text_file(name)
    else:
        with gzip.open(ASSETS / "corpora" / f"{name}.json.gz", "rt", encoding="utf-8") as f:
            docs = json.load(f)
    if n_docs is not None:
        if n_docs < 1:
            raise LensParallelError(f"n_docs must be >= 1, got {n_docs}")
        docs = docs[:n_docs]
    return docs


def texts_of(texts: str | Sequence[str]) -> tuple[str, list[str]]:
    """(the corpus's name, its documents) of what a caller gave as texts: a name :func:`load_texts` reads, or a list
    of documents (``"user-texts"``, each checked by :func:`check_texts`)."""
    if isinstance(texts, str):
        return texts, load_texts(texts)
    return "user-texts", check_texts(texts)


CORPUS_N_DOCS = 16
"""How many documents :func:`token_blocks` and :func:`~lens_parallel.documents.whole_documents` take of a bundled or
hub corpus by default (of a user's own texts, a list or a file: all of them)."""


def wanted_docs(texts: str | Sequence[str], n_docs: int | None, available: int) -> int:
    """``n_docs`` checked (>= 1), or its default: every one of a user's ``available`` texts (a list or a ``.txt`` /
    ``.jsonl`` file), :data:`CORPUS_N_DOCS` of a bundled or hub corpus."""
    if n_docs is None:
        own = not isinstance(texts, str) or texts.endswith(TEXT_FILE_SUFFIXES)
        return max(available, 1) if own else CORPUS_N_DOCS
    if isinstance(n_docs, bool) or not isinstance(n_docs, (int, np.integer)) or n_docs < 1:
        raise LensParallelError(f"n_docs must be an integer >= 1 (or None: all of your texts), got {n_docs!r}")
    return int(n_docs)


def stored_or_seeded(available: int, n_docs: int, seed: int) -> np.ndarray:
    """The order documents are taken in: as stored when all ``available`` are wanted (document i is text i), else a
    seeded permutation."""
    return np.arange(available) if n_docs == available else np.random.default_rng(seed).permutation(available)


@dataclass(frozen=True)
class TokenBlocks:
    """Fixed-length token blocks, one per document, and how they were made.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> docs.describe()["n_docs"]
        4
    """

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
    n_docs: int | None = None,
    seq_len: int = 128,
    seed: int = 0,
) -> TokenBlocks:
    """``n_docs`` blocks of ``seq_len`` tokens: documents chosen in a seeded order among those long enough.

    ``texts`` is a bundled corpus name, a ``.txt`` / ``.jsonl`` file or a list of documents; ``n_docs`` (None: every
    one of your own texts, 16 of a corpus). Raises
    ``ValueError`` before tokenizing anything if ``seq_len`` exceeds the model's context or is < 2, or the corpus is
    empty; after, if fewer than ``n_docs`` documents have ``seq_len - 1`` tokens.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> docs.tokens.shape  # 4 blocks of 16 tokens, each starting with <|endoftext|>
        torch.Size([4, 16])
    """
    corpus, docs = texts_of(texts)
    n_ctx = model.cfg.n_ctx
    if seq_len < 2:
        raise LensParallelError(f"seq_len must be >= 2 (a boundary token and one text token), got {seq_len}")
    if seq_len > n_ctx:
        raise LensParallelError(
            f"seq_len={seq_len} exceeds the model's context length n_ctx={n_ctx}; use seq_len <= {n_ctx}"
        )
    n_docs = wanted_docs(texts, n_docs, len(docs))
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise LensParallelError(f"seed must be an integer >= 0, got {seed!r}")
    if not docs or not any(d.strip() for d in docs):
        raise LensParallelError(f"corpus {corpus!r} is empty: no document has any text")
    token, token_id = boundary_token(model.tokenizer)
    order = stored_or_seeded(len(docs), n_docs, seed)
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
            f"n_docs={n_docs} blocks asked for, but {corpus!r} has {len(rows)} documents (of {len(docs)}) with the "
            f"{seq_len - 1} tokens a block of seq_len={seq_len} needs (the longest has {longest}); lower n_docs to "
            f"{len(rows)} or less, or seq_len, or give more texts"
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
    return einops.rearrange(
        torch.tensor(ids[: n * seq_len], dtype=torch.long, device="cpu"), "(batch pos) -> batch pos", pos=seq_len
    )
