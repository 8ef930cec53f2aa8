"""The effect of one intervention on next-token loss and perplexity."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lens_parallel.plots.common import TEMPLATE


@runtime_checkable
class EditEffectRead(Protocol):
    """What these figures read of a :class:`~lens_parallel.losses.EditEffect`."""

    @property
    def delta_loss(self) -> Any: ...

    @property
    def delta_loss_ci(self) -> Any: ...

    @property
    def delta_ppl(self) -> Any: ...

    @property
    def delta_ppl_ci(self) -> Any: ...

    @property
    def info(self) -> Any: ...

    @property
    def loss_noop(self) -> Any: ...

    @property
    def n_docs(self) -> Any: ...

    @property
    def n_tokens(self) -> Any: ...

    @property
    def ppl_noop(self) -> Any: ...

    @property
    def provenance(self) -> Any: ...


def edit_effect_figure(effect: EditEffectRead) -> go.Figure:
    """Edited minus matched no-op: Δ loss (nats/token, left) and Δ perplexity (right), each a point with its 95%
    paired bootstrap CI over documents; the dashed line is no change."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=["Δ next-token loss", "Δ perplexity"], horizontal_spacing=0.2)
    for col, (delta, (lo, hi), unit, base) in enumerate(
        (
            (effect.delta_loss, effect.delta_loss_ci, "nats/token", f"no-op loss {effect.loss_noop:.4f}"),
            (effect.delta_ppl, effect.delta_ppl_ci, "perplexity", f"no-op perplexity {effect.ppl_noop:.2f}"),
        ),
        start=1,
    ):
        point = go.Scatter(
            x=["edited − no-op"],
            y=[delta],
            mode="markers",
            marker={"size": 11, "color": "#d62728"},
            error_y={"type": "data", "symmetric": False, "array": [hi - delta], "arrayminus": [delta - lo]},
            name="estimate (bar: 95% paired bootstrap CI over documents)",
            showlegend=col == 1,
            hovertemplate=f"%{{y:.4g}} {unit} [{lo:.4g}, {hi:.4g}]<br>{base}<extra></extra>",
        )
        fig.add_trace(point, row=1, col=col)
        fig.add_hline(y=0, line={"dash": "dash", "color": "grey"}, row=1, col=col)
        bottom, top = min(lo, 0.0), max(hi, 0.0)
        pad = 0.15 * (top - bottom or 1.0)
        fig.update_yaxes(title_text=f"edited − matched no-op ({unit})", range=[bottom - pad, top + pad], row=1, col=col)
    name = "" if effect.provenance is None else f"{effect.info.name}, "
    fig.update_layout(
        title=f"Effect of the edit ({name}{effect.n_docs} documents, {effect.n_tokens} scored tokens)",
        template=TEMPLATE,
        height=420,
        width=720,
        legend={"orientation": "h", "y": -0.15},
    )
    return fig
