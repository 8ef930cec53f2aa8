"""Head ablation runs: the loss change of every job."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
import plotly.graph_objects as go

from lens_parallel.plots.common import TEMPLATE, head_unit, layer_axis


@runtime_checkable
class AblationRunRead(Protocol):
    """What these figures read of a :class:`~lens_parallel.analyses.ablation.AblationRun`."""

    @property
    def ablation(self) -> Any: ...

    def delta(self, *args: Any, **kwargs: Any) -> Any: ...

    @property
    def info(self) -> Any: ...

    @property
    def jobs(self) -> Any: ...

    @property
    def loss_sum(self) -> Any: ...


def ablation_figure(run: AblationRunRead) -> go.Figure:
    """Single-head jobs only: a layer x head heatmap of Δ loss. Otherwise one bar per job. Δ loss is the
    token-weighted next-token loss change, ablated minus unedited (nats/token), over all documents."""
    delta = run.delta()
    title = f"Head ablation ({run.ablation}): {run.info.name}, {run.loss_sum.shape[1]} documents"
    if all(len(job.heads) == 1 for job in run.jobs):
        layers = sorted({job.layer for job in run.jobs})
        n_heads = max(job.heads[0] for job in run.jobs) + 1
        grid = np.full((len(layers), n_heads), np.nan)
        for job, d in zip(run.jobs, delta, strict=True):
            grid[layers.index(job.layer), job.heads[0]] = d
        trace = go.Heatmap(
            z=grid,
            x=list(range(n_heads)),
            y=layers,
            colorscale="RdBu_r",
            zmid=0,
            colorbar={"title": "Δ loss<br>(nats/token)"},
            hovertemplate="L%{y}H%{x}<br>Δ loss %{z:.4f} nats/token<extra></extra>",
        )
        fig = go.Figure(trace)
        fig.update_xaxes(title_text=head_unit(run.info.layer_types, layers), dtick=1)
        fig.update_yaxes(layer_axis(run.info.layer_types, layers, reversed_=True))
    else:
        fig = go.Figure(go.Bar(x=[job.key for job in run.jobs], y=delta, marker_color="#1f77b4", name="Δ loss"))
        fig.update_xaxes(title_text="job (layer and heads removed together)")
        fig.update_yaxes(title_text="Δ loss (nats/token)")
    fig.update_layout(title=title, template=TEMPLATE, height=480, width=760)
    return fig
