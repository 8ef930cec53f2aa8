"""Next-layer head dominance."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lens_parallel.layers import LAYER_KINDS
from lens_parallel.plots.common import TEMPLATE, line_with_band


@runtime_checkable
class DominanceResultRead(Protocol):
    """What these figures read of a :class:`~lens_parallel.analyses.dominance.DominanceResult`."""

    @property
    def info(self) -> Any: ...

    def joint_table(self, *args: Any, **kwargs: Any) -> Any: ...

    @property
    def qkv(self) -> Any: ...

    @property
    def query_positions(self) -> Any: ...

    def to_dataframe(self, *args: Any, **kwargs: Any) -> Any: ...


SCALE_NAMES = {"qkv": "Q/K/V change", "js_distance": "sqrt(JS) of attention row"}
SCALE_COLORS = {"qkv": "#1f77b4", "js_distance": "#ff7f0e"}
JOINT_COLORS = {"weak": "#2ca02c", "strong": "#d62728", "random": "#7f7f7f", "all": "#000000"}


def _pair_labels(df: pd.DataFrame) -> pd.Series:
    short = {name: kind.short for name, kind in LAYER_KINDS.items()}
    types = df.upstream_type.map(short) + "→" + df.receiving_type.map(short)
    return "L" + df.upstream_layer.astype(str) + "→L" + df.receiving_layer.astype(str) + " (" + types + ")"


def dominance_figure(result: DominanceResultRead) -> go.Figure:
    """Four panels, one observation = (pair, text, query token, receiving head): (a) the distribution of the
    effective fraction of upstream heads per layer pair, on the Q/K/V scale and on sqrt(JS); (b) the median share of
    the top and bottom 25% of upstream heads per pair on both scales; (c) the measured joint effect of removing the
    weak, strong, a random half or all upstream heads (Q/K/V scale, halves ranked on Q/K/V; median, band =
    interquartile range); (d) the per-observation strong/weak ratio by receiving-layer type, on both scales."""
    conc = result.to_dataframe()
    conc = conc[conc.scale.isin(list(SCALE_NAMES))].assign(pair=lambda d: _pair_labels(d))
    joint = result.joint_table()
    joint = joint[joint.scale.isin(list(SCALE_NAMES)) & (joint.mask_scale == "qkv")].assign(
        pair=lambda d: _pair_labels(d)
    )
    pairs = list(dict.fromkeys(_pair_labels(conc[conc.scale == "qkv"])))
    fig = make_subplots(
        rows=2,
        cols=2,
        horizontal_spacing=0.08,
        vertical_spacing=0.22,
        subplot_titles=[
            "(a) effective fraction of upstream heads (box: quartiles; whiskers: min-max)",
            "(b) share of the top / bottom 25% of upstream heads (median)",
            "(c) joint removal, Q/K/V scale (median; band: interquartile range)",
            "(d) strong / weak joint effect per observation (box: quartiles; whiskers: min-max)",
        ],
    )
    _concentration_panels(fig, conc, pairs)
    _joint_panel(fig, joint, pairs)
    _ratio_panel(fig, joint)
    n_texts, n_obs = result.qkv.shape[1], len(conc[conc.scale == "qkv"])
    fig.update_layout(
        title=f"Next-layer head dominance: {result.info.name} ({len(pairs)} layer pairs, {n_texts} texts, "
        f"{len(result.query_positions)} query tokens, {n_obs} observations)",
        height=1150,
        width=1500,
        template=TEMPLATE,
        margin={"b": 170},
        legend={"orientation": "h", "yref": "container", "y": 0.0, "yanchor": "bottom"},
    )
    return fig


def _scale_box(scale: str, x: pd.Series, y: pd.Series, name: str) -> go.Box:
    """One effect scale's boxes (whiskers to 1.5 IQR, no points), grouped and coloured by the scale."""
    return go.Box(
        x=x,
        y=y,
        name=name,
        boxpoints=False,
        marker={"color": SCALE_COLORS[scale]},
        offsetgroup=scale,
        legendgroup=scale,
    )


def _concentration_panels(fig: go.Figure, conc: pd.DataFrame, pairs: list[str]) -> None:
    """Panels (a) and (b): per scale, the effective fraction's boxes and the top / bottom 25% shares' medians."""
    for scale, name in SCALE_NAMES.items():
        at = conc[conc.scale == scale]
        fig.add_trace(_scale_box(scale, at.pair, at.effective_fraction, f"effective fraction, {name}"), row=1, col=1)
        medians = at.groupby("pair", sort=False)[["top25_share", "bottom25_share"]].median().reindex(pairs)
        for column, dash, label in (("top25_share", "solid", "top 25%"), ("bottom25_share", "dot", "bottom 25%")):
            fig.add_trace(
                go.Scatter(
                    x=pairs,
                    y=medians[column],
                    mode="lines+markers",
                    line={"color": SCALE_COLORS[scale], "dash": dash},
                    name=f"{label} share, {name}",
                    legendgroup=scale,
                ),
                row=1,
                col=2,
            )
    fig.update_layout(boxmode="group")
    fig.update_xaxes(title_text="layer pair (upstream→receiving)", tickangle=-90, tickfont={"size": 9}, row=1)
    fig.update_yaxes(title_text="effective fraction exp(H)/n (1 = all equal)", row=1, col=1)
    fig.update_yaxes(title_text="share of the summed single-head effects", row=1, col=2)


def _joint_panel(fig: go.Figure, joint: pd.DataFrame, pairs: list[str]) -> None:
    """Panel (c): each joint removal's median over observations per pair, its interquartile range as a band."""
    qkv = joint[joint.scale == "qkv"].groupby("pair", sort=False)
    x = np.arange(len(pairs))
    for kind, color in JOINT_COLORS.items():
        q = qkv[f"joint_{kind}"].quantile([0.25, 0.5, 0.75]).unstack().reindex(pairs)
        line_with_band(
            fig,
            x,
            q[0.5],
            q[0.25],
            q[0.75],
            color=color,
            name=f"{kind} {'heads' if kind == 'all' else 'half'} removed (median)",
            band_name=f"{kind}: interquartile range",
            group=f"joint-{kind}",
            row=2,
            col=1,
        )
    fig.update_xaxes(title_text="layer pair (upstream→receiving)", tickangle=-90, tickfont={"size": 9}, row=2, col=1)
    fig.update_xaxes(tickvals=list(x), ticktext=pairs, row=2, col=1)
    fig.update_yaxes(title_text="relative L2 change of Q/K/V", row=2, col=1)


def _ratio_panel(fig: go.Figure, joint: pd.DataFrame) -> None:
    """Panel (d): the strong / weak ratio per observation, by receiving-layer type, on a log scale."""
    for scale, name in SCALE_NAMES.items():
        at = joint[(joint.scale == scale) & (joint.strong_weak_ratio > 0)]
        box = _scale_box(scale, at.receiving_type + " receiver", at.strong_weak_ratio, f"strong/weak ratio, {name}")
        fig.add_trace(box, row=2, col=2)
    fig.add_hline(y=1, line={"color": "#444", "dash": "dash"}, row=2, col=2)
    fig.update_xaxes(title_text="receiving layer type", row=2, col=2)
    ticks = [0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100, 300, 1000]
    fig.update_yaxes(
        title_text="strong / weak (log scale; 1 = equal)", type="log", tickvals=ticks, ticktext=ticks, row=2, col=2
    )
