"""Tests for EER, minDCF, the DET curve and the DET plot against hand-worked and independent values."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.interpolate import interp1d
from scipy.optimize import brentq
from sklearn.metrics import roc_curve

from fedvox.errors import DataError
from fedvox.eval.metrics import (
    VerificationMetrics,
    compute_eer,
    compute_min_dcf,
    det_curve,
    evaluate_scores,
)
from fedvox.eval.plots import plot_det

TOY_TGT = np.array([0.9, 0.8, 0.3])
TOY_NON = np.array([0.7, 0.2, 0.1, 0.05])


def test_toy_eer_is_roc_interpolated_25_percent():
    # Operating points (P_miss, P_fa) go (0, 1/4) at threshold 0.3 -> (1/3, 1/4) at 0.7;
    # P_miss - P_fa changes sign there and the interpolated crossing is at 1/4 (Kaldi: 1/3).
    eer, thr = compute_eer(TOY_TGT, TOY_NON)
    assert eer == pytest.approx(0.25, abs=1e-12)
    assert 0.3 < thr < 0.7


def test_toy_min_dcf_by_hand():
    # Points (P_miss, P_fa): (0,1) (0,.75) (0,.5) (0,.25) (1/3,.25) (1/3,0) (2/3,0) (1,0).
    # p=0.01: cost/0.01 = P_miss + 99 P_fa -> min 1/3 at (1/3, 0), threshold 0.8.
    val, thr = compute_min_dcf(TOY_TGT, TOY_NON, 0.01)
    assert val == pytest.approx(1 / 3, abs=1e-12)
    assert thr == pytest.approx(0.8)
    # p=0.05: cost/0.05 = P_miss + 19 P_fa -> also 1/3 (next best (0, .25) gives 4.75).
    assert compute_min_dcf(TOY_TGT, TOY_NON, 0.05)[0] == pytest.approx(1 / 3, abs=1e-12)
    # p=0.5: cost/0.5 = P_miss + P_fa -> 0.25 at (0, .25), threshold 0.3: the normaliser
    # and the threshold search both show up here.
    val, thr = compute_min_dcf(TOY_TGT, TOY_NON, 0.5)
    assert val == pytest.approx(0.25, abs=1e-12)
    assert thr == pytest.approx(0.3)
    # Unequal costs: c_miss=10, p=0.01 -> (0.1 P_miss + 0.99 P_fa) / 0.1; (1/3, 0) gives 1/3,
    # (0, .25) gives 2.475, (1, 0) gives 1.
    assert compute_min_dcf(TOY_TGT, TOY_NON, 0.01, c_miss=10.0)[0] == pytest.approx(1 / 3)


def test_det_curve_toy_points():
    p_miss, p_fa, thr = det_curve(TOY_TGT, TOY_NON)
    np.testing.assert_allclose(p_miss, [0, 0, 0, 0, 1 / 3, 1 / 3, 2 / 3, 1])
    np.testing.assert_allclose(p_fa, [1, 0.75, 0.5, 0.25, 0.25, 0, 0, 0])
    assert np.isinf(thr[-1]) and np.all(np.diff(thr) > 0)


def _sklearn_eer(tgt: np.ndarray, non: np.ndarray) -> float:
    """EER the common independent way: ROC from sklearn, solve FNR(fpr) = fpr."""
    labels = np.r_[np.ones(tgt.size), np.zeros(non.size)]
    fpr, tpr, _ = roc_curve(labels, np.r_[tgt, non])
    return float(brentq(lambda x: 1.0 - x - interp1d(fpr, tpr)(x), 0.0, 1.0))


@pytest.mark.parametrize("seed", [0, 1])
def test_eer_matches_sklearn_on_large_gaussian_lists(seed):
    rng = np.random.default_rng(seed)
    tgt = rng.normal(2.0, 1.0, 10_000)
    non = rng.normal(0.0, 1.2, 40_000)
    eer, thr = compute_eer(tgt, non)
    assert abs(eer - _sklearn_eer(tgt, non)) < 1e-3
    # The threshold is where the empirical error rates are (nearly) equal.
    assert abs(np.mean(tgt < thr) - np.mean(non >= thr)) < 2e-3
    # And near the population EER of these two Gaussians (~0.16).
    from scipy.stats import norm

    t_star = brentq(lambda t: norm.cdf(t, 2, 1) - norm.sf(t, 0, 1.2), -5, 5)
    assert abs(eer - norm.cdf(t_star, 2, 1)) < 0.01


def test_min_dcf_matches_brute_force():
    rng = np.random.default_rng(3)
    tgt = np.round(rng.normal(1.5, 1.0, 300), 2)  # rounding makes ties, which must not matter
    non = np.round(rng.normal(0.0, 1.0, 1200), 2)
    for p in (0.01, 0.05, 0.3):
        best = np.inf
        for th in [*np.unique(np.r_[tgt, non]), np.inf]:
            cost = np.mean(tgt < th) * p + np.mean(non >= th) * (1 - p)
            best = min(best, cost / min(p, 1 - p))
        assert compute_min_dcf(tgt, non, p)[0] == pytest.approx(best, abs=1e-12)


def test_perfect_separation_and_identical_distributions():
    rng = np.random.default_rng(4)
    eer, thr = compute_eer(rng.uniform(2, 3, 500), rng.uniform(0, 1, 500))
    assert eer == 0.0 and 1.0 <= thr <= 3.0
    assert compute_min_dcf(rng.uniform(2, 3, 50), rng.uniform(0, 1, 50), 0.01)[0] == 0.0
    same = rng.normal(size=40_000)
    assert compute_eer(same[:20_000], same[20_000:])[0] == pytest.approx(0.5, abs=0.01)
    # Reversed scores (targets lower) give an EER near 1, not clipped to 0.5.
    assert compute_eer(rng.uniform(0, 1, 100), rng.uniform(2, 3, 100))[0] == pytest.approx(1.0)


def test_eer_independent_of_tie_order():
    tgt = np.array([0.5, 0.5, 0.9])
    non = np.array([0.5, 0.1])
    a = compute_eer(tgt, non)[0]
    b = compute_eer(tgt[::-1], non[::-1])[0]
    assert a == b


def test_evaluate_scores_and_errors():
    scores = np.r_[TOY_TGT, TOY_NON]
    labels = np.array([True, True, True, False, False, False, False])
    m = evaluate_scores(scores, labels)
    assert isinstance(m, VerificationMetrics)
    assert m.eer == pytest.approx(0.25)
    assert m.min_dcf_01 == pytest.approx(1 / 3) and m.min_dcf_05 == pytest.approx(1 / 3)
    assert (m.n_target, m.n_nontarget) == (3, 4)
    d = m.to_dict()
    assert set(d) == {"eer", "eer_threshold", "min_dcf_01", "min_dcf_05", "n_target", "n_nontarget"}
    assert evaluate_scores(scores, labels.astype(int)).eer == m.eer  # 0/1 labels accepted

    with pytest.raises(DataError, match="no target"):
        evaluate_scores(TOY_NON, np.zeros(4, bool))
    with pytest.raises(DataError, match="no non-target"):
        evaluate_scores(TOY_TGT, np.ones(3, bool))
    bad = scores.copy()
    bad[1] = np.nan
    with pytest.raises(DataError, match="not finite"):
        evaluate_scores(bad, labels)
    with pytest.raises(DataError, match="labels"):
        evaluate_scores(scores, labels[:-1])
    with pytest.raises(DataError, match="boolean"):
        evaluate_scores(scores, np.arange(7))
    with pytest.raises(ValueError, match="p_target"):
        compute_min_dcf(TOY_TGT, TOY_NON, 1.0)


def test_plot_det_writes_png(tmp_path):
    rng = np.random.default_rng(5)
    curves = {
        "good": (rng.normal(3, 1, 2000), rng.normal(0, 1, 2000)),
        "poor": (rng.normal(1, 1, 2000), rng.normal(0, 1, 2000)),
        "perfect": (rng.uniform(2, 3, 100), rng.uniform(0, 1, 100)),
    }
    out = plot_det(curves, tmp_path / "sub" / "det.png", title="test")
    assert out == tmp_path / "sub" / "det.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert [p.name for p in out.parent.iterdir()] == ["det.png"]  # no temp file left behind
