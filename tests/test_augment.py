"""Tests for fedvox.data.augment: SNR, RIR decay, speed perturbation, determinism, new speakers."""

from __future__ import annotations

import numpy as np
import pytest

from fedvox.data.augment import (
    AugmentConfig,
    AugmentedCorpus,
    Augmenter,
    SpeedPerturbedCorpus,
    add_noise,
    coloured_noise,
    reverberate,
    speed_perturb,
    synthetic_rir,
)
from fedvox.errors import ConfigError, DataError

SR = 16000


def tone(freq: float, n: int, amp: float = 0.5) -> np.ndarray:
    return (amp * np.sin(2 * np.pi * freq * np.arange(n) / SR)).astype(np.float32)


def snr_db(clean: np.ndarray, noisy: np.ndarray) -> float:
    c = clean.astype(np.float64)
    noise = noisy.astype(np.float64) - c
    return 10 * np.log10(np.mean(c**2) / np.mean(noise**2))


@pytest.mark.parametrize("target", [0.0, 5.0, 15.0, -3.0])
def test_add_noise_achieves_requested_snr(target):
    rng = np.random.default_rng(int(target) + 10)
    wave = tone(440, SR) * (1 + 0.5 * np.sin(np.arange(SR) / 900)).astype(np.float32)
    out = add_noise(wave, rng, target)
    assert out.dtype == np.float32 and out.shape == wave.shape
    assert snr_db(wave, out) == pytest.approx(target, abs=0.01)
    # Given noise: shorter (tiled) and longer (cropped) than the signal.
    for noise in (rng.standard_normal(3000), rng.standard_normal(5 * SR)):
        out = add_noise(wave, rng, target, noise=noise)
        assert snr_db(wave, out) == pytest.approx(target, abs=0.01)


def test_coloured_noise_has_the_requested_slope():
    rng = np.random.default_rng(0)
    n = 1 << 16
    for slope in (0.0, 1.0, 2.0):
        x = coloured_noise(rng, n, slope)
        assert np.mean(x**2) == pytest.approx(1.0)
        psd = np.abs(np.fft.rfft(x)) ** 2
        f = np.arange(psd.shape[0])
        band = (f > 50) & (f < n // 4)
        fitted = np.polyfit(np.log(f[band]), np.log(psd[band]), 1)[0]
        assert fitted == pytest.approx(-slope, abs=0.05)


def test_add_noise_edge_cases():
    rng = np.random.default_rng(1)
    silent = np.zeros(1000, np.float32)
    assert np.array_equal(add_noise(silent, rng, 10.0), silent)
    with pytest.raises(DataError, match="silent"):
        add_noise(tone(300, 1000), rng, 10.0, noise=np.zeros(50))


def schroeder_rt60(h: np.ndarray, sr: int) -> float:
    """RT60 from the backward-integrated energy decay, fitted between -5 and -25 dB (T20 x 3)."""
    edc = np.cumsum(h[::-1] ** 2)[::-1]
    edc_db = 10 * np.log10(edc / edc[0])
    sel = (edc_db <= -5) & (edc_db >= -25)
    slope = np.polyfit(np.arange(h.size)[sel] / sr, edc_db[sel], 1)[0]
    return -60.0 / slope


@pytest.mark.parametrize("rt60", [0.25, 0.5, 0.8])
def test_synthetic_rir_decays_60_db_per_rt60(rt60):
    for seed in range(3):
        rir = synthetic_rir(np.random.default_rng(seed), SR, rt60)
        assert int(np.argmax(np.abs(rir))) == 0  # the direct path leads
        assert np.sum(rir**2) == pytest.approx(1.0)
        start = int(np.flatnonzero(rir[1:])[0]) + 1
        assert 0.001 * SR <= start <= 0.005 * SR
        assert schroeder_rt60(rir[start:], SR) == pytest.approx(rt60, rel=0.1)


def test_reverberate_keeps_length_alignment_and_level():
    rng = np.random.default_rng(3)
    rir = synthetic_rir(rng, SR, 0.4)
    click = np.zeros(SR, np.float32)
    click[1000] = 0.5
    out = reverberate(click, rir)
    assert out.shape == click.shape and int(np.argmax(np.abs(out))) == 1000
    wave = tone(500, SR)
    out = reverberate(wave, rir)
    assert out.dtype == np.float32
    assert np.sqrt(np.mean(out**2)) == pytest.approx(np.sqrt(np.mean(wave**2)), rel=1e-4)
    # Delaying the RIR does not move the result: alignment is on the direct path.
    shifted = np.concatenate([np.zeros(37), rir])
    np.testing.assert_allclose(reverberate(wave, shifted), out, atol=1e-5)


def dominant_freq(x: np.ndarray) -> float:
    spec = np.abs(np.fft.rfft(x * np.hanning(x.size)))
    return float(np.argmax(spec)) * SR / x.size


@pytest.mark.parametrize("factor", [0.9, 1.1, 0.95])
def test_speed_perturb_scales_duration_and_pitch(factor):
    n = 2 * SR
    wave = tone(1000, n)
    out = speed_perturb(wave, factor, SR)
    assert out.dtype == np.float32
    assert abs(out.size - n / factor) <= 1
    assert dominant_freq(out) == pytest.approx(1000 * factor, abs=1.0)
    assert np.array_equal(speed_perturb(wave, 1.0, SR), wave)
    with pytest.raises(ConfigError):
        speed_perturb(wave, 0.0, SR)


def test_augmenter_is_deterministic_given_rng():
    wave = tone(300, SR) + tone(1200, SR, 0.1)
    aug = Augmenter(AugmentConfig(noise_prob=0.7, reverb_prob=0.7))
    outs = [aug(wave, np.random.default_rng(s)) for s in (5, 5, 6)]
    assert np.array_equal(outs[0], outs[1])
    assert not np.array_equal(outs[0], outs[2])
    assert np.array_equal(wave, tone(300, SR) + tone(1200, SR, 0.1))  # input untouched
    # Probabilities: 0 -> identity; 1 -> always changed, SNR within the configured range.
    assert np.array_equal(Augmenter(AugmentConfig())(wave, np.random.default_rng(0)), wave)
    noisy = Augmenter(AugmentConfig(noise_prob=1.0, snr_db=(10.0, 12.0)))
    for s in range(5):
        assert 10.0 - 0.01 <= snr_db(wave, noisy(wave, np.random.default_rng(s))) <= 12.01
    applied = [not np.array_equal(aug(wave, np.random.default_rng(s)), wave) for s in range(40)]
    assert 0.75 < np.mean(applied) < 1.0  # P(any) = 1 - 0.3^2 = 0.91


def test_augment_config_validation():
    with pytest.raises(ConfigError, match="noise_prob"):
        AugmentConfig(noise_prob=1.5)
    with pytest.raises(ConfigError, match="snr_db"):
        AugmentConfig(snr_db=(15.0, 0.0))
    with pytest.raises(ConfigError, match="speed_factors"):
        AugmentConfig(speed_factors=(0.9, -1.0))
    assert AugmentConfig(snr_db=[0, 5]).snr_db == (0.0, 5.0)


class TinyCorpus:
    sample_rate = SR

    def __init__(self) -> None:
        self.spk = {"a1": "alice", "a2": "alice", "b1": "bob"}

    def utt_ids(self) -> list[str]:
        return list(self.spk)

    def speaker_of(self, utt_id: str) -> str:
        return self.spk[utt_id]

    def speakers(self) -> list[str]:
        return sorted(set(self.spk.values()))

    def load(self, utt_id: str) -> np.ndarray:
        return tone(200 + 100 * len(utt_id) + ord(utt_id[0]), SR)


def test_speed_perturbed_copies_are_new_speakers():
    base = TinyCorpus()
    sp = SpeedPerturbedCorpus(base, (0.9, 1.0, 1.1))
    assert sp.sample_rate == SR
    assert len(sp.utt_ids()) == 9 and sp.utt_ids()[:3] == ["a1", "a2", "b1"]
    assert "sp0.9-a1" in sp.utt_ids() and "sp1.1-b1" in sp.utt_ids()
    assert sp.speakers() == sorted(
        ["alice", "bob", "sp0.9-alice", "sp0.9-bob", "sp1.1-alice", "sp1.1-bob"]
    )
    assert sp.speaker_of("sp0.9-a2") == "sp0.9-alice"
    assert sp.spk2utt()["sp1.1-alice"] == ["sp1.1-a1", "sp1.1-a2"]
    assert np.array_equal(sp.load("a1"), base.load("a1"))
    assert abs(sp.load("sp0.9-a1").size - SR / 0.9) <= 1
    assert np.array_equal(sp.load("sp1.1-b1"), speed_perturb(base.load("b1"), 1.1, SR))
    with pytest.raises(DataError, match="unknown utterance"):
        sp.load("sp1.2-a1")
    assert SpeedPerturbedCorpus(base, ()).utt_ids() == base.utt_ids()


def test_augmented_copies_keep_the_speaker_and_do_not_depend_on_the_rest_of_the_corpus():
    cfg = AugmentConfig(noise_prob=1.0, reverb_prob=0.5)
    base = TinyCorpus()
    aug = AugmentedCorpus(base, cfg, copies=2, seed=7)
    assert aug.utt_ids() == sorted(
        ["a1", "a2", "b1", *(f"aug{c}-{u}" for c in (0, 1) for u in base.spk)]
    )
    assert aug.speaker_of("aug1-b1") == "bob" and aug.speakers() == base.speakers()
    assert np.array_equal(aug.load("a1"), base.load("a1"))
    noisy = aug.load("aug0-a1")
    assert noisy.dtype == np.float32 and not np.allclose(noisy, base.load("a1"))
    assert not np.array_equal(noisy, aug.load("aug1-a1"))
    smaller = TinyCorpus()
    smaller.spk = {"a1": "alice"}
    assert np.array_equal(AugmentedCorpus(smaller, cfg, copies=1, seed=7).load("aug0-a1"), noisy)
    assert not np.array_equal(AugmentedCorpus(base, cfg, copies=1, seed=8).load("aug0-a1"), noisy)
