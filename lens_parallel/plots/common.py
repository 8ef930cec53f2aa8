"""What every figure module shares: the template, writing a figure to disk, the min-max band drawn into a subplot
cell, the layer axis (layer 0 first, at the top of a heatmap; a hybrid model's layer types marked), the head unit,
and figures that stay in a saved notebook: in a Jupyter kernel, the first use of a figure module sets
:func:`notebook_figures` up, so that no call of the user's is needed."""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import plotly.graph_objects as go
from numpy.typing import ArrayLike

from lens_parallel.errors import LensParallelError
from lens_parallel.layers import LAYER_KINDS
from lens_parallel.models import layer_label
from lens_parallel.paths import add_suffix, check_writable, write_atomic
from lens_parallel.plots.png import png_bytes

TEMPLATE = "plotly_white"
"""Every figure's template (white background, light grid): results, the report and the explorer alike."""


def png_failure(exc: Exception) -> str:
    """Why a PNG could not be written, in one line: the first non-empty line of kaleido's message (which starts
    with blank lines); for a missing Chrome/Chromium, what to install instead of kaleido's advice (a downloaded
    browser build, which this project never uses)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    reason = lines[0] if lines else type(exc).__name__
    if "chrome" in reason.lower() or "chromium" in reason.lower():
        return "no Chrome or Chromium found for kaleido (install Debian's chromium: apt-get install chromium)"
    return reason


_PNG_FAILURES_SAID: set[str] = set()
"""Why PNGs could not be written, each said once per process."""


def save_figure(fig: go.Figure, stem: str | Path) -> list[Path]:
    """Write ``stem.html`` (plotly.js inlined: opens offline) and, when kaleido finds a Chrome/Chromium,
    ``stem.png`` (:func:`~lens_parallel.plots.png.png_bytes`: one browser kept for the process); returns the files
    written (a missing PNG renderer, or a failed render, is reported on stderr once per process and reason, not
    raised; the files written say which figures have a PNG)."""
    stem = Path(stem)
    html, png = add_suffix(stem, ".html"), add_suffix(stem, ".png")
    written = [check_writable(html, "figure")]
    try:
        write_atomic(html, lambda f: f.write(fig.to_html(include_plotlyjs=True).encode()))
    except OSError as exc:
        raise LensParallelError(f"cannot write the figure {html} ({exc.strerror})") from exc
    try:
        image = png_bytes(fig, scale=2.0)
    except Exception as exc:  # no kaleido, no Chrome/Chromium, a failed render: the HTML stands
        reason = png_failure(exc)
        if reason not in _PNG_FAILURES_SAID:
            _PNG_FAILURES_SAID.add(reason)
            print(f"(no PNG for {stem.name}: {reason}; the HTML has the figure)", file=sys.stderr)
        return written
    try:
        write_atomic(png, lambda f: f.write(image))
    except OSError as exc:
        raise LensParallelError(f"cannot write the figure {png} ({exc.strerror})") from exc
    return [*written, png]


def band(
    fig: go.Figure,
    x: ArrayLike,
    lo: ArrayLike,
    hi: ArrayLike,
    color: str,
    name: str,
    group: str,
    row: int,
    col: int,
    show: bool,
) -> None:
    """A filled band from ``lo`` to ``hi`` over ``x`` in cell (``row``, ``col``); ``name`` says what it spans."""
    x, lo, hi = np.asarray(x), np.asarray(lo), np.asarray(hi)
    fig.add_trace(
        go.Scatter(
            x=np.concatenate([x, x[::-1]]),
            y=np.concatenate([hi, lo[::-1]]),
            fill="toself",
            fillcolor=color,
            opacity=0.14,
            line={"width": 0},
            hoverinfo="skip",
            name=name,
            legendgroup=group,
            showlegend=show,
        ),
        row=row,
        col=col,
    )


def line_with_band(
    fig: go.Figure,
    x: ArrayLike,
    mean: ArrayLike,
    lo: ArrayLike,
    hi: ArrayLike,
    *,
    color: str,
    name: str,
    band_name: str,
    group: str,
    row: int,
    col: int,
    show_band: bool = True,
    show_line: bool = True,
) -> None:
    """A mean line (``name``) over a filled band from ``lo`` to ``hi`` (``band_name`` says what the band spans)."""
    band(fig, x, np.asarray(lo), np.asarray(hi), color, band_name, group, row, col, show_band)
    line = go.Scatter(
        x=x, y=mean, mode="lines+markers", line={"color": color}, legendgroup=group, name=name, showlegend=show_line
    )
    fig.add_trace(line, row=row, col=col)


def layer_axis(layer_types: Sequence[str], layers: Sequence[int], *, reversed_: bool = False) -> dict[str, Any]:
    """A layer axis, the same in every figure: titled "layer", ticks ``L{l}`` with each layer's kind marked
    (:func:`layer_ticks`); a heatmap's (``reversed_``) with layer 0 at the top."""
    axis: dict[str, Any] = {"title": "layer", "tickvals": list(layers), "ticktext": layer_ticks(layer_types, layers)}
    if len(layers) > 24:  # every layer named would overlap: every k-th
        step = -(-len(layers) // 12)
        axis |= {"tickvals": list(layers)[::step], "ticktext": layer_ticks(layer_types, list(layers)[::step])}
    return axis | ({"autorange": "reversed"} if reversed_ else {})


def head_unit(layer_types: Sequence[str], layers: Sequence[int]) -> str:
    """What a head axis counts over ``layers``: query heads, value heads (linear attention), or both, said."""
    kinds = [LAYER_KINDS[k] for k in dict.fromkeys(layer_types[layer] for layer in layers)]
    if len({kind.unit for kind in kinds}) == 1:
        return kinds[0].unit
    return " / ".join(f"{kind.unit} ({kind.short})" for kind in kinds)


def layer_ticks(layer_types: Sequence[str], layers: Sequence[int]) -> list[str]:
    """Tick labels of ``layers``: ``L{l}``, followed by its kind's tick (:class:`~lens_parallel.layers.LayerKind`)
    where it has one: `` lin`` after a linear-attention layer (its units are value heads, its map the delta rule's),
    `` mix`` after a mixer without heads."""
    return [" ".join(filter(None, (layer_label(layer), LAYER_KINDS[layer_types[layer]].tick))) for layer in layers]


OUTSIDE_SCRIPT = re.compile(r'<script[^>]*\ssrc="(?:https?:)?//[^"]*"[^>]*></script>')
"""A script tag that loads from outside the page (Plotly's notebook output loads MathJax from a CDN, always)."""


def notebook_figures() -> str:
    """Draw this notebook's figures so that they survive nbconvert's HTML export, offline: Plotly's own mime type
    (JupyterLab, VS Code: interactive) plus HTML that draws itself with plotly.js inline, once per notebook (the
    output of this call holds it: about 4.8 MB of the saved notebook), and loads nothing from outside (Plotly's
    notebook output loads MathJax from a CDN: dropped; no figure here writes LaTeX). A renderer chosen on purpose
    (not Plotly's default ``plotly_mimetype``) is kept.

    Returns:
        str: the renderer in use (``plotly.io.renderers.default``).

    Examples:
        >>> import lens_parallel as lp
        >>> import plotly.io as pio
        >>> lp.notebook_figures() == pio.renderers.default
        True
    """
    import plotly.io as pio
    from plotly.io.base_renderers import NotebookRenderer

    class OfflineNotebook(NotebookRenderer):  # type: ignore[misc]
        def to_mimebundle(self, fig_dict: dict[str, Any]) -> dict[str, Any]:
            bundle: dict[str, Any] = super().to_mimebundle(fig_dict)
            bundle["text/html"] = OUTSIDE_SCRIPT.sub("", bundle["text/html"])
            return bundle

    if pio.renderers.default == "plotly_mimetype":
        pio.renderers["lens_parallel_notebook"] = OfflineNotebook()
        pio.renderers.default = "plotly_mimetype+lens_parallel_notebook"
    return str(pio.renderers.default)


def _in_notebook_kernel() -> bool:
    """Whether this process is a Jupyter kernel (IPython's shell with a kernel attached; never imports IPython)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None


if _in_notebook_kernel():  # figures that survive the notebook's export, with no call of the user's
    notebook_figures()
