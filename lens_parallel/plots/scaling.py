"""Figures of component-scaling sweeps."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lens_parallel.models import layer_label
from lens_parallel.plots.common import TEMPLATE


@runtime_checkable
class ScalingResultRead(Protocol):
    """What these figures read of a :class:`~lens_parallel.analyses.scaling.ScalingResult`."""

    @property
    def info(self) -> Any: ...

    @property
    def provenance(self) -> Any: ...

    def to_dataframe(self, *args: Any, **kwargs: Any) -> Any: ...

    @property
    def unit(self) -> Any: ...


SPACE_COLORS = {
    "value": "#1f77b4",
    "value-exclude-self": "#ff7f0e",
    "value-merged": "#8c564b",
    "residual-attn": "#2ca02c",
    "residual-mlp": "#d62728",
    "residual-block": "#9467bd",
}


def _edited_layers(result: ScalingResultRead) -> str:
    """Which layers the all-layer sweep edited together, in words (from the provenance's resolved layers)."""
    n = result.info.n_layers
    layers = list(result.provenance.settings.get("layers") or range(n))
    if layers == list(range(n)):
        return "all layers edited"
    if layers == list(range(layers[0], n)):
        skipped = "layer 0" if layers[0] == 1 else f"layers 0-{layers[0] - 1}"
        return f"layers {layers[0]}-{n - 1} edited ({skipped} left alone)"
    return f"layers {', '.join(map(str, layers))} edited"


def scaling_figure(result: ScalingResultRead) -> go.Figure:
    """All-layer sweeps: two panels (vary s_par at s_perp = 1; vary s_perp at s_par = 1), one curve per space,
    error bars = 95% paired bootstrap CI over documents. Per-layer sweeps: one heatmap per space (setting x layer)."""
    df = result.to_dataframe()
    info, unit = result.info, result.unit
    if df["layer"].notna().any():
        return _per_layer_scaling_figure(df, info.name, unit)
    titles = ["vary s_par (s_perp = 1)", "vary s_perp (s_par = 1)"]
    fig = make_subplots(rows=1, cols=2, subplot_titles=titles, horizontal_spacing=0.16)  # room for both y titles
    for col, vary in enumerate(("s_par", "s_perp"), start=1):
        for space, d in df[df.vary == vary].groupby("space", sort=False):
            d = d.sort_values(vary)
            x = np.concatenate([d[vary].to_numpy(), [1.0]])
            order = np.argsort(x)
            y = np.concatenate([d.delta_loss.to_numpy(), [0.0]])[order]
            hi = np.concatenate([d.delta_loss_hi.to_numpy(), [0.0]])[order] - y
            lo = y - np.concatenate([d.delta_loss_lo.to_numpy(), [0.0]])[order]
            fig.add_trace(
                go.Scatter(
                    x=x[order],
                    y=y,
                    mode="lines+markers",
                    name=space,
                    legendgroup=space,
                    showlegend=col == 1,
                    line={"color": SPACE_COLORS.get(space)},
                    error_y={"type": "data", "array": hi, "arrayminus": lo, "thickness": 1},
                    hovertemplate=f"{space}<br>{vary}=%{{x}}<br>Δloss %{{y:.4f}} nats/{unit}<extra></extra>",
                ),
                row=1,
                col=col,
            )
        fig.add_vline(x=1.0, line={"dash": "dot", "color": "grey"}, row=1, col=col)
        fig.update_xaxes(title_text=f"{vary} (1 = no-op)", row=1, col=col)
        label = "Δ log word perplexity vs no-op (nats/word)" if unit == "word" else "Δ loss vs no-op (nats/token)"
        fig.update_yaxes(title_text=label, row=1, col=col)
    n = df.n_docs.iloc[0] if len(df) else 0
    docs = f"{n} texts, per word" if unit == "word" else f"{n} docs"
    fig.update_layout(
        title=f"Component scaling, {_edited_layers(result)}: {info.name}<br><sup>{docs}; bars = 95% paired bootstrap CI"
        "</sup>",
        height=480,
        width=1150,
        template=TEMPLATE,
        legend={"title": "space"},
    )
    return fig


def _per_layer_scaling_figure(df: pd.DataFrame, model_name: str, unit: str) -> go.Figure:
    spaces = list(dict.fromkeys(df.space))
    fig = make_subplots(
        rows=len(spaces),
        cols=1,
        subplot_titles=[f"{s}: one layer edited at a time" for s in spaces],
        vertical_spacing=0.25 / max(len(spaces), 1),
    )
    for row, space in enumerate(spaces, start=1):
        d = df[df.space == space].assign(
            setting=lambda t: np.where(
                t.vary == "s_par", "s_par=" + t.s_par.astype(str), "s_perp=" + t.s_perp.astype(str)
            )
        )
        grid = d.pivot_table(index="setting", columns="layer", values="delta_loss", sort=False)
        fig.add_trace(
            go.Heatmap(
                z=grid.to_numpy(),
                x=[layer_label(layer) for layer in grid.columns],
                y=list(grid.index),
                zmid=0,
                colorscale="RdBu_r",
                colorbar={
                    "title": f"Δ loss<br>nats/{unit}",
                    "len": 1 / len(spaces),
                    "y": 1 - (row - 0.5) / len(spaces),
                },
                hovertemplate="%{x} %{y}<br>Δloss %{z:.4f}<extra></extra>",
            ),
            row=row,
            col=1,
        )
        fig.update_xaxes(title_text="edited layer", row=row, col=1)
        fig.update_yaxes(title_text="setting", row=row, col=1)
    fig.update_layout(
        title=f"Component scaling per layer: {model_name} (Δ loss vs matched no-op)",
        height=380 * len(spaces) + 100,
        width=1150,
        template=TEMPLATE,
    )
    return fig
