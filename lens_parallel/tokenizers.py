"""The bundled tokenizers (GPT-2, GPT-NeoX, Qwen3), unpacked once into the cache as Hugging Face folders, and
small byte-level BPE tokenizers trained on a corpus (for the small models of :mod:`lens_parallel.training`).

TransformerLens reloads a tokenizer from its ``name_or_path``, so a tokenizer built in memory is not enough:
each one is written to ``cache_dir()/tokenizers/<family>`` and loaded back from there.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from lens_parallel.errors import EnvironmentFailure, LensParallelError
from lens_parallel.paths import ASSETS, cache_dir, cached_folder

BUNDLED_TOKENIZERS = ("gpt2", "gpt-neox", "qwen3")
_FORMAT = 1  # bump when the unpacked layout changes


def _unpack(family: str, into: Path) -> None:
    src = ASSETS / "tokenizers" / family
    for gz in src.glob("*.gz"):
        (into / gz.name.removesuffix(".gz")).write_bytes(gzip.decompress(gz.read_bytes()))
    if family == "gpt2":
        bpe = models.BPE.from_file(str(into / "encoder.json"), str(into / "vocab.bpe"))
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        special = "<|endoftext|>"
        PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token=special, eos_token=special, unk_token=special, model_max_length=1024
        ).save_pretrained(into)
    elif family == "gpt-neox":
        special = "<|endoftext|>"
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": special,
            "eos_token": special,
            "unk_token": special,
            "model_max_length": 2048,
        }
        (into / "tokenizer_config.json").write_text(json.dumps(config))
    (into / "lens_parallel_format").write_text(str(_FORMAT))


def _current(folder: Path) -> bool:
    """Whether ``folder`` is a finished unpack of this layout (its marker is written last)."""
    marker = folder / "lens_parallel_format"
    return marker.is_file() and marker.read_text() == str(_FORMAT)


def bundled_tokenizer_folder(family: str) -> Path:
    """The cached Hugging Face folder of a bundled tokenizer, unpacked on first use (safe under concurrent
    first uses: :func:`lens_parallel.paths.cached_folder`)."""
    if family not in BUNDLED_TOKENIZERS:
        raise LensParallelError(f"no bundled tokenizer {family!r}; bundled: {', '.join(BUNDLED_TOKENIZERS)}")
    return cached_folder(cache_dir() / "tokenizers" / family, lambda into: _unpack(family, into), _current)


def load_bundled_tokenizer(family: str, *, for_bridge: bool = False) -> PreTrainedTokenizerBase:
    """Load a bundled tokenizer (``gpt2``, ``gpt-neox`` or ``qwen3``) offline.

    ``for_bridge``: as a TransformerLens bridge keeps it: with ``add_bos_token=True`` where the tokenizer has a BOS
    token. Given any other, the bridge loads it again so (``get_tokenizer_with_bos``: a second load, 0.15-0.3 s)."""
    folder = bundled_tokenizer_folder(family)
    if for_bridge and json.loads((folder / "tokenizer_config.json").read_text()).get("bos_token") is not None:
        return AutoTokenizer.from_pretrained(folder, add_bos_token=True)
    return AutoTokenizer.from_pretrained(folder)


def trained_bpe_folder(docs: Sequence[str], vocab_size: int) -> Path:
    """A byte-level BPE tokenizer with ``vocab_size`` tokens (``<|endoftext|>`` is id 0) trained on ``docs`` with the
    ``tokenizers`` library, saved as a Hugging Face folder under ``cache_dir()/tokenizers/bpe-<N>-<hash of docs>``
    (trained once; training is deterministic)."""
    if not 256 < vocab_size <= 1_000_000:
        raise LensParallelError(f"a byte-level BPE needs 257..1000000 tokens (256 bytes + merges), got {vocab_size}")
    digest = hashlib.sha256("\x00".join(docs).encode()).hexdigest()[:12]
    folder = cache_dir() / "tokenizers" / f"bpe-{vocab_size}-{digest}"

    def build(into: Path) -> None:
        special = "<|endoftext|>"
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[special],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(docs, trainer)
        PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token=special, eos_token=special, unk_token=special, model_max_length=4096
        ).save_pretrained(into)
        (into / "lens_parallel_format").write_text(str(_FORMAT))

    return cached_folder(folder, build, _current)


def hf_tokenizer(model: Any) -> Any:
    """The model's tokenizer with Hugging Face's defaults, loaded again from where the bridge's came from
    (``tokenizer.name_or_path``: the model's folder, a bundled tokenizer, or a hub name, which needs the hub). Loaded
    once per source and process (about 0.1 s each: every ``generate`` call asked for it) and shared: copy it before
    changing it."""
    return _load_tokenizer(str(getattr(model.tokenizer, "name_or_path", "")))


@functools.lru_cache(maxsize=16)
def _load_tokenizer(source: str) -> Any:
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise EnvironmentFailure(
            f"could not load the tokenizer {source!r} with Hugging Face's defaults ({exc}); pass tokenizer= (the "
            "one Hugging Face or lm-eval's hf model would use)"
        ) from None
