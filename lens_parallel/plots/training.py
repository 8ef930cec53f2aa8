"""Training runs and the paired factorial."""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from lens_parallel.errors import LensParallelError
from lens_parallel.plots.common import TEMPLATE, band

ARM_COLORS = {
    "baseline": "#444444",
    "value-parallel-removal": "#d62728",
    "xsa-gated": "#ff7f0e",
    "residual-parallel-removal": "#9467bd",
    "random-direction": "#1f77b4",
    "random-direction-gated": "#17becf",
    "learned-gate": "#2ca02c",
    "learned-gate-layer": "#8c564b",
    "xsa-alpha-layer": "#e377c2",
}
"""One colour per training arm, the same in every figure (an arm not listed gets plotly's default sequence)."""


GATE_LABELS = {
    "learned-gate": "s_par = sigmoid(w.x + b), mean over tokens",
    "learned-gate-layer": "s_par = 1 - sigmoid(w.x + b), mean over tokens",
    "xsa-alpha-layer": "g = sigmoid(a) (s_par = 1 - g)",
}
"""What the gates figure plots for an arm (default: g = tanh(alpha), s_par = 1 - g)."""


def _arm_colors(arms: Iterable[str]) -> dict[str, str]:
    fallback = go.layout.Template(pio.templates["plotly"]).layout.colorway
    return {arm: ARM_COLORS.get(arm, fallback[i % len(fallback)]) for i, arm in enumerate(arms)}


def _loss_column(curves: pd.DataFrame, smooth: int) -> tuple[str, str]:
    """The loss column of ``curves`` (``val_loss`` or ``train_loss``) and its axis title."""
    if isinstance(smooth, bool) or not isinstance(smooth, int) or smooth < 1:
        raise LensParallelError(f"smooth must be a window of >= 1 points (an integer), got {smooth!r}")
    if "val_loss" in curves:
        return "val_loss", "validation loss (nats/token)"
    mean = f", running mean of {smooth} steps" if smooth > 1 else ""
    return "train_loss", f"training loss (nats/token, batch loss per step{mean})"


def _smoothed(curves: pd.DataFrame, column: str, smooth: int) -> pd.DataFrame:
    """``curves`` with ``column`` a running mean over ``smooth`` rows within each (arm, seed): each row the mean of
    itself and the ``smooth - 1`` rows before."""
    mean = curves.groupby(["arm", "seed"], sort=False)[column].transform(lambda x: x.rolling(smooth, 1).mean())
    return curves.assign(**{column: mean})


def training_curves(curves: pd.DataFrame, *, title: str, smooth: int = 1) -> go.Figure:
    """Validation (or training) loss against step, one line per (arm, seed)."""
    column, axis = _loss_column(curves, smooth)
    fig = go.Figure()
    colors = _arm_colors(dict.fromkeys(curves["arm"]))
    for (arm, seed), df in _smoothed(curves, column, smooth).groupby(["arm", "seed"], sort=False):
        fig.add_trace(
            go.Scatter(
                x=df["step"],
                y=df[column],
                mode="lines+markers" if column == "val_loss" else "lines",
                line={"color": colors[arm]},
                name=f"{arm}, seed {seed}",
            )
        )
    fig.update_layout(title=title, xaxis_title="optimiser step", yaxis_title=axis, template=TEMPLATE)
    return fig


def factorial_figure(curves: pd.DataFrame, finals: pd.DataFrame, table: pd.DataFrame, *, smooth: int = 1) -> go.Figure:
    """Left: validation (or training: ``curves`` with ``train_loss``, a running mean of ``smooth`` steps) loss per
    arm (line = mean over seeds, band = min-max over seeds). Right: the paired delta (arm - baseline final
    validation loss) of every seed, with the mean and its 95% bootstrap CI."""
    column, axis = _loss_column(curves, smooth)
    curves = _smoothed(curves, column, smooth)
    arms = list(dict.fromkeys(curves["arm"]))
    colors = _arm_colors(arms)
    n_seeds = curves.groupby("arm")["seed"].nunique().max()
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.58, 0.42],
        horizontal_spacing=0.1,
        subplot_titles=[f"{axis.split(' (')[0]} by step", "paired delta vs baseline"],
    )
    fig.update_annotations(font_size=13)  # the subplot titles
    for arm in arms:
        g = curves[curves["arm"] == arm].groupby("step")[column]
        x = g.mean().index.to_numpy()
        band(
            fig, x, g.min().to_numpy(), g.max().to_numpy(), colors[arm], f"{arm}: min-max over seeds", arm, 1, 1, False
        )
        fig.add_trace(
            go.Scatter(
                x=x, y=g.mean().to_numpy(), mode="lines", line={"color": colors[arm]}, name=arm, legendgroup=arm
            ),
            row=1,
            col=1,
        )
    wide = finals.pivot(index="seed", columns="arm", values="final_val_loss")
    for _, row in table[table["reference"] == "baseline"].iterrows():
        arm = row["arm"]
        d = (wide[arm] - wide["baseline"]).dropna()
        fig.add_trace(
            go.Scatter(
                x=[arm] * len(d),
                y=d.to_numpy(),
                mode="markers",
                marker={"color": colors[arm], "size": 8, "opacity": 0.6},
                text=[f"seed {s}" for s in d.index],
                name=f"{arm}: per seed",
                legendgroup=arm,
                showlegend=False,
            ),
            row=1,
            col=2,
        )
        fig.add_trace(
            go.Scatter(
                x=[arm],
                y=[row["mean_delta"]],
                mode="markers",
                marker={"color": colors[arm], "symbol": "line-ew-open", "size": 26, "line": {"width": 3}},
                error_y={
                    "type": "data",
                    "symmetric": False,
                    "array": [row["ci_hi"] - row["mean_delta"]],
                    "arrayminus": [row["mean_delta"] - row["ci_lo"]],
                },
                name=f"{arm}: mean, 95% CI",
                legendgroup=arm,
                showlegend=False,
            ),
            row=1,
            col=2,
        )
    fig.add_hline(y=0, line={"color": "black", "width": 1, "dash": "dot"}, row=1, col=2)
    fig.update_xaxes(title_text="optimiser step", row=1, col=1)
    fig.update_yaxes(title_text=axis, row=1, col=1)
    fig.update_yaxes(title_text="delta final validation loss (nats/token; < 0 helps)", row=1, col=2)
    legend = (
        f"left: line = mean over {n_seeds} seeds, band = min-max; right: dots = seeds, bar = mean with its 95% "
        "bootstrap CI"
    )
    title = f"Training-time interventions: paired by seed<br><sup>{legend}</sup>"
    fig.update_layout(title=title, template=TEMPLATE, height=500, width=1150, margin={"t": 100})
    return fig


def gates_figure(gates: pd.DataFrame) -> go.Figure:
    """Learned gates per layer and arm: line = mean over heads and seeds, band = min-max over heads and seeds."""
    fig = make_subplots(rows=1, cols=1)
    if gates.empty:
        fig.update_layout(title="Learned gates: no gated arm in this factorial", template=TEMPLATE)
        return fig
    colors = _arm_colors(dict.fromkeys(gates["arm"]))
    for arm, df in gates.groupby("arm", sort=False):
        g = df.groupby("layer")["gate"]
        x = g.mean().index.to_numpy()
        what = GATE_LABELS.get(str(arm), "g = tanh(alpha)")
        band(
            fig,
            x,
            g.min().to_numpy(),
            g.max().to_numpy(),
            colors[arm],
            f"{arm}: min-max over heads, seeds",
            arm,
            1,
            1,
            True,
        )
        fig.add_trace(
            go.Scatter(
                x=x,
                y=g.mean().to_numpy(),
                mode="lines+markers",
                line={"color": colors[arm]},
                name=f"{arm}: {what}",
                legendgroup=arm,
            )
        )
    fig.update_xaxes(title_text="layer", dtick=1)
    fig.update_yaxes(title_text="gate value")
    fig.update_layout(
        title="Learned gates by layer (tanh gates: 1 = full removal; s_par: kept parallel share)",
        template=TEMPLATE,
        width=900,
        height=560,
        legend={"orientation": "h", "yanchor": "top", "y": -0.18, "x": 0},
    )
    return fig
