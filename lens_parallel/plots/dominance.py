"""Next-layer head dominance."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lens_parallel.plots.common import line_with_band

if TYPE_CHECKING:
    from lens_parallel.analyses.dominance import DominanceResult


def dominance_figure(result: DominanceResult) -> go.Figure:
    """Three panels over layer pairs: the distribution of the effective fraction of upstream heads (box per pair,
    one point per text and receiving head); the mean share of the top and bottom 25% of upstream heads; and the
    measured joint effects of removing the weak, strong or a random half (mean, band = one std over observations)."""
    df = result.to_dataframe()
    linear = np.where(df.receiving_type == "linear", " (linear)", "")
    df["pair"] = "L" + df.upstream_layer.astype(str) + "→L" + df.receiving_layer.astype(str) + linear
    pairs = list(dict.fromkeys(df.pair))
    fig = make_subplots(
        rows=1,
        cols=3,
        horizontal_spacing=0.08,
        subplot_titles=[
            "effective fraction of upstream heads",
            "share of top / bottom 25% of upstream heads",
            "joint removal of half the upstream heads",
        ],
    )
    fig.add_trace(
        go.Box(
            x=df.pair,
            y=df.effective_fraction,
            name="effective fraction exp(H)/n",
            boxpoints="all",
            jitter=0.4,
            marker={"size": 3},
            line={"color": "#1f77b4"},
        ),
        row=1,
        col=1,
    )
    grouped = df.groupby("pair", sort=False)
    for column, color, name in (
        ("top25_share", "#d62728", "top 25% share"),
        ("bottom25_share", "#2ca02c", "bottom 25% share"),
    ):
        fig.add_trace(
            go.Scatter(
                x=pairs,
                y=grouped[column].mean().reindex(pairs),
                mode="lines+markers",
                line={"color": color},
                name=f"{name} (mean)",
            ),
            row=1,
            col=2,
        )
    for kind, color in zip(result.joint_kinds, ("#2ca02c", "#d62728", "#7f7f7f"), strict=True):
        mean, std = grouped[f"joint_{kind}"].mean().reindex(pairs), grouped[f"joint_{kind}"].std().reindex(pairs)
        x = np.arange(len(pairs))
        line_with_band(
            fig,
            x,
            mean,
            mean - std,
            mean + std,
            color=color,
            name=f"{kind} half removed (mean)",
            band_name=f"{kind} half: ±1 std",
            group=kind,
            row=1,
            col=3,
        )
    fig.update_xaxes(title_text="layer pair (upstream→receiving)", tickangle=-90, tickfont={"size": 9})
    fig.update_xaxes(tickvals=list(range(len(pairs))), ticktext=pairs, row=1, col=3)
    fig.update_yaxes(title_text="effective fraction (1 = all heads equal)", row=1, col=1)
    fig.update_yaxes(title_text="share of total single-head effect", row=1, col=2)
    fig.update_yaxes(title_text="relative L2 change of receiving Q/K/V", row=1, col=3)
    n_texts = result.joint.shape[1]
    fig.update_layout(
        title=f"Next-layer head dominance: {result.info.name} ({n_texts} texts, "
        f"{len(result.query_positions)} query positions)",
        height=620,
        width=1500,
        template="plotly_white",
        margin={"b": 190},
        legend={"orientation": "h", "yref": "container", "y": 0.02, "yanchor": "bottom"},
    )
    return fig
