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
import functools
import importlib
import importlib.util
import inspect
import sys
import types
import typing
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import jaxtyping
from beartype import BeartypeConf, FrozenDict, beartype

_spec = importlib.util.spec_from_file_location(
    "_lens_parallel_choices", Path(__file__).resolve().parent.parent / "lens_parallel" / "choices.py"
)
assert _spec is not None and _spec.loader is not None
_choices = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_choices)

_beartype = beartype(conf=BeartypeConf(hint_overrides=FrozenDict({choice: str for choice in _choices.CHOICES})))
_CHECKED: dict[Hashable, Callable[..., Any]] = {}
_JAXTYPED = jaxtyping.jaxtyped


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


def _array_hint(hint: Any) -> bool:
    """Whether ``hint`` is, or holds, a jaxtyping array type (``Float[Tensor, "batch pos"]``, ...)."""
    if isinstance(hint, type) and issubclass(hint, jaxtyping.AbstractArray):
        return True
    return any(_array_hint(arg) for arg in typing.get_args(hint))


def _resolved(fn: Callable[..., Any]) -> dict[str, Any]:
    """``fn``'s hints as objects, each resolved in its module's namespace as jaxtyping resolves them (one that cannot
    be, a name imported for type checkers only, is ``Any``)."""
    out = {}
    for name, hint in fn.__annotations__.items():
        holder = types.SimpleNamespace(__annotations__={"value": hint}, __module__=fn.__module__)
        try:
            out[name] = typing.get_type_hints(holder, fn.__globals__, include_extras=True)["value"]
        except Exception:
            out[name] = Any
    return out


def _decorate(fn: Any, typechecker: Any) -> Any:
    """What the import hook's decorator does to one of the package's functions or classes (:func:`install`)."""
    local = isinstance(fn, types.FunctionType) and "<locals>" in fn.__qualname__
    if not isinstance(fn, types.FunctionType) or local or not fn.__module__.startswith("lens_parallel"):
        return _JAXTYPED(fn, typechecker=typechecker)
    hints = _resolved(fn)
    if any(_array_hint(hint) for hint in hints.values()):
        return _JAXTYPED(fn, typechecker=typechecker)
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__, copy.__module__ = fn.__kwdefaults__, fn.__qualname__, fn.__module__
    copy.__annotations__ = hints
    return functools.update_wrapper(_beartype(copy), fn)  # what inspect and help() read: fn's own hints


def _hook_decorator(fn: Any = None, *, typechecker: Any = None) -> Any:
    if fn is None:
        return functools.partial(_decorate, typechecker=typechecker)
    return _decorate(fn, typechecker)


def install() -> None:
    """Check the package's functions without jaxtyping's per-call wrapper where it adds nothing. jaxtyping's import
    hook decorates every function and class of the package with ``jaxtyping.jaxtyped(typechecker=...)``, read from
    the ``jaxtyping`` module as each decorated ``def`` runs; in this process that name is :func:`_hook_decorator`:

    - a function whose hints name an array type, a class (a dataclass's ``__init__``), a function defined inside
      another, and anything outside the package: jaxtyping's own ``jaxtyped`` with :func:`checker` (array shapes
      consistent across arguments and the return);
    - every other function of the package: beartype alone (:func:`checker`'s configuration), on a copy whose hints
      are resolved as jaxtyping resolves them, which checks the same hints without jaxtyping's wrapper (binding the
      arguments, a shape memo, every argument checked before and again after the call). Those are 89% of the calls
      the suite makes into the package, and the wrapper was most of the checker's cost (about 35 us a call).

    ``tests/test_style.py`` checks that both kinds are checked, and which is which."""
    jaxtyping.jaxtyped = _hook_decorator  # type: ignore[assignment]


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
