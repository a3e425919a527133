"""Tests for LDA, two-covariance PLDA (EM, likelihood, scoring) and the PLDA back end."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from scipy.stats import multivariate_normal

from fedvox.errors import DataError
from fedvox.eval.metrics import compute_eer
from fedvox.eval.plda import LDA, PLDABackend, TwoCovPLDA
from fedvox.eval.scoring import cosine_score


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _random_cov(rng, d, lo, hi):
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    return q @ np.diag(np.linspace(lo, hi, d)) @ q.T


def _two_cov_data(rng, sb, sw, mu, counts):
    """Draw x = mu + y_class + e from the two-covariance model; returns x, labels, y."""
    d = mu.size
    lab = np.repeat(np.arange(len(counts)), counts)
    y = rng.multivariate_normal(np.zeros(d), sb, len(counts))
    x = mu + y[lab] + rng.multivariate_normal(np.zeros(d), sw, lab.size)
    return x, lab, y


def test_plda_recovers_true_covariances():
    rng = np.random.default_rng(0)
    d = 10
    sb, sw = _random_cov(rng, d, 0.2, 3.0), _random_cov(rng, d, 0.1, 1.0)
    mu = 2.0 * rng.normal(size=d)
    x, lab, y = _two_cov_data(rng, sb, sw, mu, np.full(2000, 10))
    m = TwoCovPLDA().fit(x, lab, n_iter=10)
    # Measured (seeds 0-2): Sb 0.05-0.06, Sw 0.013-0.021 relative Frobenius error.
    assert _rel(m.between, sb) < 0.1
    assert _rel(m.within, sw) < 0.05
    # Against the covariance of the class offsets actually drawn (no sampling error in y),
    # the between-class estimate is much closer still.
    assert _rel(m.between, np.cov(y.T, bias=True)) < 0.04
    np.testing.assert_allclose(m.mean, mu, atol=0.1)


def test_em_increases_likelihood_and_likelihood_is_exact():
    rng = np.random.default_rng(1)
    d = 5
    sb, sw = _random_cov(rng, d, 0.3, 2.0), _random_cov(rng, d, 0.1, 0.6)
    # Unequal class sizes: there the closed-form start is not the ML point and EM moves.
    x, lab, _ = _two_cov_data(rng, sb, sw, np.ones(d), rng.integers(1, 25, 200))
    m = TwoCovPLDA().fit(x, lab, n_iter=15)
    ll = np.array(m.log_likelihoods)
    assert ll.size == 16
    assert np.all(np.diff(ll) > -1e-6)  # EM never decreases the likelihood
    # It moves off the start (measured +0.12 nats) and converges (later steps ~1e-8).
    assert ll[-1] - ll[0] > 0.05
    assert ll[-1] - ll[-2] < 1e-6
    # The factorised likelihood equals the joint Gaussian of each class's stacked vectors.
    direct = 0.0
    sub = lab < 25  # a subset keeps the dense check fast; the method takes any grouped data
    for k in range(25):
        xi = x[lab == k]
        n = len(xi)
        cov = np.kron(np.ones((n, n)), m.between) + np.kron(np.eye(n), m.within)
        direct += multivariate_normal(np.tile(m.mean, n), cov).logpdf(xi.ravel())
    assert m.log_likelihood(x[sub], lab[sub]) == pytest.approx(direct, rel=1e-10)
    assert m.log_likelihood(x, lab) == pytest.approx(ll[-1], rel=1e-12)


def test_plda_llr_matches_joint_gaussian_ratio():
    rng = np.random.default_rng(2)
    d = 4
    sb, sw = _random_cov(rng, d, 0.5, 2.0), _random_cov(rng, d, 0.2, 0.8)
    x, lab, _ = _two_cov_data(rng, sb, sw, np.zeros(d), np.full(100, 5))
    m = TwoCovPLDA().fit(x, lab, n_iter=3)
    e, t = rng.normal(size=(6, d)), rng.normal(size=(6, d))
    tot = m.between + m.within
    same = multivariate_normal(np.tile(m.mean, 2), np.block([[tot, m.between], [m.between, tot]]))
    marg = multivariate_normal(m.mean, tot)
    want = [
        same.logpdf(np.r_[a, b]) - marg.logpdf(a) - marg.logpdf(b)
        for a, b in zip(e, t, strict=True)
    ]
    np.testing.assert_allclose(m.score(e, t), want, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(m.score(e, t), m.score(t, e), atol=1e-9)  # symmetric


def _verification_split(rng, sb, sw, n_train=400, n_eval=60, per=8):
    d = sb.shape[0]
    mu = 5.0 * rng.normal(size=d)
    x_tr, l_tr, _ = _two_cov_data(rng, sb, sw, mu, np.full(n_train, per))
    x_ev, l_ev, _ = _two_cov_data(rng, sb, sw, mu, np.full(n_eval, per))
    i, j = np.triu_indices(len(x_ev), 1)
    return x_tr, l_tr, x_ev[i], x_ev[j], l_ev[i] == l_ev[j]


def _eer(scores, labels):
    return compute_eer(scores[labels], scores[~labels])[0]


def test_plda_beats_cosine_on_two_covariance_data():
    rng = np.random.default_rng(3)
    d = 12
    # Speaker information in a few directions, nuisance variability large in others: cosine
    # weighs all directions alike, PLDA whitens the nuisance away.
    sb = np.diag(np.r_[np.full(4, 1.0), np.full(8, 0.02)])
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    sw = q @ np.diag(np.r_[np.full(4, 0.1), np.full(8, 1.5)]) @ q.T
    x_tr, l_tr, e, t, same = _verification_split(rng, sb, sw)
    plda = TwoCovPLDA().fit(x_tr, l_tr)
    backend = PLDABackend(lda_dim=12).fit(x_tr, l_tr)
    eer_cos = _eer(cosine_score(e, t, mean=x_tr.mean(0)), same)
    eer_plda = _eer(plda.score(e, t), same)
    eer_backend = _eer(backend.score(e, t), same)
    # Measured (seeds 3, 13, 23): cosine 0.35, PLDA 0.11-0.14, full back end 0.14-0.17.
    assert eer_plda < 0.5 * eer_cos
    assert eer_backend < 0.6 * eer_cos
    assert eer_plda < 0.2


def test_lda_projects_onto_discriminative_axes():
    rng = np.random.default_rng(4)
    d, k, per = 10, 50, 20
    # Class means differ only in dims 0 and 1; dims 2..9 carry large class-independent noise.
    centres = np.zeros((k, d))
    centres[:, :2] = rng.normal(size=(k, 2)) * 2.0
    noise_sd = np.r_[0.3, 0.3, np.full(d - 2, 3.0)]
    lab = np.repeat(np.arange(k), per)
    x = centres[lab] + noise_sd * rng.normal(size=(k * per, d))
    lda = LDA().fit(x, lab, dim=2)
    y = lda.transform(x)
    assert y.shape == (k * per, 2)
    assert lda.transform(x[0]).shape == (2,)
    # The projection lives in the discriminative subspace ...
    w = lda.matrix / np.linalg.norm(lda.matrix, axis=0)
    assert np.all(np.linalg.norm(w[2:], axis=0) < 0.1)
    # ... whitens within-class variation and separates the classes: nearest class mean
    # classifies well after LDA (chance is 2%).
    means = np.stack([y[lab == c].mean(0) for c in range(k)])
    resid = y - means[lab]
    np.testing.assert_allclose(resid.T @ resid / len(y), np.eye(2), atol=0.05)
    pred = np.argmin(((y[:, None, :] - means[None]) ** 2).sum(-1), axis=1)
    assert np.mean(pred == lab) > 0.6
    assert lda.eigenvalues[0] >= lda.eigenvalues[1] > 10.0
    with pytest.raises(DataError, match="LDA dimension"):
        LDA().fit(x, lab, dim=k)


def test_backend_clips_lda_dim_and_roundtrips(tmp_path):
    rng = np.random.default_rng(5)
    d = 16
    sb, sw = _random_cov(rng, d, 0.2, 2.0), _random_cov(rng, d, 0.1, 0.5)
    x, lab, _ = _two_cov_data(rng, sb, sw, np.zeros(d), np.full(9, 6))  # 9 speakers
    with pytest.warns(UserWarning, match="clipped to 8"):
        backend = PLDABackend(lda_dim=200).fit(x, lab)
    assert backend.lda_dim_used == 8 and backend.notes
    # Kaldi's length norm: every projected vector has norm sqrt(lda dim) before PLDA.
    np.testing.assert_allclose(np.linalg.norm(backend._prepare(x), axis=1), np.sqrt(8))
    e, t = rng.normal(size=(20, d)), rng.normal(size=(20, d))
    scores = backend.score(e, t)
    assert scores.shape == (20,) and np.isfinite(scores).all()

    path = tmp_path / "models" / "plda.npz"
    backend.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["plda.npz"]  # no temp file left
    loaded = PLDABackend.load(path)
    np.testing.assert_array_equal(loaded.score(e, t), scores)
    assert loaded.lda_dim_used == 8

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no clipping note when the dimension fits
        PLDABackend(lda_dim=4).fit(x, lab)

    with pytest.raises(DataError, match="not found"):
        PLDABackend.load(tmp_path / "missing.npz")
    np.savez(tmp_path / "other.npz", a=np.zeros(3))
    with pytest.raises(DataError, match="not a fedvox PLDA"):
        PLDABackend.load(tmp_path / "other.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError):
        PLDABackend.load(tmp_path / "junk.npz")


def test_plda_input_errors():
    x = np.random.default_rng(6).normal(size=(10, 3))
    with pytest.raises(DataError, match="2 speakers"):
        TwoCovPLDA().fit(x, np.zeros(10))
    with pytest.raises(DataError, match="one"):
        TwoCovPLDA().fit(x, np.arange(10))
    with pytest.raises(DataError, match="label"):
        TwoCovPLDA().fit(x, np.zeros(9))
    bad = x.copy()
    bad[0, 0] = np.inf
    with pytest.raises(DataError, match="NaN"):
        PLDABackend(2).fit(bad, np.arange(10) % 2)
