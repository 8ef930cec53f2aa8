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

import html
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.bridges import check_model
from lens_parallel.choices import ContextForm
from lens_parallel.downstream.data import (
    LOCAL_TASKS,
    RULER_LENGTHS,
    check_task_names,
    code_executing,
    ruler_metadata,
)
from lens_parallel.downstream.loading import load_tasks, say_stand_ins, task_description
from lens_parallel.downstream.presets import TaskList, resolve_tasks
from lens_parallel.downstream.running import code_execution, run_tasks
from lens_parallel.downstream.samples import short_context
from lens_parallel.downstream.scoring import Scored, pooled_group, scored_task
from lens_parallel.downstream.settings import TaskSettings, check_for_model, check_generation_room
from lens_parallel.downstream.tables import (
    BINARY_METRICS,
    averages,
    effects_table,
    metric_labels,
    metric_unit,
    score_metric,
)
from lens_parallel.edits import UNEDITED, Settings, compile_hooks, describe_edit, named_edits
from lens_parallel.errors import LensParallelError, long_call
from lens_parallel.models import model_info, weights_digest
from lens_parallel.options import RunOptions, refuse_renamed, resolve
from lens_parallel.paths import check_writable
from lens_parallel.plots.texts import html_page, texts_table
from lens_parallel.results import Provenance, ResultMixin
from lens_parallel.sandbox import Fence, sandbox_fence
from lens_parallel.stats import N_RESAMPLES, mean_of_means_ci
from lens_parallel.tokenizers import hf_tokenizer
from lens_parallel.validate import check_choice

# -- the result --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, repr=False, kw_only=True)
class TaskResult(ResultMixin):
    """Per task, item and setting the scores of lm-eval's metrics; ``settings[0]`` is the unedited baseline.

    ``values[f"{task}|{metric}"]``: [setting, item] (a weighted metric, e.g. word perplexity: [setting, item, 2],
    the log-likelihood and its words / bytes); ``aggregations``: lm-eval's aggregation of each; ``scores``: lm-eval's
    own aggregate per task, metric and setting; ``effects``: the paired comparisons (:meth:`differences`);
    ``truncated[task][setting]``: how many of the task's items had a context cut to fit the model (lm-eval's
    left-truncation); ``stand_ins``: the offline tasks that stood in for a preset's tasks whose data could not be
    reached (stand-in -> lm-eval's task); ``contexts[task]``: each item's context (doc-id order) and
    ``answers[task]``: what the model answered, per item and setting (:mod:`~lens_parallel.downstream.samples`; read
    them with :meth:`samples`).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> result = lp.task_effects(model, lp.ZeroDiagonal(layers=[0]), "quick", limit=2, progress=False)
        >>> "task" in result.to_dataframe().columns
        True
    """

    columns: ClassVar[str] = (
        "task doc_id setting <metric> model tasks average_<metric>_difference[<setting>] "
        "average_<metric>_difference_lo[<setting>] average_<metric>_difference_hi[<setting>]"
    )

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
            metrics = metric_labels(self.values, task)
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
        metrics = {t: score_metric(metric_labels(self.values, t)) for t in self.tasks}
        return {t: m for t, m in metrics.items() if m.split(",")[0] in BINARY_METRICS or m.isdigit()}

    def table(self) -> pd.DataFrame:
        """The directional-decomposition paper's table: one row per setting, each task's score
        (:func:`score_metric`, percent, lm-eval's aggregate) and the average over tasks (``score``, else ``acc``)
        with its 95% CI (items resampled within each task), then the paired difference to the unedited model
        (percentage points) with its CI; each task named by :meth:`shown_name`."""
        by_average = averages(self.tasks, self.values)
        name = "score" if "score" in by_average else "acc" if "acc" in by_average else None
        if name is None:
            raise LensParallelError("no task of this result has a score to average (acc or a 0/1 metric)")
        members = by_average[name]
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


@long_call
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
    ``store``: resumable, ``progress``). Every name, edit and option is checked before the first forward.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> result = lp.task_effects(model, lp.ZeroDiagonal(layers=[0]), "quick", limit=2, progress=False)
        >>> type(result).__name__
        'TaskResult'
    """
    info = check_model(model)
    refuse_renamed(changes, {"task_settings": "settings"}, where="task_effects")
    s, opts = resolve(TaskSettings, settings, options, protocol, changes)
    named = named_edits(edits, info)
    plan, preset = resolve_tasks(tasks)
    lengths = s.max_seq_lengths or (preset.max_seq_lengths if preset is not None else None) or RULER_LENGTHS
    check_for_model(model, s, [name for name, _ in plan], lengths)
    for edits in named.values():  # each edit checked against the model now, not after the baseline's run
        compile_hooks(model, edits)
    if opts.store is not None:
        check_writable(opts.store, "store")
    check_task_names([name for name, _ in plan])
    plan, left_out, fence = _code_tasks(plan, s, from_preset=preset is not None)
    limit = s.limit if s.limit is not None else None if preset is None else preset.limit
    metadata = ruler_metadata([name for name, _ in plan], hf_tokenizer(model), lengths)
    loaded, runs = _run_settings(model, named, plan, metadata, s, opts, limit=limit, substitute=preset is not None)
    task_objects, reported = loaded.tasks, loaded.reported
    setting_names = tuple(runs)
    leaf: dict[str, Scored] = {t: scored_task(t, task_objects[t], runs, setting_names) for t in task_objects}
    pooled = {name: parts for name, parts in reported if name not in task_objects}
    scored = {
        name: pooled_group([leaf[t] for t in parts]) if name in pooled else leaf[name] for name, parts in reported
    }
    names = tuple(scored)
    values = {f"{t}|{label}": v for t, x in scored.items() for label, v in x.values.items()}
    aggregations = {f"{t}|{label}": agg for t, x in scored.items() for label, agg in x.aggregations.items()}
    scores = {t: x.scores for t, x in scored.items()}
    effects = effects_table(names, setting_names, values, aggregations, scores, n_resamples=s.n_resamples, seed=s.seed)
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
                t: task_description(t, configs[t], len(leaf[t].doc_ids), int(runs[UNEDITED]["n-shot"][t]))
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
        sandbox=None if fence is None else fence.describe(),
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


def _run_settings(
    model: TransformerBridge,
    named: dict[str, Any],
    plan: list[tuple[str, int | None]],
    metadata: Any,
    s: TaskSettings,
    opts: RunOptions,
    *,
    limit: int | None,
    substitute: bool,
) -> tuple[Any, dict[str, Any]]:
    """lm-eval's tasks loaded once (``substitute``: offline stand-ins for a preset's missing ones, said in one line)
    and run on the unedited model, then under each of ``named``: the loaded tasks and each setting's run."""
    weights = None if opts.store is None else weights_digest(model)  # once: it reads every weight
    runs = {}
    with code_execution(s.allow_code_execution):  # lm-eval's code tasks check code execution as they load
        loaded = load_tasks(plan, s.num_fewshot, metadata, substitute=substitute)
        check_generation_room(model, s, loaded.tasks)
        say_stand_ins(loaded, len(loaded.reported))
        for name, edits in {UNEDITED: (), **named}.items():
            runs[name] = run_tasks(
                model, edits, loaded.manager, loaded.tasks, s=s, opts=opts, limit=limit, desc=name, weights=weights
            )
    return loaded, runs


def _code_tasks(
    plan: list[tuple[str, int | None]], s: TaskSettings, *, from_preset: bool
) -> tuple[list[tuple[str, int | None]], list[str], Fence | None]:
    """The tasks that run the code the model writes, before any forward: refused unless ``allow_code_execution``
    (a preset's are left out, with a warning, and named in ``left_out``), and refused where lm-eval would run them
    outside the sandbox; with it, this machine's sandbox (:func:`~lens_parallel.sandbox.sandbox_fence`, one line
    where it cannot run). Returns the plan to run, what was left out, and the fence."""
    unsafe = code_executing([name for name, _ in plan])
    if unsafe and not s.allow_code_execution and not from_preset:
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
    if not unsafe:
        return plan, [], None
    if s.allow_code_execution:
        return plan, [], sandbox_fence()
    why = "runs the code the model writes: pass allow_code_execution=True"
    warnings.warn(f"{', '.join(unsafe)} left out of the preset: {why}", stacklevel=3)
    return [(name, k) for name, k in plan if name not in unsafe], unsafe, None


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
