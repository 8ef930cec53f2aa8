"""Where lens_parallel keeps its bundled assets and its per-user cache."""

from __future__ import annotations

import os
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"


def cache_dir() -> Path:
    """``$LENS_PARALLEL_CACHE``, else ``$XDG_CACHE_HOME/lens_parallel``, else ``~/.cache/lens_parallel``."""
    if env := os.environ.get("LENS_PARALLEL_CACHE"):
        root = Path(env)
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lens_parallel"
    root.mkdir(parents=True, exist_ok=True)
    return root


def add_suffix(stem: Path, suffix: str) -> Path:
    """``stem`` with ``suffix`` appended: unlike ``Path.with_suffix``, a dot already in the name stays
    (``toy-qwen3.5_scaling`` + ``.json``, not ``toy-qwen3.json``)."""
    return stem.parent / f"{stem.name}{suffix}"
