"""Downstream task scores under edits: the paired difference per task, and the absolute scores per setting."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import plotly.graph_objects as go
from plotly.colors import qualitative

from lens_parallel.plots.common import TEMPLATE


@runtime_checkable
class TaskResultRead(Protocol):
    """What these figures read of a :class:`~lens_parallel.downstream.effects.TaskResult`."""

    def differences(self, *args: Any, **kwargs: Any) -> Any: ...

    @property
    def info(self) -> Any: ...

    @property
    def provenance(self) -> Any: ...

    def score_metrics(self, *args: Any, **kwargs: Any) -> Any: ...

    @property
    def scores(self) -> Any: ...

    @property
    def settings(self) -> Any: ...

    def shown_name(self, *args: Any, **kwargs: Any) -> Any: ...


def _label(result: TaskResultRead, task: str, metric: str) -> str:
    """``task``, with the task it stands in for (``gsm8k_cot for gsm8k``) and its metric where that is not acc
    (RULER's length in k tokens: ``niah_single_1 (4k)``)."""
    name = result.shown_name(task)
    if metric.isdigit():
        return f"{name} ({int(metric) / 1024:g}k)"
    return name if metric == "acc" else f"{name} ({metric})"


def _layout(fig: go.Figure, result: TaskResultRead, title: str, **axes: str) -> go.Figure:
    """The figures' shared layout: the model's name before ``title``, a legend of the settings beside; the figure
    is taller by what its longest task label takes when slanted (``gsm8k_cot for gsm8k (exact_match,strict-match)``),
    so the plot keeps its height."""
    name = "" if result.provenance is None else f"{result.info.name}: "
    longest = max((len(str(x)) for trace in fig.data for x in trace.x), default=0)
    return fig.update_layout(
        title=f"{name}{title}",
        template=TEMPLATE,
        height=460 + 5 * max(0, longest - 20),
        width=860,
        legend={"title": "setting"},
        showlegend=True,
        **axes,
    )


def task_difference_figure(result: TaskResultRead) -> go.Figure:
    """Edited − unedited accuracy per task and setting (percentage points), each a point with its 95% paired
    bootstrap CI over items; the last group is the unweighted average over tasks."""
    table = result.differences()
    fig = go.Figure()
    averaged = set(table.loc[table["task"] == "average", "metric"])
    first = "score" if "score" in averaged else "acc" if "acc" in averaged else None
    shown = result.score_metrics() | {"average": first or min(averaged, key=int, default="acc")}
    for k, setting in enumerate(result.settings[1:]):
        rows = table[(table["setting"] == setting) & (table["metric"] == table["task"].map(shown))]
        rows = rows.set_index("task").reindex(list(shown)).dropna(subset=["difference"])
        fig.add_trace(
            go.Scatter(
                x=[_label(result, t, shown[t]) for t in rows.index],
                y=100 * rows["difference"],
                mode="markers",
                marker={"size": 10, "color": qualitative.D3[k % 10]},
                error_y={
                    "type": "data",
                    "symmetric": False,
                    "array": 100 * (rows["ci_high"] - rows["difference"]),
                    "arrayminus": 100 * (rows["difference"] - rows["ci_low"]),
                },
                name=setting,
                customdata=rows[["p_holm", "n_items"]].to_numpy(),
                hovertemplate="%{x}: %{y:.1f} pp<br>Holm p %{customdata[0]:.3g}, %{customdata[1]} items<extra>"
                + setting
                + "</extra>",
            )
        )
    fig.add_hline(y=0, line={"dash": "dash", "color": "grey"})
    fig.update_layout(scattermode="group")
    return _layout(
        fig,
        result,
        "score change under each edit (bars: 95% paired bootstrap CI over items)",
        xaxis_title="task (acc; generation: exact match; RULER: score at its length; average: mean over the tasks)",
        yaxis_title="edited − unedited score (percentage points)",
    )


def task_scores_figure(result: TaskResultRead) -> go.Figure:
    """Absolute accuracy per task (lm-eval's aggregate, %; a generation task's exact match) for the unedited model
    and each setting."""
    fig = go.Figure()
    shown = result.score_metrics()
    for k, setting in enumerate(result.settings):
        fig.add_trace(
            go.Bar(
                x=[_label(result, t, m) for t, m in shown.items()],
                y=[100 * result.scores[t][m][setting] for t, m in shown.items()],
                name=setting,
                marker_color="#7f7f7f" if k == 0 else qualitative.D3[(k - 1) % 10],
                hovertemplate="%{x}: %{y:.1f}%<extra>" + setting + "</extra>",
            )
        )
    fig.update_layout(barmode="group")
    return _layout(
        fig,
        result,
        "task score per setting (lm-eval's own metric)",
        xaxis_title="task",
        yaxis_title="score (%)",
    )
