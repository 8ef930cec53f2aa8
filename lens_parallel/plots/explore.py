"""Figures of the notebook explorer: the heads heatmap, one head's pattern, its diagonal, the per-token loss change;
and the kernel-free page that switches between precomputed views with Plotly's own menus."""

from __future__ import annotations

import html
import json
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio

from lens_parallel.layers import LAYER_KINDS, MixingMap
from lens_parallel.models import head_label
from lens_parallel.plots.common import TEMPLATE, head_unit, layer_axis


@runtime_checkable
class ViewRead(Protocol):
    """What these figures read of a :class:`~lens_parallel.explore.View`."""

    @property
    def all_heads(self) -> Any: ...

    @property
    def coef(self) -> Any: ...

    @property
    def diag(self) -> Any: ...

    @property
    def diag_edited(self) -> Any: ...

    @property
    def doc(self) -> Any: ...

    @property
    def edit(self) -> Any: ...

    @property
    def head(self) -> Any: ...

    @property
    def heatmap(self) -> Any: ...

    @property
    def label(self) -> Any: ...

    @property
    def layer(self) -> Any: ...

    @property
    def layer_types(self) -> Any: ...

    @property
    def loss_change(self) -> Any: ...

    @property
    def pattern(self) -> Any: ...

    @property
    def s_par(self) -> Any: ...

    @property
    def s_perp(self) -> Any: ...

    @property
    def seed(self) -> Any: ...

    @property
    def space(self) -> Any: ...

    @property
    def tokens(self) -> Any: ...


SPACE_TITLES = {
    "value": "value space",
    "value-exclude-self": "value space, exclude-self",
    "residual-attn": "residual-attn (per-head write)",
}
HEIGHT = 360
EDIT_TITLES = {
    "random-direction": "random-direction removal",
    "random-direction-norm-matched": "random-direction removal, norm-matched",
    "zero-diagonal": "hard diagonal removal",
}


def setting_label(view: ViewRead) -> str:
    """The view's edit in a few words: its scales for ``scale``, else the comparison edit (and its seed)."""
    if view.edit == "scale":
        return f"s_par={view.s_par:g}, s_perp={view.s_perp:g}"
    seed = f" (seed {view.seed})" if view.edit.startswith("random") else ""
    return EDIT_TITLES[view.edit] + seed


def _labels(tokens: tuple[str, ...]) -> list[str]:
    """Token texts made unique (Plotly merges equal category labels): position-prefixed."""
    return [f"{i}:{t}" for i, t in enumerate(tokens)]


def heatmap_figure(
    grid: np.ndarray, space: str, selected: tuple[int, int], name: str, layer_types: tuple[str, ...] = ()
) -> go.Figure:
    """Mean self-cosine of every head (layer x head), the selected head outlined; on a hybrid model (``layer_types``
    of more than one kind) each layer's kind is marked (a linear-attention layer's heads are value heads)."""
    layer, head = selected
    types = layer_types or ("softmax",) * grid.shape[0]
    fig = go.Figure(
        go.Heatmap(
            z=grid,
            x=list(range(grid.shape[1])),
            y=list(range(grid.shape[0])),
            colorscale="RdBu",
            reversescale=True,
            zmid=0,
            zmin=-1,
            zmax=1,
            colorbar={"title": "mean cos"},
            hovertemplate="L%{y}H%{x}<br>mean self-cos %{z:.3f}<extra></extra>",
        )
    )
    fig.add_shape(type="rect", x0=head - 0.5, x1=head + 0.5, y0=layer - 0.5, y1=layer + 0.5, line={"width": 3})
    fig.update_layout(
        template=TEMPLATE,
        title=f"{name}: mean self-cosine of every head<br>{SPACE_TITLES[space]}; selected: L{layer}H{head}",
        xaxis={
            "title": head_unit(types, range(grid.shape[0])),
            "tickvals": list(range(grid.shape[1])),
            "ticktext": [head_label(None, h) for h in range(grid.shape[1])],
        },
        yaxis=layer_axis(types, range(grid.shape[0]), reversed_=True),
        height=HEIGHT + 60,
        margin={"t": 60},
    )
    return fig


def _map(view: ViewRead) -> MixingMap:
    """How the view's layer's mixing map is named and drawn: a softmax pattern A, or a linear-attention layer's
    delta-rule mixing weights M."""
    mixing = LAYER_KINDS[view.layer_types[view.layer]].mixing_map
    assert mixing is not None  # the explorer views layers with heads
    return mixing


def pattern_figure(view: ViewRead) -> go.Figure:
    labels = _labels(view.tokens)
    text = [[f"query {labels[q]}<br>key {labels[k]}" for k in range(len(labels))] for q in range(len(labels))]
    mixing = _map(view)
    symbol, bound = mixing.symbol, mixing.bound(view.pattern)
    scale = (
        {"colorscale": "RdBu_r", "zmid": 0, "zmin": -bound, "zmax": bound}  # M is not a distribution: signed
        if mixing.signed
        else {"colorscale": "Viridis", "zmin": 0, "zmax": 1}
    )
    fig = go.Figure(
        go.Heatmap(
            z=view.pattern,
            x=labels,
            y=labels,
            text=text,
            **scale,
            colorbar={"title": f"{symbol}_ts"},
            hovertemplate=f"%{{text}}<br>{symbol}_ts = %{{z:.4f}}<extra></extra>",
        )
    )
    what = mixing.name
    fig.update_layout(
        template=TEMPLATE,
        title=f"{view.label} {what}, document {view.doc}",
        xaxis_title="key token s",
        yaxis_title="query token t",
        yaxis_autorange="reversed",
        height=HEIGHT + 120,
        margin={"t": 70},
    )
    return fig


def diagonal_figure(view: ViewRead) -> go.Figure:
    labels = _labels(view.tokens)
    fig = go.Figure()
    a = _map(view).self_symbol
    fig.add_trace(go.Scatter(x=labels, y=view.diag, mode="lines+markers", name=f"{a}_tt (model)"))
    edited = {
        "scale": f"{a}'_tt = {a}_tt + dA_tt (s_par={view.s_par:g})",
        "zero-diagonal": f"{a}'_tt under hard diagonal removal",
    }.get(view.edit, f"{a}'_tt: none (a random direction of z is not a diagonal edit)")
    fig.add_trace(go.Scatter(x=labels, y=view.diag_edited, mode="lines+markers", name=edited))
    fig.add_trace(go.Scatter(x=labels, y=view.coef, mode="lines", name="parallel coefficient", yaxis="y2", opacity=0.6))
    fig.update_layout(
        template=TEMPLATE,
        title=f"{view.label} diagonal and its edited form<br>{SPACE_TITLES[view.space]}",
        xaxis_title="token t",
        yaxis_title=_map(view).self_title,
        yaxis2={
            "title": "parallel coefficient (unitless)",
            "overlaying": "y",
            "side": "right",
            "showgrid": False,
            "tickmode": "auto",
        },
        legend={"orientation": "h", "y": -0.45},
        height=HEIGHT,
        margin={"t": 70},
    )
    return fig


def loss_figure(view: ViewRead) -> go.Figure:
    labels = _labels(view.tokens)[1:]
    who = f"all heads of layer {view.layer}" if view.all_heads else view.label
    reference = "matched no-op" if view.edit == "scale" else "unedited model"
    fig = go.Figure(
        go.Bar(
            x=labels,
            y=view.loss_change,
            name=f"edited - {reference}",
            hovertemplate="next token %{x}<br>%{y:+.4f} nats<extra></extra>",
        )
    )
    fig.update_layout(
        template=TEMPLATE,
        title=(
            f"loss change per token: {who}, {setting_label(view)}<br>"
            f"{SPACE_TITLES[view.space] if view.edit == 'scale' else 'no space: a fixed edit'}; "
            f"mean {np.mean(view.loss_change):+.4f} nats"
        ),
        xaxis_title="predicted token",
        yaxis_title=f"Δ NLL vs {reference} (nats)",
        height=HEIGHT,
        margin={"t": 70},
        showlegend=False,
    )
    return fig


def explorer_figures(view: ViewRead, name: str) -> dict[str, go.Figure]:
    return {
        "heatmap": heatmap_figure(view.heatmap, view.space, (view.layer, view.head), name, view.layer_types),
        "pattern": pattern_figure(view),
        "diagonal": diagonal_figure(view),
        "loss": loss_figure(view),
    }


def _switched(figures: list[go.Figure], names: list[str], what: str) -> go.Figure:
    """One figure holding the traces of ``figures``, one shown at a time, chosen by a dropdown labelled ``names``."""
    fig = go.Figure()
    counts = [len(f.data) for f in figures]
    for i, f in enumerate(figures):
        for trace in f.data:
            fig.add_trace(trace.update(visible=i == 0))
    fig.update_layout(figures[0].layout)
    buttons = []
    for i, (f, label) in enumerate(zip(figures, names, strict=True)):
        visible = [j == i for j, n in enumerate(counts) for _ in range(n)]
        shapes = f.layout.shapes or []
        buttons.append(
            {
                "label": label,
                "method": "update",
                "args": [{"visible": visible}, {"title": f.layout.title, "shapes": shapes}],
            }
        )
    menu = {"buttons": buttons, "x": 1, "y": 1.02, "xanchor": "right", "yanchor": "bottom", "showactive": True}
    fig.update_layout(
        template=TEMPLATE,
        updatemenus=[menu],
        annotations=[
            {
                "text": f"{what}:",
                "x": 0.8,
                "y": 1.06,
                "xref": "paper",
                "yref": "paper",
                "xanchor": "right",
                "yanchor": "bottom",
                "showarrow": False,
            }
        ],
        margin={"t": 110},
    )
    return fig


def explorer_page(
    heatmaps: Mapping[str, np.ndarray],
    views: Mapping[tuple[int, int, float], ViewRead],
    name: str,
    provenance: dict[str, Any],
) -> str:
    """The kernel-free page: heatmaps of every space (a dropdown), then per (head, s_par) the three head views
    (one dropdown per figure), plotly.js inlined once."""
    spaces = list(heatmaps)
    first = next(iter(views.values()))
    selected = (first.layer, first.head)
    heat = _switched(
        [heatmap_figure(heatmaps[s], s, selected, name, first.layer_types) for s in spaces], spaces, "space"
    )
    keys = list(views)
    labels = [f"{head_label(layer, head)}, {setting_label(views[layer, head, s])}" for layer, head, s in keys]
    parts = [pio.to_html(heat, include_plotlyjs=True, full_html=False)]
    for builder in (pattern_figure, diagonal_figure, loss_figure):
        fig = _switched([builder(views[k]) for k in keys], labels, "head and setting")
        parts.append(pio.to_html(fig, include_plotlyjs=False, full_html=False))
    meta = html.escape(json.dumps(provenance, indent=1, default=str))
    body = "\n".join(f"<div class='fig'>{p}</div>" for p in parts)
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>lens_parallel explorer: {html.escape(name)}</title>"
        "<style>body{font-family:sans-serif;margin:1em 2em} .fig{margin-bottom:1.5em}</style></head><body>"
        f"<h1>lens_parallel explorer: {html.escape(name)}</h1><p>Precomputed views ({first.space}, document "
        f"{first.doc}); choose a space, and a head and setting, in each figure's menu.</p>"
        f"{body}<details><summary>provenance</summary><pre>{meta}</pre></details></body></html>"
    )
