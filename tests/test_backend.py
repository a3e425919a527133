"""Tests for fedvox.eval.backend: fitting only the back ends asked for, saving and reloading."""

from __future__ import annotations

import numpy as np

from fedvox.eval.backend import (
    Backend,
    BackendConfig,
    fit_backend,
    speaker_offset,
    train_subset,
)


def _embeddings(n_spk: int = 6, per: int = 5, dim: int = 8) -> tuple[np.ndarray, list[str]]:
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(n_spk, dim)) * 3
    x = np.concatenate([c + rng.normal(size=(per, dim)) for c in centres])
    return x, [f"s{i}" for i in range(n_spk) for _ in range(per)]


def test_train_subset_takes_every_speaker_before_a_second_utterance() -> None:
    utts = ["a2", "a1", "b1", "b2", "c1"]
    spks = ["a", "a", "b", "b", "c"]
    assert train_subset(utts, spks, 4) == [0, 1, 2, 4]  # a1, b1, c1, then a2
    assert train_subset(utts, spks, 99) == [0, 1, 2, 3, 4]


def test_train_subset_keeps_two_utterances_a_speaker_when_speakers_outnumber_it() -> None:
    # 10,000 one-speaker devices and a 4,000-utterance subset left every speaker with one
    # utterance, and PLDA refused the run; now an even half of the budget's speakers, two each
    spks = [f"s{i:02d}" for i in range(10) for _ in range(3)]
    utts = [f"{s}-{j}" for i, s in enumerate(spks) for j in [i % 3]]
    got = train_subset(utts, spks, 4)
    assert [spks[i] for i in got] == ["s00", "s00", "s09", "s09"]
    assert [spks[i] for i in train_subset(utts, spks, 3)] == ["s00"] * 3  # one speaker
    # 40 speakers, a subset of 20: ten of them, two each, and PLDA fits on it
    spks = [f"s{i:02d}" for i in range(40) for _ in range(3)]
    utts = [f"{s}-{j % 3}" for j, s in enumerate(spks)]
    got = train_subset(utts, spks, 20)
    counts = {s: [spks[i] for i in got].count(s) for s in {spks[i] for i in got}}
    assert len(counts) == 10 and set(counts.values()) == {2}
    x = np.random.default_rng(0).normal(size=(len(spks), 8))
    plda = fit_backend(x[got], [spks[i] for i in got], BackendConfig(("plda",), 4, 4, 20))
    assert plda.plda is not None


def test_fit_backend_fits_only_the_back_ends_it_will_score() -> None:
    x, spk = _embeddings()
    cosine = fit_backend(x, spk, BackendConfig(("cosine",), 10, 4, 100))
    np.testing.assert_allclose(cosine.mean, x.mean(axis=0))
    assert cosine.cohort is None and cosine.plda is None
    full = fit_backend(x, spk, BackendConfig(("cosine", "asnorm", "plda"), 10, 4, 100))
    assert full.cohort is not None and full.cohort.shape == (6, 8)
    assert full.plda is not None


def test_backend_save_load_round_trip(tmp_path) -> None:
    x, spk = _embeddings()
    fitted = fit_backend(x, spk, BackendConfig(("cosine", "asnorm", "plda"), 10, 4, 100))
    fitted.save(tmp_path / "backend")
    loaded = Backend.load(tmp_path / "backend")
    np.testing.assert_array_equal(loaded.mean, fitted.mean)
    np.testing.assert_array_equal(loaded.cohort, fitted.cohort)
    probe = x[:3]
    np.testing.assert_allclose(
        loaded.plda.score(probe, probe), fitted.plda.score(probe, probe), rtol=0, atol=0
    )


def test_speaker_offset_measures_a_direction_common_to_every_speaker() -> None:
    rng = np.random.default_rng(0)
    dim, speakers, per = 64, 30, 4
    centres = rng.standard_normal((speakers, dim))
    emb = {
        f"s{s:02d}-{k}": centres[s] + 0.1 * rng.standard_normal(dim)
        for s in range(speakers)
        for k in range(per)
    }

    def spk(u: str) -> str:
        return u.split("-")[0]

    spread = speaker_offset(emb, spk)
    shifted = speaker_offset({u: e + 5.0 * np.ones(dim) for u, e in emb.items()}, spk)
    assert abs(spread) < 0.1  # random centres: nearly orthogonal prototypes
    assert shifted > 0.9  # a shared direction dominates every prototype
    # a speaker's own utterances do not count: one speaker has no pair
    assert np.isnan(speaker_offset({"a-1": np.ones(dim), "a-2": np.ones(dim)}, spk))
