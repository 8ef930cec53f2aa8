"""Whole texts sampled as the directional-decomposition paper samples them (its ``prepare_text_dataset_jsonl.py``).

A stream of texts (the C4 en validation split online, ``hf:allenai/c4:en:validation``, streamed; or a bundled corpus
offline) is shuffled with Hugging Face ``datasets``' buffer shuffle, ``IterableDataset.shuffle(seed=1337,
buffer_size=10_000)``, then read in that order: each text stripped of surrounding white space, kept if it has
``min_chars`` to ``max_chars`` characters (160-1,200) and has not been kept before (exact duplicates dropped), until
``max_texts`` are kept or ``max_to_scan`` texts have been read. The texts are kept whole (ragged), not cut into
blocks: give ``sample.texts`` to :func:`~lens_parallel.documents.whole_documents`.

The shuffle order is ``datasets``' own and depends on its version, which :class:`TextSample` records.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lens_parallel.data import CORPORA, check_corpus, hub_spec, load_texts
from lens_parallel.errors import LensParallelError
from lens_parallel.validate import check_non_negative_int, check_positive_int

C4 = "hf:allenai/c4:en:validation"
"""The paper's source: C4 en, validation split, streamed."""


@dataclass(frozen=True, kw_only=True)
class TextSelection:
    """How texts are sampled (defaults: the authors' script's).

    Examples:
        >>> import lens_parallel as lp
        >>> lp.TextSelection(max_texts=4).max_texts
        4
    """

    max_texts: int = field(default=16, metadata={"help": "texts kept"})
    min_chars: int = field(default=160, metadata={"help": "fewest characters of a kept text (after stripping)"})
    max_chars: int = field(default=1200, metadata={"help": "most characters of a kept text"})
    shuffle_seed: int = field(default=1337, metadata={"help": "seed of the buffer shuffle"})
    shuffle_buffer: int = field(default=10_000, metadata={"help": "size of the shuffle buffer"})
    max_to_scan: int = field(default=200_000, metadata={"help": "texts read at most"})

    def __post_init__(self) -> None:
        for name in ("max_texts", "min_chars", "max_chars", "shuffle_buffer", "max_to_scan"):
            check_positive_int(name, getattr(self, name))
        check_non_negative_int("shuffle_seed", self.shuffle_seed)
        if self.min_chars > self.max_chars:
            raise LensParallelError(f"min_chars ({self.min_chars}) must not exceed max_chars ({self.max_chars})")


@dataclass(frozen=True)
class TextSample:
    """The kept texts, each with its index in the shuffled stream, how many texts were read, and where from.

    Examples:
        >>> import lens_parallel as lp
        >>> sample = lp.sample_texts(["A first paragraph of text. " * 10])
        >>> sample.source
        'user-texts'
    """

    texts: tuple[str, ...]
    source_indices: tuple[int, ...]
    n_scanned: int
    source: str
    paragraphs: bool
    selection: TextSelection
    datasets_version: str

    def describe(self) -> dict[str, Any]:
        """JSON-ready provenance (the texts left out)."""
        out = {k: v for k, v in asdict(self).items() if k != "texts"}
        return out | {"n_texts": len(self.texts)}


def select_texts(stream: Iterable[object], selection: TextSelection) -> tuple[list[str], list[int], int]:
    """The selection rule on an already ordered ``stream``: (kept texts, their indices in the stream, texts read).
    A non-string item counts as read and is skipped."""
    kept: list[str] = []
    indices: list[int] = []
    seen: set[str] = set()
    scanned = 0
    for item in stream:
        if scanned >= selection.max_to_scan:
            break
        scanned += 1
        if not isinstance(item, str):
            continue
        text = item.strip()
        if not selection.min_chars <= len(text) <= selection.max_chars or text in seen:
            continue
        seen.add(text)
        kept.append(text)
        indices.append(scanned - 1)
        if len(kept) >= selection.max_texts:
            break
    return kept, indices, scanned


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(
            "sample_texts shuffles with Hugging Face datasets (as the paper did): pip install 'lens_parallel[tasks]'"
        ) from exc
    return datasets


def _shuffled(source: str | Sequence[str], selection: TextSelection, paragraphs: bool) -> Iterator[object]:
    """The texts of ``source`` in ``datasets``' buffer-shuffled order (a hub data set streamed)."""
    datasets = _datasets()
    if isinstance(source, str) and source.startswith("hf:"):
        name, config, split = hub_spec(source)
        try:
            stream = datasets.load_dataset(name, config, split=split or "validation", streaming=True)
        except (OSError, ConnectionError, ValueError) as exc:
            raise LensParallelError(
                f"cannot stream {source!r} (offline, or no such data set: {str(exc).splitlines()[0][:160]}); "
                f"bundled corpora work offline: {', '.join(CORPORA)}"
            ) from exc
    else:
        texts = load_texts(source) if isinstance(source, str) else list(source)
        if paragraphs:
            texts = [line for text in texts for line in text.split("\n") if line.strip()]
        stream = datasets.IterableDataset.from_generator(lambda: ({"text": t} for t in texts))
    shuffled = stream.shuffle(seed=selection.shuffle_seed, buffer_size=selection.shuffle_buffer)
    return (row.get("text") for row in shuffled)


def sample_texts(
    source: str | Sequence[str] = C4, selection: TextSelection | None = None, *, paragraphs: bool = False
) -> TextSample:
    """Whole texts of ``source`` (``hf:DATASET[:CONFIG[:SPLIT]]``, streamed; a bundled corpus; or a list of texts)
    sampled by ``selection`` (default :class:`TextSelection`: the paper's), as the module docstring describes.
    ``paragraphs``: each non-empty line of a bundled or given document is one text, the offline stand-in for C4's
    short web texts (the bundled documents are all longer than 1,200 characters; 2,920 of wikipedia-en's 3,073
    paragraphs have 160-1,200).

    Examples:
        >>> import lens_parallel as lp
        >>> sample = lp.sample_texts(["A first paragraph of text. " * 10, "Another one. " * 20])
        >>> len(sample.texts)
        2
    """
    selection = selection or TextSelection()
    if isinstance(source, str):
        check_corpus(source)
        if paragraphs and source.startswith("hf:"):
            raise LensParallelError(
                "paragraphs=True splits bundled or given documents; a hub data set is streamed whole"
            )
    texts, indices, scanned = select_texts(_shuffled(source, selection, paragraphs), selection)
    if not texts:
        raise LensParallelError(
            f"no text of {source!r} has {selection.min_chars}-{selection.max_chars} characters in the first "
            f"{scanned} read; relax min_chars / max_chars"
        )
    return TextSample(
        texts=tuple(texts),
        source_indices=tuple(indices),
        n_scanned=scanned,
        source=source if isinstance(source, str) else "user-texts",
        paragraphs=paragraphs,
        selection=selection,
        datasets_version=importlib.metadata.version("datasets"),
    )
