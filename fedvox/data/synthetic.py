"""Synthetic multi-speaker speech corpus: a vectorised source-filter voice generator.

First stage of the data path when no real corpus is at hand: it writes Kaldi-style data dirs
(wav + wav.scp/utt2spk/spk2utt) and VoxCeleb/Kaldi trial lists that the loaders read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path
from types import MappingProxyType
from typing import Literal, get_args

import numpy as np
import soundfile as sf
from scipy.fft import irfft, next_fast_len, rfft
from scipy.signal import fftconvolve, istft, stft

from fedvox.errors import ConfigError, DataError

# Bump whenever the audio or the file layout a config produces changes: it is part of the key.
GENERATOR_VERSION = "1"

Difficulty = Literal["clean", "mild", "hard"]
Split = Literal["train", "test"]

_SPLIT_CODE = {"train": 1, "test": 2}
# Purpose codes: each aspect of an utterance draws from its own stream, so changing the
# difficulty (channel, drift) leaves the spoken content and the source noise unchanged.
_P_SPEAKER, _P_CONTENT, _P_DRIFT, _P_SOURCE, _P_CHANNEL, _P_TRIALS = range(6)

_NFFT = 512  # 32 ms analysis frame at 16 kHz
_HOP = 128  # 8 ms: the frame rate of every control track
_REF_RATE = 4.5  # syllables per second the base segment durations correspond to

# ---------------------------------------------------------------------------------------------
# Phone inventory. Formants F1..F5 in Hz for an adult male reference tract (vowels from
# Peterson & Barney 1952; consonants as loci, which only shape the transitions).
# kind: V vowel, A approximant, N nasal, F fricative, S stop, P pause.
# ---------------------------------------------------------------------------------------------
_PHONES: tuple[tuple[str, str, tuple[float, float, float, float, float]], ...] = (
    ("i", "V", (270, 2290, 3010, 3500, 4500)),
    ("I", "V", (390, 1990, 2550, 3550, 4500)),
    ("e", "V", (530, 1840, 2480, 3500, 4500)),
    ("ae", "V", (660, 1720, 2410, 3450, 4500)),
    ("a", "V", (730, 1090, 2440, 3400, 4500)),
    ("o", "V", (570, 840, 2410, 3400, 4500)),
    ("U", "V", (440, 1020, 2240, 3400, 4500)),
    ("u", "V", (300, 870, 2240, 3400, 4500)),
    ("V", "V", (640, 1190, 2390, 3400, 4500)),
    ("er", "V", (490, 1350, 1690, 3300, 4500)),
    ("l", "A", (360, 1300, 2900, 3600, 4500)),
    ("r", "A", (350, 1100, 1600, 3300, 4500)),
    ("w", "A", (300, 700, 2200, 3400, 4500)),
    ("j", "A", (280, 2200, 3000, 3600, 4500)),
    ("m", "N", (280, 1000, 2200, 3400, 4500)),
    ("n", "N", (280, 1600, 2500, 3500, 4500)),
    ("ng", "N", (280, 2000, 2700, 3500, 4500)),
    ("f", "F", (400, 1100, 2300, 3400, 4500)),
    ("v", "F", (400, 1100, 2300, 3400, 4500)),
    ("s", "F", (400, 1700, 2600, 3500, 4500)),
    ("z", "F", (400, 1700, 2600, 3500, 4500)),
    ("sh", "F", (400, 1900, 2500, 3500, 4500)),
    ("zh", "F", (400, 1900, 2500, 3500, 4500)),
    ("h", "F", (500, 1500, 2500, 3500, 4500)),
    ("p", "S", (400, 900, 2300, 3400, 4500)),
    ("b", "S", (400, 900, 2300, 3400, 4500)),
    ("t", "S", (400, 1800, 2700, 3500, 4500)),
    ("d", "S", (400, 1800, 2700, 3500, 4500)),
    ("k", "S", (400, 2000, 2500, 3500, 4500)),
    ("g", "S", (400, 2000, 2500, 3500, 4500)),
    ("_", "P", (500, 1500, 2500, 3500, 4500)),
)
_NAMES = tuple(p[0] for p in _PHONES)
_IDX = {name: i for i, name in enumerate(_NAMES)}
_BASE_FORMANTS = np.array([p[2] for p in _PHONES], dtype=np.float64)
_VOWELS = tuple(_IDX[n] for n, k, _ in _PHONES if k == "V")
_APPROX = tuple(_IDX[n] for n, k, _ in _PHONES if k == "A")
_NASALS = tuple(_IDX[n] for n, k, _ in _PHONES if k == "N")
_FRICS = tuple(_IDX[n] for n in ("f", "v", "s", "z", "sh", "zh", "h"))
_STOPS = tuple(_IDX[n] for n in ("p", "b", "t", "d", "k", "g"))
_VOICED = frozenset(_IDX[n] for n in ("v", "z", "zh", "b", "d", "g"))
# Nasal antiresonance (Hz, male reference) for m, n, ng.
_NASAL_ZERO = {_IDX["m"]: 1100.0, _IDX["n"]: 1800.0, _IDX["ng"]: 3000.0}
# Frication noise spectrum: centre Hz, bandwidth Hz, gain. "h" is aspiration through the tract.
_FRIC_SHAPE = {
    _IDX["f"]: (4500.0, 5000.0, 0.25),
    _IDX["v"]: (4500.0, 5000.0, 0.15),
    _IDX["s"]: (5800.0, 1800.0, 1.0),
    _IDX["z"]: (5800.0, 1800.0, 0.6),
    _IDX["sh"]: (3200.0, 1300.0, 0.9),
    _IDX["zh"]: (3200.0, 1300.0, 0.5),
}
# Stop release bursts: centre Hz, bandwidth Hz (labial low, alveolar high, velar mid).
_BURST_SHAPE = {
    _IDX["p"]: (1200.0, 1500.0),
    _IDX["b"]: (1200.0, 1500.0),
    _IDX["t"]: (4500.0, 2500.0),
    _IDX["d"]: (4500.0, 2500.0),
    _IDX["k"]: (2300.0, 900.0),
    _IDX["g"]: (2300.0, 900.0),
}
_BASE_BANDWIDTHS = np.array([60.0, 80.0, 110.0, 160.0, 220.0])
# Speaker timbre: smooth long-term spectral deviations (source spectrum and cavity-wall
# idiosyncrasies not captured by the formants), as Gaussian bumps on a log-frequency axis.
_TIMBRE_BUMPS = 5
_TIMBRE_DB = 10.0  # calibrated so the fbank-statistics baseline is far from 0% EER and 50%


@dataclass(frozen=True)
class _Channel:
    """Session and channel variability of one difficulty level."""

    snr_db: tuple[float, float]
    eq_db: float  # std of the random EQ bumps
    highpass_hz: tuple[float, float]
    lowpass_hz: tuple[float, float]
    reverb_prob: float
    rt60_s: tuple[float, float]
    level_db: float  # +- range of the recording level
    drift_f0_st: float  # std of the per-utterance pitch drift, semitones
    drift_rate: float  # std of the log speaking-rate drift
    drift_tilt_db: float  # std of the per-utterance vocal-effort (tilt) drift, dB/octave
    drift_vtl: float  # std of the log formant-scale drift


_DIFFICULTY: Mapping[str, _Channel] = MappingProxyType({
    "clean": _Channel((35.0, 50.0), 1.0, (20.0, 60.0), (7600.0, 7900.0), 0.0, (0.2, 0.4),
                      1.5, 0.8, 0.05, 0.6, 0.006),
    "mild": _Channel((18.0, 35.0), 2.0, (20.0, 200.0), (5000.0, 7900.0), 0.5, (0.15, 0.6),
                     2.0, 1.5, 0.08, 1.2, 0.012),
    "hard": _Channel((5.0, 25.0), 4.0, (50.0, 350.0), (3000.0, 7900.0), 0.85, (0.2, 0.9),
                     3.0, 2.5, 0.12, 2.0, 0.02),
})  # fmt: skip


@dataclass(frozen=True)
class SyntheticConfig:
    """Everything that determines a synthetic corpus; its `key()` names the cache entry."""

    seed: int = 0
    n_train_speakers: int = 200
    n_test_speakers: int = 40
    train_utts_per_speaker: int = 16
    test_utts_per_speaker: int = 8
    min_duration_s: float = 2.5
    max_duration_s: float = 5.0
    sample_rate: int = 16000
    difficulty: Difficulty = "mild"
    nontarget_ratio: int = 10  # nontarget trials per target trial

    def __post_init__(self) -> None:
        checks = [
            ("n_train_speakers", self.n_train_speakers >= 1, "at least 1"),
            ("n_test_speakers", self.n_test_speakers >= 2, "at least 2 (nontarget trials)"),
            ("train_utts_per_speaker", self.train_utts_per_speaker >= 1, "at least 1"),
            ("test_utts_per_speaker", self.test_utts_per_speaker >= 2, "at least 2 (targets)"),
            ("min_duration_s", self.min_duration_s >= 0.5, "at least 0.5 s"),
            ("max_duration_s", self.max_duration_s >= self.min_duration_s, ">= min_duration_s"),
            ("sample_rate", self.sample_rate == 16000, "16000 (the generator's only rate)"),
            ("difficulty", self.difficulty in get_args(Difficulty), "clean, mild or hard"),
            ("nontarget_ratio", self.nontarget_ratio >= 1, "at least 1"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise ConfigError(name, f"got {getattr(self, name)!r}", f"use {want}")

    def key(self) -> str:
        """Short hex cache key of every field and GENERATOR_VERSION."""
        blob = json.dumps(_config_record(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _config_record(cfg: SyntheticConfig) -> dict[str, object]:
    return {**asdict(cfg), "generator_version": GENERATOR_VERSION}


@dataclass(frozen=True)
class SpeakerParams:
    """One voice drawn from the population prior; constant across all its utterances."""

    speaker_id: str
    sex: Literal["female", "male"]
    vtl_scale: float  # multiplies every formant (shorter tract -> higher formants)
    formant_offsets: tuple[tuple[float, ...], ...]  # log offsets per (phone, formant 1..5)
    f0_mean_hz: float
    f0_range_st: float  # pitch-accent excursion, semitones
    jitter: float  # std of the relative period-to-period F0 perturbation
    shimmer: float  # std of the log period-to-period amplitude perturbation
    open_quotient: float  # fraction of the glottal period the folds are open
    speed_quotient: float  # fraction of the open phase spent opening
    tilt_db_per_oct: float  # extra spectral tilt of the voice source
    breathiness: float  # aspiration noise relative to the pulses
    bandwidth_scale: float  # multiplies every formant bandwidth
    speaking_rate: float  # syllables per second
    nasal_zero_scale: float  # scales the nasal antiresonance (sinus geometry)
    fricative_scale: float  # scales fricative and burst spectra (front cavity size)
    coarticulation_ms: float  # std of the smoothing of formant targets
    piriform_zero_hz: float  # antiresonance of the piriform fossae (speaker-specific, 4-5 kHz)
    timbre: tuple[tuple[float, float, float], ...]  # (centre Hz, width octaves, gain dB) bumps


def _speaker_id(split: str, index: int) -> str:
    return f"syn-{split}-{index:05d}"


def _check_split(split: str) -> None:
    if split not in _SPLIT_CODE:
        raise ConfigError("split", f"got {split!r}", "use 'train' or 'test'")


def _rng(seed: int, split: str, spk: int, utt: int, purpose: int) -> np.random.Generator:
    return np.random.default_rng(
        np.random.SeedSequence([seed, _SPLIT_CODE[split], spk, utt, purpose])
    )


def sample_speaker(seed: int, split: str, speaker_index: int) -> SpeakerParams:
    """Draw a speaker from the population prior; depends on (seed, split, index) only."""
    _check_split(split)
    if speaker_index < 0:
        raise ConfigError("speaker_index", f"got {speaker_index}", "use an index >= 0")
    return draw_voice(
        _rng(seed, split, speaker_index, 0, _P_SPEAKER), _speaker_id(split, speaker_index)
    )


def draw_voice(
    rng: np.random.Generator, speaker_id: str, female_prob: float = 0.5
) -> SpeakerParams:
    """One voice from the population prior, drawn from `rng` (the prior shared by every world)."""
    female = bool(rng.random() < female_prob)
    vtl = float(np.exp(rng.normal(np.log(1.16) if female else 0.0, 0.055)))
    # Formant idiosyncrasies: a speaker-wide offset per formant (larger for F4/F5, which
    # depend on the larynx cavity more than on the vowel) plus one per (phone, formant).
    global_off = rng.normal(0.0, [0.03, 0.03, 0.035, 0.06, 0.06])
    per_phone = rng.normal(0.0, 0.04, size=(len(_PHONES), 5))
    offsets = global_off[None, :] + per_phone
    f0 = float((210.0 if female else 120.0) * np.exp(rng.normal(0.0, 0.15)))
    return SpeakerParams(
        speaker_id=speaker_id,
        sex="female" if female else "male",
        vtl_scale=vtl,
        formant_offsets=tuple(tuple(float(v) for v in row) for row in offsets),
        f0_mean_hz=f0,
        f0_range_st=float(rng.uniform(1.5, 6.0)),
        jitter=float(rng.uniform(0.003, 0.02)),
        shimmer=float(rng.uniform(0.02, 0.10)),
        open_quotient=float(rng.uniform(0.4, 0.8)),
        speed_quotient=float(rng.uniform(0.5, 0.8)),
        tilt_db_per_oct=float(np.clip(rng.normal(-1.5, 1.5), -5.0, 2.0)),
        breathiness=float(rng.uniform(0.0, 0.3) + (0.05 if female else 0.0)),
        bandwidth_scale=float(np.exp(rng.normal(0.0, 0.2))),
        speaking_rate=float(rng.uniform(3.5, 6.0)),
        nasal_zero_scale=float(np.exp(rng.normal(0.0, 0.08))),
        fricative_scale=float(np.exp(rng.normal(0.0, 0.08))),
        coarticulation_ms=float(rng.uniform(20.0, 45.0)),
        piriform_zero_hz=float(rng.uniform(3800.0, 5200.0) * vtl / (1.16 if female else 1.0)),
        timbre=tuple(
            (float(c), float(w), float(g))
            for c, w, g in zip(
                np.exp(rng.uniform(np.log(300.0), np.log(6000.0), _TIMBRE_BUMPS)),
                rng.uniform(0.5, 1.5, _TIMBRE_BUMPS),
                rng.normal(0.0, _TIMBRE_DB, _TIMBRE_BUMPS),
                strict=True,
            )
        ),
    )


# ---------------------------------------------------------------------------------------------
# Content: a syllable sequence as a list of segments, then frame-rate control tracks.
# ---------------------------------------------------------------------------------------------

# Segment columns: n_frames, phone, voice amp, tract-noise amp, frication amp, fric centre,
# fric bandwidth, nasal weight.
_SEG_COLS = 8


def _segments(rng: np.random.Generator, n_frames: int, rate: float) -> np.ndarray:
    """A random syllable sequence filling n_frames control frames, one row per segment."""
    fr = 1000.0 * _HOP / 16000.0  # ms per frame
    scale = _REF_RATE / rate
    segs: list[tuple[float, ...]] = []
    total = 0

    def add(
        ms: float,
        phone: int,
        va: float,
        asp: float = 0.0,
        fa: float = 0.0,
        fc: float = 0.0,
        fb: float = 1.0,
        nas: float = 0.0,
    ) -> None:
        nonlocal total
        n = max(1, round(ms * scale * float(np.exp(rng.normal(0.0, 0.2))) / fr))
        segs.append((n, phone, va, asp, fa, fc, fb, nas))
        total += n

    pause = _IDX["_"]
    add(rng.uniform(80.0, 200.0) / scale, pause, 0.0)
    # Speech runs to a short tail of silence: the silent fraction, which dominates
    # utterance-level spectral statistics, stays nearly constant across utterances.
    speech_end = n_frames - round(rng.uniform(80.0, 200.0) / fr)
    while total < speech_end:
        onset = rng.choice(6, p=[0.15, 0.3, 0.2, 0.15, 0.15, 0.05])
        if onset in (1, 5):
            _stop(add, rng, int(rng.choice(_STOPS)))
        if onset == 5:
            add(50.0, int(rng.choice(_APPROX)), 0.8)
        elif onset == 2:
            _fricative(add, int(rng.choice(_FRICS)))
        elif onset == 3:
            ph = int(rng.choice(_NASALS))
            add(60.0, ph, 0.6, nas=1.0)
        elif onset == 4:
            add(55.0, int(rng.choice(_APPROX)), 0.8)
        stressed = rng.random() < 0.35
        add(150.0 if stressed else 100.0, int(rng.choice(_VOWELS)), 1.0 if stressed else 0.85)
        coda = rng.choice(4, p=[0.5, 0.2, 0.15, 0.15])
        if coda == 1:
            add(70.0, int(rng.choice(_NASALS)), 0.6, nas=1.0)
        elif coda == 2:
            _fricative(add, int(rng.choice(_FRICS)))
        elif coda == 3:
            _stop(add, rng, int(rng.choice(_STOPS)))
        if rng.random() < 0.06:
            add(rng.uniform(80.0, 250.0), pause, 0.0)
    # Cut the last segment at speech_end (the amplitude smoothing fades it out).
    over = total - speech_end
    if over > 0:
        last = segs[-1]
        segs[-1] = (last[0] - over, *last[1:])
        if segs[-1][0] <= 0:
            segs.pop()
        total = speech_end
    if total < n_frames:
        segs.append((n_frames - total, pause, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0))
    return np.array(segs, dtype=np.float64).reshape(-1, _SEG_COLS)


def _fricative(add, phone: int) -> None:
    if phone == _IDX["h"]:
        add(70.0, phone, 0.0, asp=0.5)
        return
    fc, fb, gain = _FRIC_SHAPE[phone]
    add(90.0, phone, 0.35 if phone in _VOICED else 0.0, fa=gain, fc=fc, fb=fb)


def _stop(add, rng: np.random.Generator, phone: int) -> None:
    voiced = phone in _VOICED
    fc, fb = _BURST_SHAPE[phone]
    add(rng.uniform(45.0, 75.0), phone, 0.15 if voiced else 0.0)  # closure (voice bar)
    add(10.0, phone, 0.0, fa=1.2, fc=fc, fb=fb)  # release burst
    if not voiced:
        add(35.0, _IDX["h"], 0.0, asp=0.45)  # aspiration before the vowel


def _smooth(x: np.ndarray, sigma_frames: float) -> np.ndarray:
    """Gaussian smoothing along axis 0 with edge padding (coarticulation, onset ramps)."""
    half = max(1, int(3 * sigma_frames))
    k = np.exp(-0.5 * (np.arange(-half, half + 1) / max(sigma_frames, 1e-3)) ** 2)
    k /= k.sum()
    pad = np.pad(x, [(half, half)] + [(0, 0)] * (x.ndim - 1), mode="edge")
    if x.ndim == 1:
        return np.convolve(pad, k, mode="valid")
    return np.stack([np.convolve(pad[:, j], k, mode="valid") for j in range(x.shape[1])], 1)


# ---------------------------------------------------------------------------------------------
# Synthesis
# ---------------------------------------------------------------------------------------------


def _resonance_power(
    cos_w: np.ndarray, sin_w: np.ndarray, freq: np.ndarray, bw: np.ndarray, fs: float
) -> np.ndarray:
    """|H|^2 of digital 2-pole resonators (unit gain at DC) on the rfft grid.

    freq, bw: (frames, k). Returns (frames, bins), the product over the k resonators.
    cos(w -+ theta) is expanded so that no transcendental is evaluated per (frame, bin).
    """
    r = np.exp(-np.pi * bw / fs)
    th = 2 * np.pi * freq / fs
    ct, st = np.cos(th), np.sin(th)
    a = 1.0 + r * r
    # (a - 2r cos(w - th)) (a - 2r cos(w + th)) = (a - 2r cos w cos th)^2 - (2r sin w sin th)^2
    out = np.ones((freq.shape[0], cos_w.size), dtype=np.float32)
    for k in range(freq.shape[1]):
        u = (a[:, k] - 2 * r[:, k] * ct[:, k]).astype(np.float32)
        p = (2 * r[:, k] * ct[:, k]).astype(np.float32)[:, None] * cos_w
        q = (2 * r[:, k] * st[:, k]).astype(np.float32)[:, None] * sin_w
        den = (a[:, k, None].astype(np.float32) - p) ** 2 - q**2
        out *= (u * u)[:, None] / den
    return out


@dataclass(frozen=True)
class Prosody:
    """How pitch moves over an utterance beyond the speaker's range: a domain's style knob."""

    declination_st: tuple[float, float] = (1.0, 4.0)  # F0 fall over the utterance, semitones
    accents_per_s: tuple[float, float] = (0.5, 1.2)  # pitch accents per second of speech
    accent_height: tuple[float, float] = (0.3, 1.0)  # x the speaker's f0_range_st
    accent_width_s: tuple[float, float] = (0.06, 0.15)  # std of an accent's Gaussian bump
    wander_st: float = 2.0  # std of the slow F0 wander (before smoothing)


_PROSODY = Prosody()


@dataclass(frozen=True)
class DriftStd:
    """How far an utterance may stray from its speaker: stds of the per-utterance drift."""

    f0_st: float  # pitch, semitones
    rate: float  # log speaking rate
    tilt_db: float  # vocal-effort tilt, dB/octave
    vtl: float  # log formant scale


@dataclass(frozen=True)
class Drift:
    """One utterance's departure from its speaker's habits (scaled draws, log or dB units)."""

    log_rate: float  # log speaking-rate factor
    log_vtl: float  # log formant-scale factor
    f0_st: float  # pitch offset, semitones
    tilt_db: float  # vocal-effort tilt offset, dB/octave

    @staticmethod
    def draw(rng: np.random.Generator, std: DriftStd) -> Drift:
        """Scale 8 standard normals from `rng` by the drift stds (4 are spare)."""
        z = rng.standard_normal(8)
        return Drift(
            log_rate=float(std.rate * z[0]),
            log_vtl=float(std.vtl * z[1]),
            f0_st=float(std.f0_st * z[2]),
            tilt_db=float(std.tilt_db * z[3]),
        )


@dataclass(frozen=True)
class _Tracks:
    """Frame-rate (8 ms) control tracks of one utterance: what the source and tract follow."""

    n: int  # samples
    t_frames: np.ndarray  # frame times, s
    phone: np.ndarray  # phone index per frame
    stress: np.ndarray  # unsmoothed voicing amplitude (1.0 marks a stressed vowel)
    formants: np.ndarray  # (frames, 5) Hz
    bws: np.ndarray  # (frames, 5) Hz
    voice: np.ndarray
    asp: np.ndarray
    fric: np.ndarray
    fric_c: np.ndarray
    fric_b: np.ndarray
    nasal: np.ndarray
    vtl: float  # the utterance's formant scale (speaker x drift)


def _articulation(
    spk: SpeakerParams, drift: Drift, content: np.random.Generator, n: int, fs: float
) -> _Tracks:
    """Spoken content (a syllable sequence) turned into formant and amplitude tracks."""
    n_frames = n // _HOP + 1  # scipy's frame count for this length (boundary + padding)
    rate = spk.speaking_rate * float(np.exp(drift.log_rate))
    segs = _segments(content, n_frames, rate)
    reps = segs[:, 0].astype(np.int64)
    phone = np.repeat(segs[:, 1].astype(np.int64), reps)[:n_frames]

    # Formant tracks: speaker-scaled targets, smoothed (coarticulation).
    vtl = spk.vtl_scale * float(np.exp(drift.log_vtl))
    targets = _BASE_FORMANTS * np.exp(np.asarray(spk.formant_offsets)) * vtl
    sigma = spk.coarticulation_ms / (1000.0 * _HOP / fs)
    formants = _smooth(targets[phone], sigma)
    formants = np.minimum(formants, 0.95 * fs / 2 - np.arange(5, 0, -1) * 150.0)
    bws = _BASE_BANDWIDTHS * spk.bandwidth_scale * (1.0 + 0.4 * spk.breathiness)

    # Amplitude tracks, lightly smoothed so onsets are ramps, not clicks.
    cols = np.repeat(segs[:, 2:], reps, axis=0)[:n_frames]
    return _Tracks(
        n=n,
        t_frames=np.arange(n_frames) * _HOP / fs,
        phone=phone,
        stress=cols[:, 0],
        formants=formants,
        bws=np.broadcast_to(bws, formants.shape),
        voice=_smooth(cols[:, 0], 1.0),
        asp=_smooth(cols[:, 1], 1.0),
        fric=_smooth(cols[:, 2], 0.7),
        fric_c=cols[:, 3] * spk.fricative_scale * (vtl / spk.vtl_scale),
        fric_b=cols[:, 4] * spk.fricative_scale,
        nasal=_smooth(cols[:, 5], sigma * 0.5),
        vtl=vtl,
    )


def _f0_contour(
    spk: SpeakerParams,
    drift: Drift,
    prosody: Prosody,
    content: np.random.Generator,
    tr: _Tracks,
    fs: float,
) -> np.ndarray:
    """F0 per frame (Hz): drift, declination, pitch accents on stressed vowels, slow wander."""
    t_frames = tr.t_frames
    dur = tr.n / fs
    st = drift.f0_st - content.uniform(*prosody.declination_st) * t_frames / dur
    vowel_frames = np.flatnonzero(np.isin(tr.phone, _VOWELS) & (tr.stress >= 1.0))
    n_acc = max(1, round(dur * content.uniform(*prosody.accents_per_s)))
    if vowel_frames.size:
        centres = content.choice(vowel_frames, size=n_acc) * _HOP / fs
        heights = content.uniform(*prosody.accent_height, size=n_acc) * spk.f0_range_st
        widths = content.uniform(*prosody.accent_width_s, size=n_acc)
        bumps = heights * np.exp(-0.5 * ((t_frames[:, None] - centres) / widths) ** 2)
        st = st + bumps.max(axis=1)
    st = st + _smooth(content.normal(0.0, prosody.wander_st, t_frames.size), 20.0)
    return spk.f0_mean_hz * 2.0 ** (st / 12.0)


def _glottal_source(
    spk: SpeakerParams, tr: _Tracks, f0_frames: np.ndarray, source: np.random.Generator, fs: float
) -> np.ndarray:
    """Excitation: Rosenberg pulses by phase accumulation (per-period jitter and shimmer)
    plus aspiration noise pulsed by the glottal opening and the h/aspiration segments."""
    n = tr.n
    t_samp = np.arange(n) / fs
    f0 = np.interp(t_samp, tr.t_frames, f0_frames)
    phase0 = np.cumsum(f0 / fs)
    n_per = int(phase0[-1]) + 2
    jit = np.clip(1.0 + spk.jitter * source.standard_normal(n_per), 0.8, 1.2)
    phase = np.cumsum(f0 * jit[phase0.astype(np.int64)] / fs)
    period = phase.astype(np.int64)
    frac = phase - period
    oq, tp = spk.open_quotient, spk.open_quotient * spk.speed_quotient
    flow = np.where(
        frac < tp,
        0.5 * (1.0 - np.cos(np.pi * frac / tp)),
        np.where(frac < oq, np.cos(0.5 * np.pi * (frac - tp) / (oq - tp)), 0.0),
    )
    shim = np.exp(spk.shimmer * source.standard_normal(int(period[-1]) + 2))
    pulses = np.diff(flow, prepend=0.0) * shim[period]
    pulses /= np.sqrt(np.mean(pulses**2)) + 1e-12
    noise = source.standard_normal(n)
    breath = spk.breathiness * (0.3 + flow)
    v_s = np.interp(t_samp, tr.t_frames, tr.voice)
    a_s = np.interp(t_samp, tr.t_frames, tr.asp)
    return v_s * (pulses + breath * noise) + a_s * noise


def _nasal_gain(
    spk: SpeakerParams,
    tr: _Tracks,
    rows: np.ndarray,
    cos_w: np.ndarray,
    sin_w: np.ndarray,
    fs: float,
) -> np.ndarray:
    """Power gain of nasal murmur on frames `rows`: an extra low pole and a speaker-scaled
    antiresonance, blended in log magnitude by the (coarticulated) nasal weight."""
    zero_hz = np.array([_NASAL_ZERO.get(int(p), 1500.0) for p in tr.phone[rows]])
    zf = np.stack([zero_hz * spk.nasal_zero_scale * tr.vtl, np.full(zero_hz.shape, 250.0)], 1)
    zb = np.stack([np.full(zero_hz.shape, 150.0), np.full(zero_hz.shape, 100.0)], 1)
    zero = 1.0 / _resonance_power(cos_w, sin_w, zf[:, :1], zb[:, :1], fs)
    pole = _resonance_power(cos_w, sin_w, zf[:, 1:], zb[:, 1:], fs)
    return (zero * pole * 0.3) ** tr.nasal[rows, None]


def _voice_quality_gain(
    spk: SpeakerParams,
    tilt: float,
    freqs: np.ndarray,
    cos_w: np.ndarray,
    sin_w: np.ndarray,
    fs: float,
) -> np.ndarray:
    """Static amplitude gain per bin: source tilt, timbre bumps, piriform antiresonance."""
    log2f = np.log2(np.maximum(freqs, 50.0))
    voice_db = tilt * np.maximum(log2f - np.log2(200.0), 0.0)
    for c, wd, g in spk.timbre:
        voice_db = voice_db + g * np.exp(-0.5 * ((log2f - np.log2(c)) / wd) ** 2)
    pz = np.array([[spk.piriform_zero_hz]])
    piriform = 1.0 / _resonance_power(cos_w, sin_w, pz, np.array([[300.0]]), fs)[0]
    return 10.0 ** (voice_db / 20.0) * np.sqrt(piriform)


def _vocal_tract(
    excitation: np.ndarray, spk: SpeakerParams, drift: Drift, tr: _Tracks, fs: float
) -> tuple[np.ndarray, np.ndarray]:
    """(STFT of the excitation filtered by the time-varying tract, bin frequencies in Hz).

    One resonance envelope per 8 ms frame, applied in the STFT domain.
    """
    _, _, spec = stft(excitation, nperseg=_NFFT, noverlap=_NFFT - _HOP, window="hann")
    m = min(spec.shape[1], tr.t_frames.size)
    spec = spec[:, :m]
    freqs = np.fft.rfftfreq(_NFFT, 1.0 / fs)
    w = 2 * np.pi * freqs / fs
    cos_w, sin_w = np.cos(w).astype(np.float32), np.sin(w).astype(np.float32)
    env = _resonance_power(cos_w, sin_w, tr.formants[:m], tr.bws[:m], fs)
    nas_rows = np.flatnonzero(tr.nasal[:m] > 1e-3)
    if nas_rows.size:
        env[nas_rows] *= _nasal_gain(spk, tr, nas_rows, cos_w, sin_w, fs)
    tilt = spk.tilt_db_per_oct + drift.tilt_db
    gain = _voice_quality_gain(spk, tilt, freqs, cos_w, sin_w, fs)
    return spec * (np.sqrt(env) * gain).T, freqs


def _frication(
    spec: np.ndarray, tr: _Tracks, source: np.random.Generator, freqs: np.ndarray
) -> None:
    """Add frication and bursts to `spec` in place: shaped noise drawn in the STFT domain."""
    m = spec.shape[1]
    fric = tr.fric[:m]
    fr_rows = np.flatnonzero(fric > 1e-3)
    if not fr_rows.size:
        return
    fric_c, fric_b = tr.fric_c[:m], tr.fric_b[:m]
    centre = np.maximum.accumulate(np.where(fric_c > 0, np.arange(m), 0))
    fc = fric_c[centre][fr_rows, None]
    fb = np.maximum(fric_b[centre][fr_rows, None], 100.0)
    shape = np.exp(-0.5 * ((freqs - fc) / fb) ** 2) + 0.03
    z = source.standard_normal((fr_rows.size, freqs.size, 2)) @ np.array([1.0, 1j])
    # 0.4: a white-noise STFT bin has std ~ 1/sqrt(sum(win)) relative to unit-rms noise.
    spec[:, fr_rows] += (0.4 * z * shape * fric[fr_rows, None]).T / np.sqrt(
        np.sum(np.hanning(_NFFT))
    )


def voice_spectrogram(
    spk: SpeakerParams,
    drift: Drift,
    prosody: Prosody,
    content: np.random.Generator,
    source: np.random.Generator,
    n: int,
    fs: float,
) -> tuple[np.ndarray, np.ndarray]:
    """(STFT of n samples of speech before any channel, bin frequencies in Hz).

    The channel-free half of synthesis; a channel multiplies the result per bin and
    `inverse_stft` turns it into a waveform. `content` and `source` are consumed in order.
    """
    tr = _articulation(spk, drift, content, n, fs)
    f0_frames = _f0_contour(spk, drift, prosody, content, tr, fs)
    excitation = _glottal_source(spk, tr, f0_frames, source, fs)
    spec, freqs = _vocal_tract(excitation, spk, drift, tr, fs)
    _frication(spec, tr, source, freqs)
    return spec, freqs


def inverse_stft(spec: np.ndarray, n: int) -> np.ndarray:
    """Waveform of exactly n samples from a `voice_spectrogram`-shaped STFT (overlap-add)."""
    _, y = istft(spec, nperseg=_NFFT, noverlap=_NFFT - _HOP, window="hann")
    return np.pad(y[:n], (0, max(0, n - y.size)))


# ---------------------------------------------------------------------------------------------
# Channel building blocks (explicit parameters; a domain draws them its own way)
# ---------------------------------------------------------------------------------------------


def eq_db(
    freqs: np.ndarray, centres_log2: np.ndarray, gains_db: np.ndarray, widths_oct: np.ndarray
) -> np.ndarray:
    """Equaliser curve in dB per bin: Gaussian bumps on a log2-frequency axis."""
    logf = np.log2(np.maximum(freqs, 50.0))
    return (gains_db * np.exp(-0.5 * ((logf[:, None] - centres_log2) / widths_oct) ** 2)).sum(1)


def band_gain(freqs: np.ndarray, highpass_hz: float, lowpass_hz: float) -> np.ndarray:
    """Amplitude gain per bin of a Butterworth-like high-pass (order 4) and low-pass (order 8)."""
    return (
        1.0
        / np.sqrt(1.0 + (highpass_hz / np.maximum(freqs, 1.0)) ** 8)
        / np.sqrt(1.0 + (freqs / lowpass_hz) ** 16)
    )


def reverb_tail(rng: np.random.Generator, rt60_s: float, drr_db: float, fs: float) -> np.ndarray:
    """Room impulse response: a unit direct path then an exponentially decaying noise tail
    (silent for 2 ms) whose energy sits drr_db below the direct path."""
    lr = int(rt60_s * fs)
    tail = rng.standard_normal(lr) * np.exp(-6.9 * np.arange(lr) / (rt60_s * fs))
    tail[: int(0.002 * fs)] = 0.0
    tail *= 10.0 ** (-drr_db / 20.0) / (np.sqrt(np.sum(tail**2)) + 1e-12)
    tail[0] = 1.0
    return tail


def coloured_noise(
    rng: np.random.Generator,
    n: int,
    beta: float,
    bump: tuple[float, float, float],
    fs: float,
) -> np.ndarray:
    """n samples of 1/f^beta noise with a Gaussian spectral bump (log2 centre, width oct,
    gain dB), unscaled."""
    bump_c, bump_w, bump_g = bump
    n_fast = next_fast_len(n, real=True)  # a prime length would make the FFT crawl
    nf = np.fft.rfftfreq(n_fast, 1.0 / fs)
    lognf = np.log2(np.maximum(nf, 50.0))
    shape_n = np.maximum(nf, 50.0) ** (-beta / 2) * 10.0 ** (
        bump_g * np.exp(-0.5 * ((lognf - bump_c) / bump_w) ** 2) / 20.0
    )
    return irfft(rfft(rng.standard_normal(n_fast)) * shape_n, n_fast)[:n]


def add_at_snr(y: np.ndarray, noise: np.ndarray, snr_db: float) -> np.ndarray:
    """y plus `noise` scaled so the speech-to-noise power ratio is snr_db."""
    p_speech = np.mean(y**2) + 1e-12
    noise = noise * np.sqrt(p_speech / (np.mean(noise**2) + 1e-20) * 10.0 ** (-snr_db / 10.0))
    return y + noise


def at_level(y: np.ndarray, level_db: float) -> np.ndarray:
    """float32 recording with RMS at -26 dBFS + level_db, peaks kept below full scale."""
    y = y * (10.0 ** ((-26.0 + level_db) / 20.0) / np.sqrt(np.mean(y**2) + 1e-20))
    peak = np.max(np.abs(y))
    if peak > 0.99:
        y *= 0.99 / peak
    return y.astype(np.float32)


# ---------------------------------------------------------------------------------------------
# The session channel of a difficulty level (one per utterance, from the channel stream)
# ---------------------------------------------------------------------------------------------


def _session_filter(chan: np.random.Generator, ch: _Channel, freqs: np.ndarray) -> np.ndarray:
    """Amplitude gain per bin, static over the session: random EQ bumps and band limits."""
    n_eq = 4
    eq_c = chan.uniform(np.log2(100.0), np.log2(7000.0), n_eq)
    eq_g = chan.normal(0.0, ch.eq_db, n_eq)
    eq_w = chan.uniform(0.4, 1.5, n_eq)
    hp = chan.uniform(*ch.highpass_hz)
    lp = chan.uniform(*ch.lowpass_hz)
    return 10.0 ** (eq_db(freqs, eq_c, eq_g, eq_w) / 20.0) * band_gain(freqs, hp, lp)


def _session_reverb(
    y: np.ndarray, chan: np.random.Generator, ch: _Channel, fs: float
) -> np.ndarray:
    """Reverberate with probability ch.reverb_prob (the draws happen either way)."""
    do_reverb = chan.random() < ch.reverb_prob
    rt60 = chan.uniform(*ch.rt60_s)
    drr_db = chan.uniform(0.0, 10.0)
    if not do_reverb:
        return y
    return fftconvolve(y, reverb_tail(chan, rt60, drr_db, fs))[: y.size]


def _session_noise_and_level(
    y: np.ndarray, chan: np.random.Generator, ch: _Channel, fs: float
) -> np.ndarray:
    """Coloured noise at a random SNR, then a random recording level (float32 result)."""
    snr = chan.uniform(*ch.snr_db)
    beta = chan.uniform(0.5, 1.5)
    bump_c, bump_w = chan.uniform(np.log2(200.0), np.log2(4000.0)), chan.uniform(0.3, 1.0)
    bump_g = chan.uniform(0.0, 6.0)
    level = chan.uniform(-ch.level_db, ch.level_db)
    nz = coloured_noise(chan, y.size, beta, (bump_c, bump_w, bump_g), fs)
    return at_level(add_at_snr(y, nz, snr), level)


def synthesize_utterance(
    cfg: SyntheticConfig, split: str, speaker_index: int, utt_index: int
) -> np.ndarray:
    """One utterance of one speaker as float32 mono in [-1, 1] at cfg.sample_rate."""
    _check_split(split)
    if utt_index < 0:
        raise ConfigError("utt_index", f"got {utt_index}", "use an index >= 0")
    spk = sample_speaker(cfg.seed, split, speaker_index)
    ch = _DIFFICULTY[cfg.difficulty]
    fs = float(cfg.sample_rate)
    content = _rng(cfg.seed, split, speaker_index, utt_index, _P_CONTENT)
    std = DriftStd(ch.drift_f0_st, ch.drift_rate, ch.drift_tilt_db, ch.drift_vtl)
    drift = Drift.draw(_rng(cfg.seed, split, speaker_index, utt_index, _P_DRIFT), std)
    source = _rng(cfg.seed, split, speaker_index, utt_index, _P_SOURCE)
    chan = _rng(cfg.seed, split, speaker_index, utt_index, _P_CHANNEL)

    n = round(content.uniform(cfg.min_duration_s, cfg.max_duration_s) * fs)
    spec, freqs = voice_spectrogram(spk, drift, _PROSODY, content, source, n, fs)
    y = inverse_stft(spec * _session_filter(chan, ch, freqs)[:, None], n)
    y = _session_reverb(y, chan, ch, fs)
    return _session_noise_and_level(y, chan, ch, fs)


# ---------------------------------------------------------------------------------------------
# Corpus writing, trials and the cache
# ---------------------------------------------------------------------------------------------


def _n_speakers(cfg: SyntheticConfig, split: str) -> int:
    return cfg.n_train_speakers if split == "train" else cfg.n_test_speakers


def _n_utts(cfg: SyntheticConfig, split: str) -> int:
    return cfg.train_utts_per_speaker if split == "train" else cfg.test_utts_per_speaker


def _write_speaker(cfg: SyntheticConfig, split: str, speaker_index: int, root: str) -> int:
    """Synthesize and write every utterance of one speaker; returns the samples written."""
    spk = _speaker_id(split, speaker_index)
    d = Path(root) / split / "wav" / spk
    d.mkdir(parents=True, exist_ok=True)
    total = 0
    for u in range(_n_utts(cfg, split)):
        audio = synthesize_utterance(cfg, split, speaker_index, u)
        sf.write(d / f"{u:04d}.wav", audio, cfg.sample_rate, subtype="PCM_16", format="WAV")
        total += audio.size
    return total


def _write_lines(path: Path, lines: Iterable[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def _write_kaldi_dir(cfg: SyntheticConfig, split: str, data_dir: Path) -> list[str]:
    utts: list[str] = []
    spk2utt: list[str] = []
    for s in range(_n_speakers(cfg, split)):
        spk = _speaker_id(split, s)
        ids = [f"{spk}-{u:04d}" for u in range(_n_utts(cfg, split))]
        utts.extend(ids)
        spk2utt.append(spk + " " + " ".join(ids))
    # Zero-padded ids make lexical order = numeric order, as Kaldi's sort requires.
    _write_lines(data_dir / "wav.scp", (f"{u} wav/{u[:-5]}/{u[-4:]}.wav" for u in utts))
    _write_lines(data_dir / "utt2spk", (f"{u} {u[:-5]}" for u in utts))
    _write_lines(data_dir / "spk2utt", spk2utt)
    return utts


def make_trials(cfg: SyntheticConfig) -> list[tuple[int, str, str]]:
    """(label, utt1, utt2) for the test split: every target pair plus nontarget_ratio x as
    many distinct-speaker pairs drawn from the seed, sorted by (utt1, utt2)."""
    n_spk, n_utt = cfg.n_test_speakers, cfg.test_utts_per_speaker
    ids = [f"{_speaker_id('test', s)}-{u:04d}" for s in range(n_spk) for u in range(n_utt)]
    iu, ju = np.triu_indices(n_utt, k=1)
    tgt = [
        (s * n_utt + i, s * n_utt + j) for s in range(n_spk) for i, j in zip(iu, ju, strict=True)
    ]
    n_total = len(ids)
    available = n_total * (n_total - 1) // 2 - len(tgt)
    want = min(cfg.nontarget_ratio * len(tgt), available)
    rng = _rng(cfg.seed, "test", 0, 0, _P_TRIALS)
    chosen: set[tuple[int, int]] = set()
    order: list[tuple[int, int]] = []
    while len(order) < want:
        a = rng.integers(0, n_total, size=2 * (want - len(order)) + 16)
        b = rng.integers(0, n_total, size=a.size)
        for x, y in zip(a.tolist(), b.tolist(), strict=True):
            if x // n_utt == y // n_utt:
                continue
            pair = (min(x, y), max(x, y))
            if pair not in chosen:
                chosen.add(pair)
                order.append(pair)
                if len(order) == want:
                    break
    trials = [(1, ids[i], ids[j]) for i, j in tgt] + [(0, ids[i], ids[j]) for i, j in order]
    return sorted(trials, key=lambda t: (t[1], t[2]))


def _utt_path(utt: str) -> str:
    return f"{utt[:-5]}/{utt[-4:]}.wav"


def _progress_map(fn, jobs: list[tuple], workers: int, progress: bool) -> list[int]:
    results: list[int] = []
    if progress:
        from rich.progress import Progress

        bar = Progress(transient=True)
        bar.start()
        task = bar.add_task("synthesizing speakers", total=len(jobs))
    try:
        if workers == 1:
            for job in jobs:
                results.append(fn(*job))
                if progress:
                    bar.advance(task)
        else:
            # spawn: forking a parent that runs torch threads can deadlock.
            with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
                futures = [pool.submit(fn, *job) for job in jobs]
                for fut in futures:
                    results.append(fut.result())
                    if progress:
                        bar.advance(task)
    finally:
        if progress:
            bar.stop()
    return results


def _is_complete(path: Path, cfg: SyntheticConfig) -> bool:
    try:
        rec = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return rec.get("key") == cfg.key()


def generate_corpus(
    cfg: SyntheticConfig, out_dir: Path, workers: int | None = None, progress: bool = True
) -> Path:
    """Generate the corpus into out_dir atomically (built in a temp dir, then os.replace).

    out_dir must not exist or be empty. workers=None uses all cores; 1 runs in-process.
    The bytes written do not depend on `workers`.
    """
    out_dir = Path(out_dir).absolute()
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise DataError(
            out_dir,
            "output directory exists and is not empty",
            "remove it or choose another directory",
        )
    if workers is None:
        workers = os.cpu_count() or 1
    if workers < 1:
        raise ConfigError("workers", f"got {workers}", "use 1 or more (None = all cores)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-{os.getpid()}-", dir=out_dir.parent))
    try:
        jobs = [
            (cfg, split, s, str(tmp))
            for split in ("train", "test")
            for s in range(_n_speakers(cfg, split))
        ]
        _progress_map(_write_speaker, jobs, min(workers, len(jobs)), progress)
        for split in ("train", "test"):
            _write_kaldi_dir(cfg, split, tmp / split)
        trials = make_trials(cfg)
        _write_lines(
            tmp / "test" / "trials.txt",
            (f"{lab} {_utt_path(a)} {_utt_path(b)}" for lab, a, b in trials),
        )
        _write_lines(
            tmp / "test" / "trials_kaldi.txt",
            (f"{a} {b} {'target' if lab else 'nontarget'}" for lab, a, b in trials),
        )
        # config.json last: its presence with the right key marks a finished corpus.
        record = {**_config_record(cfg), "key": cfg.key()}
        (tmp / "config.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        try:
            os.replace(tmp, out_dir)
        except OSError:
            # Another process finished the same corpus first: keep theirs.
            if _is_complete(out_dir, cfg):
                shutil.rmtree(tmp, ignore_errors=True)
                return out_dir
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temps(cache_root: Path, name: str) -> None:
    """Delete temp dirs of this entry left by killed runs (owner pid no longer alive)."""
    for p in cache_root.glob(f".{name}.tmp-*"):
        try:
            pid = int(p.name[len(f".{name}.tmp-") :].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)


def corpus_dir(cfg: SyntheticConfig, cache_root: Path | None = None) -> Path:
    """Where ensure_corpus keeps the corpus of cfg."""
    root = Path(".cache/fedvox/corpora") if cache_root is None else Path(cache_root)
    return root.absolute() / f"synthetic-{cfg.key()}"


def ensure_corpus(
    cfg: SyntheticConfig,
    cache_root: Path | None = None,
    workers: int | None = None,
    progress: bool = True,
) -> Path:
    """Return the cached corpus dir of cfg, generating it first if it is absent."""
    path = corpus_dir(cfg, cache_root)
    if _is_complete(path, cfg):
        return path
    if path.exists() and any(path.iterdir()):
        raise DataError(
            path,
            "cache entry exists but has no matching config.json",
            "delete the directory; it will be regenerated",
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(path.parent, path.name)
    return generate_corpus(cfg, path, workers=workers, progress=progress)


__all__ = [
    "GENERATOR_VERSION",
    "Difficulty",
    "Drift",
    "DriftStd",
    "Prosody",
    "SpeakerParams",
    "SyntheticConfig",
    "add_at_snr",
    "at_level",
    "band_gain",
    "coloured_noise",
    "corpus_dir",
    "draw_voice",
    "ensure_corpus",
    "eq_db",
    "generate_corpus",
    "inverse_stft",
    "make_trials",
    "reverb_tail",
    "sample_speaker",
    "synthesize_utterance",
    "voice_spectrogram",
]
