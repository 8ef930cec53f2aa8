"""How a result shows itself as a notebook cell's or a prompt's last value: its type, its model, its summary
and the head of its table, never its arrays (a dataclass's own repr prints every array: several kB a result).

:class:`~lens_parallel.results.ResultMixin` hands every result's ``_repr_html_`` (Jupyter, VS Code, nbconvert's
export) and ``__repr__`` (a prompt's and IPython's text) to :func:`result_html` and :func:`result_text`.
"""

from __future__ import annotations

import html
from typing import Any, Protocol, runtime_checkable

import pandas as pd


@runtime_checkable
class Shown(Protocol):
    """What a result shows (:class:`~lens_parallel.results.Result`'s part that this module reads)."""

    @property
    def provenance(self) -> Any: ...

    def summary(self) -> pd.DataFrame: ...

    def to_dataframe(self) -> pd.DataFrame: ...


HEAD_ROWS = 8
"""Rows of the result's table shown."""
MAX_COLUMNS = 10
"""Columns shown of a table wider than this (pandas elides the middle ones)."""
MAX_SUMMARY_ROWS = 12
"""Rows of the summary shown (a summary with more, e.g. one per setting, is elided in the middle)."""


def _title(result: Shown) -> str:
    """``DecompositionResult: toy-gpt2 (gpt2, 3 layers x 4 heads), lens_parallel 0.25.0``."""
    provenance = result.provenance
    if provenance is None:
        return type(result).__name__
    model = provenance.model
    shape = f"{model.get('n_layers', '?')} layers x {model.get('n_heads', '?')} heads"
    version = provenance.versions.get("lens_parallel", "?")
    name, family = model.get("name", "?"), model.get("family", "?")
    return f"{type(result).__name__}: {name} ({family}, {shape}), lens_parallel {version}"


def _frames(result: Shown) -> tuple[pd.DataFrame | None, pd.DataFrame | None, str]:
    """The result's summary and table (each None where the result cannot form it, with the reason)."""
    notes = []
    frames: list[pd.DataFrame | None] = []
    for what, make in (("summary()", result.summary), ("to_dataframe()", result.to_dataframe)):
        try:
            frames.append(make())
        except Exception as error:  # a view never raises: what it could not form is said instead
            frames.append(None)
            notes.append(f"{what}: {type(error).__name__}: {' '.join(str(error).split())}")
    return frames[0], frames[1], "; ".join(notes)


def result_html(result: Shown) -> str:
    """A short HTML view: the title, the summary, the table's first :data:`HEAD_ROWS` rows and its size, and the
    calls that give the rest."""
    summary, table, note = _frames(result)
    parts = [f"<div class='lens-parallel-result'><strong>{html.escape(_title(result))}</strong>"]
    if summary is not None:
        parts.append(summary.to_html(max_rows=MAX_SUMMARY_ROWS, max_cols=MAX_COLUMNS, float_format="{:.4g}".format))
    if table is not None:
        parts.append(
            f"<p>to_dataframe(): {len(table):,} rows x {table.shape[1]} columns; the first {min(len(table), HEAD_ROWS)}"
            "</p>"
        )
        parts.append(table.head(HEAD_ROWS).to_html(max_cols=MAX_COLUMNS, float_format="{:.4g}".format))
    if note:
        parts.append(f"<p>{html.escape(note)}</p>")
    parts.append("<p><code>.figure()</code>, <code>.to_dataframe()</code>, <code>.save(path)</code></p></div>")
    return "\n".join(parts)


def result_text(result: Shown) -> str:
    """A one-screen text view: the title, the summary and the table's first rows, each at most
    :data:`MAX_COLUMNS` columns."""
    summary, table, note = _frames(result)
    lines = [_title(result)]
    if summary is not None:
        lines += ["summary():", summary.to_string(max_rows=MAX_SUMMARY_ROWS, max_cols=MAX_COLUMNS, max_colwidth=24)]
    if table is not None:
        lines.append(f"to_dataframe(): {len(table):,} rows x {table.shape[1]} columns; the first {min(len(table), 5)}:")
        lines.append(table.head(5).to_string(max_cols=MAX_COLUMNS, max_colwidth=24))
    if note:
        lines.append(note)
    return "\n".join(lines)
