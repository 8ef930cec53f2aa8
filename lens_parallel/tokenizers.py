"""The bundled tokenizers (GPT-2, GPT-NeoX, Qwen3), unpacked once into the cache as Hugging Face folders.

TransformerLens reloads a tokenizer from its ``name_or_path``, so a tokenizer built in memory is not enough:
each one is written to ``cache_dir()/tokenizers/<family>`` and loaded back from there.
"""

from __future__ import annotations

import gzip
import json
import shutil
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from lens_parallel.paths import ASSETS, cache_dir

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
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": special, "eos_token": special,
                  "unk_token": special, "model_max_length": 2048}  # fmt: skip
        (into / "tokenizer_config.json").write_text(json.dumps(config))
    (into / "lens_parallel_format").write_text(str(_FORMAT))


def bundled_tokenizer_folder(family: str) -> Path:
    """The cached Hugging Face folder of a bundled tokenizer, unpacked on first use (atomically)."""
    if family not in BUNDLED_TOKENIZERS:
        raise ValueError(f"no bundled tokenizer {family!r}; bundled: {', '.join(BUNDLED_TOKENIZERS)}")
    folder = cache_dir() / "tokenizers" / family
    marker = folder / "lens_parallel_format"
    if marker.is_file() and marker.read_text() == str(_FORMAT):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{family}-"))
    _unpack(family, tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def load_bundled_tokenizer(family: str) -> PreTrainedTokenizerBase:
    """Load a bundled tokenizer (``gpt2``, ``gpt-neox`` or ``qwen3``) offline."""
    return AutoTokenizer.from_pretrained(bundled_tokenizer_folder(family))
