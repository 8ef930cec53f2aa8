"""The attention-diagonal view of one head."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lens_parallel.models import head_label

if TYPE_CHECKING:
    from lens_parallel.analyses.diagonal import DiagonalView


def diagonal_figure(view: DiagonalView, *, max_tokens: int = 48) -> go.Figure:
    """Row 1: the head's empirical attention map, the residual-space view A + diag(dA), the layer-level residual view
    A + diag(δ) (one δ_t for every head) and the exclude-self value-space edited map (first ``max_tokens``
    positions, token labels on both axes; one diverging colour scale clipped to [-1, 1], so negative diagonal
    entries show; hover gives exact values).
    Row 2: per-head strip of mean dA_tt over documents and positions t >= 1."""
    n = min(max_tokens, len(view.token_labels))
    labels = list(view.token_labels[:n])
    panels = [("empirical A", view.pattern)]
    for space, title in (("residual-attn", "residual-space view"), ("value-exclude-self", "exclude-self value space")):
        if space in view.spaces:
            if space == "residual-attn":
                par, perp = view.residual_par[1:].sum(), view.residual_perp[1:].sum()
                title += f"<br>(adds a perpendicular change: Σ|Δ⊥| / Σ|Δ∥| = {perp / max(par, 1e-30):.2f})"
            panels.append((f"{title}: A + diag(dA)", view.edited(space)))
        if space == "residual-attn" and view.layer_delta.size:
            par, perp = view.layer_par[1:].sum(), view.layer_perp[1:].sum()
            title = f"layer-level view, one δ for every head<br>(Σ|Δ⊥| / Σ|Δ∥| = {perp / max(par, 1e-30):.2f})"
            panels.append((f"{title}: A + diag(δ)", view.edited("residual-attn-layer")))
    maps = [m[:n, :n] for _, m in panels]
    specs = [[{}] * len(panels), [{"colspan": len(panels)}] + [None] * (len(panels) - 1)]
    titles = [t for t, _ in panels] + ["per-head mean dA_tt (all documents, t ≥ 1)"]
    fig = make_subplots(
        rows=2,
        cols=len(panels),
        row_heights=[0.78, 0.22],
        vertical_spacing=0.22,
        horizontal_spacing=0.07,
        specs=specs,
        subplot_titles=titles,
    )
    for col, (m, (title, _)) in enumerate(zip(maps, panels, strict=True), start=1):
        fig.add_trace(
            go.Heatmap(
                z=m,
                x=labels,
                y=labels,
                zmid=0,
                zmin=-1,
                zmax=1,
                colorscale="RdBu_r",
                showscale=col == 1,
                colorbar={"title": "attention weight<br>(colour clipped<br>to ±1)", "len": 0.7, "y": 0.62},
                hovertemplate="query %{y}<br>key %{x}<br>A %{z:.3f}<extra>" + title.split(":")[0] + "</extra>",
            ),
            row=1,
            col=col,
        )
        fig.update_xaxes(title_text="key token", tickfont={"size": 8}, row=1, col=col)
        fig.update_yaxes(
            title_text="query token" if col == 1 else None, autorange="reversed", tickfont={"size": 8}, row=1, col=col
        )
    heads = [head_label(view.layer, h) for h in range(view.da_mean.shape[1])]
    fig.add_trace(
        go.Heatmap(
            z=view.da_mean,
            x=heads,
            y=list(view.spaces),
            zmid=0,
            colorscale="PuOr_r",
            colorbar={"title": "mean dA", "len": 0.22, "y": 0.1},
            customdata=np.stack([view.da_min, view.da_max, view.da_negative_share], -1),
            hovertemplate="%{x} %{y}<br>mean dA %{z:.3f}<br>min %{customdata[0]:.3f} max %{customdata[1]:.3f}"
            "<br>share A+dA<0: %{customdata[2]:.1%}<extra></extra>",
        ),
        row=2,
        col=1,
    )
    fig.update_xaxes(title_text="query head", row=2, col=1)
    fig.update_layout(
        title=f"Attention-diagonal form of s_par = {view.s_par:g}: {view.info.name} L{view.layer}H{view.head}, "
        f"document {view.doc} (first {n} tokens)",
        height=950,
        width=1500,
        template="plotly_white",
    )
    return fig
