from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps
from statsmodels.stats.multitest import multipletests

from lens_parallel import stats


def test_holm_hand_checked():
    # sorted 0.005 x4 = 0.02, 0.01 x3 = 0.03, 0.03 x2 = 0.06, 0.04 x1 = 0.04 -> step-down max keeps 0.06
    np.testing.assert_allclose(stats.holm(np.array([0.01, 0.04, 0.03, 0.005])), [0.03, 0.06, 0.06, 0.02])


def test_bh_matches_statsmodels():
    p = np.random.default_rng(0).uniform(size=40) ** 2
    np.testing.assert_allclose(stats.benjamini_hochberg(p), multipletests(p, method="fdr_bh")[1])
    np.testing.assert_allclose(
        stats.benjamini_hochberg(np.array([0.01, 0.04, 0.03, 0.2])), [0.04, 0.16 / 3, 0.16 / 3, 0.2]
    )


def test_paired_t_matches_scipy_ttest_rel():
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=12), rng.normal(size=12) + 0.3
    res = stats.paired_t(b - a)
    ref = sps.ttest_rel(b, a)
    assert res.t == pytest.approx(ref.statistic) and res.p == pytest.approx(ref.pvalue)
    sigma = np.std(b - a, ddof=1)
    assert res.sigma_paired == pytest.approx(sigma) and res.cohens_dz == pytest.approx(np.mean(b - a) / sigma)
    assert res.mde_paper == pytest.approx(2.9 * sigma / np.sqrt(12)) == stats.minimum_detectable_effect(sigma, 12)
    assert res.mde_80 == stats.mde(sigma, 12, power=0.8) and res.mde_90 == stats.mde(sigma, 12, power=0.9)
    with pytest.raises(ValueError, match="at least 2 differences"):
        stats.paired_t(np.array([1.0]))


def test_sign_flip_exact_enumeration():
    # 7 positive, 1 negative: only the observed pattern, its mirror, and flipping the negative one (and its mirror)
    # reach |mean| >= observed: 4 of 2^8 sign patterns
    d = np.array([0.1, 0.2, 0.15, -0.05, 0.3, 0.12, 0.08, 0.11])
    assert stats.sign_flip_pvalue(d) == pytest.approx(4 / 256)
    assert stats.sign_flip_pvalue(np.zeros(5)) == 1.0


def test_spearman_and_bootstrap():
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=30), rng.normal(size=30)
    assert stats.spearman(a, b) == pytest.approx(sps.spearmanr(a, b).statistic)
    assert stats.spearman(a, a) == 1.0 and np.isnan(stats.spearman(a, np.ones(30)))
    x = rng.normal(size=(50, 3)) + np.array([0.0, 1.0, -1.0])
    lo, hi = stats.bootstrap_mean_ci(x, seed=3)
    assert (lo < x.mean(0)).all() and (x.mean(0) < hi).all()
    assert np.array_equal(lo, stats.bootstrap_mean_ci(x, seed=3)[0])  # seeded: bit for bit
    e, base, w = rng.normal(size=20) + 1.0, rng.normal(size=20), np.full(20, 10.0)
    lo, hi = stats.paired_bootstrap_ci(e, base, w, seed=4)
    assert lo < stats.ratio_of_sums_delta(e, base, w) < hi


@pytest.mark.parametrize("n", [4, 8, 16])
@pytest.mark.parametrize("power", [0.8, 0.9])
def test_exact_mde_has_the_asked_power_and_exceeds_the_papers_approximation(n, power):
    """At the exact MDE the two-sided paired t-test (df n-1, noncentrality mde sqrt(n) / sigma) has the asked power,
    computed here from scipy's noncentral t; the paper's 2.9 sigma / sqrt(n) is smaller at these n."""
    sigma = 0.002
    effect = stats.mde(sigma, n, power=power)
    crit = sps.t.ppf(0.975, n - 1)
    nc = effect * np.sqrt(n) / sigma
    achieved = sps.nct.sf(crit, n - 1, nc) + sps.nct.cdf(-crit, n - 1, nc)
    assert achieved == pytest.approx(power, abs=1e-6)
    assert effect > stats.minimum_detectable_effect(sigma, n) == pytest.approx(2.9 * sigma / np.sqrt(n))
    with pytest.raises(ValueError, match="n >= 2"):
        stats.mde(sigma, 1)


def test_cross_half_correlation_recovers_a_known_correlation_and_the_pooled_one_is_a_diagnostic():
    """Latent statistic s and effect e with Spearman correlation rho_s; each half measures s with a little noise
    and e with as much noise as signal. The cross-half disattenuated correlation recovers rho_s; the paper's pooled
    one (pooled numerator, half-sample denominator) overshoots it."""
    rng = np.random.default_rng(0)
    n, rho = 20000, 0.6
    s, e = rng.multivariate_normal([0, 0], [[1, rho], [rho, 1]], size=n).T
    stat = np.stack([s + rng.normal(0, 0.3, n) for _ in range(2)])
    delta = np.stack([e + rng.normal(0, 1.0, n) for _ in range(2)])
    true_spearman = 6 / np.pi * np.arcsin(rho / 2)
    cross = stats.split_half_correlations(stat, delta, method="cross-half")
    pooled = stats.split_half_correlations(stat, delta)
    assert cross["rho_disattenuated"] == pytest.approx(true_spearman, abs=0.03)
    assert pooled["rho_disattenuated"] > true_spearman + 0.05
    assert cross["r_stat"] == pooled["r_stat"] and cross["rho_max"] == pooled["rho_max"]
    with pytest.raises(ValueError, match="unknown method 'both'"):
        stats.split_half_correlations(stat, delta, method="both")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_inputs_are_refused_never_p_zero(bad):
    """scipy compares NaN as never extreme (p = 0 for a NaN input): a test needs finite values, and says whose."""
    d = np.array([0.1, bad, 0.2, 0.3, -0.05])
    with pytest.raises(stats.LensParallelError, match=r"L3H2: 1 of 5 values are not finite .*index 1"):
        stats.sign_flip_pvalue(d, what="L3H2")
    with pytest.raises(stats.LensParallelError, match="xsa-gated - baseline: 1 of 5 values are not finite"):
        stats.paired_t(d, what="xsa-gated - baseline")
    with pytest.raises(stats.LensParallelError, match="not finite"):
        stats.bootstrap_mean_ci(d[:, None])
    with pytest.raises(stats.LensParallelError, match="not finite"):
        stats.paired_bootstrap_ci(d, np.zeros(5), np.ones(5))


def test_a_finite_input_never_gives_p_zero():
    """scipy's conventions: the exact test counts the observed sign pattern (p >= 2 / 2^n), the resampled one adds
    one to both counts of each side, and two-sided doubles the smaller side (p >= 2 / (n_resamples + 1))."""
    strong = np.full(20, 1.0) + np.linspace(0, 1e-3, 20)
    assert stats.sign_flip_pvalue(strong[:6]) == pytest.approx(2 / 2**6)
    assert stats.sign_flip_pvalue(strong, n_resamples=999) == pytest.approx(2 / 1000)


def test_corrections_keep_undefined_p_values_undefined():
    """NaN (an undefined p-value) stays NaN and is not counted as a test: the others are corrected among the
    defined ones, as R's p.adjust does; BH no longer raises on NaN."""
    p = np.array([0.01, np.nan, 0.04, 0.03])
    defined = p[~np.isnan(p)]
    for corrected, method in ((stats.holm(p), "holm"), (stats.benjamini_hochberg(p), "fdr_bh")):
        assert np.isnan(corrected[1])
        np.testing.assert_allclose(corrected[[0, 2, 3]], multipletests(defined, method=method)[1])
    assert np.isnan(stats.holm(np.full(3, np.nan))).all()
    with pytest.raises(stats.LensParallelError, match=r"p-values must lie in \[0, 1\]"):
        stats.benjamini_hochberg(np.array([0.2, np.inf]))


def test_the_mean_of_means_ci_is_exact_where_every_draw_is_the_same():
    """Constant differences within each group: every resample gives the mean over groups of those constants."""
    from lens_parallel.stats import mean_of_means_ci

    a = [np.stack([np.zeros(5), np.full(5, 0.2)]), np.stack([np.ones(3), np.full(3, 0.4)])]  # d = 0.2 and -0.6
    low, high = mean_of_means_ci(a, n_resamples=200, seed=1)
    assert low == pytest.approx(-0.2) and high == pytest.approx(-0.2)
    spread = [np.stack([np.zeros(40), np.r_[np.zeros(20), np.ones(20)]])]  # d: half 0, half 1; mean 0.5
    low, high = mean_of_means_ci(spread, n_resamples=4000, seed=0)
    assert low < 0.5 < high and high - low == pytest.approx(2 * 1.96 * 0.5 / np.sqrt(40), abs=0.05)
    one_item = [*spread, np.stack([np.zeros(1), np.ones(1)])]  # a task of one item: no CI, not a narrow one
    assert all(np.isnan(mean_of_means_ci(one_item, n_resamples=200, seed=0)))
