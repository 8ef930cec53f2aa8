"""The package's three kinds of failure, each with its own root, so that a caller (and the CLI) can tell them apart.

- :class:`LensParallelError`: **bad input**. Every check of what a caller passed (a model spec, a layer index, a
  scale, a file) raises it with what was wrong and what is accepted, before any expensive work. It subclasses
  ``ValueError``, so ``except ValueError`` keeps working. The CLI prints its message as one line and exits 2.
  :class:`NonFiniteError` is the one kind found during the work: a model (its weights, its dtype, an edit) whose
  forward or backward produces NaN or infinity, never read as a number.
- :class:`EnvironmentFailure`: **the environment failed**, not the input: a download that cannot reach its
  registry, a kernel this device cannot run. The message says what failed and what to do; the CLI prints it
  without a traceback and exits 3.
- **Ctrl-C** during a long run raises Python's own ``KeyboardInterrupt``, made by :func:`interrupted` with one line
  saying what finished work was kept, where, and how to resume, shown as that line alone (the CLI exits 130).
- :class:`LibraryError`: **the libraries underneath do not behave as this package requires** (a TransformerLens
  hook of an unexpected shape, captured activations that do not reproduce hook_z): an incompatible version or a
  bug. The CLI lets it show its traceback, as any other exception (a bug inside this package).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar


class LensParallelError(ValueError):
    """Bad input: the message says what was wrong and what is accepted.

    Examples:
        >>> import lens_parallel as lp
        >>> try:
        ...     lp.DecomposeSettings(space=("values",))
        ... except lp.LensParallelError as error:  # a ValueError too
        ...     print(str(error).split(";")[0])
        unknown space 'values' (did you mean 'value'?)
    """


class NonFiniteError(LensParallelError):
    """A forward or backward produced NaN or infinity: the message names the model, the first hook point (and any
    parameter) holding one, and the likely cause.

    Examples:
        >>> import lens_parallel as lp
        >>> issubclass(lp.NonFiniteError, lp.LensParallelError)
        True
    """


class EnvironmentFailure(RuntimeError):
    """The environment failed (network, package registry, device, kernels): the message says what and what to do.

    Examples:
        >>> import lens_parallel as lp
        >>> issubclass(lp.EnvironmentFailure, lp.LensParallelError)
        False
    """


class LibraryError(RuntimeError):
    """A library underneath (TransformerLens, transformers, torch) does not behave as this package requires.

    Examples:
        >>> import lens_parallel as lp
        >>> issubclass(lp.LibraryError, RuntimeError)
        True
    """


_MESSAGE = "lens_parallel_message"
"""The attribute that marks a KeyboardInterrupt :func:`interrupted` made (its one line)."""


def interrupted(message: str) -> KeyboardInterrupt:
    """The ``KeyboardInterrupt`` a long run raises when Ctrl-C stops it, ``message`` saying what finished work was
    kept, where and how to resume. It is Python's own type, so a script still ends as an interrupted process (status
    130 in a shell), and it shows as that one line, never a traceback: in IPython and Jupyter through its
    ``_render_traceback_``, in a script through :data:`sys.excepthook`, which this chains once (every other exception
    goes on to the hook that was there).

    Examples:
        >>> import lens_parallel as lp
        >>> from lens_parallel.errors import interrupted
        >>> interrupted("3 of 8 jobs kept in store.jsonl")._render_traceback_()
        ['KeyboardInterrupt: 3 of 8 jobs kept in store.jsonl']
    """
    exc = KeyboardInterrupt(message)
    setattr(exc, _MESSAGE, message)
    setattr(exc, "_render_traceback_", lambda: [f"KeyboardInterrupt: {message}"])  # noqa: B010  (IPython reads it)
    if not getattr(sys.excepthook, _MESSAGE, False):
        sys.excepthook = _one_line_hook(sys.excepthook)
    return exc


def interrupt_message(exc: BaseException) -> str | None:
    """The line of a KeyboardInterrupt :func:`interrupted` made, or None for any other exception."""
    return getattr(exc, _MESSAGE, None)


def _one_line_hook(previous: Any) -> Any:
    def hook(kind: type[BaseException], value: BaseException, tb: types.TracebackType | None) -> None:
        if (message := interrupt_message(value)) is not None:
            print(f"KeyboardInterrupt: {message}", file=sys.stderr, flush=True)
        else:
            previous(kind, value, tb)

    setattr(hook, _MESSAGE, True)
    return hook


_KEPT: contextvars.ContextVar[dict[str, None] | None] = contextvars.ContextVar("kept", default=None)
"""Where the running call (or command) has kept finished work: the stores and checkpoints it wrote to."""
F = TypeVar("F", bound=Callable[..., Any])


def kept_in(path: str | Path) -> None:
    """Say that the running call has kept finished work in ``path`` (a store's row, a checkpoint), for the line a
    Ctrl-C ends it with (:func:`one_line_interrupt`)."""
    if (kept := _KEPT.get()) is not None:
        kept[str(path)] = None


@contextlib.contextmanager
def one_line_interrupt(what: str) -> Iterator[None]:
    """Around a long call or a command: a Ctrl-C inside becomes one line (:func:`interrupted`): the line a sweep said
    (how many of its jobs finished, where they are kept), or where the call kept finished work (:func:`kept_in`) and
    that running it again resumes from it, or that it kept none. Nested: the outermost says it."""
    outer = _KEPT.get() is None
    token = _KEPT.set({}) if outer else None
    try:
        yield
    except KeyboardInterrupt as exc:
        if not outer or interrupt_message(exc) is not None:
            raise
        places = list(_KEPT.get() or ())
        said = (
            f"{what} stopped; its finished work is kept in {', '.join(places)}: run the same again to resume from it"
            if places
            else f"{what} stopped before any of its work was kept"
        )
        raise interrupted(said) from None
    finally:
        if token is not None:
            _KEPT.reset(token)


def long_call(fn: F) -> F:
    """``fn`` (a public entry point) with Ctrl-C ending it in one line (:func:`one_line_interrupt`)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with one_line_interrupt(fn.__name__):
            return fn(*args, **kwargs)

    return call  # type: ignore[return-value]  # functools.wraps keeps fn's signature
