"""Confirm an attribution screen exactly: the top heads (and random others) through the exact ablation engine.

A first-order estimate is exact for small edits and only a linearisation for large ones (``zero`` and
``parallel-value`` remove a whole component, s_par = 0 is not near s = 1). :func:`confirm` measures how far off it
is where it matters: for the ``top_k`` heads with the largest |estimate| and ``n_random`` others drawn at random
(the check that the ranking is not only right at the top), it runs the same edit exactly, on the same documents and
positions, and reports both side by side with the Spearman and Pearson correlations across the confirmed heads
and the median ratio exact / estimate.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import scipy.stats as sps
from jaxtyping import Int
from torch import Tensor
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.analyses.attribution import AttributionResult
from lens_parallel.data import TokenBlocks
from lens_parallel.errors import LensParallelError
from lens_parallel.plots.attribution import confirm_figure
from lens_parallel.results import Provenance, ResultMixin, as_tokens, serializable
from lens_parallel.stats import paired_bootstrap_ci, ratio_of_sums_delta, spearman
from lens_parallel.sweep import AblationJob, run_sweep


@serializable
@dataclass(frozen=True)
class ConfirmResult(ResultMixin):
    """Estimate vs exact effect (nats/token) per confirmed head; ``chosen`` is ``top`` or ``random``."""

    edit: str
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
                "edit": self.edit,
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
                    "edit": self.edit,
                    "n_confirmed": len(self.labels),
                    "spearman": self.spearman,
                    "pearson": self.pearson,
                    "median_exact_over_estimate": self.median_ratio,
                    "top_sign_agreement": float(np.mean(np.sign(self.exact[top]) == np.sign(self.estimate[top]))),
                    "note": _linearity_note(self.edit),
                }
            ]
        )

    def figure(self):
        return confirm_figure(self)


def _linearity_note(edit: str) -> str:
    if edit == "mean":
        return "first order in z_h - mean: close where a head's output varies little around its mean"
    return (
        f"{edit} removes a whole component (s = 0 is not a small change from s = 1): the estimate is a "
        "linearisation, good for ranking, not for size"
    )


def confirm(
    model: TransformerBridge,
    tokens: TokenBlocks | Int[Tensor, "batch pos"],
    result: AttributionResult,
    *,
    top_k: int = 10,
    n_random: int = 10,
    seed: int = 0,
    batch_size: int = 8,
    rows_per_forward: int = 8,
    store: str | Path | None = None,
    progress: bool = True,
) -> ConfirmResult:
    """Run ``result``'s edit exactly (ablation engine, same positions) on its ``top_k`` heads by |estimate| and
    ``n_random`` other heads (``default_rng(seed)``), on the documents ``result`` was computed on."""
    toks = as_tokens(tokens)
    if not isinstance(result, AttributionResult):
        raise LensParallelError(f"confirm needs an AttributionResult, got {type(result).__name__}")
    if len(toks) != len(result.n_tokens) or toks.shape[1] - 1 != int(result.n_tokens[0]):
        raise LensParallelError(
            f"tokens {tuple(toks.shape)} are not the documents the screen ran on ({len(result.n_tokens)} documents "
            f"of {int(result.n_tokens[0]) + 1} tokens): confirm on the same tokens"
        )
    if isinstance(tokens, TokenBlocks) and tokens.describe() != result.provenance.texts:
        raise LensParallelError("tokens differ from those the screen ran on (another corpus, seed or length)")
    n_heads = result.estimate.shape[2]
    n_all = len(result.layers) * n_heads
    if top_k < 1 or n_random < 0 or top_k + n_random > n_all:
        raise LensParallelError(f"need 1 <= top_k and 0 <= n_random with top_k + n_random <= {n_all} heads")
    top = result.top_heads(top_k)
    rest = [(layer, h) for layer in result.layers for h in range(n_heads) if (layer, h) not in top]
    pick = np.random.default_rng(seed).choice(len(rest), size=n_random, replace=False)
    chosen = [*top, *[rest[i] for i in sorted(pick)]]
    jobs = [AblationJob(layer, (h,)) for layer, h in chosen]
    run = run_sweep(
        model,
        toks,
        jobs,
        edit=result.edit,
        positions=result.positions,
        batch_size=batch_size,
        rows_per_forward=rows_per_forward,
        store=store,
        progress=progress,
        desc="confirm",
    )
    exact = np.stack([run[j].loss_sum for j in jobs], axis=1)  # [doc, job]
    base = np.broadcast_to(run.base.loss_sum[:, None], exact.shape)
    weights = np.broadcast_to(result.n_tokens[:, None].astype(float), exact.shape)
    lo, hi = paired_bootstrap_ci(exact, base, weights, seed=seed, what="confirm: exact losses of the chosen heads")
    exact_mean = ratio_of_sums_delta(exact, base, weights, axis=0)
    est_grid = result.head_estimate()
    estimate = np.array([est_grid[result.layers.index(layer), h] for layer, h in chosen])
    provenance = Provenance.collect(
        result.info,
        tokens,
        analysis="confirm",
        edit=result.edit,
        positions=result.positions,
        top_k=top_k,
        n_random=n_random,
        seed=seed,
        batch_size=batch_size,
    )
    return ConfirmResult(
        edit=result.edit,
        labels=tuple(f"L{layer}H{h}" for layer, h in chosen),
        layers=np.array([layer for layer, _ in chosen]),
        heads=np.array([h for _, h in chosen]),
        chosen=tuple(["top"] * len(top) + ["random"] * n_random),
        estimate=estimate,
        exact=exact_mean,
        exact_lo=np.asarray(lo),
        exact_hi=np.asarray(hi),
        spearman=spearman(estimate, exact_mean),
        pearson=float(sps.pearsonr(estimate, exact_mean).statistic) if len(chosen) > 2 else float("nan"),
        provenance=provenance,
    )
