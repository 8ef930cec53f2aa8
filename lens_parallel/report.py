"""The standard battery of analyses on one or several models, and one self-contained HTML report.

Battery (:func:`run_battery`), per model, on the same token blocks:

1. decomposition in every space (:func:`~lens_parallel.analyses.decompose.decompose`, ``space="all"``);
2. a scaling sweep: s_par in {0, 0.5, 1.5} and s_perp = 0.5 in value-exclude-self and residual-attn, all layers;
3. diagonal views (s_par = 0) of the two heads with the highest mean value-space self-cosine;
4. layer sensitivity: each head's parallel part removed alone, and all heads of a layer jointly;
5. attribution screening of every head (one forward + one backward per batch) for the same removal, its top 10
   heads and 10 random others confirmed exactly (from the sensitivity sweep's shared store: no extra forward);
6. sanity checks: causal null (GQA within/across groups for grouped-query models), split-half reliability;
7. opt-in (``tasks=``): downstream tasks through lm-evaluation-harness under the further edits (or, without any,
   value-parallel removal), :func:`~lens_parallel.downstream.effects.task_effects`.

:func:`write_report` writes ``report.html`` (plotly.js inlined once, every figure embedded: it opens offline) and
the tables (CSV) beside it. Several models give a side-by-side report: one column per model in every section.
"""

from __future__ import annotations

import dataclasses
import html
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.analyses.attribution import AttributionResult, head_attribution
from lens_parallel.analyses.confirm import ConfirmResult, confirm
from lens_parallel.analyses.decompose import DecompositionResult, decompose
from lens_parallel.analyses.diagonal import DiagonalView, diagonal_view
from lens_parallel.analyses.evaluate import evaluate
from lens_parallel.analyses.reliability import SanityReport, check_documents, sanity_report
from lens_parallel.analyses.scaling import ScalingResult, scale_sweep
from lens_parallel.analyses.sensitivity import SensitivityResult, head_sensitivity
from lens_parallel.bridges import check_model
from lens_parallel.choices import Space
from lens_parallel.documents import Documents, DocumentsLike
from lens_parallel.downstream.data import check_task_names
from lens_parallel.downstream.effects import TaskResult, task_effects
from lens_parallel.downstream.presets import resolve_tasks
from lens_parallel.edits import ComponentScale, Edit, as_edits, describe_edit
from lens_parallel.errors import long_call
from lens_parallel.hooks import head_layers
from lens_parallel.losses import EditEffect
from lens_parallel.models import model_info
from lens_parallel.options import RunOptions, resolve
from lens_parallel.paths import write_atomic, write_table
from lens_parallel.plots.comparison import comparison_figure
from lens_parallel.results import Provenance, Result, ResultMixin
from lens_parallel.spaces import HEAD_SPACES
from lens_parallel.store import quiet_stores
from lens_parallel.validate import as_tuple, check_choices, check_non_negative_int, check_positive_int

SECTIONS = {
    "decomposition": "Decomposition: how much of each message lies along its own reference (value v_t, residual x_t)",
    "scaling": "Component scaling: loss change when the parallel / perpendicular part is rescaled (all layers)",
    "diagonal": "Attention-diagonal form of parallel removal, for the most self-aligned heads",
    "sensitivity": "Layer sensitivity: removing each head's parallel part, alone and jointly",
    "attribution": "Attribution screening: every head from one backward pass, the top heads confirmed exactly",
    "sanity": "Sanity checks: causal null, GQA groups, split-half reliability",
    "edits": "Further edits (built-in or user-defined): loss change against the matched no-op",
    "tasks": "Downstream tasks (lm-evaluation-harness) under the edits, paired per item (opt-in: tasks=...)",
}
T = TypeVar("T")


@dataclass(frozen=True, repr=False)
class ModelReport(ResultMixin):
    """One model's battery: every result, and the seconds each step took.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=8, seq_len=16)
        >>> report = lp.run_battery(model, docs, progress=False)
        >>> isinstance(report, lp.ModelReport)
        True
    """

    columns: ClassVar[str] = " ".join(
        [
            "section",
            *(cls.columns for cls in (DecompositionResult, ScalingResult, DiagonalView, SensitivityResult)),
            *(cls.columns for cls in (ConfirmResult, SanityReport, EditEffect, TaskResult)),
            "family n_layers n_heads n_kv_heads self_cos_<space> delta_loss_s_par0_<space> attribution_spearman",
            "seconds",
        ]
    )
    """The columns of :meth:`to_dataframe` (each section's rows, in its result's columns) and :meth:`summary`,
    space-separated (:mod:`lens_parallel.glossary` defines each)."""

    name: str
    decomposition: DecompositionResult
    scaling: ScalingResult
    diagonal: tuple[DiagonalView, ...]
    sensitivity: SensitivityResult
    sanity: SanityReport
    seconds: dict[str, float] = field(default_factory=dict)
    screen: AttributionResult | None = None
    confirmation: ConfirmResult | None = None
    edit_effects: tuple[EditEffect, ...] = ()
    tasks: TaskResult | None = None

    @property
    def provenance(self) -> Provenance:
        return self.decomposition.provenance

    def summary(self) -> pd.DataFrame:
        """One row: the model, its attention shape, the headline numbers of every section."""
        info = self.decomposition.info
        dec = self.decomposition.to_dataframe()
        heads = dec[dec["level"] == "head"].groupby("space")["self_cos"].mean()
        scale = self.scaling.to_dataframe()
        removal = scale[(scale["vary"] == "s_par") & (scale["s_par"] == 0.0)].set_index("space")["delta_loss"]
        sens = self.sensitivity.to_dataframe()
        joint = sens[sens["head"].isna()].set_index("layer")["delta_loss"]
        row = {
            "model": self.name,
            "family": info.family,
            "n_layers": info.n_layers,
            "n_heads": info.n_heads,
            "n_kv_heads": info.n_kv_heads,
            "loss_noop": scale["loss_noop"].iloc[0],
        }
        row |= {f"self_cos_{space}": heads.get(space) for space in HEAD_SPACES}
        row |= {f"delta_loss_s_par0_{space}": removal.get(space) for space in dict.fromkeys(scale["space"])}
        row |= {"most_sensitive_layer": int(joint.idxmax()), "max_joint_delta_loss": joint.max()}
        if self.confirmation is not None:
            row |= {"attribution_spearman": self.confirmation.spearman}
        row |= self.sanity.headline()
        return pd.DataFrame([row | {"seconds": sum(self.seconds.values())}])

    def tables(self) -> dict[str, pd.DataFrame]:
        """Each section's tidy table."""
        return {
            "decomposition": self.decomposition.to_dataframe(),
            "scaling": self.scaling.to_dataframe(),
            "diagonal": pd.concat([v.to_dataframe() for v in self.diagonal], ignore_index=True),
            "sensitivity": self.sensitivity.to_dataframe(),
            "attribution": self.confirmation.to_dataframe() if self.confirmation else pd.DataFrame(),
            "sanity": self.sanity.to_dataframe(),
            "edits": pd.concat(
                [e.to_dataframe().assign(edit=_edit_label(e)) for e in self.edit_effects], ignore_index=True
            )
            if self.edit_effects
            else pd.DataFrame(),
            "tasks": self.tasks.differences() if self.tasks is not None else pd.DataFrame(),
        }

    def to_dataframe(self) -> pd.DataFrame:
        """Every section's tidy table, stacked, with a ``section`` column."""
        return pd.concat([df.assign(section=s) for s, df in self.tables().items()], ignore_index=True)

    def results(self) -> dict[str, Result]:
        """Every result of the battery by section (diagonal views as ``diagonal_<i>``)."""
        out: dict[str, Result] = {
            "decomposition": self.decomposition,
            "scaling": self.scaling,
            "sensitivity": self.sensitivity,
            "sanity": self.sanity,
        }
        out |= {f"diagonal_{i}": v for i, v in enumerate(self.diagonal)}
        out |= self._attribution() | {f"edit_{i}": e for i, e in enumerate(self.edit_effects)}
        return out | ({"tasks": self.tasks} if self.tasks is not None else {})

    def _attribution(self) -> dict[str, Result]:
        pair = {"attribution": self.screen, "attribution_confirm": self.confirmation}
        return {k: v for k, v in pair.items() if v is not None}

    def save_sections(self, folder: str | Path) -> list[Path]:
        """Every result as its own JSON + npz (with its provenance): ``folder/<model>_<section>.json``."""
        stem = self.name.replace("/", "_")
        return [result.save(Path(folder) / f"{stem}_{section}") for section, result in self.results().items()]

    def section_figures(self) -> dict[str, list[go.Figure]]:
        """The figures of each report section."""
        return {
            "decomposition": [self.decomposition.figure()],
            "scaling": [self.scaling.figure()],
            "diagonal": [v.figure() for v in self.diagonal],
            "sensitivity": [self.sensitivity.figure()],
            "attribution": [r.figure() for r in self._attribution().values()],
            "sanity": [self.sanity.figure()],
            "edits": [e.figure() for e in self.edit_effects],
            "tasks": list(self.tasks.figures().values()) if self.tasks is not None else [],
        }

    def figures(self) -> dict[str, go.Figure]:
        """The summary comparison, then every section's figures by name."""
        named = {"summary": self.figure()}
        for section, figs in self.section_figures().items():
            named |= {section: figs[0]} if len(figs) == 1 else {f"{section}_{i}": f for i, f in enumerate(figs)}
        return named

    def figure(self) -> go.Figure:
        return comparison_figure(self.summary())


def _edit_label(effect: EditEffect) -> str:
    """An evaluated intervention as text: each edit's type and fields (from the effect's provenance)."""
    described = effect.provenance.settings["edits"] if effect.provenance else []

    def one(d: dict[str, Any]) -> str:
        return f"{d['type'].rsplit('.', 1)[-1]}({', '.join(f'{k}={v}' for k, v in d.items() if k != 'type')})"

    return " + ".join(one(d) for d in described)


def strongest_parallel_heads(result: DecompositionResult, k: int = 2) -> list[tuple[int, int]]:
    """The ``k`` (layer, head) pairs with the highest mean value-space self-cosine."""
    df = result.to_dataframe()
    df = df[(df["space"] == "value") & (df["level"] == "head")].nlargest(k, "self_cos")
    return [(int(r.layer), int(r.head)) for r in df.itertuples()]


@dataclass(frozen=True, kw_only=True)
class ReportSettings:
    """What the battery computes beyond its fixed sections: ``seed`` (null draws, bootstrap, halves, the random
    heads confirmed) and ``edits``, further interventions (built-in or user-defined, each one
    :class:`~lens_parallel.edits.Edit` or a tuple of them as one intervention) evaluated against their matched
    no-op in the "edits" section.

    Examples:
        >>> import lens_parallel as lp
        >>> lp.ReportSettings(tasks=("quick",)).tasks
        ('quick',)
    """

    seed: int = field(default=0, metadata={"help": "seed of the null draws, the bootstrap and the halves"})
    edits: tuple[Any, ...] = field(default=(), metadata={"help": "further edits (Python only)", "cli": False})
    tasks: tuple[str, ...] = field(
        default=(), metadata={"help": "downstream tasks under the edits (a preset or task names; the tasks extra)"}
    )
    task_limit: int | None = field(default=40, metadata={"help": "items per task", "none": "all"})
    scale_space: tuple[Space, ...] = field(
        default=("value-exclude-self", "residual-attn"), metadata={"help": "spaces of the scaling section"}
    )
    scale_s_par: tuple[float, ...] = field(default=(0.0, 0.5, 1.5), metadata={"help": "s_par of the scaling section"})
    scale_s_perp: tuple[float, ...] = field(default=(0.5,), metadata={"help": "s_perp of the scaling section"})
    diagonal_heads: int = field(default=2, metadata={"help": "most self-aligned heads given a diagonal view"})
    confirm_heads: int = field(
        default=10, metadata={"help": "top attribution heads (and as many random ones) confirmed exactly"}
    )

    def __post_init__(self) -> None:
        check_non_negative_int("seed", self.seed)
        object.__setattr__(self, "scale_space", check_choices("scale_space", as_tuple(self.scale_space), Space))
        check_positive_int("diagonal_heads", self.diagonal_heads)
        check_positive_int("confirm_heads", self.confirm_heads)
        for edit in self.edits:
            as_edits(edit)
        if self.task_limit is not None:
            check_positive_int("task_limit", self.task_limit)

    def record(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "edits": [[describe_edit(e) for e in as_edits(x)] for x in self.edits],
            "tasks": list(self.tasks),
            "task_limit": self.task_limit,
            "scale_space": list(self.scale_space),
            "scale_s_par": list(self.scale_s_par),
            "scale_s_perp": list(self.scale_s_perp),
            "diagonal_heads": self.diagonal_heads,
            "confirm_heads": self.confirm_heads,
        }

    def task_edits(self) -> dict[str, tuple[Edit, ...]]:
        """The settings the tasks section scores: each further edit, or value-parallel removal without any."""
        if not self.edits:
            return {"value-parallel removal": (ComponentScale("value", s_par=0.0),)}
        return {
            f"{i}: {'+'.join(type(e).__name__ for e in as_edits(x))}": as_edits(x) for i, x in enumerate(self.edits)
        }


def check_battery(documents: Documents, settings: ReportSettings, options: RunOptions) -> None:
    """The settings every step of :func:`run_battery` checks, checked together before the first forward: the
    documents (split-half reliability needs :data:`~lens_parallel.analyses.reliability.MIN_DOCUMENTS`), the
    settings and run options (checked on construction) and, with a tasks section, the task names."""
    check_documents(len(documents))
    if settings.tasks:
        plan, _ = resolve_tasks(settings.tasks[0] if len(settings.tasks) == 1 else list(settings.tasks))
        check_task_names([name for name, _ in plan])


@long_call
def run_battery(
    model: TransformerBridge,
    documents: DocumentsLike,
    *,
    settings: ReportSettings | None = None,
    options: RunOptions | None = None,
    protocol: str | None = None,
    **changes: Any,
) -> ModelReport:
    """Run the sections on ``model`` (see the module docstring; :class:`ReportSettings`, run options
    :class:`~lens_parallel.options.RunOptions`); every setting is checked first (:func:`check_battery`).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=8, seq_len=16)
        >>> report = lp.run_battery(model, docs, progress=False)
    """
    check_model(model)
    s, opts = resolve(ReportSettings, settings, options, protocol, changes)
    head_layers(model_info(model), None, what="the report's battery (diagonal views, head ablations, the nulls)")
    docs = Documents.of(documents, model)
    check_battery(docs, s, opts)
    seconds: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], T]) -> T:
        t0 = time.perf_counter()
        out = fn()
        seconds[name] = time.perf_counter() - t0
        return out

    dec = timed("decomposition", lambda: decompose(model, docs, space="all", options=opts))
    scaling = timed(
        "scaling",
        lambda: scale_sweep(
            model, docs, space=s.scale_space, s_par=s.scale_s_par, s_perp=s.scale_s_perp, seed=s.seed, options=opts
        ),
    )
    heads = strongest_parallel_heads(dec, s.diagonal_heads)
    views = timed(
        "diagonal",
        lambda: tuple(diagonal_view(model, docs, layer=lay, head=h, options=opts) for lay, h in heads),
    )
    # sensitivity's single-head jobs are split-half's: run them once, in a store of the report's own (silent)
    with tempfile.TemporaryDirectory() as store, quiet_stores():
        shared = dataclasses.replace(opts, store=str(Path(store) / "ablations.jsonl"))
        sens = timed(  # the sanity checks' positions (first token untouched, as the paper), so the sweep is shared
            "sensitivity",
            lambda: head_sensitivity(model, docs, positions="after-first", seed=s.seed, options=shared),
        )
        screen = timed("attribution", lambda: head_attribution(model, docs, positions="after-first", options=opts))
        n_heads = screen.estimate.shape[1] * screen.estimate.shape[2]
        k = min(s.confirm_heads, n_heads // 2)
        confirmation = timed(  # its exact jobs are sensitivity's, already in the shared store
            "confirm",
            lambda: confirm(
                model, docs, screen, top_k=k, n_random=min(s.confirm_heads, n_heads - k), seed=s.seed, options=shared
            ),
        )
        sanity = timed("sanity", lambda: sanity_report(model, docs, seed=s.seed, options=shared))
    effects = timed("edits", lambda: tuple(evaluate(model, docs, edit, seed=s.seed, options=opts) for edit in s.edits))
    tasks = None
    if s.tasks:
        plan = s.tasks[0] if len(s.tasks) == 1 else list(s.tasks)
        task_opts = dataclasses.replace(opts, store=None)
        tasks = timed(
            "tasks",
            lambda: task_effects(model, s.task_edits(), plan, limit=s.task_limit, seed=s.seed, options=task_opts),
        )
    return ModelReport(
        name=model_info(model).name,
        decomposition=dec,
        scaling=scaling,
        diagonal=views,
        sensitivity=sens,
        sanity=sanity,
        seconds=seconds,
        screen=screen,
        confirmation=confirmation,
        edit_effects=effects,
        tasks=tasks,
    )


_CSS = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1500px; color: #222; }
h1 { font-size: 1.6em; } h2 { margin-top: 2em; border-bottom: 1px solid #ccc; }
nav a { margin-right: 1.2em; } .grid { display: grid; gap: 16px; }
table { border-collapse: collapse; font-size: 0.85em; margin: 8px 0; } td, th { padding: 3px 8px; }
th { background: #f2f2f2; } tr:nth-child(even) { background: #fafafa; } .note { color: #555; font-size: 0.9em; }
.scroll { overflow-x: auto; max-height: 420px; overflow-y: auto; } .figure { overflow-x: auto; }
.whole .scroll { max-height: none; }
"""

MIN_FIGURE_WIDTH = 720
"""The narrowest a figure is drawn in a side-by-side column (px): below it its column scrolls, so that titles,
legends and colour bars never run into each other."""


def _figure_html(fig: go.Figure, responsive: bool) -> str:
    """A figure as HTML: at its own width, or (``responsive``, a side-by-side column) filling its column but never
    narrower than its own width or :data:`MIN_FIGURE_WIDTH`, whichever is less (the column scrolls instead)."""
    least = min(fig.layout.width or MIN_FIGURE_WIDTH, MIN_FIGURE_WIDTH)
    if responsive:
        fig = go.Figure(fig).update_layout(width=None, autosize=True)
    html: str = pio.to_html(fig, full_html=False, include_plotlyjs=False, config={"responsive": True})
    return f'<div class="figure"><div style="min-width: {least}px">{html}</div></div>' if responsive else html


def _by_model(summary: pd.DataFrame) -> pd.DataFrame:
    """The summary with one column per model and one row per quantity (it has many more quantities than models:
    read down, it fits a page at any width)."""
    shown = summary.set_index("model").T.map(lambda x: f"{x:.4g}" if isinstance(x, float) else x)
    return shown.rename_axis(index="quantity", columns=None).reset_index()


def _table_html(df: pd.DataFrame, max_rows: int = 60) -> str:
    body = df.head(max_rows).to_html(index=False, float_format=lambda x: f"{x:.4g}", na_rep="", border=0)
    more = f'<p class="note">first {max_rows} of {len(df)} rows; all rows in the CSV</p>' if len(df) > max_rows else ""
    return f'<div class="scroll">{body}</div>{more}'


def write_report(reports: Sequence[ModelReport], out: str | Path, *, settings: dict[str, Any] | None = None) -> Path:
    """Write ``out/report.html``, ``out/tables/<model>_<section>.csv`` (+ ``summary.csv``) and every result with its
    provenance under ``out/results/``; returns the HTML's path.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=8, seq_len=16)
        >>> report = lp.run_battery(model, docs, progress=False)
        >>> lp.write_report([report], "results/report").name
        'report.html'
    """
    out = Path(out)
    (out / "tables").mkdir(parents=True, exist_ok=True)
    summary = pd.concat([r.summary() for r in reports], ignore_index=True)
    write_table(summary, out / "tables" / "summary.csv")
    tables = {r.name: r.tables() for r in reports}  # built once: every section reads them
    figures = {r.name: r.section_figures() for r in reports}
    for r in reports:
        for section, df in tables[r.name].items():
            write_table(df, out / "tables" / f"{r.name.replace('/', '_')}_{section}.csv")
        r.save_sections(out / "results")
    side_by_side = len(reports) > 1
    cols = f"grid-template-columns: repeat({len(reports)}, minmax(0, 1fr));"
    parts = [f"<h1>lens_parallel report: {html.escape(', '.join(r.name for r in reports))}</h1>"]
    if settings:
        parts.append(f'<p class="note">{html.escape(", ".join(f"{k}: {v}" for k, v in settings.items()))}</p>')
    parts.append("<nav>" + "".join(f'<a href="#{s}">{s}</a>' for s in ["summary", *SECTIONS]) + "</nav>")
    whole = f'<div class="whole">{_table_html(_by_model(summary))}</div>'  # every row shown: no inner scroll
    parts.append(f'<section id="summary"><h2>Summary</h2>{whole}</section>')
    for section, title in SECTIONS.items():
        columns = []
        for r in reports:
            figs = "".join(_figure_html(f, side_by_side) for f in figures[r.name][section])
            columns.append(f"<div><h3>{html.escape(r.name)}</h3>{figs}{_table_html(tables[r.name][section], 12)}</div>")
        parts.append(
            f'<section id="{section}"><h2>{html.escape(title)}</h2>'
            f'<div class="grid" style="{cols}">{"".join(columns)}</div></section>'
        )
    page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>lens_parallel report</title>'
        f"<style>{_CSS}</style><script>{get_plotlyjs()}</script></head><body>{''.join(parts)}</body></html>"
    )
    path = out / "report.html"
    write_atomic(path, lambda f: f.write(page.encode()))
    return path
