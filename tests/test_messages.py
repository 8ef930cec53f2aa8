"""Every name an error message points to exists: a ``lens_parallel.<module>[.<attribute>]`` imports and resolves,
and an extra named in ``pip install 'lens_parallel[<extra>]'`` is one the installed package provides."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lens_parallel"
NAME = re.compile(r"\blens_parallel(?:\.[A-Za-z_]\w*)+(?![\w/])")  # not a format name (lens_parallel.plan/2)
EXTRA = re.compile(r"lens_parallel\[(\w+)\]")


def _message_texts() -> list[tuple[str, str]]:
    """(file:line, text) of every string constant inside a ``raise`` statement of the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and node.exc is not None:
                for part in ast.walk(node.exc):
                    if isinstance(part, ast.Constant) and isinstance(part.value, str):
                        found.append((f"{path.relative_to(PACKAGE.parent)}:{part.lineno}", part.value))
    return found


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_every_name_an_error_message_mentions_exists():
    texts = _message_texts()
    assert len(texts) > 200  # the scan sees the package's messages
    names = {(where, m) for where, text in texts for m in NAME.findall(text)}
    missing = sorted((where, name) for where, name in names if not _resolves(name.rstrip(".")))
    assert not missing, missing
    extras = importlib.metadata.metadata("lens_parallel").get_all("Provides-Extra") or []
    named = {(where, e) for where, text in texts for e in EXTRA.findall(text)}
    assert named and all(e in extras for _, e in named), named
