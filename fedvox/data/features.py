"""Kaldi-compatible log-mel filterbanks, energy VAD and sliding CMN (the x-vector front end).

Sits between audio loading and the feature store: waveform -> fbank -> CMN -> VAD -> frames.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedvox.errors import ConfigError, DataError

# Bump when the numbers produced for a given config change, so cached features are not reused.
FEATURES_VERSION = "1"

# Kaldi works on int16-scale samples; fedvox waveforms are float in [-1, 1].
INT16_SCALE = 32768.0
# Kaldi floors mel energies and frame energies at FLT_EPSILON before taking the log.
_FLT_EPS = float(np.finfo(np.float32).eps)
# extract_features keeps every frame when VAD keeps fewer than this many (see its docstring).
MIN_VAD_FRAMES = 10

_WINDOWS = ("povey", "hamming", "hanning", "rectangular", "blackman")
_CMN_MODES = ("sliding", "utterance", "none")


def _coerce_fields(obj: Any, prefix: str) -> None:
    """Check each field against the type of its default (int -> float allowed), in place.

    Normalising 20 to 20.0 keeps `FeatureConfig.hash` identical for equal configs.
    """
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        kind = type(f.default)
        name = f"{prefix}.{f.name}"
        if kind is bool:
            ok = isinstance(value, bool | np.bool_)
            value = bool(value) if ok else value
        elif kind is float:
            ok = isinstance(value, int | float | np.integer | np.floating) and not isinstance(
                value, bool
            )
            value = float(value) if ok else value
        elif kind is int:
            ok = isinstance(value, int | np.integer) and not isinstance(value, bool)
            value = int(value) if ok else value
        elif kind is str:
            ok = isinstance(value, str)
        else:  # pragma: no cover - every field has a scalar default
            ok = True
        if not ok:
            raise ConfigError(
                name, f"expected {kind.__name__}, got {value!r}", f"give a {kind.__name__}"
            )
        object.__setattr__(obj, f.name, value)


@dataclass(frozen=True)
class FbankConfig:
    """Kaldi `compute-fbank` options (the names follow Kaldi's, in fedvox units).

    `dither` is in Kaldi's int16 units (Kaldi's default is 1.0); 0 makes features deterministic.
    """

    sample_rate: int = 16000
    num_mel_bins: int = 80
    frame_length_ms: float = 25.0
    frame_shift_ms: float = 10.0
    dither: float = 0.0
    preemphasis: float = 0.97
    window: str = "povey"
    remove_dc_offset: bool = True
    low_freq: float = 20.0
    high_freq: float = 0.0  # <= 0 means an offset from Nyquist (Kaldi convention)
    snip_edges: bool = True
    energy_floor: float = 0.0

    def __post_init__(self) -> None:
        _coerce_fields(self, "fbank")
        if self.sample_rate <= 0:
            raise ConfigError("fbank.sample_rate", f"must be > 0, got {self.sample_rate}")
        if self.num_mel_bins < 1:
            raise ConfigError("fbank.num_mel_bins", f"must be >= 1, got {self.num_mel_bins}")
        if self.window not in _WINDOWS:
            raise ConfigError(
                "fbank.window", f"unknown window {self.window!r}", f"use one of {_WINDOWS}"
            )
        if self.dither < 0:
            raise ConfigError("fbank.dither", f"must be >= 0, got {self.dither}")
        if not 0.0 <= self.preemphasis <= 1.0:
            raise ConfigError("fbank.preemphasis", f"must be in [0, 1], got {self.preemphasis}")
        if self.energy_floor < 0:
            raise ConfigError("fbank.energy_floor", f"must be >= 0, got {self.energy_floor}")
        win, shift = _window_sizes(self)
        if win < 1 or shift < 1:
            raise ConfigError(
                "fbank.frame_length_ms",
                f"frame length {win} / shift {shift} samples at {self.sample_rate} Hz",
                "use frame_length_ms and frame_shift_ms of at least one sample",
            )
        nyquist = 0.5 * self.sample_rate
        high = self.high_freq if self.high_freq > 0 else nyquist + self.high_freq
        if not (0.0 <= self.low_freq < nyquist and 0.0 < high <= nyquist and high > self.low_freq):
            raise ConfigError(
                "fbank.low_freq",
                f"band [{self.low_freq}, {high}] Hz does not fit in [0, {nyquist}] Hz",
                "choose 0 <= low_freq < high_freq <= sample_rate/2 (high_freq <= 0: from Nyquist)",
            )


@dataclass(frozen=True)
class VadConfig:
    """Kaldi `compute-vad` options, with the VoxCeleb recipe's values (conf/vad.conf)."""

    enabled: bool = True
    energy_threshold: float = 5.5
    energy_mean_scale: float = 0.5
    frames_context: int = 2
    proportion_threshold: float = 0.12

    def __post_init__(self) -> None:
        _coerce_fields(self, "vad")
        if self.frames_context < 0:
            raise ConfigError("vad.frames_context", f"must be >= 0, got {self.frames_context}")
        if not 0.0 < self.proportion_threshold < 1.0:
            raise ConfigError(
                "vad.proportion_threshold",
                f"must be in (0, 1) as in Kaldi, got {self.proportion_threshold}",
            )
        if self.energy_mean_scale < 0:
            raise ConfigError(
                "vad.energy_mean_scale", f"must be >= 0, got {self.energy_mean_scale}"
            )


@dataclass(frozen=True)
class CmnConfig:
    """Cepstral mean normalisation: Kaldi `apply-cmvn-sliding --norm-vars=false`, or per utterance."""

    mode: str = "sliding"
    window: int = 300
    center: bool = True
    min_window: int = 100  # only used when center is False (as in Kaldi)

    def __post_init__(self) -> None:
        _coerce_fields(self, "cmn")
        if self.mode not in _CMN_MODES:
            raise ConfigError("cmn.mode", f"unknown mode {self.mode!r}", f"use one of {_CMN_MODES}")
        if self.window < 1:
            raise ConfigError("cmn.window", f"must be >= 1, got {self.window}")
        if self.min_window < 1:
            raise ConfigError("cmn.min_window", f"must be >= 1, got {self.min_window}")


_SECTIONS: dict[str, type] = {"fbank": FbankConfig, "vad": VadConfig, "cmn": CmnConfig}


@dataclass(frozen=True)
class FeatureConfig:
    """The whole front end; its `hash` keys cached features."""

    fbank: FbankConfig = field(default_factory=FbankConfig)
    vad: VadConfig = field(default_factory=VadConfig)
    cmn: CmnConfig = field(default_factory=CmnConfig)

    def __post_init__(self) -> None:
        for name, section in _SECTIONS.items():
            if not isinstance(getattr(self, name), section):
                raise ConfigError(
                    name,
                    f"expected {section.__name__}, got {type(getattr(self, name)).__name__}",
                    "build from a dict with FeatureConfig.from_dict",
                )

    def to_dict(self) -> dict:
        """Plain nested dict (JSON/TOML-ready)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> FeatureConfig:
        """Build from a nested dict; missing keys take defaults, unknown keys are errors."""
        if not isinstance(d, dict):
            raise ConfigError("features", f"expected a table/dict, got {type(d).__name__}")
        unknown = set(d) - set(_SECTIONS)
        if unknown:
            raise ConfigError(
                f"features.{sorted(unknown)[0]}", "unknown section", f"use {sorted(_SECTIONS)}"
            )
        parts = {}
        for name, section in _SECTIONS.items():
            sub = d.get(name, {})
            if isinstance(sub, section):
                parts[name] = sub
                continue
            if not isinstance(sub, dict):
                raise ConfigError(name, f"expected a table/dict, got {type(sub).__name__}")
            known = {f.name for f in dataclasses.fields(section)}
            bad = set(sub) - known
            if bad:
                raise ConfigError(
                    f"{name}.{sorted(bad)[0]}", "unknown option", f"use one of {sorted(known)}"
                )
            parts[name] = section(**sub)
        return cls(**parts)

    def hash(self) -> str:
        """Stable sha256 hex of the canonical JSON of this config and FEATURES_VERSION."""
        payload = {"features_version": FEATURES_VERSION, "config": self.to_dict()}
        text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Framing and filterbank


def _window_sizes(cfg: FbankConfig) -> tuple[int, int]:
    """Frame length and shift in samples, rounded the way Kaldi does (float32 options)."""
    sr = float(np.float32(cfg.sample_rate))
    win = int(sr * 0.001 * float(np.float32(cfg.frame_length_ms)))
    shift = int(sr * 0.001 * float(np.float32(cfg.frame_shift_ms)))
    return win, shift


def _padded_size(win: int) -> int:
    return 1 << max(0, (win - 1).bit_length())


def num_frames(num_samples: int, cfg: FbankConfig) -> int:
    """Number of frames Kaldi produces for `num_samples` samples (feature-window.cc NumFrames)."""
    win, shift = _window_sizes(cfg)
    if cfg.snip_edges:
        return 0 if num_samples < win else 1 + (num_samples - win) // shift
    return (num_samples + shift // 2) // shift


@functools.lru_cache(maxsize=32)
def _window_function(kind: str, win: int) -> np.ndarray:
    i = np.arange(win, dtype=np.float64)
    a = 2.0 * np.pi / (win - 1) if win > 1 else 0.0
    if kind == "povey":
        w = (0.5 - 0.5 * np.cos(a * i)) ** 0.85
    elif kind == "hanning":
        w = 0.5 - 0.5 * np.cos(a * i)
    elif kind == "hamming":
        w = 0.54 - 0.46 * np.cos(a * i)
    elif kind == "blackman":  # Kaldi's blackman_coeff default 0.42
        w = 0.42 - 0.5 * np.cos(a * i) + 0.08 * np.cos(2 * a * i)
    else:
        w = np.ones(win)
    w.setflags(write=False)
    return w


@functools.lru_cache(maxsize=32)
def mel_matrix(
    sample_rate: int, padded: int, num_bins: int, low_freq: float, high_freq: float
) -> np.ndarray:
    """Kaldi's triangular mel weights, shape [padded // 2, num_bins] (the Nyquist bin gets none).

    Mirrors mel-computations.cc: mel(f) = 1127 ln(1 + f/700), bins equally spaced in mel
    between low_freq and high_freq, a weight only where left < mel(f) < right.
    """
    nyquist = 0.5 * sample_rate
    high = high_freq if high_freq > 0 else nyquist + high_freq
    n_fft_bins = padded // 2
    mel_low = 1127.0 * np.log1p(low_freq / 700.0)
    mel_high = 1127.0 * np.log1p(high / 700.0)
    delta = (mel_high - mel_low) / (num_bins + 1)
    freqs = (sample_rate / padded) * np.arange(n_fft_bins)
    mel = 1127.0 * np.log1p(freqs / 700.0)[:, None]
    b = np.arange(num_bins)[None, :]
    left, center, right = mel_low + b * delta, mel_low + (b + 1) * delta, mel_low + (b + 2) * delta
    up = (mel - left) / (center - left)
    down = (right - mel) / (right - center)
    weights = np.where(mel <= center, up, down)
    weights = np.where((mel > left) & (mel < right), weights, 0.0)
    weights.setflags(write=False)
    return weights


def _check_wave(wave: np.ndarray) -> np.ndarray:
    wave = np.asarray(wave)
    if wave.ndim != 1:
        raise DataError(
            None, f"waveform must be 1-D (mono), got shape {wave.shape}", "mix down to mono first"
        )
    if not np.issubdtype(wave.dtype, np.floating):
        raise DataError(
            None,
            f"waveform must be float in [-1, 1], got dtype {wave.dtype}",
            "load with soundfile.read(..., dtype='float32') or divide int16 samples by 32768",
        )
    if wave.size and not np.isfinite(wave).all():
        raise DataError(None, "waveform contains NaN or Inf", "check the audio file and decoder")
    return wave


def _frames(wave: np.ndarray, cfg: FbankConfig) -> np.ndarray:
    """[frames, win] float64 copy of the int16-scaled frames (Kaldi framing)."""
    win, shift = _window_sizes(cfg)
    n = num_frames(wave.shape[0], cfg)
    if n == 0:
        return np.zeros((0, win))
    scaled = wave.astype(np.float64) * INT16_SCALE
    if cfg.snip_edges:
        view = np.lib.stride_tricks.sliding_window_view(scaled, win)[::shift][:n]
        return np.array(view)
    # Frames centred on i*shift + shift/2, samples outside the signal reflected (Kaldi).
    size = wave.shape[0]
    starts = np.arange(n) * shift + shift // 2 - win // 2
    idx = (starts[:, None] + np.arange(win)[None, :]) % (2 * size)
    idx = np.where(idx < size, idx, 2 * size - 1 - idx)
    return scaled[idx]


def _fbank_and_energy(
    wave: np.ndarray, cfg: FbankConfig, rng: np.random.Generator | None
) -> tuple[np.ndarray, np.ndarray]:
    """Log-mel fbank and raw log energy from the same (dithered) frames."""
    wave = _check_wave(wave)
    if cfg.dither > 0 and rng is None:
        raise ConfigError(
            "fbank.dither",
            f"dither={cfg.dither} needs a random generator",
            "pass rng=np.random.default_rng(seed), or set dither = 0",
        )
    frames = _frames(wave, cfg)
    win = frames.shape[1]
    if frames.shape[0] == 0:
        return np.zeros((0, cfg.num_mel_bins), np.float32), np.zeros(0, np.float32)
    if cfg.dither > 0:
        frames += cfg.dither * rng.standard_normal(frames.shape)
    if cfg.remove_dc_offset:
        frames -= frames.mean(axis=1, keepdims=True)
    # Raw energy (Kaldi raw_energy=true): after DC removal, before pre-emphasis and window.
    log_energy = np.log(np.maximum(np.einsum("ij,ij->i", frames, frames), _FLT_EPS))
    if cfg.energy_floor > 0:
        log_energy = np.maximum(log_energy, np.log(cfg.energy_floor))
    if cfg.preemphasis != 0:
        frames[:, 1:] -= cfg.preemphasis * frames[:, :-1]
        frames[:, 0] *= 1.0 - cfg.preemphasis
    frames *= _window_function(cfg.window, win)
    padded = _padded_size(win)
    spec = np.fft.rfft(frames, n=padded, axis=1)[:, : padded // 2]
    power = spec.real**2 + spec.imag**2
    mel = power @ mel_matrix(cfg.sample_rate, padded, cfg.num_mel_bins, cfg.low_freq, cfg.high_freq)
    fbank = np.log(np.maximum(mel, _FLT_EPS))
    return fbank.astype(np.float32), log_energy.astype(np.float32)


def compute_fbank(
    wave: np.ndarray, cfg: FbankConfig, rng: np.random.Generator | None = None
) -> np.ndarray:
    """Kaldi `compute-fbank` log-mel features, [frames, num_mel_bins] float32.

    `wave` is float in [-1, 1]; it is scaled by 32768 internally because Kaldi works on
    int16-scale samples (so the log values match Kaldi's, offset by nothing). Fewer samples
    than one frame give a [0, num_mel_bins] array. `rng` is needed only when dither > 0.
    """
    return _fbank_and_energy(wave, cfg, rng)[0]


def frame_log_energy(wave: np.ndarray, cfg: FbankConfig) -> np.ndarray:
    """Kaldi raw log energy per frame (MFCC c0 with raw_energy=true), same framing as fbank.

    Energy is the sum of squares of the int16-scaled frame after DC removal, before
    pre-emphasis and windowing, floored at FLT_EPSILON (and at energy_floor when > 0).
    Dither is not applied here; `extract_features` shares the dithered frames with fbank.
    """
    return _fbank_and_energy(wave, dataclasses.replace(cfg, dither=0.0), None)[1]


# ---------------------------------------------------------------------------------------------
# VAD and CMN


def energy_vad(log_energy: np.ndarray, cfg: VadConfig) -> np.ndarray:
    """Kaldi `compute-vad` (ivector/voice-activity-detection.cc), one bool per frame.

    threshold = energy_threshold + energy_mean_scale * mean(log_energy). Frame t is speech
    when num >= den * proportion_threshold, where den counts the frames of [t-ctx, t+ctx]
    that exist (the window is clipped at the edges, not padded) and num those of them with
    log energy strictly above the threshold. Computed whatever `cfg.enabled` says; the
    caller (`extract_features`) decides whether to apply it.
    """
    e = np.asarray(log_energy, dtype=np.float64).reshape(-1)
    t_count = e.shape[0]
    if t_count == 0:
        return np.zeros(0, dtype=bool)
    threshold = cfg.energy_threshold + cfg.energy_mean_scale * e.mean()
    above = np.concatenate([[0], np.cumsum(e > threshold)])
    t = np.arange(t_count)
    lo = np.maximum(t - cfg.frames_context, 0)
    hi = np.minimum(t + cfg.frames_context, t_count - 1) + 1
    num = above[hi] - above[lo]
    # Kaldi compares an int count with int * float (float32 arithmetic).
    den = (hi - lo).astype(np.float32) * np.float32(cfg.proportion_threshold)
    return num >= den


def _sliding_windows(n: int, cfg: CmnConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per-frame [start, end) of Kaldi's sliding CMN window (SlidingWindowCmnInternal)."""
    t = np.arange(n)
    if cfg.center:
        start = t - cfg.window // 2
        end = start + cfg.window
    else:
        start = t - cfg.window
        end = t + 1
    # A window starting before frame 0 is shifted right, keeping its length.
    end = np.where(start < 0, end - start, end)
    start = np.maximum(start, 0)
    if not cfg.center:
        end = np.where(end > t, np.maximum(t + 1, cfg.min_window), end)
    # A window ending after the last frame is shifted left (and clipped at 0).
    over = np.maximum(end - n, 0)
    start = np.maximum(start - over, 0)
    end = np.minimum(end, n)
    return start, end


def apply_cmn(feats: np.ndarray, cfg: CmnConfig) -> np.ndarray:
    """Mean normalisation per feature dimension (no variance normalisation), float32.

    sliding: Kaldi `apply-cmvn-sliding --norm-vars=false`: with center=True frame t uses
    frames [t - window//2, t - window//2 + window), shifted to lie inside the utterance
    (all frames when the utterance is shorter than the window); min_window matters only
    for center=False. utterance: subtract the utterance mean. none: unchanged.
    """
    x = np.asarray(feats)
    if x.ndim != 2:
        raise DataError(None, f"features must be [frames, dims], got shape {x.shape}", "")
    if cfg.mode == "none" or x.shape[0] == 0:
        return x.astype(np.float32, copy=True)
    x64 = x.astype(np.float64)
    if cfg.mode == "utterance":
        return (x64 - x64.mean(axis=0, keepdims=True)).astype(np.float32)
    start, end = _sliding_windows(x.shape[0], cfg)
    cs = np.zeros((x.shape[0] + 1, x.shape[1]))
    np.cumsum(x64, axis=0, out=cs[1:])
    mean = (cs[end] - cs[start]) / (end - start)[:, None]
    return (x64 - mean).astype(np.float32)


def extract_features(
    wave: np.ndarray, cfg: FeatureConfig, rng: np.random.Generator | None = None
) -> np.ndarray:
    """The x-vector front end in Kaldi recipe order, float32 [frames, bins].

    fbank -> sliding CMN over all frames -> drop non-speech frames by energy VAD (computed
    on the same frames' raw log energy). If VAD keeps fewer than MIN_VAD_FRAMES (10) frames,
    all frames are kept: a short or quiet utterance must still give an embedding (Kaldi
    would drop the utterance instead). `rng` is needed only when fbank dither > 0.
    """
    fbank, log_energy = _fbank_and_energy(wave, cfg.fbank, rng)
    feats = apply_cmn(fbank, cfg.cmn)
    if cfg.vad.enabled and feats.shape[0] > 0:
        voiced = energy_vad(log_energy, cfg.vad)
        if int(voiced.sum()) >= MIN_VAD_FRAMES:
            feats = feats[voiced]
    return np.ascontiguousarray(feats, dtype=np.float32)
