"""Rebuild the text and tokenizer assets shipped in ``lens_parallel/assets`` from ``../shared/data``.

Run once by a maintainer (``python scripts/build_assets.py [SHARED_DATA_DIR]``); the outputs are committed.
Every corpus is a JSON list of documents, gzip-compressed; provenance is in ``assets/SOURCES.md``.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import sys
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "lens_parallel" / "assets"
MIN_CHARS = 2000  # a document must hold a few hundred tokens in every bundled tokenizer


def group(items: list[str], *, min_chars: int, sep: str = "\n\n") -> list[str]:
    """Join consecutive items until each document has at least ``min_chars`` characters."""
    docs, cur = [], []
    for item in items:
        cur.append(item)
        if sum(len(x) for x in cur) >= min_chars:
            docs.append(sep.join(cur))
            cur = []
    return docs


def chapters(text: str, pattern: str) -> list[str]:
    parts = re.split(pattern, text)
    return [p.strip() for p in parts[1:] if len(p.strip()) >= MIN_CHARS]


def main(shared: Path) -> None:
    text = shared / "text"
    wiki = [p.strip() for p in (text / "en_wikipedia_leads.txt").read_text().split("\n\n") if p.strip()]
    austen = (text / "en_austen.txt").read_text()
    moby = (text / "en_moby_dick.txt").read_text()
    moby = moby[moby.index("CHAPTER 1. Loomings.") : moby.index("End of Project Gutenberg")]
    lunyu = [p.strip() for p in (text / "zh_lunyu.txt").read_text().split("\n\n") if p.strip()]
    tang = [p.strip() for p in (text / "zh_tang_poems.txt").read_text().split("\n\n") if p.strip()]
    corpora = {
        "wikipedia-en": group(wiki[:3000], min_chars=MIN_CHARS),
        "austen": chapters(austen, r"\nCHAPTER [IVXLC]+\.?\n")[:60],
        "moby-dick": chapters(moby, r"\nCHAPTER \d+\.[^\n]*\n")[:40],
        "lunyu": group(lunyu, min_chars=600, sep="\n"),
        "tang-poems": group(tang, min_chars=600),
    }
    out = ASSETS / "corpora"
    out.mkdir(parents=True, exist_ok=True)
    for name, docs in corpora.items():
        with gzip.open(out / f"{name}.json.gz", "wt", encoding="utf-8", compresslevel=9) as f:
            json.dump(docs, f, ensure_ascii=False)
        print(f"{name}: {len(docs)} documents, {sum(map(len, docs)):,} characters")

    tok = ASSETS / "tokenizers"
    for family, files in {
        "gpt2": ["encoder.json", "vocab.bpe", "LICENSE"],
        "gpt-neox": ["tokenizer.json"],
        "qwen3": ["tokenizer.json", "tokenizer_config.json", "LICENSE"],
    }.items():
        (tok / family).mkdir(parents=True, exist_ok=True)
        for name in files:
            src = shared / "tokenizers" / family / name
            if name == "LICENSE":
                shutil.copyfile(src, tok / family / name)
                continue
            with open(src, "rb") as fi, gzip.open(tok / family / f"{name}.gz", "wb", compresslevel=9) as fo:
                shutil.copyfileobj(fi, fo)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "shared" / "data")
