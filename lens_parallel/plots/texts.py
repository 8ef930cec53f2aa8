"""Texts side by side in HTML: each row's texts under every setting, the edited ones highlighted from where they
depart from the unedited one (the first column of texts). Used by generation (:class:`~lens_parallel.generation.
GenerationResult`) and by the task answers (:meth:`~lens_parallel.downstream.effects.TaskResult.samples_html`)."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

_STYLE = "white-space: pre-wrap; vertical-align: top; text-align: left"


def shared_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items (tokens, characters) ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _cell(text: str, base: str | None) -> str:
    """A table cell of ``text``; unless ``base`` is None (the unedited text itself), the part from where it departs
    from ``base`` is marked."""
    if base is None:
        return f"<td>{html.escape(text)}</td>"
    common = shared_prefix(base, text)
    same, rest = html.escape(text[:common]), html.escape(text[common:])
    return f'<td>{same}<mark title="departs from the unedited text">{rest}</mark></td>'


def texts_table(
    labels: Sequence[str], rows: Sequence[tuple[Sequence[str], Sequence[str]]], *, code: bool = False
) -> str:
    """An HTML table: ``labels`` head the columns; each row is (its leading cells, escaped as text; its texts, one
    per setting, the first the unedited one); ``code``: the texts are programs (monospace, their line breaks and
    indentation kept). Empty: a line saying so."""
    if not rows:
        return "<p>no rows</p>"
    head = "".join(f"<th>{html.escape(label)}</th>" for label in labels)
    body = []
    for lead, texts in rows:
        cells = [f"<td>{html.escape(c)}</td>" for c in lead]
        cells += [_cell(text, None if s == 0 else texts[0]) for s, text in enumerate(texts)]
        body.append("<tr>" + "".join(cells) + "</tr>")
    kind = ' class="code"' if code else ""
    return f'<table{kind} style="{_STYLE}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def html_page(title: str, parts: Sequence[str | go.Figure]) -> str:
    """A self-contained page (plotly.js inlined once: opens offline): ``title``, then ``parts`` in order, each an
    HTML fragment or a figure."""
    body, inlined = [], False
    for part in parts:
        if isinstance(part, go.Figure):
            body.append(part.to_html(full_html=False, include_plotlyjs=not inlined))
            inlined = True
        else:
            body.append(part)
    return (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        "<style>body{font-family:sans-serif;margin:1.5em} td,th{border:1px solid #ccc;padding:4px;"
        "overflow-wrap:anywhere} table{border-collapse:collapse;width:100%;table-layout:fixed}"
        " table.code td{font-family:monospace;font-size:90%} mark{background:#ffe08a}</style></head>"
        f"<body><h1>{html.escape(title)}</h1>{''.join(body)}</body></html>"
    )
