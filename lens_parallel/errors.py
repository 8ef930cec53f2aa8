"""The package's three kinds of failure, each with its own root, so that a caller (and the CLI) can tell them apart.

- :class:`LensParallelError`: **bad input**. Every check of what a caller passed (a model spec, a layer index, a
  scale, a file) raises it with what was wrong and what is accepted, before any expensive work. It subclasses
  ``ValueError``, so ``except ValueError`` keeps working. The CLI prints its message as one line and exits 2.
  :class:`NonFiniteError` is the one kind found during the work: a model (its weights, its dtype, an edit) whose
  forward or backward produces NaN or infinity, never read as a number.
- :class:`EnvironmentFailure`: **the environment failed**, not the input: a download that cannot reach its
  registry, a kernel this device cannot run. The message says what failed and what to do; the CLI prints it
  without a traceback and exits 3.
- :class:`LibraryError`: **the libraries underneath do not behave as this package requires** (a TransformerLens
  hook of an unexpected shape, captured activations that do not reproduce hook_z): an incompatible version or a
  bug. The CLI lets it show its traceback, as any other exception (a bug inside this package).
"""

from __future__ import annotations


class LensParallelError(ValueError):
    """Bad input: the message says what was wrong and what is accepted.

    Examples:
        >>> import lens_parallel as lp
        >>> try:
        ...     lp.DecomposeSettings(space=("values",))
        ... except lp.LensParallelError as error:  # a ValueError too
        ...     print(str(error).split(";")[0])
        unknown space 'values'
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
