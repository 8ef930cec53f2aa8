"""Plotly figures. Every result's ``.figure()`` calls a function here; nothing here computes statistics."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

if TYPE_CHECKING:
    from lens_parallel.analyses.decompose import DecompositionResult
    from lens_parallel.analyses.diagonal import DiagonalView
    from lens_parallel.analyses.dominance import DominanceResult
    from lens_parallel.analyses.nulls import NullResult
    from lens_parallel.analyses.reliability import SanityReport, SplitHalfResult
    from lens_parallel.analyses.scaling import ScalingResult
    from lens_parallel.analyses.sensitivity import SensitivityResult


def save_figure(fig: go.Figure, stem: str | Path) -> list[Path]:
    """Write ``stem.html`` (plotly.js inlined: opens offline) and, when kaleido finds a Chrome/Chromium,
    ``stem.png``; returns the files written (a missing PNG renderer is reported on stderr, not raised)."""
    stem = Path(stem)
    written = [stem.with_suffix(".html")]
    fig.write_html(written[0], include_plotlyjs=True)
    try:
        fig.write_image(stem.with_suffix(".png"), scale=2)
        written.append(stem.with_suffix(".png"))
    except Exception as exc:  # kaleido missing, or no Chrome/Chromium on this machine
        print(f"(no PNG for {stem.name}: {str(exc).splitlines()[0][:120]})", file=sys.stderr)
    return written


COLORS = {"self_cos": "#1f77b4", "par_frac": "#d62728", "perp_frac": "#2ca02c"}
LABELS = {"self_cos": "self-cosine cos(m, r)", "par_frac": "|m_par| / |m|", "perp_frac": "|m_perp| / |m|"}


def _band(fig: go.Figure, x, lo, hi, color: str, name: str, group: str, row: int, col: int, show: bool) -> None:
    fig.add_trace(go.Scatter(
        x=np.concatenate([x, x[::-1]]), y=np.concatenate([hi, lo[::-1]]), fill="toself", fillcolor=color,
        opacity=0.14, line={"width": 0}, hoverinfo="skip", name=name, legendgroup=group, showlegend=show,
    ), row=row, col=col)  # fmt: skip


def decomposition_figure(result: DecompositionResult) -> go.Figure:
    """Per space: layer-wise curves (line = mean over heads, band = min-max over heads; whole-sublayer updates as
    dashed lines) and, for head-level spaces, a layer x head heatmap of the mean self-cosine."""
    info = result.info
    spaces = list(dict.fromkeys(t.space for t in result.tables))
    has_heads = [any(t.space == space and t.level == "head" for t in result.tables) for space in spaces]
    titles, specs = [], []
    for space, heads in zip(spaces, has_heads, strict=True):
        titles += (
            [f"{space}: self-alignment by layer", f"{space}: self-cosine per head"]
            if heads
            else [f"{space}: self-alignment by layer (whole update; no per-head split)"]
        )
        specs.append([{}, {}] if heads else [{"colspan": 2}, None])
    fig = make_subplots(rows=len(spaces), cols=2, subplot_titles=titles, column_widths=[0.55, 0.45], specs=specs,
                        horizontal_spacing=0.12, vertical_spacing=0.32 / max(len(spaces), 1))  # fmt: skip
    shown: set[str] = set()
    for row, space in enumerate(spaces, start=1):
        tables = {t.level: t for t in result.tables if t.space == space}
        for stat, color in COLORS.items():
            if "head" in tables:
                t = tables["head"]
                x, values = np.array(t.layers), getattr(t, stat)
                group = f"{stat}-head"
                _band(fig, x, np.nanmin(values, 1), np.nanmax(values, 1), color, f"{LABELS[stat]}: min-max over heads",
                      group, row, 1, group not in shown)  # fmt: skip
                fig.add_trace(go.Scatter(
                    x=x, y=np.nanmean(values, 1), mode="lines+markers", line={"color": color},
                    name=f"{LABELS[stat]}: mean over heads", legendgroup=group, showlegend=group not in shown,
                ), row=row, col=1)  # fmt: skip
                shown.add(group)
            if "sublayer" in tables:
                t = tables["sublayer"]
                group = f"{stat}-sublayer"
                fig.add_trace(go.Scatter(
                    x=np.array(t.layers), y=getattr(t, stat)[:, 0], mode="lines+markers",
                    line={"color": color, "dash": "dash"}, marker={"symbol": "diamond"},
                    name=f"{LABELS[stat]}: whole update", legendgroup=group, showlegend=group not in shown,
                ), row=row, col=1)  # fmt: skip
                shown.add(group)
        fig.update_xaxes(title_text="layer", dtick=max(1, info.n_layers // 10), row=row, col=1)
        fig.update_yaxes(title_text="mean over positions t ≥ 1", row=row, col=1)
        if "head" in tables:
            t = tables["head"]
            fig.add_trace(go.Heatmap(
                z=t.self_cos, x=[f"H{h}" for h in range(t.self_cos.shape[1])], y=[f"L{layer}" for layer in t.layers],
                zmid=0, colorscale="RdBu_r", colorbar={"title": "self-cos", "len": 1 / len(spaces),
                                                       "y": 1 - (row - 0.5) / len(spaces)},
                customdata=np.stack([t.par_frac, t.perp_frac, t.par_coef], -1),
                hovertemplate="%{y}%{x}<br>self-cos %{z:.3f}<br>|m_par|/|m| %{customdata[0]:.3f}"
                "<br>|m_perp|/|m| %{customdata[1]:.3f}<br>coef %{customdata[2]:.3f}<extra></extra>",
            ), row=row, col=2)  # fmt: skip
            fig.update_xaxes(title_text="query head", row=row, col=2)
            fig.update_yaxes(title_text="layer", autorange="reversed", row=row, col=2)
    texts = result.provenance.texts
    n_docs = texts.get("n_docs", "?")
    height = 330 * len(spaces) + 190
    fig.update_layout(
        title={"text": f"Parallel/perpendicular decomposition: {info.name} ({n_docs} docs, position 0 excluded)",
               "yref": "container", "yanchor": "top", "y": 1 - 15 / height},
        height=height, width=1150, template="plotly_white", margin={"t": 190},
        legend={"orientation": "h", "yref": "container", "yanchor": "top", "y": 1 - 60 / height, "x": 0,
                "font": {"size": 11}},
    )  # fmt: skip
    return fig


SPACE_COLORS = {
    "value": "#1f77b4",
    "value-exclude-self": "#ff7f0e",
    "residual-attn": "#2ca02c",
    "residual-mlp": "#d62728",
    "residual-block": "#9467bd",
}


def scaling_figure(result: ScalingResult) -> go.Figure:
    """All-layer sweeps: two panels (vary s_par at s_perp = 1; vary s_perp at s_par = 1), one curve per space,
    error bars = 95% paired bootstrap CI over documents. Per-layer sweeps: one heatmap per space (setting x layer)."""
    df = result.to_dataframe()
    info = result.info
    if df["layer"].notna().any():
        return _per_layer_scaling_figure(df, info.name)
    fig = make_subplots(rows=1, cols=2, subplot_titles=["vary s_par (s_perp = 1)", "vary s_perp (s_par = 1)"])
    for col, vary in enumerate(("s_par", "s_perp"), start=1):
        for space, d in df[df.vary == vary].groupby("space", sort=False):
            d = d.sort_values(vary)
            x = np.concatenate([d[vary].to_numpy(), [1.0]])
            order = np.argsort(x)
            y = np.concatenate([d.delta_loss.to_numpy(), [0.0]])[order]
            hi = np.concatenate([d.delta_loss_hi.to_numpy(), [0.0]])[order] - y
            lo = y - np.concatenate([d.delta_loss_lo.to_numpy(), [0.0]])[order]
            fig.add_trace(go.Scatter(
                x=x[order], y=y, mode="lines+markers", name=space, legendgroup=space, showlegend=col == 1,
                line={"color": SPACE_COLORS.get(space)},
                error_y={"type": "data", "array": hi, "arrayminus": lo, "thickness": 1},
                hovertemplate=f"{space}<br>{vary}=%{{x}}<br>Δloss %{{y:.4f}} nats/token<extra></extra>",
            ), row=1, col=col)  # fmt: skip
        fig.add_vline(x=1.0, line={"dash": "dot", "color": "grey"}, row=1, col=col)
        fig.update_xaxes(title_text=f"{vary} (1 = no-op)", row=1, col=col)
        fig.update_yaxes(title_text="Δ loss vs no-op (nats/token)", row=1, col=col)
    n = df.n_docs.iloc[0] if len(df) else 0
    fig.update_layout(
        title=f"Component scaling, all layers edited: {info.name} ({n} docs; bars = 95% paired bootstrap CI)",
        height=480, width=1150, template="plotly_white", legend={"title": "space"},
    )  # fmt: skip
    return fig


def _per_layer_scaling_figure(df, model_name: str) -> go.Figure:
    spaces = list(dict.fromkeys(df.space))
    fig = make_subplots(rows=len(spaces), cols=1, subplot_titles=[f"{s}: one layer edited at a time" for s in spaces],
                        vertical_spacing=0.25 / max(len(spaces), 1))  # fmt: skip
    for row, space in enumerate(spaces, start=1):
        d = df[df.space == space].assign(setting=lambda t: np.where(
            t.vary == "s_par", "s_par=" + t.s_par.astype(str), "s_perp=" + t.s_perp.astype(str)))  # fmt: skip
        grid = d.pivot_table(index="setting", columns="layer", values="delta_loss", sort=False)
        fig.add_trace(go.Heatmap(
            z=grid.to_numpy(), x=[f"L{layer}" for layer in grid.columns], y=list(grid.index), zmid=0,
            colorscale="RdBu_r", colorbar={"title": "Δ loss<br>nats/token", "len": 1 / len(spaces),
                                           "y": 1 - (row - 0.5) / len(spaces)},
            hovertemplate="%{x} %{y}<br>Δloss %{z:.4f}<extra></extra>",
        ), row=row, col=1)  # fmt: skip
        fig.update_xaxes(title_text="edited layer", row=row, col=1)
        fig.update_yaxes(title_text="setting", row=row, col=1)
    fig.update_layout(title=f"Component scaling per layer: {model_name} (Δ loss vs matched no-op)",
                      height=380 * len(spaces) + 100, width=1150, template="plotly_white")  # fmt: skip
    return fig


def diagonal_figure(view: DiagonalView, *, max_tokens: int = 48) -> go.Figure:
    """Row 1: the head's empirical attention map, the residual-space view A + diag(dA) and the exclude-self
    value-space edited map (first ``max_tokens`` positions, token labels on both axes; one diverging colour scale
    clipped to [-1, 1], so negative diagonal entries show; hover gives exact values).
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
    maps = [m[:n, :n] for _, m in panels]
    specs = [[{}] * len(panels), [{"colspan": len(panels)}] + [None] * (len(panels) - 1)]
    titles = [t for t, _ in panels] + ["per-head mean dA_tt (all documents, t ≥ 1)"]
    fig = make_subplots(rows=2, cols=len(panels), row_heights=[0.78, 0.22], vertical_spacing=0.22,
                        horizontal_spacing=0.07, specs=specs, subplot_titles=titles)  # fmt: skip
    for col, (m, (title, _)) in enumerate(zip(maps, panels, strict=True), start=1):
        fig.add_trace(go.Heatmap(
            z=m, x=labels, y=labels, zmid=0, zmin=-1, zmax=1, colorscale="RdBu_r", showscale=col == 1,
            colorbar={"title": "attention weight<br>(colour clipped<br>to ±1)", "len": 0.7, "y": 0.62},
            hovertemplate="query %{y}<br>key %{x}<br>A %{z:.3f}<extra>" + title.split(":")[0] + "</extra>",
        ), row=1, col=col)  # fmt: skip
        fig.update_xaxes(title_text="key token", tickfont={"size": 8}, row=1, col=col)
        fig.update_yaxes(title_text="query token" if col == 1 else None, autorange="reversed",
                         tickfont={"size": 8}, row=1, col=col)  # fmt: skip
    heads = [f"L{view.layer}H{h}" for h in range(view.summary_mean.shape[1])]
    fig.add_trace(go.Heatmap(
        z=view.summary_mean, x=heads, y=list(view.spaces), zmid=0, colorscale="PuOr_r",
        colorbar={"title": "mean dA", "len": 0.22, "y": 0.1},
        customdata=np.stack([view.summary_min, view.summary_max, view.summary_negative_share], -1),
        hovertemplate="%{x} %{y}<br>mean dA %{z:.3f}<br>min %{customdata[0]:.3f} max %{customdata[1]:.3f}"
        "<br>share A+dA<0: %{customdata[2]:.1%}<extra></extra>",
    ), row=2, col=1)  # fmt: skip
    fig.update_xaxes(title_text="query head", row=2, col=1)
    fig.update_layout(
        title=f"Attention-diagonal form of s_par = {view.s_par:g}: {view.info.name} L{view.layer}H{view.head}, "
        f"document {view.doc} (first {n} tokens)",
        height=950, width=1500, template="plotly_white",
    )  # fmt: skip
    return fig


def sensitivity_figure(result: SensitivityResult) -> go.Figure:
    """Per layer: the joint effect (all heads of the layer edited together; bars = 95% paired bootstrap CI) and a
    band spanning the smallest to the largest single-head effect (a range over heads, not a confidence interval)."""
    x = np.array(result.layers)
    fig = go.Figure()
    fig.add_trace(go.Scatter(
        x=np.concatenate([x, x[::-1]]),
        y=np.concatenate([result.head_delta.max(1), result.head_delta.min(1)[::-1]]),
        fill="toself", fillcolor="#1f77b4", opacity=0.2, line={"width": 0}, hoverinfo="skip",
        name="single heads: range min-max over heads (not a CI)",
    ))  # fmt: skip
    fig.add_trace(go.Scatter(
        x=x, y=np.median(result.head_delta, 1), mode="lines", line={"color": "#1f77b4", "dash": "dot"},
        name="single heads: median",
    ))  # fmt: skip
    fig.add_trace(go.Scatter(
        x=x, y=result.joint_delta, mode="lines+markers", line={"color": "#d62728"},
        error_y={"type": "data", "array": result.joint_hi - result.joint_delta,
                 "arrayminus": result.joint_delta - result.joint_lo, "thickness": 1},
        name="all heads of the layer jointly (bars: 95% paired bootstrap CI)",
    ))  # fmt: skip
    fig.add_hline(y=0, line={"color": "grey", "width": 1})
    fig.update_layout(
        title=f"Layer sensitivity to {result.edit} ablation: {result.info.name} "
        f"(base loss {result.loss_base:.3f} nats/token)",
        xaxis_title="layer", yaxis_title="Δ loss vs unedited (nats/token)", template="plotly_white",
        height=480, width=1100, legend={"orientation": "h", "y": -0.2},
    )  # fmt: skip
    fig.update_xaxes(dtick=max(1, len(x) // 15))
    return fig


def dominance_figure(result: DominanceResult) -> go.Figure:
    """Three panels over layer pairs: the distribution of the effective fraction of upstream heads (box per pair,
    one point per text and receiving head); the mean share of the top and bottom 25% of upstream heads; and the
    measured joint effects of removing the weak, strong or a random half (mean, band = one std over observations)."""
    df = result.to_dataframe()
    linear = np.where(df.receiving_type == "linear", " (linear)", "")
    df["pair"] = "L" + df.upstream_layer.astype(str) + "→L" + df.receiving_layer.astype(str) + linear
    pairs = list(dict.fromkeys(df.pair))
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.08, subplot_titles=[
        "effective fraction of upstream heads", "share of top / bottom 25% of upstream heads",
        "joint removal of half the upstream heads"])  # fmt: skip
    fig.add_trace(go.Box(x=df.pair, y=df.effective_fraction, name="effective fraction exp(H)/n", boxpoints="all",
                         jitter=0.4, marker={"size": 3}, line={"color": "#1f77b4"}), row=1, col=1)  # fmt: skip
    grouped = df.groupby("pair", sort=False)
    for column, color, name in (("top25_share", "#d62728", "top 25% share"),
                                ("bottom25_share", "#2ca02c", "bottom 25% share")):  # fmt: skip
        fig.add_trace(go.Scatter(x=pairs, y=grouped[column].mean().reindex(pairs), mode="lines+markers",
                                 line={"color": color}, name=f"{name} (mean)"), row=1, col=2)  # fmt: skip
    from lens_parallel.analyses.dominance import JOINT  # runtime import: dominance imports this module

    for kind, color in zip(JOINT, ("#2ca02c", "#d62728", "#7f7f7f"), strict=True):
        mean, std = grouped[f"joint_{kind}"].mean().reindex(pairs), grouped[f"joint_{kind}"].std().reindex(pairs)
        x = np.arange(len(pairs))
        _band(fig, x, (mean - std).to_numpy(), (mean + std).to_numpy(), color, f"{kind} half: ±1 std", kind, 1, 3,
              True)  # fmt: skip
        fig.add_trace(go.Scatter(x=x, y=mean, mode="lines+markers", line={"color": color}, legendgroup=kind,
                                 name=f"{kind} half removed (mean)"), row=1, col=3)  # fmt: skip
    fig.update_xaxes(title_text="layer pair (upstream→receiving)", tickangle=-90, tickfont={"size": 9})
    fig.update_xaxes(tickvals=list(range(len(pairs))), ticktext=pairs, row=1, col=3)
    fig.update_yaxes(title_text="effective fraction (1 = all heads equal)", row=1, col=1)
    fig.update_yaxes(title_text="share of total single-head effect", row=1, col=2)
    fig.update_yaxes(title_text="relative L2 change of receiving Q/K/V", row=1, col=3)
    n_texts = result.joint.shape[1]
    fig.update_layout(
        title=f"Next-layer head dominance: {result.info.name} ({n_texts} texts, "
        f"{len(result.query_positions)} query positions)",
        height=620, width=1500, template="plotly_white", margin={"b": 190},
        legend={"orientation": "h", "yref": "container", "y": 0.02, "yanchor": "bottom"},
    )  # fmt: skip
    return fig


def null_figure(result: NullResult) -> go.Figure:
    """Left: cos_self and the causal-null cos_null per layer (line = mean over heads, band = min-max over heads).
    Right (GQA): within-group and across-group excess per layer, mean over heads."""
    df = result.to_dataframe()
    gqa = result.cos_across is not None
    titles = ["self-cosine vs earlier-position null"] + (["GQA: within- vs across-group excess"] if gqa else [])
    fig = make_subplots(rows=1, cols=2 if gqa else 1, subplot_titles=titles)
    by_layer = df.groupby("layer")
    x = np.array(sorted(df.layer.unique()))
    for column, color, name in (
        ("cos_self", "#1f77b4", "cos(y_t, v_t)"),
        ("cos_null", "#7f7f7f", "cos(y_t, v_j), j < t"),
    ):
        _band(fig, x, by_layer[column].min().to_numpy(), by_layer[column].max().to_numpy(), color,
              f"{name}: min-max over heads", column, 1, 1, True)  # fmt: skip
        fig.add_trace(go.Scatter(x=x, y=by_layer[column].mean(), mode="lines+markers", line={"color": color},
                                 name=f"{name}: mean over heads", legendgroup=column), row=1, col=1)  # fmt: skip
    fig.update_xaxes(title_text="layer", row=1, col=1)
    fig.update_yaxes(title_text="mean cosine over positions t ≥ 1", row=1, col=1)
    if gqa:
        for column, color, name in (("within_excess", "#1f77b4", "within group"),
                                    ("across_excess", "#d62728", "across groups (neighbour kv)")):  # fmt: skip
            bar = go.Bar(x=x, y=by_layer[column].mean(), marker_color=color, name=f"{name} excess: mean over heads")
            fig.add_trace(bar, row=1, col=2)
        fig.update_xaxes(title_text="layer", row=1, col=2)
        fig.update_yaxes(title_text="excess over the own-group null (cosine)", row=1, col=2)
    fig.update_layout(
        title=f"Causal null: {result.info.name} ({result.cos_self.shape[0]} docs, seed {result.seed})",
        height=460, width=1150 if gqa else 700, template="plotly_white", barmode="group",
        legend={"orientation": "h", "y": -0.22},
    )  # fmt: skip
    return fig


def split_half_figure(result: SplitHalfResult) -> go.Figure:
    """Half A vs half B across heads: the causal-null excess (left) and the intervention effect Δ loss (right);
    the dashed diagonal is perfect agreement; r is Spearman across heads."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=[
        f"excess: r_stat = {result.correlations('excess')['r_stat']:.2f}",
        f"Δ loss ({result.edit}): r_delta = {result.correlations('excess')['r_delta']:.2f}"])  # fmt: skip
    labels = [f"L{layer}H{h}" for layer in result.layers for h in range(result.delta.shape[2])]
    for col, (values, unit) in enumerate(((result.excess, "cosine"), (result.delta, "nats/token")), start=1):
        a, b = values[0].ravel(), values[1].ravel()
        lo, hi = float(min(a.min(), b.min())), float(max(a.max(), b.max()))
        fig.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", line={"dash": "dash", "color": "grey"},
                                 name="half A = half B", showlegend=col == 1), row=1, col=col)  # fmt: skip
        hover = "%{text}<br>A %{x:.4f}<br>B %{y:.4f}<extra></extra>"
        marker = {"size": 6, "color": "#1f77b4"}
        fig.add_trace(go.Scatter(x=a, y=b, mode="markers", text=labels, marker=marker, name="one head",
                                 showlegend=col == 1, hovertemplate=hover), row=1, col=col)  # fmt: skip
        fig.update_xaxes(title_text=f"half A ({unit})", row=1, col=col)
        fig.update_yaxes(title_text=f"half B ({unit})", row=1, col=col)
    verdict = result.correlations("excess")["verdict"]
    fig.update_layout(title=f"Split-half reliability: {result.info.name} (verdict: {verdict})", height=460,
                      width=1000, template="plotly_white", legend={"orientation": "h", "y": -0.2})  # fmt: skip
    return fig


def sanity_figure(report: SanityReport) -> go.Figure:
    """Top row: the null panels (cos_self vs cos_null per layer; GQA within/across, when there are kv groups).
    Bottom row: the split-half scatters of the statistic and of the intervention effect."""
    parts = [null_figure(report.null), split_half_figure(report.split_half)]
    specs = [[{}, {}] if len(p.layout.annotations) == 2 else [{"colspan": 2}, None] for p in parts]
    titles = [a.text for part in parts for a in part.layout.annotations]
    fig = make_subplots(rows=2, cols=2, specs=specs, subplot_titles=titles, horizontal_spacing=0.1,
                        vertical_spacing=0.16)  # fmt: skip
    for row, part in enumerate(parts, start=1):
        for trace in part.data:
            axis = trace.xaxis or "x"
            fig.add_trace(trace, row=row, col=int(axis[1:]) if len(axis) > 1 else 1)
        for col in range(1, len(part.layout.annotations) + 1):
            suffix = "" if col == 1 else str(col)
            fig.update_xaxes(title_text=part.layout[f"xaxis{suffix}"].title.text, row=row, col=col)
            fig.update_yaxes(title_text=part.layout[f"yaxis{suffix}"].title.text, row=row, col=col)
    verdict = report.split_half.correlations("excess")["verdict"]
    fig.update_layout(title=f"Sanity checks: {report.null.info.name} (per-head effects: {verdict})", height=900,
                      width=1100, template="plotly_white", barmode="group",
                      legend={"orientation": "h", "y": -0.08})  # fmt: skip
    return fig


ARM_COLORS = ("#444444", "#d62728", "#ff7f0e", "#9467bd", "#1f77b4", "#17becf", "#2ca02c")


def _arm_colors(arms) -> dict[str, str]:
    from lens_parallel.training.arms import ARMS

    return {arm: ARM_COLORS[ARMS.index(arm) % len(ARM_COLORS)] for arm in arms}


def training_curves(curves, *, title: str) -> go.Figure:
    """Validation loss against step, one line per (arm, seed)."""
    fig = go.Figure()
    colors = _arm_colors(dict.fromkeys(curves["arm"]))
    for (arm, seed), df in curves.groupby(["arm", "seed"], sort=False):
        fig.add_trace(go.Scatter(x=df["step"], y=df["val_loss"], mode="lines+markers", line={"color": colors[arm]},
                                 name=f"{arm}, seed {seed}"))  # fmt: skip
    fig.update_layout(title=title, xaxis_title="optimiser step", yaxis_title="validation loss (nats/token)",
                      template="plotly_white")  # fmt: skip
    return fig


def factorial_figure(curves, finals, table) -> go.Figure:
    """Left: validation loss per arm (line = mean over seeds, band = min-max over seeds). Right: the paired delta
    (arm - baseline final validation loss) of every seed, with the mean and its 95% bootstrap CI."""
    arms = list(dict.fromkeys(curves["arm"]))
    colors = _arm_colors(arms)
    n_seeds = curves.groupby("arm")["seed"].nunique().max()
    fig = make_subplots(rows=1, cols=2, column_widths=[0.58, 0.42], horizontal_spacing=0.1, subplot_titles=[
        f"validation loss (line: mean over {n_seeds} seeds, band: min-max)",
        "paired delta vs baseline (dots: seeds; bar: mean, 95% bootstrap CI)",
    ])  # fmt: skip
    for arm in arms:
        g = curves[curves["arm"] == arm].groupby("step")["val_loss"]
        x = g.mean().index.to_numpy()
        _band(fig, x, g.min().to_numpy(), g.max().to_numpy(), colors[arm], f"{arm}: min-max over seeds", arm, 1, 1,
              False)  # fmt: skip
        fig.add_trace(go.Scatter(x=x, y=g.mean().to_numpy(), mode="lines", line={"color": colors[arm]}, name=arm,
                                 legendgroup=arm), row=1, col=1)  # fmt: skip
    wide = finals.pivot(index="seed", columns="arm", values="final_val_loss")
    for _, row in table.iterrows():
        arm = row["arm"]
        d = (wide[arm] - wide["baseline"]).dropna()
        fig.add_trace(go.Scatter(
            x=[arm] * len(d), y=d.to_numpy(), mode="markers", marker={"color": colors[arm], "size": 8, "opacity": 0.6},
            text=[f"seed {s}" for s in d.index], name=f"{arm}: per seed", legendgroup=arm, showlegend=False,
        ), row=1, col=2)  # fmt: skip
        fig.add_trace(go.Scatter(
            x=[arm], y=[row["mean_delta"]], mode="markers", marker={"color": colors[arm], "symbol": "line-ew-open",
            "size": 26, "line": {"width": 3}}, error_y={"type": "data", "symmetric": False,
            "array": [row["ci_hi"] - row["mean_delta"]], "arrayminus": [row["mean_delta"] - row["ci_lo"]]},
            name=f"{arm}: mean, 95% CI", legendgroup=arm, showlegend=False,
        ), row=1, col=2)  # fmt: skip
    fig.add_hline(y=0, line={"color": "black", "width": 1, "dash": "dot"}, row=1, col=2)
    fig.update_xaxes(title_text="optimiser step", row=1, col=1)
    fig.update_yaxes(title_text="validation loss (nats/token)", row=1, col=1)
    fig.update_yaxes(title_text="delta final validation loss (nats/token; < 0 helps)", row=1, col=2)
    fig.update_layout(title="Training-time interventions: paired by seed", template="plotly_white", height=480,
                      width=1150)  # fmt: skip
    return fig


def gates_figure(gates) -> go.Figure:
    """Learned gates per layer and arm: line = mean over heads and seeds, band = min-max over heads and seeds."""
    fig = make_subplots(rows=1, cols=1)
    if gates.empty:
        fig.update_layout(title="Learned gates: no gated arm in this factorial", template="plotly_white")
        return fig
    colors = _arm_colors(dict.fromkeys(gates["arm"]))
    for arm, df in gates.groupby("arm", sort=False):
        g = df.groupby("layer")["gate"]
        x = g.mean().index.to_numpy()
        what = "s_par = sigmoid(w.x + b), mean over tokens" if arm == "learned-gate" else "g = tanh(alpha)"
        _band(fig, x, g.min().to_numpy(), g.max().to_numpy(), colors[arm], f"{arm}: min-max over heads, seeds", arm,
              1, 1, True)  # fmt: skip
        fig.add_trace(go.Scatter(x=x, y=g.mean().to_numpy(), mode="lines+markers", line={"color": colors[arm]},
                                 name=f"{arm}: {what}", legendgroup=arm))  # fmt: skip
    fig.update_xaxes(title_text="layer", dtick=1)
    fig.update_yaxes(title_text="gate value")
    fig.update_layout(title="Learned gates by layer (tanh gates: 1 = full removal; s_par: kept parallel share)",
                      template="plotly_white", width=900, height=560,
                      legend={"orientation": "h", "yanchor": "top", "y": -0.18, "x": 0})  # fmt: skip
    return fig


def compression_figure(result, *, sublayer: str = "attn") -> go.Figure:
    """Perpendicular (left) and parallel (right) error of one sublayer's update by layer, relative to the dense
    update: line = mean over prompts, band = ±1 std over prompts, one colour per method."""
    from lens_parallel.analyses.compression import SUBLAYERS

    if sublayer not in SUBLAYERS:
        raise ValueError(f"sublayer must be one of {SUBLAYERS}, got {sublayer!r}")
    j = SUBLAYERS.index(sublayer)
    what = "attention" if sublayer == "attn" else "MLP"
    fig = make_subplots(rows=1, cols=2, shared_yaxes=False, horizontal_spacing=0.1, subplot_titles=[
        f"perpendicular error |e_perp| / |delta| ({what} update)", f"parallel error |e_par| / |delta| ({what} update)",
    ])  # fmt: skip
    palette = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
    x = np.array(result.layers)
    for i, method in enumerate(result.methods):
        color = palette[i % len(palette)]
        for col, values in ((1, result.perp[i, j]), (2, result.par[i, j])):
            mean, std = np.nanmean(values, -1), np.nanstd(values, -1)
            _band(fig, x, mean - std, mean + std, color, f"{method}: ±1 std over prompts", method, 1, col, False)
            fig.add_trace(go.Scatter(x=x, y=mean, mode="lines+markers", line={"color": color}, legendgroup=method,
                                     name=f"{method} (delta loss {result.delta_loss[i]:+.3f})", showlegend=col == 1),
                          row=1, col=col)  # fmt: skip
    fig.update_xaxes(title_text="layer")
    fig.update_yaxes(title_text="relative error (fraction of |delta_dense|)", row=1, col=1)
    fig.update_yaxes(title_text="relative error (fraction of |delta_dense|)", row=1, col=2)
    n = result.par.shape[-1]
    fig.update_layout(
        title=f"Compression error along / across the dense {what} update ({result.info.name}, {n} prompts, "
        f"{result.positions} positions; bands: ±1 std over prompts)",
        template="plotly_white", height=460, width=1150,
    )  # fmt: skip
    return fig


def comparison_figure(summary) -> go.Figure:
    """One bar per model in four panels: mean head self-cosine per space; causal-null excess and self-specific
    fraction; loss change of removing the parallel part (s_par = 0, all layers); split-half r_stat and r_delta."""
    fig = make_subplots(rows=2, cols=2, vertical_spacing=0.2, horizontal_spacing=0.1, subplot_titles=[
        "mean self-cosine over heads, by space", "causal null: excess and self-specific fraction",
        "delta loss of s_par = 0, all layers (nats/token)", "split-half reliability (Spearman across heads)",
    ])  # fmt: skip
    panels = {
        (1, 1): {"self_cos_value": "value", "self_cos_value-exclude-self": "value-exclude-self",
                 "self_cos_residual-attn": "residual-attn"},
        (1, 2): {"excess": "excess (cos_self - cos_null)", "self_specific_fraction": "self-specific fraction"},
        (2, 1): {"delta_loss_s_par0_value-exclude-self": "value-exclude-self",
                 "delta_loss_s_par0_residual-attn": "residual-attn"},
        (2, 2): {"r_stat_excess": "r_stat (excess)", "r_delta_excess": "r_delta (parallel removal)"},
    }  # fmt: skip
    palette = ("#1f77b4", "#d62728", "#2ca02c")
    groups = {(1, 1): "self-cosine", (1, 2): "causal null", (2, 1): "s_par = 0 (space)", (2, 2): "split-half"}
    for (row, col), columns in panels.items():
        for k, (column, label) in enumerate(columns.items()):
            if column in summary:
                fig.add_trace(go.Bar(x=summary["model"], y=summary[column], name=label, marker_color=palette[k],
                                     legendgroup=f"{row}{col}", legendgrouptitle_text=groups[row, col]),
                              row=row, col=col)  # fmt: skip
    fig.update_yaxes(title_text="cosine", row=1, col=1)
    fig.update_yaxes(title_text="cosine / fraction", row=1, col=2)
    fig.update_yaxes(title_text="nats/token", row=2, col=1)
    fig.update_yaxes(title_text="Spearman rho", row=2, col=2)
    fig.update_layout(title="Models compared on the standard battery", template="plotly_white", barmode="group",
                      height=760, width=1150)  # fmt: skip
    return fig
