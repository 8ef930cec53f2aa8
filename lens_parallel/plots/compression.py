"""Directional decomposition of compression error."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lens_parallel.errors import LensParallelError
from lens_parallel.plots.common import TEMPLATE, layer_axis, line_with_band


@runtime_checkable
class CompressionResultRead(Protocol):
    """What these figures read of a :class:`~lens_parallel.analyses.compression.CompressionResult`."""

    @property
    def delta_loss(self) -> Any: ...

    @property
    def info(self) -> Any: ...

    @property
    def layers(self) -> Any: ...

    @property
    def methods(self) -> Any: ...

    @property
    def mode(self) -> Any: ...

    @property
    def par(self) -> Any: ...

    @property
    def perp(self) -> Any: ...

    @property
    def positions(self) -> Any: ...

    @property
    def sublayers(self) -> Any: ...


SUBLAYER_NAMES = {"attn": "attention", "mlp": "MLP", "block": "block"}


def compression_figure(result: CompressionResultRead, *, sublayer: str = "attn", drop_ends: bool = False) -> go.Figure:
    """Perpendicular (left) and parallel (right) error of one sublayer's update by layer, relative to the dense
    update: line = mean over prompts, band = ±1 std over prompts, one colour per method. ``drop_ends``: without the
    first and last layers (the directional-decomposition paper's Fig. 6)."""
    if sublayer not in result.sublayers:
        raise LensParallelError(f"sublayer must be one of {result.sublayers}, got {sublayer!r}")
    if drop_ends and len(result.layers) < 3:
        raise LensParallelError(f"drop_ends needs at least 3 layers, the result has {len(result.layers)}")
    j = result.sublayers.index(sublayer)
    what = SUBLAYER_NAMES[sublayer]
    shown = slice(1, -1) if drop_ends else slice(None)
    fig = make_subplots(
        rows=1,
        cols=2,
        shared_yaxes=False,
        horizontal_spacing=0.1,
        subplot_titles=[
            f"perpendicular error |e_perp| / |delta| ({what} update)",
            f"parallel error |e_par| / |delta| ({what} update)",
        ],
    )
    palette = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
    x = np.array(result.layers)[shown]
    for i, method in enumerate(result.methods):
        color = palette[i % len(palette)]
        for col, values in ((1, result.perp[i, j, shown]), (2, result.par[i, j, shown])):
            mean, std = np.nanmean(values, -1), np.nanstd(values, -1)
            line_with_band(
                fig,
                x,
                mean,
                mean - std,
                mean + std,
                color=color,
                name=f"{method} (delta loss {result.delta_loss[i]:+.3f})",
                band_name=f"{method}: ±1 std over prompts",
                group=method,
                row=1,
                col=col,
                show_band=False,
                show_line=col == 1,
            )
    fig.update_xaxes(layer_axis(result.info.layer_types, result.layers))
    fig.update_yaxes(title_text="relative error (fraction of |delta_dense|)", row=1, col=1)
    fig.update_yaxes(title_text="relative error (fraction of |delta_dense|)", row=1, col=2)
    n = result.par.shape[-1]
    ends = f"; layers {x[0]}-{x[-1]} shown (first and last left out)" if drop_ends else ""
    fig.update_layout(
        title=f"Compression error along / across the dense {what} update ({result.info.name}, {result.mode} mode)"
        f"<br><sup>{n} prompts, {result.positions} positions; bands: ±1 std over prompts{ends}</sup>",
        template=TEMPLATE,
        height=480,
        width=1150,
    )
    return fig
