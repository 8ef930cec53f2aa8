"""Null-model checks: causal null, GQA groups, split-half reliability, and the sanity figure composing their panels."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lens_parallel.models import head_label
from lens_parallel.plots.common import TEMPLATE, band, layer_axis


@runtime_checkable
class NullResultRead(Protocol):
    """What these figures read of a :class:`~lens_parallel.analyses.nulls.NullResult`."""

    @property
    def cos_across(self) -> Any: ...

    @property
    def cos_self(self) -> Any: ...

    def head_table(self, *args: Any, **kwargs: Any) -> Any: ...

    @property
    def info(self) -> Any: ...

    @property
    def seed(self) -> Any: ...


@runtime_checkable
class SanityReportRead(Protocol):
    """What these figures read of a :class:`~lens_parallel.analyses.reliability.SanityReport`."""

    @property
    def null(self) -> Any: ...

    @property
    def split_half(self) -> Any: ...


@runtime_checkable
class SplitHalfResultRead(Protocol):
    """What these figures read of a :class:`~lens_parallel.analyses.reliability.SplitHalfResult`."""

    @property
    def ablation(self) -> Any: ...

    def correlations(self, *args: Any, **kwargs: Any) -> Any: ...

    @property
    def delta(self) -> Any: ...

    @property
    def excess(self) -> Any: ...

    @property
    def info(self) -> Any: ...

    @property
    def layers(self) -> Any: ...


NULL_TITLES = ("self-cosine vs earlier-position null", "GQA: within- vs across-group excess")


def _layer_axis(fig: go.Figure, result: NullResultRead, x: np.ndarray, *, row: int, col: int) -> None:
    """The layer axis of a panel: on a hybrid model every layer named with its type marked (:func:`layer_ticks`)."""
    fig.update_xaxes(layer_axis(result.info.layer_types, [int(layer) for layer in x]), row=row, col=col)


def null_panel(fig: go.Figure, result: NullResultRead, *, row: int, col: int) -> None:
    """cos_self and the causal-null cos_null per layer (line = mean over heads, band = min-max over heads)."""
    by_layer = result.head_table().groupby("layer")
    x = np.array(sorted(by_layer.groups))
    for column, color, name in (
        ("cos_self", "#1f77b4", "cos(y_t, v_t)"),
        ("cos_null", "#7f7f7f", "cos(y_t, v_j), j < t"),
    ):
        lo, hi = by_layer[column].min().to_numpy(), by_layer[column].max().to_numpy()
        band(fig, x, lo, hi, color, f"{name}: min-max over heads", column, row, col, True)
        line = go.Scatter(
            x=x,
            y=by_layer[column].mean(),
            mode="lines+markers",
            line={"color": color},
            name=f"{name}: mean over heads",
            legendgroup=column,
        )
        fig.add_trace(line, row=row, col=col)
    _layer_axis(fig, result, x, row=row, col=col)
    fig.update_yaxes(title_text="mean cosine over positions t ≥ 1", row=row, col=col)


def gqa_panel(fig: go.Figure, result: NullResultRead, *, row: int, col: int) -> None:
    """Within-group and across-group excess per layer (bars: mean over heads)."""
    by_layer = result.head_table().groupby("layer")
    x = np.array(sorted(by_layer.groups))
    for column, color, name in (
        ("within_excess", "#1f77b4", "within group"),
        ("across_excess", "#d62728", "across groups (other kv)"),
    ):
        bar = go.Bar(x=x, y=by_layer[column].mean(), marker_color=color, name=f"{name} excess: mean over heads")
        fig.add_trace(bar, row=row, col=col)
    _layer_axis(fig, result, x, row=row, col=col)
    fig.update_yaxes(title_text="excess over the own-group null (cosine)", row=row, col=col)


def null_figure(result: NullResultRead) -> go.Figure:
    """Left: :func:`null_panel`. Right (GQA, several kv heads): :func:`gqa_panel`."""
    gqa = result.cos_across is not None
    fig = make_subplots(rows=1, cols=2 if gqa else 1, subplot_titles=NULL_TITLES[: 1 + gqa])
    null_panel(fig, result, row=1, col=1)
    if gqa:
        gqa_panel(fig, result, row=1, col=2)
    fig.update_layout(
        title=f"Causal null: {result.info.name} ({result.cos_self.shape[0]} docs, seed {result.seed})",
        height=460,
        width=1150 if gqa else 700,
        template=TEMPLATE,
        barmode="group",
        legend={"orientation": "h", "y": -0.22},
    )
    return fig


def split_half_titles(result: SplitHalfResultRead) -> tuple[str, str]:
    c = result.correlations("excess")
    return f"excess: r_stat = {c['r_stat']:.2f}", f"Δ loss ({result.ablation}): r_delta = {c['r_delta']:.2f}"


def split_half_panels(fig: go.Figure, result: SplitHalfResultRead, *, row: int) -> None:
    """Half A vs half B across heads in columns 1 and 2 of ``row``: the causal-null excess and the intervention
    effect Δ loss; the dashed diagonal is perfect agreement."""
    labels = [head_label(layer, h) for layer in result.layers for h in range(result.delta.shape[2])]
    hover = "%{text}<br>A %{x:.4f}<br>B %{y:.4f}<extra></extra>"
    for col, (values, unit) in enumerate(((result.excess, "cosine"), (result.delta, "nats/token")), start=1):
        a, b = values[0].ravel(), values[1].ravel()
        lo, hi = float(min(a.min(), b.min())), float(max(a.max(), b.max()))
        diagonal = go.Scatter(
            x=[lo, hi],
            y=[lo, hi],
            mode="lines",
            line={"dash": "dash", "color": "grey"},
            name="half A = half B",
            showlegend=col == 1,
        )
        heads = go.Scatter(
            x=a,
            y=b,
            mode="markers",
            text=labels,
            marker={"size": 6, "color": "#1f77b4"},
            name="one head",
            showlegend=col == 1,
            hovertemplate=hover,
        )
        fig.add_trace(diagonal, row=row, col=col)
        fig.add_trace(heads, row=row, col=col)
        fig.update_xaxes(title_text=f"half A ({unit})", row=row, col=col)
        fig.update_yaxes(title_text=f"half B ({unit})", row=row, col=col)


def split_half_figure(result: SplitHalfResultRead) -> go.Figure:
    """:func:`split_half_panels` with Spearman r across heads in the titles; r is Spearman across heads."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=split_half_titles(result))
    split_half_panels(fig, result, row=1)
    fig.update_layout(
        title=f"Split-half reliability: {result.info.name} (verdict: {result.correlations('excess')['verdict']})",
        height=460,
        width=1000,
        template=TEMPLATE,
        legend={"orientation": "h", "y": -0.2},
    )
    return fig


def sanity_figure(report: SanityReportRead) -> go.Figure:
    """Top row: the null panels (cos_self vs cos_null per layer; GQA within/across, when there are kv groups; the
    null panel spans the row without them). Bottom row: the split-half scatters."""
    gqa = report.null.cos_across is not None
    top = [{}, {}] if gqa else [{"colspan": 2}, None]
    titles = (*NULL_TITLES[: 1 + gqa], *split_half_titles(report.split_half))
    fig = make_subplots(
        rows=2,
        cols=2,
        specs=[top, [{}, {}]],
        subplot_titles=titles,
        horizontal_spacing=0.1,
        vertical_spacing=0.16,
    )
    null_panel(fig, report.null, row=1, col=1)
    if gqa:
        gqa_panel(fig, report.null, row=1, col=2)
    split_half_panels(fig, report.split_half, row=2)
    verdict = report.split_half.correlations("excess")["verdict"]
    fig.update_layout(
        title=f"Sanity checks: {report.null.info.name} (per-head effects: {verdict})",
        height=900,
        width=1100,
        template=TEMPLATE,
        barmode="group",
        legend={"orientation": "h", "y": -0.08},
    )
    return fig
