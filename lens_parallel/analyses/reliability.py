"""Split-half reliability of per-head statistics and per-head intervention effects, and the sanity report.

Documents are split (seeded) into two disjoint halves. In each half: the per-head self-cosine and causal-null
excess (:func:`causal_null`) and the per-head intervention effect (Δ next-token loss of ablating that head alone,
on the ablation engine). Both are per-document quantities, so each runs once over all documents and is split by
half afterwards (the sanity report reuses its own null pass). Across heads, Spearman between halves gives r_stat
(of the statistic) and r_delta (of the effect), with no Spearman-Brown correction; the ceiling on how well the
statistic can predict the effect is rho_max = sqrt(r_delta r_stat); rho_raw = Spearman(statistic, effect) on the
two halves' means; disattenuated rho = rho_raw / rho_max, which the paper calls "a diagnostic, not a calibrated
estimate" (pooled numerator, half-sample denominator); the cross-half variant (statistic of one half against the
effect of the other) is beside it in :meth:`SplitHalfResult.correlation_table`. Verdict on r_delta: reliable
(>= 0.6), attenuated (>= 0.3), else unresolvable.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.analyses.nulls import NullResult, NullSettings, causal_null, gqa_alignment, is_grouped
from lens_parallel.analyses.registry import Analysis
from lens_parallel.bridges import check_model
from lens_parallel.choices import Ablation, EditPositions, Null
from lens_parallel.distributed import check_workers
from lens_parallel.documents import Documents, DocumentsLike
from lens_parallel.edits import LINEAR_ABLATIONS, check_positions
from lens_parallel.errors import LensParallelError, long_call
from lens_parallel.hooks import softmax_layers
from lens_parallel.models import model_info
from lens_parallel.options import RunOptions, resolve
from lens_parallel.plots.nulls import sanity_figure, split_half_figure
from lens_parallel.results import Provenance, ResultMixin, head_frame
from lens_parallel.stats import SPLIT_HALF_METHODS, split_half_correlations
from lens_parallel.sweep import AblationJob, run_sweep
from lens_parallel.validate import check_choice, check_non_negative_int

STATISTICS = ("cos_self", "excess")
HEADLINE = (
    "cos_self",
    "cos_null",
    "excess",
    "self_specific_fraction",
    "within_excess",
    "across_excess",
    "r_stat_excess",
    "r_delta_excess",
    "rho_max_excess",
    "verdict_excess",
)
"""The columns of :meth:`SanityReport.summary` that headline a model (the GQA ones only with several kv heads)."""


def verdict(r_delta: float) -> str:
    """reliable (r_delta >= 0.6), attenuated (>= 0.3), unresolvable otherwise (NaN included)."""
    if r_delta >= 0.6:
        return "reliable"
    return "attenuated" if r_delta >= 0.3 else "unresolvable"


@dataclass(frozen=True, repr=False)
class SplitHalfResult(ResultMixin):
    """Per-head values in each half, ``[half, layer, head]``: ``cos_self``, ``excess``, ``delta`` (nats/token).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=8, seq_len=16)
        >>> rel = lp.split_half_reliability(model, docs, progress=False)
        >>> fig = rel.figure()
    """

    columns: ClassVar[str] = (
        "model layer head kv_head label layer_type ablation half cos_self excess delta_loss r_stat_cos_self "
        "r_delta_cos_self rho_max_cos_self rho_raw_cos_self rho_disattenuated_cos_self verdict_cos_self "
        "r_stat_excess r_delta_excess rho_max_excess rho_raw_excess rho_disattenuated_excess verdict_excess"
    )

    ablation: Ablation
    layers: tuple[int, ...]
    halves: tuple[tuple[int, ...], tuple[int, ...]]
    cos_self: np.ndarray
    excess: np.ndarray
    delta: np.ndarray
    provenance: Provenance

    def correlations(self, statistic: str = "excess", *, method: str = "pooled") -> dict[str, float | str]:
        """r_stat, r_delta, rho_max, rho_raw, rho_disattenuated and the verdict for one statistic
        (:func:`~lens_parallel.stats.split_half_correlations`: ``pooled`` is the paper's diagnostic, ``cross-half``
        correlates the statistic of one half with the effect of the other)."""
        out = split_half_correlations(getattr(self, statistic), self.delta, method=method)
        return out | {"verdict": verdict(out["r_delta"])}

    def to_dataframe(self) -> pd.DataFrame:
        """Full resolution: one row per (half, layer, head) with that half's cos_self, excess and delta."""
        values = {"cos_self": self.cos_self, "excess": self.excess, "delta_loss": self.delta}
        return head_frame(self.info, self.layers, values, front={"ablation": self.ablation}, outer=("half", ["A", "B"]))

    def correlation_table(self) -> pd.DataFrame:
        """One row per statistic and method (``pooled``: the paper's diagnostic; ``cross-half``) with its split-half
        correlations."""
        return pd.DataFrame(
            [
                {
                    "model": self.info.name,
                    "ablation": self.ablation,
                    "statistic": s,
                    "method": m,
                    **self.correlations(s, method=m),
                }
                for s in STATISTICS
                for m in SPLIT_HALF_METHODS
            ]
        )

    def correlation_row(self) -> dict[str, Any]:
        """``{r_stat_excess, r_delta_excess, ..., verdict_cos_self}``: the correlations of every statistic."""
        return {f"{k}_{s}": v for s in STATISTICS for k, v in self.correlations(s).items()}

    def summary(self) -> pd.DataFrame:
        return pd.DataFrame([{"model": self.info.name, "ablation": self.ablation, **self.correlation_row()}])

    def figure(self) -> go.Figure:
        return split_half_figure(self)


@dataclass(frozen=True, kw_only=True)
class SanitySettings:
    """What the sanity checks compute: the causal null (``null``: ``sampled``, the paper's, or ``exact``) and the
    split-half reliability of single-head ablations (``ablation`` at ``positions``: ``after-first``, the paper's frozen
    protocol), both seeded by ``seed`` (the null draws and the halves).

    Examples:
        >>> import lens_parallel as lp
        >>> lp.SanitySettings(null="exact").null
        'exact'
    """

    ablation: Ablation = field(default="parallel-value", metadata={"help": "how heads are removed"})
    positions: EditPositions = field(
        default="after-first", metadata={"help": "the paper's frozen protocol: after-first"}
    )
    null: Null = field(default="sampled", metadata={"help": "causal null: sampled (the paper's) or exact"})
    seed: int = field(default=0, metadata={"help": "seed of the null draws and the halves"})

    def __post_init__(self) -> None:
        check_choice("ablation", self.ablation, Ablation)
        check_positions(self.positions)
        check_choice("null", self.null, Null)
        check_non_negative_int("seed", self.seed)


@long_call
def split_half_reliability(
    model: TransformerBridge,
    documents: DocumentsLike,
    *,
    settings: SanitySettings | None = None,
    options: RunOptions | None = None,
    protocol: str | None = None,
    **changes: Any,
) -> SplitHalfResult:
    """See the module docstring (:class:`SanitySettings`; run options :class:`~lens_parallel.options.RunOptions`).
    ``store``: the JSON-lines file of the resumable single-head ablation sweep (run once over all documents and split
    by half: per-document losses do not depend on the half; :func:`~lens_parallel.analyses.sensitivity.head_sensitivity`
    given the same file and positions shares its finished jobs).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=8, seq_len=16)
        >>> rel = lp.split_half_reliability(model, docs, progress=False)
        >>> type(rel).__name__
        'SplitHalfResult'
    """
    check_model(model)
    s, opts = resolve(SanitySettings, settings, options, protocol, changes)
    docs = Documents.of(documents, model)
    check_documents(len(docs))
    check_workers(opts.workers, opts.ray_address, model)
    alone = dataclasses.replace(opts, store=None)  # the store is the ablation sweep's
    null = causal_null(model, docs, settings=NullSettings(null=s.null, seed=s.seed, n_resamples=100), options=alone)
    return _split_half(model, docs, null, s, opts)


MIN_DOCUMENTS = 4
"""Split-half reliability needs two halves of at least 2 documents each."""


def check_documents(n_docs: int) -> None:
    """Refuse fewer than :data:`MIN_DOCUMENTS` documents (before any forward)."""
    if n_docs < MIN_DOCUMENTS:
        raise LensParallelError(
            f"split-half reliability needs at least {MIN_DOCUMENTS} documents (2 per half), got {n_docs}"
        )


def _split_half(
    model: TransformerBridge, docs: Documents, null: NullResult, s: SanitySettings, opts: RunOptions
) -> SplitHalfResult:
    """Split ``null`` (per-document cosines on ``docs``) and one single-head ablation sweep into seeded halves."""
    info = model_info(model)
    order = np.random.default_rng(s.seed).permutation(len(docs))
    halves = (tuple(sorted(order[: len(docs) // 2].tolist())), tuple(sorted(order[len(docs) // 2 :].tolist())))
    layers, skipped = null.layers, ""
    if s.ablation not in LINEAR_ABLATIONS and info.hybrid:
        layers, skipped = softmax_layers(info, None, what=f"a {s.ablation} head ablation")
    rows = [null.layers.index(layer) for layer in layers]
    jobs = [AblationJob(layer, (h,)) for layer in layers for h in range(info.output_heads(layer))]
    run = run_sweep(model, docs, jobs, ablation=s.ablation, positions=s.positions, options=opts)
    assert run.base is not None
    cos_self, excess, deltas = [], [], []
    for half in halves:
        idx = list(half)
        cos_self.append(null.cos_self[idx][:, rows].mean(0))
        excess.append((null.cos_self[idx] - null.cos_null[idx])[:, rows].mean(0))
        n = run.base.n_tokens[idx].sum()
        base = run.base.loss_sum[idx].sum() / n
        delta = np.full(cos_self[-1].shape, np.nan)  # [layer, head], NaN past a layer's heads
        for job in jobs:
            delta[layers.index(job.layer), job.heads[0]] = run[job].loss_sum[idx].sum() / n - base
        deltas.append(delta)
    provenance = Provenance.of(
        info, docs, "split_half_reliability", s, run, halves=[list(h) for h in halves], skipped=skipped
    )
    return SplitHalfResult(
        ablation=s.ablation,
        layers=layers,
        halves=halves,
        cos_self=np.stack(cos_self),
        excess=np.stack(excess),
        delta=np.stack(deltas),
        provenance=provenance,
    )


@dataclass(frozen=True, repr=False)
class SanityReport(ResultMixin):
    """The causal null (with GQA groups where there are several kv heads) and split-half reliability together.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=8, seq_len=16)
        >>> report = lp.sanity_report(model, docs, progress=False)
        >>> fig = report.figure()
    """

    columns: ClassVar[str] = (
        "model layer head kv_head label layer_type cos_self cos_null excess excess_lo excess_hi "
        "self_specific_fraction null_share cos_self_A cos_self_B excess_A excess_B delta_loss_A delta_loss_B "
        "null n_heads median_head_self_specific_fraction median_head_null_share r_stat_cos_self "
        "r_delta_cos_self rho_max_cos_self rho_raw_cos_self rho_disattenuated_cos_self verdict_cos_self "
        "r_stat_excess r_delta_excess rho_max_excess rho_raw_excess rho_disattenuated_excess verdict_excess"
    )

    null: NullResult
    split_half: SplitHalfResult
    provenance: Provenance

    def to_dataframe(self) -> pd.DataFrame:
        """Full resolution: one row per (layer, head) of the null (:meth:`NullResult.head_table`) with the head's
        values in each half (``*_A``, ``*_B``)."""
        halves = self.split_half.to_dataframe().pivot(
            index=["layer", "head"], columns="half", values=["cos_self", "excess", "delta_loss"]
        )
        halves.columns = [f"{value}_{half}" for value, half in halves.columns]
        return self.null.head_table().merge(halves.reset_index(), on=["layer", "head"], how="left")

    def summary(self) -> pd.DataFrame:
        """The per-model row: the null's model-level means and the split-half correlations of every statistic."""
        return pd.DataFrame([self.null.summary().iloc[0].to_dict() | self.split_half.correlation_row()])

    def headline(self) -> dict[str, Any]:
        """The :data:`HEADLINE` entries of :meth:`summary` this model has."""
        row = self.summary().iloc[0]
        return {k: row[k] for k in HEADLINE if k in row}

    def figures(self) -> dict[str, go.Figure]:
        return {"sanity": self.figure(), "null": self.null.figure(), "split_half": self.split_half.figure()}

    def figure(self) -> go.Figure:
        return sanity_figure(self)


@long_call
def sanity_report(
    model: TransformerBridge,
    documents: DocumentsLike,
    *,
    settings: SanitySettings | None = None,
    options: RunOptions | None = None,
    protocol: str | None = None,
    **changes: Any,
) -> SanityReport:
    """Every check on one set of documents: causal null (+ GQA alignment under grouped-query attention) and split
    halves (from that same null pass and one single-head ablation sweep); :class:`SanitySettings`, run options
    :class:`~lens_parallel.options.RunOptions` (``store`` makes the sweep resumable, ``workers`` runs it on Ray).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=8, seq_len=16)
        >>> report = lp.sanity_report(model, docs, progress=False)
        >>> type(report).__name__
        'SanityReport'
    """
    check_model(model)
    s, opts = resolve(SanitySettings, settings, options, protocol, changes)
    docs = Documents.of(documents, model)
    check_documents(len(docs))
    check_workers(opts.workers, opts.ray_address, model)
    null_settings, alone = NullSettings(null=s.null, seed=s.seed), dataclasses.replace(opts, store=None)
    if is_grouped(model_info(model)):  # the store is the ablation sweep's
        nulls = gqa_alignment(model, docs, settings=null_settings, options=alone)
    else:
        nulls = causal_null(model, docs, settings=null_settings, options=alone)
    split_half = _split_half(model, docs, nulls, s, opts)
    provenance = Provenance.of(model_info(model), docs, "sanity_report", s, opts)
    return SanityReport(null=nulls, split_half=split_half, provenance=provenance)


def _printed(result: SanityReport, s: SanitySettings, display: None) -> tuple[str, pd.DataFrame]:
    title = f"{result.info.name}: sanity checks on {result.provenance.texts['n_docs']} documents"
    return title, result.summary().T.rename(columns={0: ""})


ANALYSIS = Analysis(
    "checks",
    "sanity checks: causal null, GQA groups, split-half reliability",
    sanity_report,
    SanitySettings,
    SanityReport,
    _printed,
    data={"n_docs": 8},
    sweep=True,
    store="ablations.jsonl",
    check_data=lambda data: check_documents(data.n_docs),
)
"""This analysis, as :data:`~lens_parallel.analyses.registry.MODULES` finds it."""
