"""From per-item values to a task result's tables: which metrics are 0/1 scores and in what unit each is, a
task's score among its metrics, the averages over tasks, lm-eval's aggregations as vectorised twins, and the
table of paired differences with bootstrap CIs, McNemar and Holm (:meth:`~lens_parallel.downstream.effects.TaskResult.
differences`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from lens_parallel.edits import UNEDITED
from lens_parallel.stats import holm, mcnemar_exact, mean_of_means_ci, paired_bootstrap_ci

BINARY_METRICS = ("acc", "acc_norm", "exact_match", "em", "pass_at_1")
"""Per-item 0/1 metrics: paired by McNemar's exact test (a generation task's ``exact_match,<filter>`` too)."""


def aggregate(name: str) -> Callable[[np.ndarray, np.ndarray], np.ndarray] | None:
    """Vectorised twins of lm-eval's aggregations (axis 0 = items): ``values`` [item, ...] and ``weights``."""
    ln2 = math.log(2)
    table: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
        "mean": lambda v, w: v.mean(0),
        "perplexity": lambda v, w: np.exp(-v.mean(0)),
        "weighted_perplexity": lambda v, w: np.exp(-v.sum(0) / w.sum(0)),
        "bits_per_byte": lambda v, w: -v.sum(0) / (w.sum(0) * ln2),
    }
    return table.get(name)


def difference_ci(
    values: np.ndarray, weights: np.ndarray, aggregation: str, *, n_resamples: int, seed: int
) -> tuple[float, float]:
    """Paired bootstrap CI of aggregate(edited) - aggregate(unedited); ``values`` [2, item], ``weights`` [item]."""
    agg = aggregate(aggregation)
    if agg is None:
        return (math.nan, math.nan)
    low, high = paired_bootstrap_ci(
        values[1],
        values[0],
        weights,
        statistic=lambda e, b, w, axis=-1: (
            agg(np.moveaxis(e, axis, 0), np.moveaxis(w, axis, 0))
            - agg(np.moveaxis(b, axis, 0), np.moveaxis(w, axis, 0))
        ),
        n_resamples=n_resamples,
        seed=seed,
        what="per-item task scores",
    )
    return float(low), float(high)


def metric_unit(metric: str, aggregation: str) -> str:
    """The unit of a task metric as lm-eval aggregates it: ``fraction`` for a mean of 0/1 or [0, 1] scores (acc,
    exact match, pass@1, F1, RULER's score at a length), ``perplexity``, ``bits per byte``, else ``mean of
    <metric>`` (a log-likelihood, say)."""
    if aggregation in ("perplexity", "weighted_perplexity"):
        return "perplexity"
    if aggregation == "bits_per_byte":
        return "bits per byte"
    base = metric.split(",")[0]
    return "fraction" if base in (*BINARY_METRICS, "f1") or base.isdigit() else f"mean of {base}"


def score_metric(labels: Sequence[str]) -> str:
    """A task's score among its metric labels (``metric`` or ``metric,filter``), the one its figures show and the
    average over tasks takes: ``acc`` where it has one, else its first 0/1 metric (a generation task's exact match
    under its first filter, DROP's ``em``, ``pass_at_1``), else RULER's score at its first length (a metric named
    by the length), else its first."""
    binary = [m for m in labels if m.split(",")[0] in BINARY_METRICS or m.isdigit()]
    return "acc" if "acc" in labels else binary[0] if binary else labels[0]


def metric_labels(values: dict[str, np.ndarray], task: str) -> list[str]:
    """The metric labels (``metric`` or ``metric,filter``) of ``task`` among ``values``' keys (``task|label``)."""
    return [key.split("|", 1)[1] for key in values if key.split("|", 1)[0] == task]


def averages(tasks: Sequence[str], values: dict[str, np.ndarray]) -> dict[str, list[tuple[str, str]]]:
    """The averages over tasks and their members (task, metric label): ``acc`` over the tasks that have it (the
    directional-decomposition paper's pretrained average); RULER's score at each length (named by the length);
    and, over two tasks or more whose scores are not all acc, ``score``: each task's :func:`score_metric` (the
    paper's general average, e.g. GSM8K's exact match beside PIQA's acc)."""
    labels = {t: metric_labels(values, t) for t in tasks}
    out: dict[str, list[tuple[str, str]]] = {}
    for t in tasks:
        for label in labels[t]:
            if label == "acc" or label.isdigit():
                out.setdefault(label, []).append((t, label))
    scores = {t: score_metric(labels[t]) for t in tasks if labels[t]}
    if len(scores) > 1 and any(m != "acc" and not m.isdigit() for m in scores.values()):
        out["score"] = [(t, m) for t, m in scores.items() if not m.isdigit()]
    return out


def effects_table(
    tasks: Sequence[str],
    settings: Sequence[str],
    values: dict[str, np.ndarray],
    aggregations: dict[str, str],
    scores: dict[str, dict[str, dict[str, float]]],
    *,
    n_resamples: int,
    seed: int,
) -> dict[str, list[Any]]:
    rows: list[dict[str, Any]] = []
    for key, v in values.items():
        task, metric = key.split("|", 1)
        weights = v[0, :, 1] if v.ndim == 3 else np.ones(v.shape[1])
        item_values = v[..., 0] if v.ndim == 3 else v
        for s, setting in enumerate(settings[1:], 1):
            pair = item_values[[0, s]]
            low, high = difference_ci(pair, weights, aggregations[key], n_resamples=n_resamples, seed=seed)
            base, edited = scores[task][metric][UNEDITED], scores[task][metric][setting]
            binary = metric.split(",")[0] in BINARY_METRICS
            p = mcnemar_exact(pair[0], pair[1]) if binary else math.nan
            rows.append(
                {
                    "task": task,
                    "metric": metric,
                    "setting": setting,
                    "n_items": v.shape[1],
                    "unedited": base,
                    "edited": edited,
                    "difference": edited - base,
                    "ci_low": low,
                    "ci_high": high,
                    "p_mcnemar": p,
                }
            )
    frame = pd.DataFrame(rows)
    frame["p_holm"] = np.nan
    for metric in dict.fromkeys(frame["metric"]):
        sel = frame["metric"] == metric
        if metric.split(",")[0] in BINARY_METRICS:
            frame.loc[sel, "p_holm"] = holm(frame.loc[sel, "p_mcnemar"].to_numpy())
    for metric, members in averages(tasks, values).items():
        for s, setting in enumerate(settings[1:], 1):
            base = float(np.mean([scores[t][label][UNEDITED] for t, label in members]))
            edited = float(np.mean([scores[t][label][setting] for t, label in members]))
            pairs = [values[f"{t}|{label}"][[0, s]] for t, label in members]
            low, high = mean_of_means_ci(pairs, n_resamples=n_resamples, seed=seed)
            average = {
                "task": "average",
                "metric": metric,
                "setting": setting,
                "n_items": sum(values[f"{t}|{label}"].shape[1] for t, label in members),
                "unedited": base,
                "edited": edited,
                "difference": edited - base,
                "ci_low": low,
                "ci_high": high,
                "p_mcnemar": math.nan,
                "p_holm": math.nan,
            }
            frame = pd.concat([frame, pd.DataFrame([average])], ignore_index=True)
    return {c: frame[c].tolist() for c in frame.columns}
