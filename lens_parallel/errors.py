"""The package's own error type for bad input.

Every check of what a caller passed (a model spec, a layer index, a scale, a file) raises
:class:`LensParallelError`, with what was wrong and what is accepted, before any expensive work. It subclasses
``ValueError``, so ``except ValueError`` keeps working; the CLI catches only this type, so a bug inside the package
still shows its traceback instead of posing as bad input.
"""

from __future__ import annotations


class LensParallelError(ValueError):
    """Bad input: the message says what was wrong and what is accepted."""
