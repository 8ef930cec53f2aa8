"""Layer sensitivity: per-head and joint ablation effects."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lens_parallel.plots.common import TEMPLATE, head_unit, layer_axis


@runtime_checkable
class HeadStatisticsRead(Protocol):
    """What these figures read of a :class:`~lens_parallel.analyses.head_statistics.HeadStatistics`."""

    @property
    def ablation(self) -> Any: ...

    @property
    def info(self) -> Any: ...

    @property
    def layers(self) -> Any: ...

    @property
    def statistics(self) -> Any: ...

    @property
    def values(self) -> Any: ...


@runtime_checkable
class SensitivityResultRead(Protocol):
    """What these figures read of a :class:`~lens_parallel.analyses.sensitivity.SensitivityResult`."""

    @property
    def ablation(self) -> Any: ...

    @property
    def head_delta(self) -> Any: ...

    @property
    def info(self) -> Any: ...

    @property
    def joint_delta(self) -> Any: ...

    @property
    def joint_hi(self) -> Any: ...

    @property
    def joint_lo(self) -> Any: ...

    @property
    def layers(self) -> Any: ...

    @property
    def loss_base(self) -> Any: ...


def sensitivity_figure(result: SensitivityResultRead) -> go.Figure:
    """Per layer: the joint effect (all heads of the layer edited together; bars = 95% paired bootstrap CI) and a
    band spanning the smallest to the largest single-head effect (a range over heads, not a confidence interval)."""
    x = np.array(result.layers)
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=np.concatenate([x, x[::-1]]),
            y=np.concatenate([np.nanmax(result.head_delta, 1), np.nanmin(result.head_delta, 1)[::-1]]),
            fill="toself",
            fillcolor="#1f77b4",
            opacity=0.2,
            line={"width": 0},
            hoverinfo="skip",
            name="single heads: range min-max over heads (not a CI)",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=np.nanmedian(result.head_delta, 1),
            mode="lines",
            line={"color": "#1f77b4", "dash": "dot"},
            name="single heads: median",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=result.joint_delta,
            mode="lines+markers",
            line={"color": "#d62728"},
            error_y={
                "type": "data",
                "array": result.joint_hi - result.joint_delta,
                "arrayminus": result.joint_delta - result.joint_lo,
                "thickness": 1,
            },
            name="all heads of the layer jointly (bars: 95% paired bootstrap CI)",
        )
    )
    fig.add_hline(y=0, line={"color": "grey", "width": 1})
    fig.update_layout(
        title=f"Layer sensitivity to {result.ablation} ablation: {result.info.name} "
        f"(base loss {result.loss_base:.3f} nats/token)",
        yaxis_title="Δ loss vs unedited (nats/token)",
        template=TEMPLATE,
        height=480,
        width=1100,
        legend={"orientation": "h", "y": -0.2},
    )
    fig.update_xaxes(layer_axis(result.info.layer_types, result.layers))
    return fig


def head_statistics_figure(result: HeadStatisticsRead) -> go.Figure:
    """The four per-head statistics of :mod:`~lens_parallel.analyses.head_statistics`, one layer x head heatmap
    each (unitless ratios, means over positions)."""
    titles = {
        "para_ratio": "para_ratio = |y_par|² / |y|²",
        "para_over_ref": "para_over_ref = |y_par| / |v|",
        "edit_over_y": "edit_over_y = |edit| / |y|",
        "edit_over_ref": "edit_over_ref = |edit| / |v|",
    }
    fig = make_subplots(
        rows=2,
        cols=2,
        subplot_titles=[titles[s] for s in result.statistics],
        horizontal_spacing=0.2,
        vertical_spacing=0.18,
    )
    for i, values in enumerate(result.values):
        row, col = divmod(i, 2)
        fig.add_trace(
            go.Heatmap(
                z=values,
                y=list(result.layers),
                colorscale="Viridis",
                colorbar={"len": 0.41, "y": 0.795 - 0.59 * row, "x": 0.41 + 0.6 * col, "title": "ratio"},
                hovertemplate="L%{y}H%{x}: %{z:.4f}<extra></extra>",
            ),
            row=row + 1,
            col=col + 1,
        )
        unit = head_unit(result.info.layer_types, result.layers)
        fig.update_xaxes(title_text=unit, dtick=max(1, values.shape[1] // 8), row=row + 1, col=col + 1)
        fig.update_yaxes(layer_axis(result.info.layer_types, result.layers, reversed_=True), row=row + 1, col=col + 1)
    fig.update_layout(
        title=f"{result.info.name}: per-head statistics of the {result.ablation} ablation (means over positions)",
        height=720,
        margin={"t": 90},
    )
    return fig


def head_ratio_figure(
    pairs: Mapping[str, tuple[SensitivityResultRead, HeadStatisticsRead]], table: pd.DataFrame, *, statistic: str
) -> go.Figure:
    """Signed single-head Δloss against one per-head statistic, one colour per model, Pearson r and Spearman rho
    (from ``table``, :func:`~lens_parallel.analyses.head_statistics.sensitivity_correlations`) in the legend."""
    fig = go.Figure()
    for name, (sens, stat) in pairs.items():
        i = stat.statistics.index(statistic)
        row = table[(table.model == name) & (table.statistic == statistic)].iloc[0]
        labels = [f"L{layer}H{h}" for layer in sens.layers for h in range(sens.head_delta.shape[1])]
        fig.add_trace(
            go.Scatter(
                x=stat.values[i].ravel(),
                y=sens.head_delta.ravel(),
                mode="markers",
                text=labels,
                name=f"{name}: Pearson r {row.pearson_r:.2f}, Spearman ρ {row.spearman_rho:.2f} ({row.n_heads} heads)",
                hovertemplate="%{text}<br>" + statistic + " %{x:.3f}<br>Δloss %{y:+.5f} nats/token<extra></extra>",
            )
        )
    fig.add_hline(y=0, line={"color": "#888", "width": 1})
    fig.update_layout(
        title=f"Single-head {next(iter(pairs.values()))[0].ablation} ablation: Δloss against {statistic}",
        xaxis_title=f"{statistic} (unitless, mean over positions)",
        yaxis_title="Δloss, ablated - unedited (nats/token)",
        legend={"orientation": "h", "y": -0.25},
        height=480,
    )
    return fig
