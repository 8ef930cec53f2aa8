"""Several models side by side."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lens_parallel.plots.common import TEMPLATE


def comparison_figure(summary: pd.DataFrame) -> go.Figure:
    """One bar per model in four panels: mean head self-cosine per space; causal-null excess and self-specific
    fraction; loss change of removing the parallel part (s_par = 0, all layers); split-half r_stat and r_delta."""
    fig = make_subplots(
        rows=2,
        cols=2,
        vertical_spacing=0.2,
        horizontal_spacing=0.1,
        subplot_titles=[
            "mean self-cosine over heads, by space",
            "causal null: excess and self-specific fraction",
            "delta loss of s_par = 0, all layers (nats/token)",
            "split-half reliability (Spearman across heads)",
        ],
    )
    panels = {
        (1, 1): {
            "self_cos_value": "value",
            "self_cos_value-exclude-self": "value-exclude-self",
            "self_cos_residual-attn": "residual-attn",
        },
        (1, 2): {"excess": "excess (cos_self - cos_null)", "self_specific_fraction": "self-specific fraction"},
        (2, 1): {
            "delta_loss_s_par0_value-exclude-self": "value-exclude-self",
            "delta_loss_s_par0_residual-attn": "residual-attn",
        },
        (2, 2): {"r_stat_excess": "r_stat (excess)", "r_delta_excess": "r_delta (parallel removal)"},
    }
    palette = ("#1f77b4", "#d62728", "#2ca02c")
    groups = {(1, 1): "self-cosine", (1, 2): "causal null", (2, 1): "s_par = 0 (space)", (2, 2): "split-half"}
    for (row, col), columns in panels.items():
        for k, (column, label) in enumerate(columns.items()):
            if column in summary:
                fig.add_trace(
                    go.Bar(
                        x=summary["model"],
                        y=summary[column],
                        name=label,
                        marker_color=palette[k],
                        legendgroup=f"{row}{col}",
                        legendgrouptitle_text=groups[row, col],
                    ),
                    row=row,
                    col=col,
                )
    fig.update_yaxes(title_text="cosine", row=1, col=1)
    fig.update_yaxes(title_text="cosine / fraction", row=1, col=2)
    fig.update_yaxes(title_text="nats/token", row=2, col=1)
    fig.update_yaxes(title_text="Spearman rho", row=2, col=2)
    fig.update_layout(
        title="Models compared on the standard battery",
        template=TEMPLATE,
        barmode="group",
        height=760,
        width=1150,
    )
    return fig
