"""Statistics over documents (seeded, vectorised; scipy where scipy has it)."""

from __future__ import annotations

import numpy as np
from scipy import stats as sps


def ratio_of_sums_delta(edited: np.ndarray, base: np.ndarray, weights: np.ndarray, axis: int = -1) -> np.ndarray:
    """Token-weighted difference of means: (sum edited - sum base) / sum weights, along ``axis``."""
    return (edited.sum(axis) - base.sum(axis)) / weights.sum(axis)


def paired_bootstrap_ci(
    edited: np.ndarray,
    base: np.ndarray,
    weights: np.ndarray,
    *,
    statistic=ratio_of_sums_delta,
    n_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile CI of ``statistic(edited, base, weights)`` resampling documents (rows paired across arrays).

    Uses ``scipy.stats.bootstrap(paired=True, method="percentile")``. With fewer than 2 documents the interval
    is (nan, nan).
    """
    if len(edited) < 2:
        return float("nan"), float("nan")
    res = sps.bootstrap(
        (edited, base, weights), statistic, paired=True, vectorized=True, n_resamples=n_resamples,
        confidence_level=confidence, method="percentile", rng=np.random.default_rng(seed),
    )  # fmt: skip
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def sign_flip_pvalue(differences: np.ndarray, *, n_resamples: int = 10000, seed: int = 0) -> float:
    """Two-sided sign-flip permutation p-value of mean(differences) = 0 (paired differences, one per document).

    ``scipy.stats.permutation_test`` with ``permutation_type="samples"`` on one sample flips signs; with few
    documents it enumerates all 2^n sign patterns exactly.
    """
    d = np.asarray(differences, dtype=np.float64)
    if len(d) < 2 or np.all(d == 0):
        return 1.0
    res = sps.permutation_test(
        (d,), np.mean, permutation_type="samples", n_resamples=n_resamples, alternative="two-sided",
        rng=np.random.default_rng(seed), vectorized=False,
    )  # fmt: skip
    return float(res.pvalue)


def benjamini_hochberg(pvalues: np.ndarray) -> np.ndarray:
    """Benjamini-Hochberg adjusted p-values (q-values), ``scipy.stats.false_discovery_control(method="bh")``."""
    p = np.asarray(pvalues, dtype=np.float64)
    return sps.false_discovery_control(p.ravel(), method="bh").reshape(p.shape)
