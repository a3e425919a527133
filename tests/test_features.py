"""Tests for fedvox.data.features: Kaldi fbank parity, VAD and CMN semantics, configs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fedvox.data.features import (
    CmnConfig,
    FbankConfig,
    FeatureConfig,
    VadConfig,
    apply_cmn,
    compute_fbank,
    energy_vad,
    extract_features,
    frame_log_energy,
    num_frames,
)
from fedvox.errors import ConfigError, DataError

knf = pytest.importorskip("kaldi_native_fbank")

SR = 16000


def kaldi_fbank(wave: np.ndarray, cfg: FbankConfig, use_energy: bool = False) -> np.ndarray:
    """Reference features from kaldi-native-fbank (an exact port of Kaldi's compute-fbank)."""
    opts = knf.FbankOptions()
    fo = opts.frame_opts
    fo.samp_freq = cfg.sample_rate
    fo.dither = 0.0
    fo.window_type = cfg.window
    fo.snip_edges = cfg.snip_edges
    fo.frame_length_ms = cfg.frame_length_ms
    fo.frame_shift_ms = cfg.frame_shift_ms
    fo.preemph_coeff = cfg.preemphasis
    fo.remove_dc_offset = cfg.remove_dc_offset
    opts.mel_opts.num_bins = cfg.num_mel_bins
    opts.mel_opts.low_freq = cfg.low_freq
    opts.mel_opts.high_freq = cfg.high_freq
    opts.use_energy = use_energy
    opts.energy_floor = cfg.energy_floor
    fb = knf.OnlineFbank(opts)
    fb.accept_waveform(cfg.sample_rate, (wave * 32768.0).astype(np.float32).tolist())
    fb.input_finished()
    rows = [fb.get_frame(i) for i in range(fb.num_frames_ready)]
    return np.array(rows, dtype=np.float32).reshape(-1, cfg.num_mel_bins + int(use_energy))


def speech_like(rng: np.random.Generator, n: int) -> np.ndarray:
    """Harmonic source with a wandering pitch, syllable-rate envelope and a noise floor."""
    t = np.arange(n) / SR
    f0 = 120 + 20 * np.sin(2 * np.pi * 3 * t)
    phase = 2 * np.pi * np.cumsum(f0) / SR
    source = sum(np.sin(k * phase) / k for k in range(1, 30))
    env = np.clip(np.sin(2 * np.pi * 2.5 * t), 0, None)
    return (0.3 * source * env + 0.01 * rng.standard_normal(n)).astype(np.float32)


def tone(freq: float, n: int, amp: float = 0.5) -> np.ndarray:
    return (amp * np.sin(2 * np.pi * freq * np.arange(n) / SR)).astype(np.float32)


# --------------------------------------------------------------------------------------------
# fbank against kaldi-native-fbank


@pytest.mark.parametrize("bins", [80, 30])
@pytest.mark.parametrize("window", ["povey", "hamming"])
@pytest.mark.parametrize("n", [400, 401, 559, 560, 16000, 23456])
def test_fbank_matches_kaldi_on_noise_and_speech_like(bins, window, n):
    rng = np.random.default_rng(n + bins)
    cfg = FbankConfig(num_mel_bins=bins, window=window)
    for wave in (
        (0.1 * rng.standard_normal(n)).astype(np.float32),
        speech_like(rng, n),
        (1e-4 * rng.standard_normal(n)).astype(np.float32),  # very quiet
    ):
        ours, ref = compute_fbank(wave, cfg), kaldi_fbank(wave, cfg)
        assert ours.dtype == np.float32
        assert ours.shape == ref.shape == (num_frames(n, cfg), bins)
        np.testing.assert_allclose(ours, ref, atol=1e-3, rtol=0)


@pytest.mark.parametrize(
    "cfg",
    [
        FbankConfig(num_mel_bins=30, low_freq=20, high_freq=7600),  # Kaldi voxceleb v2 mfcc
        FbankConfig(num_mel_bins=40, window="hanning", high_freq=-400),
        FbankConfig(window="rectangular", remove_dc_offset=False, preemphasis=0.0),
        FbankConfig(window="blackman", snip_edges=False),
        FbankConfig(num_mel_bins=64, sample_rate=8000, frame_shift_ms=12.5, snip_edges=False),
    ],
)
def test_fbank_matches_kaldi_for_other_options(cfg):
    rng = np.random.default_rng(7)
    for n in (cfg.sample_rate // 10 + 13, cfg.sample_rate):
        wave = speech_like(rng, n)
        ours, ref = compute_fbank(wave, cfg), kaldi_fbank(wave, cfg)
        assert ours.shape == ref.shape
        np.testing.assert_allclose(ours, ref, atol=1e-3, rtol=0)


def test_fbank_matches_kaldi_on_tones_where_the_reference_is_accurate():
    # Pure tones have bins ~130 dB below the peak, where the reference's float32 FFT
    # round-off dominates (our float64 is the more accurate one); compare bins within
    # 16 nats (~70 dB) of each frame's peak, and everything once a -60 dB floor is added.
    rng = np.random.default_rng(3)
    n = 12000
    t = np.arange(n) / SR
    tones = [
        tone(440, n),
        tone(1000, n, 0.3) + tone(3500, n, 0.2),
        (0.5 * np.sin(2 * np.pi * (100 + 3000 * t) * t)).astype(np.float32),
        (0.3 + tone(200, n, 0.1)).astype(np.float32),  # DC offset
    ]
    for bins in (80, 30):
        cfg = FbankConfig(num_mel_bins=bins)
        for wave in tones:
            ours, ref = compute_fbank(wave, cfg), kaldi_fbank(wave, cfg)
            near_peak = ref > ref.max(axis=1, keepdims=True) - 16.0
            assert near_peak.mean() > 0.1
            assert np.abs(ours - ref)[near_peak].max() < 1e-3
        floored = tones[0] + (1e-3 * rng.standard_normal(n)).astype(np.float32)
        np.testing.assert_allclose(
            compute_fbank(floored, cfg), kaldi_fbank(floored, cfg), atol=1e-3
        )


@pytest.mark.parametrize("snip", [True, False])
def test_short_inputs_give_kaldi_frame_counts(snip):
    cfg = FbankConfig(snip_edges=snip)
    for n in (0, 1, 79, 80, 160, 399):
        wave = (0.1 * np.random.default_rng(n).standard_normal(n)).astype(np.float32)
        ours = compute_fbank(wave, cfg)
        assert ours.shape == (num_frames(n, cfg), 80)
        if n >= 80:  # knf needs a few samples to start
            ref = kaldi_fbank(wave, cfg)
            assert ours.shape == ref.shape
            np.testing.assert_allclose(ours, ref, atol=1e-3)
    assert compute_fbank(np.zeros(399, np.float32), FbankConfig()).shape == (0, 80)
    assert frame_log_energy(np.zeros(10, np.float32), FbankConfig()).shape == (0,)


def test_frame_log_energy_is_kaldi_raw_energy():
    rng = np.random.default_rng(11)
    wave = speech_like(rng, 20000)
    for cfg in (FbankConfig(), FbankConfig(energy_floor=1e6)):
        ref = kaldi_fbank(wave, cfg, use_energy=True)[:, 0]
        np.testing.assert_allclose(frame_log_energy(wave, cfg), ref, atol=1e-3)
    # Raw energy is taken before the window: a constant-amplitude frame of +-a after DC
    # removal has energy 400 a^2 (int16 scale), whatever the window.
    square = np.tile(np.array([0.25, -0.25], np.float32), 200)
    e = frame_log_energy(square, FbankConfig(window="hamming"))
    assert e[0] == pytest.approx(np.log(400 * (0.25 * 32768) ** 2), abs=1e-4)


def test_dither_needs_rng_and_is_reproducible():
    wave = speech_like(np.random.default_rng(0), 8000)
    cfg = FbankConfig(dither=1.0)
    with pytest.raises(ConfigError, match="dither"):
        compute_fbank(wave, cfg)
    a = compute_fbank(wave, cfg, np.random.default_rng(5))
    b = compute_fbank(wave, cfg, np.random.default_rng(5))
    c = compute_fbank(wave, cfg, np.random.default_rng(6))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    # Dither keeps digital silence finite and off the FLT_EPSILON floor.
    silent = compute_fbank(np.zeros(4000, np.float32), cfg, np.random.default_rng(1))
    assert silent.min() > np.log(np.finfo(np.float32).eps) + 1


def test_bad_waveforms_raise_data_errors():
    with pytest.raises(DataError, match="float"):
        compute_fbank(np.zeros(1000, np.int16), FbankConfig())
    with pytest.raises(DataError, match="1-D"):
        compute_fbank(np.zeros((2, 1000), np.float32), FbankConfig())
    with pytest.raises(DataError, match="NaN"):
        compute_fbank(np.full(1000, np.nan, np.float32), FbankConfig())


# --------------------------------------------------------------------------------------------
# VAD


def test_energy_vad_hand_worked():
    e = np.array([0, 0, 10, 10, 10, 0, 0, 0, 0, 0], dtype=np.float32)
    # threshold = 5.5 + 0.5 * mean(e) = 5.5 + 0.5 * 3 = 7.0 -> frames 2, 3, 4 are loud.
    # With the recipe's 12% of a +-2 window, one loud frame in reach suffices.
    v = energy_vad(e, VadConfig())
    assert v.tolist() == [True] * 7 + [False] * 3
    # At 50%: t=0 sees frames 0..2 (den 3, num 1: 1 < 1.5) -> silence; t=1 sees 0..3
    # (den 4 because the window is clipped, num 2 >= 2) -> speech; t=5 sees 3..7
    # (num 2 < 2.5) -> silence.
    v = energy_vad(e, VadConfig(proportion_threshold=0.5))
    assert v.tolist() == [False, True, True, True, True, False, False, False, False, False]
    # context 0, 60% (Kaldi's defaults): exactly the loud frames.
    v = energy_vad(e, VadConfig(frames_context=0, proportion_threshold=0.6))
    assert v.tolist() == [False, False, True, True, True, False, False, False, False, False]


def test_energy_vad_threshold_is_strict_and_absolute_term_matters():
    e = np.array([2.0, 2.0, 8.0, 8.0])  # threshold = 5.5 + 0.5 * 5 = 8.0 exactly
    assert not energy_vad(e, VadConfig()).any()
    assert energy_vad(e, VadConfig(energy_threshold=5.4)).tolist() == [True] * 4
    # mean scale 0: the threshold is the absolute term alone.
    assert energy_vad(e, VadConfig(energy_mean_scale=0.0, frames_context=0)).tolist() == [
        False,
        False,
        True,
        True,
    ]
    assert energy_vad(np.zeros(0), VadConfig()).shape == (0,)


def test_energy_vad_matches_kaldi_loop():
    rng = np.random.default_rng(2)
    for _ in range(20):
        cfg = VadConfig(
            frames_context=int(rng.integers(0, 5)),
            proportion_threshold=float(rng.uniform(0.05, 0.95)),
            energy_threshold=float(rng.uniform(0, 8)),
        )
        e = rng.normal(10, 4, int(rng.integers(1, 60))).astype(np.float32)
        thr = cfg.energy_threshold + cfg.energy_mean_scale * e.mean()
        expect = []
        for t in range(len(e)):
            lo, hi = max(0, t - cfg.frames_context), min(len(e) - 1, t + cfg.frames_context)
            num = sum(e[t2] > thr for t2 in range(lo, hi + 1))
            expect.append(num >= (hi - lo + 1) * cfg.proportion_threshold)
        assert energy_vad(e, cfg).tolist() == expect


# --------------------------------------------------------------------------------------------
# CMN


def kaldi_sliding_cmn(x: np.ndarray, cfg: CmnConfig) -> np.ndarray:
    """Direct transcription of Kaldi's SlidingWindowCmnInternal (norm_vars=false)."""
    n = len(x)
    out = np.empty_like(x, dtype=np.float64)
    for t in range(n):
        if cfg.center:
            start = t - cfg.window // 2
            end = start + cfg.window
        else:
            start, end = t - cfg.window, t + 1
        if start < 0:
            end -= start
            start = 0
        if not cfg.center and end > t:
            end = max(t + 1, cfg.min_window)
        if end > n:
            start -= end - n
            end = n
            start = max(start, 0)
        out[t] = x[t] - x[start:end].mean(axis=0)
    return out


def test_sliding_cmn_hand_worked_ramp():
    ramp = np.arange(5, dtype=np.float32)[:, None]
    # window 3 (centred): frame windows [0,3) [0,3) [1,4) [2,5) [2,5) -> means 1 1 2 3 3.
    out = apply_cmn(ramp, CmnConfig(window=3))
    assert out[:, 0].tolist() == [-1.0, 0.0, 0.0, 0.0, 1.0]
    # window 4: [0,4) x3 then [1,5) x2 -> means 1.5 1.5 1.5 2.5 2.5.
    out = apply_cmn(ramp, CmnConfig(window=4))
    assert out[:, 0].tolist() == [-1.5, -0.5, 0.5, 0.5, 1.5]
    # Not centred, window 3, min_window 2: [0,2) [0,2) [0,3) [0,4) [1,5).
    out = apply_cmn(ramp, CmnConfig(window=3, center=False, min_window=2))
    assert out[:, 0].tolist() == [-0.5, 0.5, 1.0, 1.5, 1.5]
    # A window longer than the utterance uses all of it: the utterance mean.
    out = apply_cmn(ramp, CmnConfig(window=300))
    assert out[:, 0].tolist() == [-2.0, -1.0, 0.0, 1.0, 2.0]


def test_sliding_cmn_matches_kaldi_loop():
    rng = np.random.default_rng(4)
    for n, window, center, min_window in [
        (1, 300, True, 100),
        (299, 300, True, 100),
        (301, 300, True, 100),
        (777, 300, True, 100),
        (50, 7, False, 3),
        (250, 60, False, 100),
        (40, 10, True, 100),
    ]:
        cfg = CmnConfig(window=window, center=center, min_window=min_window)
        x = rng.normal(5, 2, (n, 3)).astype(np.float32)
        np.testing.assert_allclose(apply_cmn(x, cfg), kaldi_sliding_cmn(x, cfg), atol=1e-5)


def test_utterance_and_no_cmn():
    x = np.random.default_rng(0).normal(3, 1, (20, 4)).astype(np.float32)
    np.testing.assert_allclose(apply_cmn(x, CmnConfig(mode="utterance")).mean(0), 0, atol=1e-6)
    assert np.array_equal(apply_cmn(x, CmnConfig(mode="none")), x)
    assert apply_cmn(np.zeros((0, 4), np.float32), CmnConfig()).shape == (0, 4)


# --------------------------------------------------------------------------------------------
# The whole front end


def test_extract_features_drops_silence_around_a_tone():
    rng = np.random.default_rng(0)
    silence = (1e-4 * rng.standard_normal(SR)).astype(np.float32)
    wave = np.concatenate([silence, tone(300, SR), silence[::-1]])
    cfg = FeatureConfig()
    total = num_frames(len(wave), cfg.fbank)
    feats = extract_features(wave, cfg)
    assert feats.dtype == np.float32 and feats.shape[1] == 80
    # ~100 tone frames plus up to 2 context frames on each side (and partial-overlap frames).
    assert 98 <= feats.shape[0] <= 110 < total
    # VAD selects from CMN'd features of all frames (Kaldi recipe order).
    full = apply_cmn(compute_fbank(wave, cfg.fbank), cfg.cmn)
    voiced = energy_vad(frame_log_energy(wave, cfg.fbank), cfg.vad)
    assert np.array_equal(feats, full[voiced])
    no_vad = FeatureConfig(vad=VadConfig(enabled=False))
    assert extract_features(wave, no_vad).shape == (total, 80)


def test_extract_features_keeps_all_frames_when_vad_keeps_too_few():
    cfg = FeatureConfig()
    flat = np.zeros(SR, np.float32)  # all frames equal: none exceeds mean + 5.5
    assert extract_features(flat, cfg).shape == (98, 80)
    short = tone(300, 1200)  # 6 frames, fewer than 10
    assert extract_features(short, cfg).shape == (6, 80)
    assert extract_features(np.zeros(100, np.float32), cfg).shape == (0, 80)


def test_extract_features_is_deterministic():
    wave = speech_like(np.random.default_rng(9), 3 * SR)
    cfg = FeatureConfig()
    a, b = extract_features(wave, cfg), extract_features(wave.copy(), cfg)
    assert a.tobytes() == b.tobytes()
    dithered = FeatureConfig(fbank=FbankConfig(dither=1.0))
    c = extract_features(wave, dithered, np.random.default_rng(1))
    d = extract_features(wave, dithered, np.random.default_rng(1))
    assert c.tobytes() == d.tobytes()


# --------------------------------------------------------------------------------------------
# Config


def test_config_round_trip_and_hash():
    cfg = FeatureConfig(fbank=FbankConfig(num_mel_bins=30), cmn=CmnConfig(mode="utterance"))
    again = FeatureConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.hash() == cfg.hash()
    assert FeatureConfig.from_dict({}) == FeatureConfig()
    # ints for float fields normalise, so equal configs hash equally.
    assert FeatureConfig.from_dict({"fbank": {"low_freq": 20}}).hash() == FeatureConfig().hash()
    # Every field takes part in the hash.
    seen = {FeatureConfig().hash()}
    special = {"preemphasis": 0.9, "high_freq": -400.0, "proportion_threshold": 0.5}
    for section in (FbankConfig, VadConfig, CmnConfig):
        name = {FbankConfig: "fbank", VadConfig: "vad", CmnConfig: "cmn"}[section]
        for f in dataclasses.fields(section):
            value = f.default
            if f.name in special:
                new = special[f.name]
            elif isinstance(value, bool):
                new = not value
            elif isinstance(value, str):
                new = {"povey": "hamming", "sliding": "utterance"}[value]
            elif isinstance(value, float):
                new = value + 0.25
            else:
                new = value + 1
            h = FeatureConfig.from_dict({name: {f.name: new}}).hash()
            assert h not in seen, f.name
            seen.add(h)


def test_default_config_hash_is_pinned():
    # Changing this means cached features change meaning: bump FEATURES_VERSION.
    assert FeatureConfig().hash() == PINNED_DEFAULT_HASH


PINNED_DEFAULT_HASH = "ba19ef71799c68b01e2838451d2f6a86d00748da19512fcef422a214000f9cf3"


def test_bad_configs_name_the_field():
    with pytest.raises(ConfigError, match=r"fbank\.window"):
        FbankConfig(window="kaiser")
    with pytest.raises(ConfigError, match=r"cmn\.mode"):
        FeatureConfig.from_dict({"cmn": {"mode": "global"}})
    with pytest.raises(ConfigError, match=r"fbank\.num_bins"):
        FeatureConfig.from_dict({"fbank": {"num_bins": 80}})
    with pytest.raises(ConfigError, match=r"features\.mfcc"):
        FeatureConfig.from_dict({"mfcc": {}})
    with pytest.raises(ConfigError, match=r"fbank\.num_mel_bins"):
        FbankConfig(num_mel_bins="80")
    with pytest.raises(ConfigError, match=r"fbank\.low_freq"):
        FbankConfig(low_freq=9000)
    with pytest.raises(ConfigError, match="vad"):
        FeatureConfig(vad={"enabled": False})
    with pytest.raises(ConfigError, match=r"vad\.proportion_threshold"):
        VadConfig(proportion_threshold=1.0)
