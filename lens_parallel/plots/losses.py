"""The effect of one intervention on next-token loss."""

from __future__ import annotations

from typing import TYPE_CHECKING

import plotly.graph_objects as go

if TYPE_CHECKING:
    from lens_parallel.losses import EditEffect


def edit_effect_figure(effect: EditEffect) -> go.Figure:
    """Next-token loss of the matched no-op and of the edited model (bars), the edited bar carrying the 95% paired
    bootstrap CI of the difference over documents."""
    lo, hi = effect.delta_loss_ci
    fig = go.Figure(
        go.Bar(
            x=["matched no-op", "edited"],
            y=[effect.loss_noop, effect.loss_edited],
            marker_color=["#7f7f7f", "#d62728"],
            error_y={
                "type": "data",
                "symmetric": False,
                "array": [0, hi - effect.delta_loss],
                "arrayminus": [0, effect.delta_loss - lo],
            },
            name="loss (error bar: 95% CI of edited - no-op)",
        )
    )
    name = "" if effect.provenance is None else f"{effect.info.name}: "
    fig.update_layout(
        title=f"{name}Δ loss {effect.delta_loss:+.4f} nats/token [{lo:+.4f}, {hi:+.4f}] over {effect.n_docs} documents",
        yaxis_title="next-token loss (nats/token)",
        template="plotly_white",
        height=420,
        width=560,
    )
    return fig
