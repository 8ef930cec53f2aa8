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
    assert res.mde == pytest.approx(2.9 * sigma / np.sqrt(12)) == stats.minimum_detectable_effect(sigma, 12)
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
