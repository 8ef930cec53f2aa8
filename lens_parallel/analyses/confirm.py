"""Confirm an attribution screen exactly: the top heads (and random others) through the exact ablation engine.

A first-order estimate is exact for small edits and only a linearisation for large ones (``zero`` and
``parallel-value`` remove a whole component, s_par = 0 is not near s = 1). :func:`confirm` measures how far off it
is where it matters: for the ``top_k`` heads with the largest |estimate| and ``n_random`` others drawn at random
(the check that the ranking is not only right at the top), it runs the same edit exactly, on the same documents and
positions, and reports both side by side with the Spearman and Pearson correlations across the confirmed heads
and the median ratio exact / estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import scipy.stats as sps
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.analyses.attribution import AttributionResult
from lens_parallel.bridges import check_model
from lens_parallel.choices import Ablation
from lens_parallel.documents import Documents, DocumentsLike
from lens_parallel.edits import ABLATION_KINDS
from lens_parallel.errors import LensParallelError, long_call
from lens_parallel.models import head_label
from lens_parallel.options import RunOptions, resolve
from lens_parallel.plots.attribution import confirm_figure
from lens_parallel.results import Provenance, ResultMixin
from lens_parallel.stats import paired_bootstrap_ci, ratio_of_sums_delta, spearman
from lens_parallel.sweep import AblationJob, run_sweep
from lens_parallel.validate import check_non_negative_int, check_positive_int


@dataclass(frozen=True, repr=False)
class ConfirmResult(ResultMixin):
    """Estimate vs exact effect (nats/token) per confirmed head; ``chosen`` is ``top`` or ``random``.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> attr = lp.head_attribution(model, docs, progress=False)
        >>> checked = lp.confirm(model, docs, attr, top_k=2, n_random=2, progress=False)
        >>> fig = checked.figure()
    """

    columns: ClassVar[str] = (
        "model layer head kv_head label layer_type ablation chosen estimate exact exact_lo exact_hi "
        "exact_over_estimate n_confirmed spearman pearson median_exact_over_estimate top_sign_agreement note"
    )

    ablation: Ablation
    labels: tuple[str, ...]
    layers: np.ndarray
    heads: np.ndarray
    chosen: tuple[str, ...]
    estimate: np.ndarray
    exact: np.ndarray
    exact_lo: np.ndarray
    exact_hi: np.ndarray
    spearman: float
    pearson: float
    provenance: Provenance

    @property
    def median_ratio(self) -> float:
        """Median over confirmed heads of exact / estimate (1 = the linear estimate is right in size)."""
        ok = np.abs(self.estimate) > 0
        return float(np.median(self.exact[ok] / self.estimate[ok])) if ok.any() else float("nan")

    def to_dataframe(self) -> pd.DataFrame:
        return pd.DataFrame(
            {
                "model": self.info.name,
                "ablation": self.ablation,
                "label": self.labels,
                "layer": self.layers,
                "head": self.heads,
                "chosen": self.chosen,
                "estimate": self.estimate,
                "exact": self.exact,
                "exact_lo": self.exact_lo,
                "exact_hi": self.exact_hi,
                "exact_over_estimate": self.exact / np.where(self.estimate == 0, np.nan, self.estimate),
            }
        )

    def summary(self) -> pd.DataFrame:
        top = np.asarray(self.chosen) == "top"
        return pd.DataFrame(
            [
                {
                    "model": self.info.name,
                    "ablation": self.ablation,
                    "n_confirmed": len(self.labels),
                    "spearman": self.spearman,
                    "pearson": self.pearson,
                    "median_exact_over_estimate": self.median_ratio,
                    "top_sign_agreement": float(np.mean(np.sign(self.exact[top]) == np.sign(self.estimate[top]))),
                    "note": _linearity_note(self.ablation),
                }
            ]
        )

    def figure(self) -> go.Figure:
        return confirm_figure(self)


def _linearity_note(ablation: str) -> str:
    return ABLATION_KINDS[ablation].linearity_note()


@dataclass(frozen=True, kw_only=True)
class ConfirmSettings:
    """Which heads of a screen are run exactly: the ``top_k`` by |estimate| and ``n_random`` others drawn with
    ``default_rng(seed)``.

    Examples:
        >>> import lens_parallel as lp
        >>> lp.ConfirmSettings(top_k=3).top_k
        3
    """

    top_k: int = field(default=10, metadata={"help": "the heads with the largest |estimate| run exactly"})
    n_random: int = field(default=10, metadata={"help": "other heads, drawn at random, run exactly"})
    seed: int = field(default=0, metadata={"help": "seed of the random draw"})

    def __post_init__(self) -> None:
        check_positive_int("top_k", self.top_k)
        check_non_negative_int("n_random", self.n_random)
        check_non_negative_int("seed", self.seed)


@long_call
def confirm(
    model: TransformerBridge,
    documents: DocumentsLike,
    result: AttributionResult,
    *,
    settings: ConfirmSettings | None = None,
    options: RunOptions | None = None,
    protocol: str | None = None,
    **changes: Any,
) -> ConfirmResult:
    """Run ``result``'s edit exactly (ablation engine, same positions) on the heads :class:`ConfirmSettings` picks,
    on the documents ``result`` was computed on (run options: :class:`~lens_parallel.options.RunOptions`, e.g. a
    ``store`` shared with :func:`~lens_parallel.analyses.sensitivity.head_sensitivity`, ``workers`` for Ray).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> attr = lp.head_attribution(model, docs, progress=False)
        >>> checked = lp.confirm(model, docs, attr, top_k=2, n_random=2, progress=False)
        >>> type(checked).__name__
        'ConfirmResult'
    """
    check_model(model)
    s, opts = resolve(ConfirmSettings, settings, options, protocol, changes)
    if not isinstance(result, AttributionResult):
        raise LensParallelError(f"confirm needs an AttributionResult, got {type(result).__name__}")
    docs = Documents.of(documents, model)
    if docs.digest() != result.provenance.texts.get("tokens_sha256_16"):
        raise LensParallelError(
            f"these {len(docs)} documents are not the ones the screen ran on ({len(result.n_tokens)} documents, "
            f"tokens {result.provenance.texts.get('tokens_sha256_16')}): confirm on the same documents"
        )
    screened = [(layer, h) for layer in result.layers for h in range(result.info.output_heads(layer))]
    if s.top_k + s.n_random > len(screened):
        raise LensParallelError(f"top_k + n_random = {s.top_k + s.n_random} exceeds the {len(screened)} heads screened")
    top = result.top_heads(s.top_k)
    rest = [head for head in screened if head not in top]
    pick = np.random.default_rng(s.seed).choice(len(rest), size=s.n_random, replace=False)
    chosen = [*top, *[rest[i] for i in sorted(pick)]]
    jobs = [AblationJob(layer, (h,)) for layer, h in chosen]
    run = run_sweep(
        model, docs, jobs, ablation=result.ablation, positions=result.positions, options=opts, desc="confirm"
    )
    assert run.base is not None
    exact = np.stack([run[j].loss_sum for j in jobs], axis=1)  # [doc, job]
    base = np.broadcast_to(run.base.loss_sum[:, None], exact.shape)
    weights = np.broadcast_to(result.n_tokens[:, None].astype(float), exact.shape)
    lo, hi = paired_bootstrap_ci(exact, base, weights, seed=s.seed, what="confirm: exact losses of the chosen heads")
    exact_mean = np.asarray(ratio_of_sums_delta(exact, base, weights, axis=0))
    est_grid = result.head_estimate()
    estimate = np.array([est_grid[result.layers.index(layer), h] for layer, h in chosen])
    provenance = Provenance.of(
        result.info, docs, "confirm", s, run, ablation=result.ablation, positions=result.positions
    )
    return ConfirmResult(
        ablation=result.ablation,
        labels=tuple(head_label(layer, h) for layer, h in chosen),
        layers=np.array([layer for layer, _ in chosen]),
        heads=np.array([h for _, h in chosen]),
        chosen=tuple(["top"] * len(top) + ["random"] * s.n_random),
        estimate=estimate,
        exact=exact_mean,
        exact_lo=np.asarray(lo),
        exact_hi=np.asarray(hi),
        spearman=spearman(estimate, exact_mean),
        pearson=float(sps.pearsonr(estimate, exact_mean).statistic) if len(chosen) > 2 else float("nan"),
        provenance=provenance,
    )
