"""The suite's runtime type checker (``--jaxtyping-packages=lens_parallel,tests.typecheck.checker``): beartype, with
the package's choice types (``Literal`` of strings, :mod:`lens_parallel.choices`) checked as plain ``str``.

A bad choice then reaches the package's own check and its one-line :class:`~lens_parallel.LensParallelError`, as it
does without the type checker; every other hint (tensor shapes and dtypes, numbers, containers) is checked as usual.
The choices are read from their file without importing the package (the import hook decorates the package's
functions with this checker while the package is being imported); ``Literal`` types compare equal by their values.

:func:`preload_dependencies` imports what the package imports before the package is imported (tests/conftest.py
calls it first): while an instrumented module runs, jaxtyping's loader swaps importlib's ``cache_from_source`` for
one that adds its own marker to the cached bytecode's name, so every module first imported then (torch,
transformers, scipy, ...: about 3,400 here) looked for bytecode under that name, found none and was compiled from
source, in every pytest process (about 10 s each; never cached where PYTHONDONTWRITEBYTECODE is set).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

from beartype import BeartypeConf, FrozenDict, beartype

_spec = importlib.util.spec_from_file_location(
    "_lens_parallel_choices", Path(__file__).resolve().parent.parent / "lens_parallel" / "choices.py"
)
assert _spec is not None and _spec.loader is not None
_choices = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_choices)

_beartype = beartype(conf=BeartypeConf(hint_overrides=FrozenDict({choice: str for choice in _choices.CHOICES})))
_CHECKED: dict[Hashable, Callable[..., Any]] = {}


def checker(stub: Callable[..., Any]) -> Callable[..., Any]:
    """beartype applied to one of the stubs jaxtyping's ``jaxtyped`` builds for a function (a function of the same
    signature whose body does nothing), once per signature: jaxtyping's import hook decorates every ``def``, also
    the ones inside a function, which run again at each call (a hook built per edit and layer), and beartype's code
    generation was most of that (about 0.3 ms each). The stub is only ever called with every argument given
    (jaxtyping binds them and applies the defaults first), so a checked stub of an equal signature checks the same.
    """
    signature = inspect.signature(stub)
    key = (
        stub.__module__,
        stub.__qualname__,
        tuple((p.name, p.kind, p.annotation) for p in signature.parameters.values()),
        signature.return_annotation,
    )
    try:
        return _CHECKED[key]
    except KeyError:
        checked = _CHECKED[key] = _beartype(stub)
        return checked
    except TypeError:  # an annotation that cannot be hashed
        return _beartype(stub)


def preload_dependencies() -> None:
    """Import every module the package imports at module level, except the package's own and the standard library's
    (each once). One that fails to import is skipped: the test that needs it meets the failure itself, as without
    this."""
    names: set[str] = set()
    for path in (Path(__file__).resolve().parent.parent / "lens_parallel").rglob("*.py"):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
    for name in sorted(names):
        top = name.split(".")[0]
        if top not in ("lens_parallel", "__future__") and top not in sys.stdlib_module_names:
            with contextlib.suppress(Exception):
                importlib.import_module(name)
