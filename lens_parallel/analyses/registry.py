"""The analyses, written out: :data:`MODULES` names each analysis's module, whose ``ANALYSIS`` (an
:class:`Analysis`: name, settings class, function, result, printer, and what its subcommand needs) the command line,
the package's exports and the contract tests read (tuned-lens' "a subcommand is its options object"). Nothing
registers itself when imported: :func:`analyses` imports the modules the table names.

Adding an analysis: its module under ``lens_parallel/analyses/`` ending in its ``ANALYSIS``, its row in
:data:`MODULES`, and its plot under ``lens_parallel/plots/``; the new subcommand appears in ``lens-parallel`` (after
``python scripts/build_cli_spec.py``) and in ``tests/test_registries.py``.
"""

from __future__ import annotations

import importlib
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


MODULES: dict[str, str] = {
    "checks": "lens_parallel.analyses.reliability",
    "compress": "lens_parallel.analyses.compression",
    "decompose": "lens_parallel.analyses.decompose",
    "diagonal": "lens_parallel.analyses.diagonal",
    "dominance": "lens_parallel.analyses.dominance",
    "scale": "lens_parallel.analyses.scaling",
    "sensitivity": "lens_parallel.analyses.sensitivity",
}
"""Every analysis with a subcommand, by name: the module whose ``ANALYSIS`` it is."""


def analyses() -> dict[str, Analysis]:
    """Every analysis of :data:`MODULES`, by name (its module imported on first use). Refused in one line where a
    module's ``ANALYSIS`` goes by another name."""
    found = {}
    for name, module in MODULES.items():
        analysis = importlib.import_module(module).ANALYSIS
        if analysis.name != name:
            raise LensParallelError(f"{module}.ANALYSIS is named {analysis.name!r}, listed as {name!r}")
        found[name] = analysis
    return found
