"""The per-head statistics the directional-decomposition paper sets against single-head sensitivity (its Fig. 7),
their correlations with signed Δloss across heads, and Benjamini-Hochberg across the models compared.

For head h at position t, with y = o_t (the head's value-space message, hook_z; the pre-gate A v under gated
attention), ref = v_t, y_par its part along v_t and edit = y' - y the change the ablation makes:

    para_ratio    = |y_par|^2 / |y|^2      (the mean cos^2 of o_t with v_t)
    para_over_ref = |y_par| / |v_t|
    edit_over_y   = |edit| / |y|
    edit_over_ref = |edit| / |v_t|

each a mean over every real position (t = 0 included, as the authors' running statistics are; ``positions=
"after-first"`` leaves it out). Denominators are floored as in the authors' ``_remove_parallel_and_stats``:
|v_t|^2 and |y|^2 at eps^2 (1e-6 at the default eps = 1e-3). For ``parallel-value`` (s_par = 0) the edit is -y_par, so
edit_over_ref equals para_over_ref exactly and edit_over_y is the mean |cos|; for ``zero`` the edit is -y, so
edit_over_y is 1 and edit_over_ref is |o_t| / |v_t|. Those coincidences are the statistics' definitions, not
estimates.

The names follow the authors' ``analyze_per_head_causal_sensitivity.py`` (which reads them from its
``head_sensitivity.csv``) and the formulas their ``_remove_parallel_and_stats`` (para_ratio, para_over_ref); the
script that writes that file is not in their public repository, so edit_over_y and edit_over_ref are defined by
their names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import einops
import numpy as np
import pandas as pd
import plotly.graph_objects as go
import scipy.stats as sps
import torch
from torch import Tensor
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import geometry
from lens_parallel.analyses.sensitivity import SensitivityResult
from lens_parallel.bridges import check_model
from lens_parallel.choices import EditPositions, HeadStatistic, StatisticAblation
from lens_parallel.distributed import TaskContext
from lens_parallel.documents import Documents, DocumentsLike
from lens_parallel.edits import ABLATION_KINDS, EDIT_POSITIONS, check_positions
from lens_parallel.errors import LensParallelError, long_call
from lens_parallel.hooks import Reducer, head_layers
from lens_parallel.models import ModelInfo
from lens_parallel.options import RunOptions, resolve
from lens_parallel.plots import sensitivity as plots
from lens_parallel.results import Provenance, ResultMixin, head_frame
from lens_parallel.spaces import value_parts
from lens_parallel.stats import benjamini_hochberg, split_half_correlations
from lens_parallel.store import Values, ValueSpec
from lens_parallel.sweep import Batch, EditJob, Metric, SweepPlan, run_rows, run_sweep
from lens_parallel.validate import as_indices, check_choice, check_eps, literal_values

STATISTICS: tuple[HeadStatistic, ...] = literal_values(HeadStatistic)
"""The four per-head statistics, in the authors' order."""


@dataclass(frozen=True, repr=False)
class HeadStatistics(ResultMixin):
    """The four statistics per ``[layer, head]`` (``values`` is ``[statistic, layer, head]``, statistics in
    :data:`STATISTICS` order; on a hybrid model the head axis is as wide as the widest layer's heads, a narrower
    layer's extra entries NaN), over ``n_positions`` positions per head; ``doc_sums`` ``[doc, statistic, layer,
    head]`` and ``doc_positions`` ``[doc]`` the per-document sums and counts they are the ratio of (for the
    split-half ceiling of :func:`sensitivity_correlations`).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> stats = lp.head_statistics(model, docs, layers=[0], progress=False)
        >>> stats.to_dataframe().shape[0] > 0
        True
    """

    columns: ClassVar[str] = (
        "model layer head kv_head label layer_type ablation positions para_ratio para_over_ref edit_over_y "
        "edit_over_ref n_positions mean_para_ratio mean_para_over_ref mean_edit_over_y mean_edit_over_ref"
    )

    ablation: str
    positions: EditPositions
    layers: tuple[int, ...]
    values: np.ndarray
    n_positions: int
    doc_sums: np.ndarray
    doc_positions: np.ndarray
    provenance: Provenance

    @property
    def statistics(self) -> tuple[HeadStatistic, ...]:
        """The statistics' names, in the order of ``values``."""
        return STATISTICS

    def to_dataframe(self) -> pd.DataFrame:
        """One row per head: the four statistics."""
        columns = dict(zip(STATISTICS, self.values, strict=True))
        return head_frame(
            self.info, self.layers, columns, front={"ablation": self.ablation, "positions": self.positions}
        )

    def summary(self) -> pd.DataFrame:
        row: dict[str, Any] = {"model": self.info.name, "ablation": self.ablation, "n_positions": self.n_positions}
        row |= {f"mean_{name}": float(np.nanmean(v)) for name, v in zip(STATISTICS, self.values, strict=True)}
        return pd.DataFrame([row])

    def figure(self) -> go.Figure:
        return plots.head_statistics_figure(self)


class _StatisticsMetric(Metric[EditJob]):
    """Per document, layer and head: the sums of the four statistics over its real positions (and their count)."""

    name = "head-statistics"

    def __init__(
        self, info: ModelInfo, layers: tuple[int, ...], ablation: str, positions: EditPositions, eps: float
    ) -> None:
        self.info, self.layers, self.ablation, self.positions, self.eps = info, layers, ablation, positions, eps
        self.roles = {layer: info.kind(layer).value_roles(info) for layer in layers}
        self.width = max(info.output_heads(layer) for layer in layers)

    def fingerprint(self) -> dict[str, Any]:
        return {"metric": self.name, "ablation": self.ablation, "positions": self.positions, "eps": self.eps}

    def spec(self, job: EditJob) -> dict[str, ValueSpec]:
        return {
            "sums": ValueSpec(("docs", len(STATISTICS), len(self.layers), self.width), allow_nan=True),
            "count": ValueSpec(("docs",)),
        }

    def measure(self, context: TaskContext, plan: SweepPlan, jobs: Sequence[EditJob], batch: Batch) -> list[Values]:
        weight = EDIT_POSITIONS[self.positions].weights(batch.docs.real.to(torch.float64))
        n = len(batch.docs.lengths)
        shape = (n, len(STATISTICS), len(self.layers), self.width)
        sums = torch.zeros(shape, dtype=torch.float64, device=weight.device)  # read on the host after the forward
        for i, layer in enumerate(self.layers):  # a layer's units past its own heads: no head there
            sums[:, :, i, self.info.output_heads(layer) :] = torch.nan
        reduce = self._reducer(sums, weight)
        run_rows(context.model, self.info, batch, capture=self.roles, reduce=reduce)
        return [{"sums": sums.cpu().numpy(), "count": weight.sum(1).cpu().numpy()}]

    def _reducer(self, sums: Tensor, weight: Tensor) -> Reducer:
        index = {layer: i for i, layer in enumerate(self.layers)}
        floor = self.eps**2

        def reduce(layer: int, t: dict[str, Tensor]) -> None:
            parts = value_parts(t, self.info)
            y, v = parts.o, parts.v
            par = geometry.project(y, v, eps=self.eps, clamp=True).par
            edit = -par if ABLATION_KINDS[self.ablation].removed_space is not None else -y  # a removal, or zero
            yy, vv = (y * y).sum(-1).clamp_min(floor), (v * v).sum(-1).clamp_min(floor)
            per_pos = torch.stack(
                [
                    (par * par).sum(-1) / yy,
                    par.norm(dim=-1) / vv.sqrt(),
                    edit.norm(dim=-1) / yy.sqrt(),
                    edit.norm(dim=-1) / vv.sqrt(),
                ]
            )  # [statistic, batch, pos, head_index]
            w = weight.to(per_pos.device)[None, :, :, None]
            sums[:, :, index[layer], : per_pos.shape[-1]] += einops.rearrange(
                (per_pos * w).sum(2), "stat batch head -> batch stat head"
            ).to(sums.device, non_blocking=True)

        return reduce


@dataclass(frozen=True, kw_only=True)
class HeadStatisticsSettings:
    """What :func:`head_statistics` computes: the statistics of ``ablation``'s change on ``layers`` (None: every layer;
    on a linear-attention layer y = o_t, its value heads' delta-rule output), over every position (``all``: t = 0
    included, as the authors) or ``after-first``; denominators floored at ``eps``^2.

    Examples:
        >>> import lens_parallel as lp
        >>> lp.HeadStatisticsSettings(layers=(1,)).layers
        (1,)
    """

    ablation: StatisticAblation = field(
        default="parallel-value", metadata={"help": "the single-head ablation described"}
    )
    positions: EditPositions = field(default="all", metadata={"help": "after-first: leave position 0 out"})
    layers: tuple[int, ...] | None = field(default=None, metadata={"help": "layers", "none": "every layer"})
    eps: float = field(default=1e-3, metadata={"help": "|v|^2 and |y|^2 floored at eps^2 (the authors' 1e-6)"})

    def __post_init__(self) -> None:
        check_choice("ablation", self.ablation, StatisticAblation)
        check_positions(self.positions)
        object.__setattr__(self, "layers", as_indices(self.layers))
        check_eps(self.eps)


@long_call
def head_statistics(
    model: TransformerBridge,
    documents: DocumentsLike,
    *,
    settings: HeadStatisticsSettings | None = None,
    options: RunOptions | None = None,
    protocol: str | None = None,
    **changes: Any,
) -> HeadStatistics:
    """The four statistics of the module docstring for every head (:class:`HeadStatisticsSettings`; run options
    :class:`~lens_parallel.options.RunOptions`; both as keyword shortcuts), one forward per batch on the engine.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> stats = lp.head_statistics(model, docs, layers=[0], progress=False)
        >>> type(stats).__name__
        'HeadStatistics'
    """
    info = check_model(model)
    s, opts = resolve(HeadStatisticsSettings, settings, options, protocol, changes)
    docs = Documents.of(documents, model)
    layer_idx, skipped = head_layers(info, s.layers, what="head_statistics")
    metric = _StatisticsMetric(info, layer_idx, s.ablation, s.positions, s.eps)
    job = EditJob("statistics", ())
    run = run_sweep(model, docs, [job], metric=metric, options=opts, desc="head statistics")
    out = run.value(job)
    count = float(out["count"].sum())
    return HeadStatistics(
        ablation=s.ablation,
        positions=s.positions,
        layers=layer_idx,
        values=out["sums"].sum(0) / count,
        n_positions=int(count),
        doc_sums=out["sums"],
        doc_positions=out["count"],
        provenance=Provenance.of(info, docs, "head_statistics", s, run, layers=list(layer_idx), skipped=skipped),
    )


def _halves(sens: SensitivityResult, stat: HeadStatistics, seed: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Each statistic and the single-head Δloss in two seeded halves of the documents (``[2, statistic, layer,
    head]`` and ``[2, layer, head]``), or None with fewer than 4 documents."""
    n = len(stat.doc_positions)
    if n < 4:
        return None
    order = np.random.default_rng(seed).permutation(n)
    stats, deltas = [], []
    for idx in (order[: n // 2], order[n // 2 :]):
        stats.append(stat.doc_sums[idx].sum(0) / stat.doc_positions[idx].sum())
        deltas.append(sens.head_doc_delta[idx].sum(0) / sens.doc_tokens[idx].sum())
    return np.stack(stats), np.stack(deltas)


def sensitivity_correlations(
    pairs: Mapping[str, tuple[SensitivityResult, HeadStatistics]], *, seed: int = 0
) -> pd.DataFrame:
    """Per model (the mapping's keys) and statistic: Pearson r and Spearman rho (with their p-values, scipy) of the
    signed single-head Δloss against the statistic across heads, as the authors' ``analyze_model``. The two results
    of a model must come from the same documents and cover the same layers; heads whose Δloss is not finite are left
    out (counted in n_heads).

    Beside them, our addition (not in the paper): the split-half ceiling. The documents are split into two seeded
    halves (``seed``); ``r_stat`` and ``r_delta`` are the Spearman correlations across heads of the statistic and of
    Δloss between the halves, and ``rho_max = sqrt(r_stat r_delta)`` bounds how well any statistic measured this
    noisily can rank an effect measured this noisily (:func:`~lens_parallel.stats.split_half_correlations`; NaN
    with fewer than 4 documents).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> sens = lp.head_sensitivity(model, docs, layers=[0], progress=False)
        >>> stats = lp.head_statistics(model, docs, layers=[0], progress=False)
        >>> table = lp.sensitivity_correlations({"toy": (sens, stats)})
        >>> len(table) > 0
        True
    """
    rows = []
    for name, (sens, stat) in pairs.items():
        if sens.provenance.texts.get("tokens_sha256_16") != stat.provenance.texts.get("tokens_sha256_16"):
            raise LensParallelError(f"{name}: the sensitivity and the statistics were computed on other documents")
        if tuple(sens.layers) != tuple(stat.layers):
            raise LensParallelError(
                f"{name}: the sensitivity covers layers {list(sens.layers)}, the statistics {list(stat.layers)}"
            )
        if sens.ablation != stat.ablation:
            raise LensParallelError(
                f"{name}: the sensitivity ablates {sens.ablation!r}, the statistics describe {stat.ablation!r}"
            )
        delta = sens.head_delta.ravel()
        keep = np.isfinite(delta)
        halves = _halves(sens, stat, seed)
        for i, (statistic, values) in enumerate(zip(STATISTICS, stat.values, strict=True)):
            x, y = values.ravel()[keep], delta[keep]
            pearson, spearman = sps.pearsonr(x, y), sps.spearmanr(x, y)
            ceiling = {"r_stat": np.nan, "r_delta": np.nan, "rho_max": np.nan}
            if halves is not None:
                split = split_half_correlations(
                    halves[0][:, i].reshape(2, -1)[:, keep], halves[1].reshape(2, -1)[:, keep]
                )
                ceiling = {k: split[k] for k in ceiling}
            rows.append(
                {
                    "model": name,
                    "statistic": statistic,
                    "pearson_r": float(pearson.statistic),
                    "pearson_p": float(pearson.pvalue),
                    "spearman_rho": float(spearman.statistic),
                    "spearman_p": float(spearman.pvalue),
                    "n_heads": int(keep.sum()),
                    **{f"{k}_split_half": v for k, v in ceiling.items()},
                }
            )
    return pd.DataFrame(rows)


def head_ratio_figure(
    pairs: Mapping[str, tuple[SensitivityResult, HeadStatistics]], *, statistic: HeadStatistic = "para_ratio"
) -> go.Figure:
    """The paper's head-ratio-against-sensitivity scatter: signed single-head Δloss against ``statistic`` (one of
    :data:`STATISTICS`), one colour per model, with :func:`sensitivity_correlations`' coefficients.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> sens = lp.head_sensitivity(model, docs, layers=[0], progress=False)
        >>> stats = lp.head_statistics(model, docs, layers=[0], progress=False)
        >>> fig = lp.head_ratio_figure({"toy": (sens, stats)})
    """
    check_choice("statistic", statistic, HeadStatistic)
    return plots.head_ratio_figure(pairs, sensitivity_correlations(pairs), statistic=statistic)


def compare_sensitivity(results: Mapping[str, SensitivityResult], *, level: float = 0.05) -> pd.DataFrame:
    """The single heads of several models' sensitivities side by side, with Benjamini-Hochberg q-values within each
    model (``q_model``) and over the heads of every model pooled (``q_global``), and each head's class at
    ``level`` under each: ``decrease`` / ``increase`` (signed Δloss, q <= level) or ``not significant``; as the
    authors' ``fdr_model_class`` / ``fdr_global_class``.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> a = lp.head_sensitivity(model, docs, layers=[0], progress=False)
        >>> table = lp.compare_sensitivity({"toy": a})
        >>> len(table) > 0
        True
    """
    frames = []
    for name, result in results.items():
        df = result.to_dataframe()
        df = df[df["head"].notna()].assign(model=name)
        frames.append(df.assign(q_model=benjamini_hochberg(df["p"].to_numpy())))
    out = pd.concat(frames, ignore_index=True)
    out["q_global"] = benjamini_hochberg(out["p"].to_numpy())
    for scope in ("model", "global"):
        q = out[f"q_{scope}"]
        out[f"class_{scope}"] = np.where(
            q <= level, np.where(out["delta_loss"] < 0, "decrease", "increase"), "not significant"
        )
    return out
