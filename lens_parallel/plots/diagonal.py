"""The attention-diagonal view of one head."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lens_parallel.errors import LensParallelError
from lens_parallel.models import head_label
from lens_parallel.plots.common import TEMPLATE
from lens_parallel.spaces import SPACES


@runtime_checkable
class DiagonalViewRead(Protocol):
    """What these figures read of a :class:`~lens_parallel.analyses.diagonal.DiagonalView`."""

    @property
    def da_max(self) -> Any: ...

    @property
    def da_mean(self) -> Any: ...

    @property
    def da_min(self) -> Any: ...

    @property
    def da_negative_share(self) -> Any: ...

    @property
    def doc(self) -> Any: ...

    def edited(self, *args: Any, **kwargs: Any) -> Any: ...

    @property
    def head(self) -> Any: ...

    @property
    def info(self) -> Any: ...

    @property
    def layer(self) -> Any: ...

    @property
    def layer_delta(self) -> Any: ...

    def layer_edited(self, *args: Any, **kwargs: Any) -> Any: ...

    @property
    def layer_par(self) -> Any: ...

    @property
    def layer_perp(self) -> Any: ...

    @property
    def pattern(self) -> Any: ...

    @property
    def residual_par(self) -> Any: ...

    @property
    def residual_perp(self) -> Any: ...

    @property
    def s_par(self) -> Any: ...

    @property
    def spaces(self) -> Any: ...

    @property
    def token_labels(self) -> Any: ...


def _kind(view: DiagonalViewRead) -> tuple[str, str, float]:
    """The map's symbol, what it is and its colour bound (:class:`~lens_parallel.layers.MixingMap`): a softmax
    layer's attention A (a distribution: ±1), or a linear-attention layer's delta-rule mixing weights M (o_t = sum_s
    M_ts v_s, M_tt = a_tt; not a distribution: ±max |M|)."""
    mixing = view.info.kind(view.layer).mixing_map
    assert mixing is not None  # a diagonal view is of a layer with heads
    return mixing.symbol, mixing.kind, mixing.bound(view.pattern)


def _map(fig: go.Figure, m: np.ndarray, labels: list[str], title: str, *, col: int, symbol: str, bound: float) -> None:
    """One map in row 1, column ``col``: token labels on both axes, one diverging scale clipped to ±``bound``."""
    fig.add_trace(
        go.Heatmap(
            z=m,
            x=labels,
            y=labels,
            zmid=0,
            zmin=-bound,
            zmax=bound,
            colorscale="RdBu_r",
            showscale=col == 1,
            colorbar={"title": f"mixing weight<br>(colour clipped<br>to ±{bound:.2g})", "len": 0.7, "y": 0.62},
            hovertemplate=f"query %{{y}}<br>key %{{x}}<br>{symbol} %{{z:.3f}}<extra>"
            + title.split(":")[0]
            + "</extra>",
        ),
        row=1,
        col=col,
    )
    fig.update_xaxes(title_text="key token", tickfont={"size": 8}, row=1, col=col)
    fig.update_yaxes(
        title_text="query token" if col == 1 else None, autorange="reversed", tickfont={"size": 8}, row=1, col=col
    )


def paper_diagonal_figure(view: DiagonalViewRead, *, max_tokens: int = 48) -> go.Figure:
    """The directional-decomposition paper's Fig. 4 for one head: the empirical map A, the residual-space map with
    the layer's shared δ on the diagonal (A + diag(δ)), and the value-space map A + diag(dA) (``value``, the full
    aggregate, where the view has it, as the authors' code; else ``value-exclude-self``, as the caption)."""
    value = next((sp for sp in SPACES if SPACES[sp].value and sp in view.spaces), None)
    if not view.layer_delta.size or value is None:
        raise LensParallelError(
            "layout='paper' needs the residual-attn and a value space in the view (space=('value', 'residual-attn')); "
            f"this view has {', '.join(view.spaces)}"
        )
    n = min(max_tokens, len(view.token_labels))
    labels = list(view.token_labels[:n])
    symbol, kind, bound = _kind(view)
    panels = [
        (f"empirical {symbol}", view.pattern),
        (f"residual space, one δ per layer: {symbol} + diag(δ)", view.layer_edited()),
        (f"value space ({value}): {symbol} + diag(dA)", view.edited(value)),
    ]
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.07, subplot_titles=[t for t, _ in panels])
    for col, (title, m) in enumerate(panels, start=1):
        _map(fig, m[:n, :n], labels, title, col=col, symbol=symbol, bound=bound)
    fig.update_layout(
        title=f"Attention-diagonal form of s_par = {view.s_par:g}: {view.info.name} {head_label(view.layer, view.head)}"
        f" ({kind}; first {n} tokens)",
        height=560,
        width=1500,
        template=TEMPLATE,
    )
    return fig


def diagonal_figure(view: DiagonalViewRead, *, max_tokens: int = 48) -> go.Figure:
    """Row 1: the head's empirical attention map, the residual-space view A + diag(dA), the layer-level residual view
    A + diag(δ) (one δ_t for every head) and the exclude-self value-space edited map (first ``max_tokens``
    positions, token labels on both axes; one diverging colour scale clipped to [-1, 1], so negative diagonal
    entries show; hover gives exact values).
    Row 2: per-head strip of mean dA_tt over documents and positions t >= 1."""
    n = min(max_tokens, len(view.token_labels))
    labels = list(view.token_labels[:n])
    symbol, kind, bound = _kind(view)
    panels = [(f"empirical {symbol}", view.pattern)]
    for space, title in (("residual-attn", "residual-space view"), ("value-exclude-self", "exclude-self value space")):
        writes = SPACES[space].head_writes
        if space in view.spaces:
            if writes:
                par, perp = view.residual_par[1:].sum(), view.residual_perp[1:].sum()
                title += f"<br>(adds a perpendicular change: Σ|Δ⊥| / Σ|Δ∥| = {perp / max(par, 1e-30):.2f})"
            panels.append((f"{title}: {symbol} + diag(dA)", view.edited(space)))
        if writes and view.layer_delta.size:
            par, perp = view.layer_par[1:].sum(), view.layer_perp[1:].sum()
            title = f"layer-level view, one δ for every head<br>(Σ|Δ⊥| / Σ|Δ∥| = {perp / max(par, 1e-30):.2f})"
            panels.append((f"{title}: A + diag(δ)", view.layer_edited()))
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
        _map(fig, m, labels, title, col=col, symbol=symbol, bound=bound)
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
            f"<br>share {symbol}+dA<0: %{{customdata[2]:.1%}}<extra></extra>",
        ),
        row=2,
        col=1,
    )
    fig.update_xaxes(title_text="value head" if symbol == "M" else "query head", row=2, col=1)
    fig.update_layout(
        title=f"Attention-diagonal form of s_par = {view.s_par:g}: {view.info.name} "
        f"{head_label(view.layer, view.head)} ({kind}), document {view.doc} (first {n} tokens)",
        height=950,
        width=1500,
        template=TEMPLATE,
    )
    return fig
