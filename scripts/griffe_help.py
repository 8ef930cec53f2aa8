"""A griffe extension for the documentation site: each public name's docstring as ``help()`` shows it, i.e. with
the ``Args`` and ``Returns`` sections :mod:`lens_parallel.docstrings` writes from the code (the source holds the
prose and the examples only)."""

from __future__ import annotations

import inspect
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


class RuntimeDocstrings(griffe.Extension):
    """Replace the static docstring of every public function and class by its completed one."""

    def __init__(self) -> None:
        self.docs = _public()

    def on_object(self, *, obj: griffe.Object, **_: Any) -> None:
        if (doc := self.docs.get(obj.path)) is not None:
            obj.docstring = griffe.Docstring(doc, parent=obj)
