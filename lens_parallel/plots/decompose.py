"""Figures of the decomposition: self-alignment by layer and per head."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lens_parallel.models import ModelInfo, head_label
from lens_parallel.plots.common import TEMPLATE, band, head_unit, layer_axis, layer_ticks


@runtime_checkable
class AlignmentTableRead(Protocol):
    """What these figures read of a :class:`~lens_parallel.analyses.decompose.AlignmentTable`."""

    @property
    def layers(self) -> Any: ...

    @property
    def par_coef(self) -> Any: ...

    @property
    def par_frac(self) -> Any: ...

    @property
    def perp_frac(self) -> Any: ...

    @property
    def self_cos(self) -> Any: ...


@runtime_checkable
class DecompositionResultRead(Protocol):
    """What these figures read of a :class:`~lens_parallel.analyses.decompose.DecompositionResult`."""

    @property
    def info(self) -> Any: ...

    @property
    def provenance(self) -> Any: ...

    @property
    def tables(self) -> Any: ...


COLORS = {"self_cos": "#1f77b4", "par_frac": "#d62728", "perp_frac": "#2ca02c"}
LABELS = {"self_cos": "self-cosine cos(m, r)", "par_frac": "|m_par| / |m|", "perp_frac": "|m_perp| / |m|"}


def layer_panel(fig: go.Figure, tables: dict[str, AlignmentTableRead], *, row: int, col: int, shown: set[str]) -> None:
    """Per statistic: the per-head mean by layer (line) with its min-max band over heads, and the whole sublayer
    update (dashed); ``shown`` collects legend groups already in the legend."""
    for stat, color in COLORS.items():
        if "head" in tables:
            t = tables["head"]
            x, values, group = np.array(t.layers), getattr(t, stat), f"{stat}-head"
            lo, hi = np.nanmin(values, 1), np.nanmax(values, 1)
            band(fig, x, lo, hi, color, f"{LABELS[stat]}: min-max over heads", group, row, col, group not in shown)
            mean = go.Scatter(
                x=x,
                y=np.nanmean(values, 1),
                mode="lines+markers",
                line={"color": color},
                name=f"{LABELS[stat]}: mean over heads",
                legendgroup=group,
                showlegend=group not in shown,
            )
            fig.add_trace(mean, row=row, col=col)
            shown.add(group)
        if "sublayer" in tables:
            t, group = tables["sublayer"], f"{stat}-sublayer"
            whole = go.Scatter(
                x=np.array(t.layers),
                y=getattr(t, stat)[:, 0],
                mode="lines+markers",
                line={"color": color, "dash": "dash"},
                marker={"symbol": "diamond"},
                name=f"{LABELS[stat]}: whole update",
                legendgroup=group,
                showlegend=group not in shown,
            )
            fig.add_trace(whole, row=row, col=col)
            shown.add(group)


def head_panel(
    fig: go.Figure, t: AlignmentTableRead, info: ModelInfo, *, row: int, col: int, colorbar: dict[str, Any]
) -> None:
    """Layer x head heatmap of the mean self-cosine (hover: parallel and perpendicular fractions, coefficient)."""
    heatmap = go.Heatmap(
        z=t.self_cos,
        x=[head_label(None, h) for h in range(t.self_cos.shape[1])],
        y=list(t.layers),
        zmid=0,
        colorscale="RdBu_r",
        colorbar=colorbar,
        customdata=np.stack([t.par_frac, t.perp_frac, t.par_coef], -1),
        text=[
            [f"{label}{head_label(None, h)}" for h in range(t.self_cos.shape[1])]
            for label in layer_ticks(info.layer_types, t.layers)
        ],
        hovertemplate="%{text}<br>self-cos %{z:.3f}<br>|m_par|/|m| %{customdata[0]:.3f}"
        "<br>|m_perp|/|m| %{customdata[1]:.3f}<br>coef %{customdata[2]:.3f}<extra></extra>",
    )
    fig.add_trace(heatmap, row=row, col=col)
    fig.update_xaxes(title_text=head_unit(info.layer_types, t.layers), row=row, col=col)
    fig.update_yaxes(layer_axis(info.layer_types, t.layers, reversed_=True), row=row, col=col)


def decomposition_figure(result: DecompositionResultRead) -> go.Figure:
    """Per space: layer-wise curves (line = mean over heads, band = min-max over heads; whole-sublayer updates as
    dashed lines) and, for head-level spaces, a layer x head heatmap of the mean self-cosine."""
    info = result.info
    spaces = list(dict.fromkeys(t.space for t in result.tables))
    has_heads = [any(t.space == space and t.level == "head" for t in result.tables) for space in spaces]
    titles, specs = [], []
    for space, heads in zip(spaces, has_heads, strict=True):
        titles += (
            [f"<b>{space}</b>: by layer", f"<b>{space}</b>: self-cosine per head"]
            if heads
            else [f"<b>{space}</b>: by layer (the whole update; no per-head split)"]
        )
        specs.append([{}, {}] if heads else [{"colspan": 2}, None])
    fig = make_subplots(
        rows=len(spaces),
        cols=2,
        subplot_titles=titles,
        column_widths=[0.55, 0.45],
        specs=specs,
        horizontal_spacing=0.12,
        vertical_spacing=0.32 / max(len(spaces), 1),
    )
    fig.update_annotations(font_size=13)  # the subplot titles
    shown: set[str] = set()
    for row, space in enumerate(spaces, start=1):
        tables = {t.level: t for t in result.tables if t.space == space}
        layer_panel(fig, tables, row=row, col=1, shown=shown)
        layers = sorted({layer for t in tables.values() for layer in t.layers})
        fig.update_xaxes(layer_axis(info.layer_types, layers), row=row, col=1)
        fig.update_yaxes(title_text="mean over positions t ≥ 1", row=row, col=1)
        if "head" in tables:
            colorbar = {"title": "cos", "len": 1 / len(spaces), "y": 1 - (row - 0.5) / len(spaces)}
            head_panel(fig, tables["head"], info, row=row, col=2, colorbar=colorbar)
    texts = result.provenance.texts
    n_docs = texts.get("n_docs", "?")
    height = 330 * len(spaces) + 190
    fig.update_layout(
        title={
            "text": f"Parallel/perpendicular decomposition: {info.name}<br><sup>{n_docs} docs, position 0 "
            "excluded; line: mean over heads, band: min-max over heads, dashed: the whole update</sup>",
            "yref": "container",
            "yanchor": "top",
            "y": 1 - 15 / height,
        },
        height=height,
        width=1150,
        template=TEMPLATE,
        margin={"t": 190},
        legend={
            "orientation": "h",
            "yref": "container",
            "yanchor": "top",
            "y": 1 - 60 / height,
            "x": 0,
            "font": {"size": 11},
        },
    )
    return fig
