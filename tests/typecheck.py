"""The suite's runtime type checker (``--jaxtyping-packages=lens_parallel,tests.typecheck.checker``): beartype, with
the package's choice types (``Literal`` of strings, :mod:`lens_parallel.choices`) checked as plain ``str``.

A bad choice then reaches the package's own check and its one-line :class:`~lens_parallel.LensParallelError`, as it
does without the type checker; every other hint (tensor shapes and dtypes, numbers, containers) is checked as usual.
The choices are read from their file without importing the package (the import hook decorates the package's
functions with this checker while the package is being imported); ``Literal`` types compare equal by their values.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from beartype import BeartypeConf, FrozenDict, beartype

_spec = importlib.util.spec_from_file_location(
    "_lens_parallel_choices", Path(__file__).resolve().parent.parent / "lens_parallel" / "choices.py"
)
assert _spec is not None and _spec.loader is not None
_choices = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_choices)

checker = beartype(conf=BeartypeConf(hint_overrides=FrozenDict({choice: str for choice in _choices.CHOICES})))
