"""lm-eval's logged samples of every run turned into per-item values: one reported task's items by metric label
and setting (:class:`Scored`), a size-weighted group pooled into one task."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lens_parallel.downstream.samples import task_answers
from lens_parallel.edits import UNEDITED


def _doc_id(row: dict[str, Any]) -> int:
    return int(row["doc_id"])


def _item_values(samples: list[dict[str, Any]], metric: str) -> np.ndarray:
    return np.asarray([np.asarray(row[metric], dtype=np.float64) for row in samples])


@dataclass(frozen=True)
class Scored:
    """One reported task's per-item values by metric label ``[setting, item]``, their aggregations, lm-eval's
    score per label and setting, and the items' doc ids."""

    doc_ids: np.ndarray
    values: dict[str, np.ndarray]
    aggregations: dict[str, str]
    scores: dict[str, dict[str, float]]
    contexts: list[str]
    answers: dict[str, list[Any]]


def scored_task(task: str, task_object: Any, runs: dict[str, Any], settings: Sequence[str]) -> Scored:
    """One task's items from every run's logged samples (a generation task once per filter: ``metric,filter``)."""
    samples = runs[UNEDITED]["samples"][task]
    values: dict[str, np.ndarray] = {}
    aggregations: dict[str, str] = {}
    scores: dict[str, dict[str, float]] = {}
    doc_ids = np.zeros(0, dtype=np.int64)
    for flt in dict.fromkeys(row.get("filter", "none") for row in samples):
        per_setting = {
            k: sorted((row for row in runs[k]["samples"][task] if row.get("filter", "none") == flt), key=_doc_id)
            for k in settings
        }
        doc_ids = np.asarray([row["doc_id"] for row in per_setting[UNEDITED]])
        for metric, agg in task_object.aggregation().items():
            if per_setting[UNEDITED] and metric not in per_setting[UNEDITED][0]:
                continue  # RULER declares a metric per length (4096 ... 131072): only the lengths asked for are scored
            if metric.isdigit() and all(row[metric] == -1 for k in settings for row in per_setting[k]):
                continue  # RULER's items carry its default length as -1 ("no sample at this length"): not run
            label = metric if flt == "none" else f"{metric},{flt}"
            values[label] = np.stack([_item_values(per_setting[k], metric) for k in settings])
            aggregations[label] = getattr(agg, "__name__", str(agg))
            scores[label] = {k: float(runs[k]["results"][task][f"{metric},{flt}"]) for k in settings}
    contexts, answers = task_answers(task_object, {k: runs[k]["samples"][task] for k in settings}, settings)
    return Scored(doc_ids, values, aggregations, scores, contexts, answers)


def pooled_group(members: Sequence[Scored]) -> Scored:
    """A size-weighted group (:func:`_poolable`) as one task: its members' items side by side (doc ids numbered
    across them), scored by the mean over all items, which is lm-eval's size-weighted mean of the members' means."""
    labels = [label for label in members[0].values if all(label in m.values for m in members)]
    values = {label: np.concatenate([m.values[label] for m in members], axis=1) for label in labels}
    settings = list(members[0].scores[labels[0]]) if labels else []
    offsets = np.cumsum([0] + [len(m.contexts) for m in members])
    columns = list(dict.fromkeys(c for m in members for c in m.answers))
    answers: dict[str, list[Any]] = {c: [] for c in columns}
    for m, offset in zip(members, offsets, strict=False):
        n = len(m.answers["item"])
        for c in columns:
            got = m.answers.get(c, [None] * n)
            answers[c] += [int(i) + int(offset) for i in got] if c == "item" else list(got)
    return Scored(
        doc_ids=np.arange(sum(len(m.doc_ids) for m in members)),
        values=values,
        aggregations=dict.fromkeys(labels, "mean"),
        scores={label: {k: float(values[label][i].mean()) for i, k in enumerate(settings)} for label in labels},
        contexts=[c for m in members for c in m.contexts],
        answers=answers,
    )
