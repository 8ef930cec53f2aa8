"""The analysis registry: each analysis module registers itself once (name, settings class, function, result,
printer, and what its subcommand needs), and the command line, the package's exports and the contract tests read
this registry (tuned-lens' "a subcommand is its options object", SAELens' ``register_*``).

Adding an analysis: its module under ``lens_parallel/analyses/`` ending in a :func:`register_analysis` call, and its
plot under ``lens_parallel/plots/``. :func:`analyses` imports every module of the package, so the new subcommand
appears in ``lens-parallel`` (after ``python scripts/build_cli_spec.py``) and in ``tests/test_registries.py``.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from lens_parallel.errors import LensParallelError

Printer = Callable[[Any, Any, Any], tuple[str, pd.DataFrame]]
"""``printer(result, settings, display) -> (title, table)``: what the subcommand prints (``display``: the instance of
the analysis's display options, or None)."""


@dataclass(frozen=True)
class Analysis:
    """One registered analysis.

    Attributes:
        name: the subcommand and the stem of its output files.
        help: one line for ``--help``.
        function: ``function(model, documents, *, settings=, options=, protocol=, **shortcuts) -> result``.
        settings: its settings dataclass (its fields are the subcommand's options, its defaults the library's).
        result: the result class it returns.
        printer: what the subcommand prints (:data:`Printer`).
        data: the subcommand's defaults for :class:`~lens_parallel.options.DataOptions` (model and documents).
        sweep: whether it runs many forwards through the engine (the subcommand then takes every run option, and
            keeps a resumable store named ``store`` in its output folder).
        store: the store's default file name (sweep analyses).
        display: a dataclass of options that change only what is printed (None: none).
        whole_texts: given the settings, whether the documents are whole texts in rolling windows (word
            perplexity) rather than token blocks.
        check_data: checks of the documents' options to run before the model loads.
        files: extra tables written beside the standard outputs, ``files(result, folder) -> paths``.
    """

    name: str
    help: str
    function: Callable[..., Any]
    settings: type
    result: type
    printer: Printer
    data: Mapping[str, Any] = field(default_factory=dict)
    sweep: bool = False
    store: str | None = None
    display: type | None = None
    whole_texts: Callable[[Any], bool] | None = None
    check_data: Callable[[Any], None] | None = None
    files: Callable[[Any, Path], tuple[Path, ...]] | None = None


ANALYSES: dict[str, Analysis] = {}
"""Every registered analysis by name (complete after :func:`analyses`)."""


def register_analysis(analysis: Analysis) -> Analysis:
    """Add ``analysis`` to the registry (a name may be registered once)."""
    known = ANALYSES.get(analysis.name)
    if known is not None and known.function is not analysis.function:
        raise LensParallelError(f"analysis {analysis.name!r} is already registered by {known.function.__qualname__}")
    ANALYSES[analysis.name] = analysis
    return analysis


def analyses() -> dict[str, Analysis]:
    """Every analysis: each module of :mod:`lens_parallel.analyses` imported (each registers itself)."""
    import lens_parallel.analyses as package

    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    return dict(sorted(ANALYSES.items()))
