"""Layer sensitivity: per-head and joint ablation effects."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go

if TYPE_CHECKING:
    from lens_parallel.analyses.sensitivity import SensitivityResult


def sensitivity_figure(result: SensitivityResult) -> go.Figure:
    """Per layer: the joint effect (all heads of the layer edited together; bars = 95% paired bootstrap CI) and a
    band spanning the smallest to the largest single-head effect (a range over heads, not a confidence interval)."""
    x = np.array(result.layers)
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=np.concatenate([x, x[::-1]]),
            y=np.concatenate([result.head_delta.max(1), result.head_delta.min(1)[::-1]]),
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
            y=np.median(result.head_delta, 1),
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
        title=f"Layer sensitivity to {result.edit} ablation: {result.info.name} "
        f"(base loss {result.loss_base:.3f} nats/token)",
        xaxis_title="layer",
        yaxis_title="Δ loss vs unedited (nats/token)",
        template="plotly_white",
        height=480,
        width=1100,
        legend={"orientation": "h", "y": -0.2},
    )
    fig.update_xaxes(dtick=max(1, len(x) // 15))
    return fig
