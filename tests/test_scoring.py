"""Tests for cosine scoring, AS-norm, cohorts and the score_trials dispatcher."""

from __future__ import annotations

import numpy as np
import pytest

from fedvox.errors import ConfigError, DataError
from fedvox.eval.metrics import compute_eer
from fedvox.eval.plda import PLDABackend
from fedvox.eval.scoring import (
    as_norm,
    cohort_from_training,
    cosine_score,
    length_normalize,
    score_trials,
)


def test_length_normalize():
    x = np.array([[3.0, 4.0], [0.0, 0.0], [-1.0, 0.0]])
    y = length_normalize(x)
    np.testing.assert_allclose(y, [[0.6, 0.8], [0, 0], [-1, 0]])
    np.testing.assert_allclose(length_normalize(np.array([0.0, 2.0])), [0.0, 1.0])


def test_cosine_score_subtracts_mean():
    e = np.array([[11.0, 10.0], [10.0, 11.0]])
    t = np.array([[10.0, 11.0], [10.0, 11.0]])
    # Without centring every pair looks alike (~0.99); the training mean (10, 10) reveals
    # the first pair is orthogonal and the second identical.
    assert np.all(cosine_score(e, t) > 0.99)
    np.testing.assert_allclose(cosine_score(e, t, mean=np.array([10.0, 10.0])), [0.0, 1.0])
    with pytest.raises(DataError, match="shape"):
        cosine_score(e, t[:1])
    with pytest.raises(DataError, match="mean"):
        cosine_score(e, t, mean=np.zeros(3))


def test_as_norm_hand_example():
    raw = np.array([0.5])
    ec = np.array([[0.1, 0.3, -0.9, 0.2]])  # top-3: 0.3, 0.2, 0.1 -> mu 0.2, sd sqrt(2/300)
    tc = np.array([[0.0, 0.4, -0.5, 0.2]])  # top-3: 0.4, 0.2, 0.0 -> mu 0.2, sd sqrt(8/300)
    expected = 0.5 * (0.3 / np.sqrt(2 / 300) + 0.3 / np.sqrt(8 / 300))
    np.testing.assert_allclose(as_norm(raw, ec, tc, top_n=3), [expected])
    # The lowest cohort score is outside the top 3, so changing it changes nothing ...
    ec2 = ec.copy()
    ec2[0, 2] = -5.0
    np.testing.assert_allclose(as_norm(raw, ec2, tc, top_n=3), [expected])
    # ... but it does with top_n = all 4.
    assert not np.allclose(as_norm(raw, ec2, tc, top_n=4), as_norm(raw, ec, tc, top_n=4))


def test_as_norm_top_n_larger_than_cohort():
    rng = np.random.default_rng(0)
    raw, ec, tc = rng.normal(size=5), rng.normal(size=(5, 7)), rng.normal(size=(5, 7))
    a = as_norm(raw, ec, tc, top_n=300)
    np.testing.assert_allclose(a, as_norm(raw, ec, tc, top_n=7))
    mu_e, sd_e, mu_t, sd_t = ec.mean(1), ec.std(1), tc.mean(1), tc.std(1)
    np.testing.assert_allclose(a, 0.5 * ((raw - mu_e) / sd_e + (raw - mu_t) / sd_t))
    with pytest.raises(ConfigError, match="top_n"):
        as_norm(raw, ec, tc, top_n=0)
    with pytest.raises(DataError, match="cohort"):
        as_norm(raw, ec[:3], tc)


def test_as_norm_invariant_to_per_speaker_affine_maps():
    rng = np.random.default_rng(1)
    n, c = 40, 50
    spk = rng.integers(0, 4, n)  # enroll speaker of each trial
    raw, ec, tc = rng.normal(size=n), rng.normal(size=(n, c)), rng.normal(size=(n, c))
    base = as_norm(raw, ec, tc, top_n=10)
    shift = np.array([0.7, -2.0, 0.0, 5.0])[spk]
    scale = np.array([2.0, 0.5, 1.0, 3.0])[spk]
    # A speaker-dependent affine map of everything a trial's normalisation sees (its raw
    # score and both cohort lists) leaves the normalised score unchanged.
    out = as_norm(
        scale * raw + shift,
        scale[:, None] * ec + shift[:, None],
        scale[:, None] * tc + shift[:, None],
        top_n=10,
    )
    np.testing.assert_allclose(out, base, atol=1e-12)
    # Shifting only the enroll side (raw + enroll cohort, one speaker's offset) is absorbed
    # exactly by the enroll term; what remains is the test term's 0.5 * shift / sd_t.
    out = as_norm(raw + shift, ec + shift[:, None], tc, top_n=10)
    sd_t = np.sort(tc, axis=1)[:, -10:].std(axis=1)
    np.testing.assert_allclose(out - base, 0.5 * shift / sd_t, atol=1e-12)


def test_cohort_from_training():
    x = np.array([[1.0, 0.0], [3.0, 2.0], [0.0, 5.0], [2.0, 2.0]])
    spk = ["b", "a", "c", "b"]
    np.testing.assert_allclose(cohort_from_training(x, spk), [[3, 2], [1.5, 1], [0, 5]])
    with pytest.raises(DataError):
        cohort_from_training(x, spk[:3])


def _toy_embeddings(rng, n_spk=30, per=6, dim=16, offset=3.0):
    centres = rng.normal(size=(n_spk, dim))
    common = offset * np.ones(dim)  # a shared offset that the training mean removes
    keys, vecs, spks = [], [], []
    for s in range(n_spk):
        for u in range(per):
            keys.append(f"spk{s}/utt{u}")
            vecs.append(common + centres[s] + 0.6 * rng.normal(size=dim))
            spks.append(f"spk{s}")
    return keys, np.array(vecs), np.array(spks)


def _trials(keys, spks, rng, n=400):
    i, j = rng.integers(0, len(keys), n), rng.integers(0, len(keys), n)
    keep = i != j
    i, j = i[keep], j[keep]
    return [keys[k] for k in i], [keys[k] for k in j], spks[i] == spks[j]


def test_score_trials_cosine_dict_and_tuple_agree():
    rng = np.random.default_rng(2)
    keys, vecs, spks = _toy_embeddings(rng)
    e_ids, t_ids, _ = _trials(keys, spks, rng)
    mean = vecs.mean(0)
    as_dict = score_trials(dict(zip(keys, vecs, strict=True)), e_ids, t_ids, mean=mean)
    as_tuple = score_trials((keys, vecs), e_ids, t_ids, backend="cosine", mean=mean)
    pos = {k: n for n, k in enumerate(keys)}
    direct = cosine_score(vecs[[pos[k] for k in e_ids]], vecs[[pos[k] for k in t_ids]], mean=mean)
    np.testing.assert_allclose(as_dict, direct, atol=1e-12)
    np.testing.assert_allclose(as_tuple, direct, atol=1e-12)
    assert score_trials((keys, vecs), [], []).shape == (0,)


def test_score_trials_errors():
    keys, vecs = ["a", "b"], np.eye(2)
    with pytest.raises(DataError, match="no embedding"):
        score_trials((keys, vecs), ["a"], ["zz"])
    with pytest.raises(DataError, match="no embedding"):
        score_trials({"a": vecs[0]}, ["a"], ["b"])
    with pytest.raises(ConfigError, match="backend"):
        score_trials((keys, vecs), ["a"], ["b"], backend="lda")
    with pytest.raises(ConfigError, match="cohort"):
        score_trials((keys, vecs), ["a"], ["b"], backend="asnorm")
    with pytest.raises(ConfigError, match="plda"):
        score_trials((keys, vecs), ["a"], ["b"], backend="plda")
    with pytest.raises(DataError, match="ids"):
        score_trials((keys, vecs), ["a", "b"], ["b"])
    with pytest.raises(DataError, match="NaN"):
        score_trials((keys, np.array([[np.nan, 0.0], [1.0, 0.0]])), ["a"], ["b"])


def test_score_trials_asnorm_matches_explicit_as_norm():
    rng = np.random.default_rng(3)
    keys, vecs, spks = _toy_embeddings(rng)
    _, tr_vecs, tr_spks = _toy_embeddings(np.random.default_rng(30), n_spk=40)
    mean = tr_vecs.mean(0)
    cohort = cohort_from_training(tr_vecs, tr_spks)
    assert cohort.shape == (40, vecs.shape[1])
    e_ids, t_ids, _ = _trials(keys, spks, rng)
    got = score_trials(
        (keys, vecs), e_ids, t_ids, backend="asnorm", mean=mean, cohort=cohort, top_n=10
    )
    # The same thing spelt out per trial, through as_norm.
    pos = {k: n for n, k in enumerate(keys)}
    e, t = vecs[[pos[k] for k in e_ids]], vecs[[pos[k] for k in t_ids]]
    rep = lambda m, n: np.repeat(m, n, axis=0)  # noqa: E731
    raw = cosine_score(e, t, mean)
    ec = cosine_score(rep(e, len(cohort)), np.tile(cohort, (len(e), 1)), mean).reshape(len(e), -1)
    tc = cosine_score(rep(t, len(cohort)), np.tile(cohort, (len(t), 1)), mean).reshape(len(t), -1)
    np.testing.assert_allclose(got, as_norm(raw, ec, tc, top_n=10), atol=1e-10)
    # top_n above the cohort size uses the whole cohort.
    big = score_trials((keys, vecs), e_ids, t_ids, "asnorm", mean=mean, cohort=cohort, top_n=1000)
    np.testing.assert_allclose(big, as_norm(raw, ec, tc, top_n=40), atol=1e-10)


def test_asnorm_calibrates_speaker_dependent_offsets():
    # Each speaker's embeddings sit on a speaker-specific "hub" direction shared with part of
    # the cohort, inflating that speaker's non-target scores; AS-norm should undo that.
    rng = np.random.default_rng(4)
    dim, n_hub = 24, 4
    hubs = rng.normal(size=(n_hub, dim)) * 1.5

    def draw(n_spk, per, gen):
        hub = gen.integers(0, n_hub, n_spk)
        strength = gen.uniform(0, 1.5, n_spk)
        centres = gen.normal(size=(n_spk, dim)) + strength[:, None] * hubs[hub]
        x = np.repeat(centres, per, axis=0) + 0.8 * gen.normal(size=(n_spk * per, dim))
        return x, np.repeat(np.arange(n_spk), per)

    tr_x, tr_s = draw(300, 4, np.random.default_rng(40))
    ev_x, ev_s = draw(60, 4, rng)
    keys = [f"u{i}" for i in range(len(ev_x))]
    i, j = np.triu_indices(len(ev_x), 1)
    labels = ev_s[i] == ev_s[j]
    e_ids, t_ids = [keys[k] for k in i], [keys[k] for k in j]
    mean = tr_x.mean(0)
    cos = score_trials((keys, ev_x), e_ids, t_ids, "cosine", mean=mean)
    asn = score_trials(
        (keys, ev_x),
        e_ids,
        t_ids,
        "asnorm",
        mean=mean,
        cohort=cohort_from_training(tr_x, tr_s),
        top_n=50,
    )
    eer_cos = compute_eer(cos[labels], cos[~labels])[0]
    eer_asn = compute_eer(asn[labels], asn[~labels])[0]
    # Measured: cosine 5.7%, AS-norm 1.7% EER.
    assert eer_asn < 0.6 * eer_cos


def test_score_trials_plda_uses_backend():
    rng = np.random.default_rng(5)
    keys, vecs, spks = _toy_embeddings(rng)
    backend = PLDABackend(lda_dim=8).fit(vecs, spks)
    e_ids, t_ids, _ = _trials(keys, spks, rng, n=50)
    pos = {k: n for n, k in enumerate(keys)}
    got = score_trials((keys, vecs), e_ids, t_ids, backend="plda", plda=backend)
    want = backend.score(vecs[[pos[k] for k in e_ids]], vecs[[pos[k] for k in t_ids]])
    np.testing.assert_allclose(got, want)
