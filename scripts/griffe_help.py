"""A griffe extension for the documentation site: each public name's docstring as ``help()`` shows it, i.e. with
the ``Args`` and ``Returns`` sections :mod:`lens_parallel.docstrings` writes from the code (the source holds the
prose and the examples only)."""

from __future__ import annotations

import inspect
import re
from typing import Any

import griffe

import lens_parallel


def _public() -> dict[str, str]:
    """The defining path (``module.name``) of every public function and class -> its completed docstring."""
    out = {}
    for name in lens_parallel.__all__:
        obj = getattr(lens_parallel, name)  # completes its docstring
        if inspect.isclass(obj) or inspect.isfunction(obj):
            out[f"{obj.__module__}.{obj.__qualname__}"] = obj.__doc__ or ""
    return out


_CODE = re.compile(r"(``.+?``|`[^`\n]+`)")


def _as_text(doc: str) -> str:
    """``doc`` with each ``<`` outside code spans and the ``Examples:`` section written ``&lt;``: a column such as
    ``self_cos[<space>,<level>]`` is text, whereas Markdown passes ``<space>`` through as an HTML tag, which the
    browser hides with everything after it nested inside."""
    prose, examples, rest = doc.partition("\nExamples:\n")
    parts = _CODE.split(prose)
    return "".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts)) + examples + rest


class RuntimeDocstrings(griffe.Extension):
    """Replace the static docstring of every public function and class by its completed one, and write every
    docstring's ``<`` as text (:func:`_as_text`)."""

    def __init__(self) -> None:
        self.docs = _public()

    def on_object(self, *, obj: griffe.Object, **_: Any) -> None:
        doc = self.docs.get(obj.path) or (obj.docstring.value if obj.docstring else None)
        if doc is not None:
            obj.docstring = griffe.Docstring(_as_text(doc), parent=obj)
