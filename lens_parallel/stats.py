"""Statistics over documents (seeded, vectorised; scipy and statsmodels where they have it).

Non-finite values never pass for a result. Tests and intervals need finite inputs: :func:`sign_flip_pvalue`,
:func:`paired_t` and the bootstraps refuse NaN or inf with a :class:`LensParallelError` naming what was tested (the
``what`` argument: a head label, an arm), since scipy would return p = 0 for them. A p-value that is legitimately
undefined (NaN, e.g. a correlation of a constant) stays NaN through :func:`benjamini_hochberg` and :func:`holm`,
which correct among the finite p-values only (R's ``p.adjust`` convention). scipy's p-value conventions are kept:
an exact sign-flip test counts the observed sign pattern, a resampled one adds one to both counts, so a finite input
never gives p = 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from scipy import stats as sps
from statsmodels.stats.contingency_tables import mcnemar
from statsmodels.stats.power import TTestPower

from lens_parallel.errors import LensParallelError

MDE_FACTOR = 2.9
"""The sanity-checks paper's realised-MDE approximation, MDE = 2.9 sigma_paired / sqrt(n), stated there as "at 80%
power, alpha 0.05" (the normal approximation gives z_{0.975} + z_{0.8} = 2.80; the exact noncentral-t figure at
small n is larger: :func:`mde`)."""


N_RESAMPLES = 2000
"""Bootstrap resamples of every confidence interval by default (one place: settings, statistics, losses)."""


def require_finite(values: np.ndarray, what: str) -> np.ndarray:
    """``values`` as float64, or a :class:`LensParallelError` saying how many of them (and which first) are not
    finite, for ``what`` (e.g. ``"L3H2: per-document delta loss"``)."""
    x = np.asarray(values, dtype=np.float64)
    bad = ~np.isfinite(x)
    if bad.any():
        first = np.unravel_index(int(np.argmax(bad)), x.shape)
        where = first[0] if x.ndim == 1 else tuple(int(i) for i in first)
        raise LensParallelError(
            f"{what}: {int(bad.sum())} of {x.size} values are not finite (the first, at index {where}, is {x[first]}); "
            "a finite value is required"
        )
    return x


def ratio_of_sums_delta(
    edited: np.ndarray, base: np.ndarray, weights: np.ndarray, axis: int = -1
) -> np.ndarray | float:
    """Token-weighted difference of means: (sum edited - sum base) / sum weights, along ``axis``."""
    delta: np.ndarray | float = (edited.sum(axis) - base.sum(axis)) / weights.sum(axis)
    return delta


def paired_bootstrap_ci(
    edited: np.ndarray,
    base: np.ndarray,
    weights: np.ndarray,
    *,
    statistic: Callable[..., np.ndarray | float] = ratio_of_sums_delta,
    n_resamples: int = N_RESAMPLES,
    confidence: float = 0.95,
    seed: int = 0,
    what: str = "paired bootstrap",
) -> tuple[float, float] | tuple[np.ndarray, np.ndarray]:
    """Percentile CI of ``statistic(edited, base, weights)`` resampling documents (rows paired across arrays).

    Uses ``scipy.stats.bootstrap(paired=True, method="percentile")``. Arrays ``[doc]`` give one interval (floats);
    arrays ``[doc, k]`` give k intervals (arrays), each column resampled with the same documents. With fewer than
    2 documents the interval is nan. Non-finite inputs are refused (``what`` names them in the error).
    """
    edited, base, weights = (require_finite(x, what) for x in (edited, base, weights))
    if len(edited) < 2:
        nan = np.full(np.shape(edited)[1:], np.nan)
        return (float("nan"), float("nan")) if np.ndim(edited) == 1 else (nan, nan.copy())
    res = sps.bootstrap(
        (edited, base, weights),
        statistic,
        paired=True,
        vectorized=True,
        axis=0,
        n_resamples=n_resamples,
        confidence_level=confidence,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    low, high = res.confidence_interval
    return (float(low), float(high)) if np.ndim(edited) == 1 else (low, high)


def sign_flip_pvalue(
    differences: np.ndarray, *, n_resamples: int = 10000, seed: int = 0, what: str = "sign-flip test"
) -> float:
    """Two-sided sign-flip permutation p-value of mean(differences) = 0 (paired differences, one per document).

    ``scipy.stats.permutation_test`` with ``permutation_type="samples"`` on one sample flips signs; with few
    documents it enumerates all 2^n sign patterns exactly (p >= 2 / 2^n), else it draws ``n_resamples`` and
    reports twice the smaller one-sided (count + 1) / (n_resamples + 1) (so p >= 2 / (n_resamples + 1)).
    Non-finite differences are refused (``what`` names them): scipy would compare NaN as never extreme and return
    p = 0.
    """
    d = require_finite(differences, what)
    if len(d) < 2 or np.all(d == 0):
        return 1.0
    res = sps.permutation_test(
        (d,),
        np.mean,
        permutation_type="samples",
        n_resamples=n_resamples,
        alternative="two-sided",
        rng=np.random.default_rng(seed),
        vectorized=False,
    )
    return float(res.pvalue)


def _adjusted(pvalues: np.ndarray, adjust: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """``adjust`` applied to the finite p-values (m = their number); NaN (undefined) stays NaN; anything else
    outside [0, 1] is refused."""
    p = np.asarray(pvalues, dtype=np.float64)
    defined = ~np.isnan(p)
    if ((p[defined] < 0) | (p[defined] > 1)).any():
        raise LensParallelError(
            f"p-values must lie in [0, 1] (NaN for undefined), got {p[defined & ((p < 0) | (p > 1))]}"
        )
    out = np.full(p.shape, np.nan)
    if defined.any():
        out[defined] = adjust(p[defined])
    return out


def benjamini_hochberg(pvalues: np.ndarray) -> np.ndarray:
    """Benjamini-Hochberg adjusted p-values (q-values), ``scipy.stats.false_discovery_control(method="bh")``, among
    the defined p-values (NaN stays NaN and does not count as a test)."""
    return _adjusted(pvalues, lambda p: sps.false_discovery_control(p, method="bh"))


def holm(pvalues: np.ndarray) -> np.ndarray:
    """Holm step-down adjusted p-values (family-wise error) among the defined p-values (NaN stays NaN and does not
    count as a test): with p_(1) <= ... <= p_(m), adjusted p_(i) = min(1, max_{j <= i} (m - j + 1) p_(j)), as
    ``statsmodels``' ``multipletests(method="holm")`` computes them (the tests compare the two). Written out here
    because ``multipletests`` runs ``gc.collect()`` on every Holm call: 0.47 s in a process that holds a model and
    lm-eval's tasks."""

    def adjust(p: np.ndarray) -> np.ndarray:
        order = np.argsort(p, kind="stable")
        out = np.empty_like(p)
        out[order] = np.minimum(1.0, np.maximum.accumulate(p[order] * np.arange(len(p), 0, -1)))
        return out

    return _adjusted(pvalues, adjust)


class PairedTest(NamedTuple):
    """Two-sided paired t-test of mean(differences) = 0, with the effect size and the detectable effect."""

    mean: float
    t: float
    p: float
    sigma_paired: float
    cohens_dz: float
    mde_paper: float
    mde_80: float
    mde_90: float
    n: int


def paired_t(differences: np.ndarray, *, what: str = "paired t-test") -> PairedTest:
    """``scipy.stats.ttest_1samp`` on paired differences; sigma_paired = sd(d, ddof=1), d_z = mean / sigma_paired;
    detectable effects: ``mde_paper`` = 2.9 sigma_paired / sqrt(n) (the sanity-checks paper's approximation,
    :func:`minimum_detectable_effect`) and the exact noncentral-t ``mde_80`` / ``mde_90`` at 80% / 90% power,
    alpha 0.05 (:func:`mde`). Non-finite differences are refused (``what`` names them)."""
    d = require_finite(differences, what)
    if len(d) < 2:
        raise LensParallelError(f"a paired t-test needs at least 2 differences, got {len(d)}")
    res = sps.ttest_1samp(d, 0.0)
    sigma = float(d.std(ddof=1))
    return PairedTest(
        mean=float(d.mean()),
        t=float(res.statistic),
        p=float(res.pvalue),
        sigma_paired=sigma,
        cohens_dz=float(d.mean() / sigma) if sigma > 0 else float("nan"),
        mde_paper=minimum_detectable_effect(sigma, len(d)),
        mde_80=mde(sigma, len(d), power=0.8),
        mde_90=mde(sigma, len(d), power=0.9),
        n=len(d),
    )


def minimum_detectable_effect(sigma_paired: float, n: int) -> float:
    """The paper's realised MDE, 2.9 sigma_paired / sqrt(n) (its approximation; :func:`mde` is the exact one)."""
    return float(MDE_FACTOR * sigma_paired / np.sqrt(n))


def mde(sigma: float, n: int, *, alpha: float = 0.05, power: float = 0.8) -> float:
    """Minimum detectable mean paired difference of a two-sided paired t-test with ``n`` pairs: the smallest
    |mean| whose noncentral-t power (df = n - 1, noncentrality mean sqrt(n) / sigma) reaches ``power`` at level
    ``alpha``. Solved for the standardised effect d by statsmodels' ``TTestPower`` (one-sample t on the
    differences), then MDE = d sigma."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 2:
        raise LensParallelError(f"mde needs n >= 2 pairs, got {n!r}")
    if not 0 < alpha < 1 or not 0 < power < 1:
        raise LensParallelError(f"alpha and power must be in (0, 1), got alpha={alpha}, power={power}")
    if not np.isfinite(sigma) or sigma < 0:
        raise LensParallelError(f"sigma must be a finite number >= 0, got {sigma}")
    d = TTestPower().solve_power(effect_size=None, nobs=int(n), alpha=alpha, power=power, alternative="two-sided")
    return float(np.asarray(d).item() * sigma)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation (``scipy.stats.spearmanr``); NaN if either side is constant."""
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    if a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(sps.spearmanr(a, b).statistic)


SPLIT_HALF_METHODS = ("pooled", "cross-half")


def split_half_correlations(stat: np.ndarray, delta: np.ndarray, *, method: str = "pooled") -> dict[str, float]:
    """Split-half reliabilities and the statistic-effect correlation, from per-unit values in two halves
    (``stat``, ``delta``: ``[2, ...]``, flattened over the units, e.g. heads; a unit holding NaN in either, a head a
    layer does not have in a ragged ``[layer, head]`` array, is left out).

    r_stat = Spearman(stat_A, stat_B), r_delta = Spearman(delta_A, delta_B) (no Spearman-Brown), rho_max =
    sqrt(r_stat r_delta). ``pooled`` (the sanity-checks paper's): rho_raw = Spearman(mean of the halves' stat, mean
    of the halves' delta), rho_disattenuated = rho_raw / rho_max, a diagnostic, not a calibrated estimate (the
    numerator uses pooled measurements, the denominator half-sample reliabilities). ``cross-half``: rho_raw = the
    mean of Spearman(stat_A, delta_B) and Spearman(stat_B, delta_A), whose noise is independent between the two
    sides, so rho_raw / rho_max estimates the correlation of the error-free quantities."""
    if method not in SPLIT_HALF_METHODS:
        raise LensParallelError(f"unknown method {method!r}; accepted: {', '.join(SPLIT_HALF_METHODS)}")
    stat, delta = (np.asarray(x, dtype=np.float64).reshape(2, -1) for x in (stat, delta))
    units = np.isfinite(stat).all(0) & np.isfinite(delta).all(0)  # NaN: a unit that does not exist (padding)
    stat, delta = stat[:, units], delta[:, units]
    r_stat, r_delta = spearman(stat[0], stat[1]), spearman(delta[0], delta[1])
    product = r_stat * r_delta
    rho_max = float(np.sqrt(product)) if product > 0 else float("nan")
    if method == "pooled":
        rho_raw = spearman(stat.mean(0), delta.mean(0))
    else:
        rho_raw = 0.5 * (spearman(stat[0], delta[1]) + spearman(stat[1], delta[0]))
    return {
        "r_stat": r_stat,
        "r_delta": r_delta,
        "rho_max": rho_max,
        "rho_raw": rho_raw,
        "rho_disattenuated": rho_raw / rho_max,
    }


def bootstrap_mean_ci(
    values: np.ndarray,
    *,
    n_resamples: int = N_RESAMPLES,
    confidence: float = 0.95,
    seed: int = 0,
    what: str = "bootstrap",
) -> tuple[np.ndarray, np.ndarray]:
    """Percentile CI of the mean over axis 0 (documents), for every column at once (``scipy.stats.bootstrap``);
    non-finite values are refused (``what`` names them)."""
    x = require_finite(values, what)
    if len(x) < 2:
        nan = np.full(x.shape[1:], np.nan)
        return nan, nan
    res = sps.bootstrap(
        (x,),
        np.mean,
        axis=0,
        vectorized=True,
        n_resamples=n_resamples,
        confidence_level=confidence,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    return res.confidence_interval.low, res.confidence_interval.high


def concentration(effects: np.ndarray) -> dict[str, np.ndarray]:
    """How concentrated non-negative effects are over their last axis (n upstream heads).

    shares = e / sum(e); H = -sum shares log shares (natural log, 0 log 0 = 0). Returns, over the leading axes:
    ``effective_n`` = exp(H); ``effective_fraction`` = exp(H) / n; ``normalised_concentration`` = 1 - H / log(n);
    ``top25_share`` / ``bottom25_share`` = total share of the ceil(n/4) largest / smallest; ``heads_for_90`` = the
    fewest heads whose shares reach 0.9. Uniform effects give effective_fraction 1; a single non-zero effect gives
    effective_n 1 and heads_for_90 1. All-zero effects give NaN.
    """
    e = np.asarray(effects, dtype=np.float64)
    if (e < 0).any():
        raise LensParallelError("effects must be non-negative (e.g. relative L2 changes)")
    n = e.shape[-1]
    total = e.sum(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        shares = e / total
        entropy = -np.where(shares > 0, shares * np.log(np.where(shares > 0, shares, 1.0)), 0.0).sum(-1)
    entropy = np.where(total[..., 0] > 0, entropy, np.nan)
    k = int(np.ceil(n / 4))
    ordered = -np.sort(-shares, axis=-1)  # descending; NaN rows stay NaN
    reached = np.cumsum(ordered, axis=-1) >= 0.9 - 1e-12
    heads_for_90 = np.where(np.isnan(entropy), np.nan, reached.argmax(-1) + 1.0)
    metrics = {
        "effective_n": np.exp(entropy),
        "effective_fraction": np.exp(entropy) / n,
        "normalised_concentration": 1 - entropy / np.log(n) if n > 1 else np.zeros_like(entropy),
        "top25_share": ordered[..., :k].sum(-1),
        "bottom25_share": ordered[..., n - k :].sum(-1),
        "heads_for_90": heads_for_90,
    }
    return {name: np.asarray(values) for name, values in metrics.items()}  # 0-d arrays for one vector


def mcnemar_exact(unedited: np.ndarray, edited: np.ndarray) -> float:
    """Exact (binomial) McNemar p-value of paired 0/1 outcomes: statsmodels' ``mcnemar(exact=True)`` on the 2 x 2
    table; 1.0 when no item is discordant."""
    a, b = unedited.astype(bool), edited.astype(bool)
    table = [[int((a & b).sum()), int((a & ~b).sum())], [int((~a & b).sum()), int((~a & ~b).sum())]]
    if table[0][1] + table[1][0] == 0:
        return 1.0
    return float(mcnemar(table, exact=True).pvalue)


def mean_of_means_ci(
    per_group: list[np.ndarray], *, n_resamples: int = N_RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """95% percentile CI of the unweighted mean over groups (tasks) of each group's mean paired difference
    mean(b - a), items resampled within each group; ``per_group``: one ``[2, item]`` array (a, b) per group. With a
    group of fewer than 2 items the interval is nan, as :func:`paired_bootstrap_ci`'s: resampling one item shows
    none of its group's variation, and the interval would be as narrow as the other groups alone make it."""
    if any(np.shape(values)[1] < 2 for values in per_group):
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    draws = np.zeros(n_resamples)
    for values in per_group:
        d = values[1] - values[0]
        idx = rng.integers(0, len(d), size=(n_resamples, len(d)))
        draws += d[idx].mean(1)
    draws /= len(per_group)
    low, high = np.quantile(draws, [0.025, 0.975])
    return float(low), float(high)
