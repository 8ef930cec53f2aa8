"""Attribution screening: estimated effect of every head, the loss's scale derivatives, estimate vs exact."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lens_parallel.models import head_label
from lens_parallel.plots.common import head_unit, layer_ticks


@runtime_checkable
class AttributionResultRead(Protocol):
    """What these figures read of a :class:`~lens_parallel.analyses.attribution.AttributionResult`."""

    @property
    def ablation(self) -> Any: ...

    @property
    def d_s_par(self) -> Any: ...

    @property
    def d_s_perp(self) -> Any: ...

    def head_estimate(self, *args: Any, **kwargs: Any) -> Any: ...

    @property
    def info(self) -> Any: ...

    @property
    def layers(self) -> Any: ...

    @property
    def n_tokens(self) -> Any: ...


@runtime_checkable
class ConfirmResultRead(Protocol):
    """What these figures read of a :class:`~lens_parallel.analyses.confirm.ConfirmResult`."""

    @property
    def ablation(self) -> Any: ...

    @property
    def chosen(self) -> Any: ...

    @property
    def estimate(self) -> Any: ...

    @property
    def exact(self) -> Any: ...

    @property
    def exact_hi(self) -> Any: ...

    @property
    def exact_lo(self) -> Any: ...

    @property
    def info(self) -> Any: ...

    @property
    def labels(self) -> Any: ...

    @property
    def pearson(self) -> Any: ...

    @property
    def spearman(self) -> Any: ...


def _heatmap(values: np.ndarray, layers: Sequence[str], title: str, colorbar_x: float) -> go.Heatmap:
    bound = float(np.nanmax(np.abs(values))) or 1.0  # NaN: a head the layer does not have
    n_heads = values.shape[1]
    return go.Heatmap(
        z=values,
        x=[head_label(None, h) for h in range(n_heads)],
        y=list(layers),
        zmin=-bound,
        zmax=bound,
        colorscale="RdBu_r",
        colorbar={"title": {"text": title, "side": "right"}, "x": colorbar_x, "len": 0.9, "thickness": 14},
        hovertemplate="%{y} %{x}: %{z:.4g}<extra></extra>",
    )


def attribution_figure(result: AttributionResultRead) -> go.Figure:
    """Three heatmaps (layer x head): the first-order estimate of the edit's effect (nats/token, positive = the
    loss rises), and dloss/ds_par and dloss/ds_perp at s = 1 in value space (nats/token per unit of scale;
    negative = turning the component up would lower the loss). Colour scales are symmetric around 0."""
    n_tok = result.n_tokens.sum()
    panels = [
        (result.head_estimate(), f"estimated Δ loss of {result.ablation} (first order)", "Δ nats/token"),
        (result.d_s_par[0].sum(0) / n_tok, "dloss/ds_par at s = 1, value space", "nats/token per unit s"),
        (result.d_s_perp[0].sum(0) / n_tok, "dloss/ds_perp at s = 1, value space", "nats/token per unit s"),
    ]
    fig = make_subplots(rows=1, cols=3, subplot_titles=[p[1] for p in panels], horizontal_spacing=0.13)
    for i, (values, _, unit) in enumerate(panels):
        right = fig.layout[f"xaxis{i + 1 if i else ''}"].domain[1]
        ticks = layer_ticks(result.info.layer_types, result.layers)
        fig.add_trace(_heatmap(values, ticks, unit, colorbar_x=right + 0.008), row=1, col=i + 1)
        fig.update_xaxes(title_text=head_unit(result.info.layer_types, result.layers), row=1, col=i + 1)
        fig.update_yaxes(title_text="layer" if i == 0 else None, autorange="reversed", row=1, col=i + 1)
    fig.update_layout(
        title=f"Attribution screening of every head: {result.info.name}, {len(result.n_tokens)} documents, "
        f"one forward + one backward per batch",
        height=max(420, 22 * len(result.layers) + 160),
        width=1400,
    )
    return fig


def confirm_figure(result: ConfirmResultRead) -> go.Figure:
    """Estimated (first-order) vs exact effect of the edit for the confirmed heads; the dashed line is
    estimate = exact, error bars are the exact effect's 95% bootstrap CI over documents."""
    fig = go.Figure()
    for chosen, symbol in (("top", "circle"), ("random", "diamond-open")):
        sel = np.asarray(result.chosen) == chosen
        if not sel.any():
            continue
        fig.add_scatter(
            x=result.estimate[sel],
            y=result.exact[sel],
            error_y={
                "type": "data",
                "symmetric": False,
                "array": result.exact_hi[sel] - result.exact[sel],
                "arrayminus": result.exact[sel] - result.exact_lo[sel],
            },
            mode="markers",
            marker={"symbol": symbol, "size": 9},
            text=[label for label, s in zip(result.labels, sel, strict=True) if s],
            hovertemplate="%{text}: estimate %{x:.4g}, exact %{y:.4g}<extra></extra>",
            name=f"{chosen} heads ({int(sel.sum())})",
        )
    lo = float(min(result.estimate.min(), result.exact_lo.min(), 0.0))
    hi = float(max(result.estimate.max(), result.exact_hi.max(), 0.0))
    fig.add_scatter(
        x=[lo, hi], y=[lo, hi], mode="lines", line={"dash": "dash", "color": "grey"}, name="estimate = exact"
    )
    fig.update_layout(
        title=f"{result.ablation}: first-order estimate vs exact ablation<br><sup>{result.info.name}, "
        f"Spearman {result.spearman:.2f}, Pearson {result.pearson:.2f} across {len(result.labels)} heads</sup>",
        xaxis_title="estimated Δ loss (nats/token, first order)",
        yaxis_title="exact Δ loss (nats/token, 95% CI)",
        height=520,
        width=760,
    )
    return fig
