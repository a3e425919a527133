"""Waveform augmentation for training: additive noise, synthetic reverberation, speed perturbation.

Sits between corpus loading and feature extraction (Kaldi/WeSpeaker-style data augmentation).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol

import numpy as np
from scipy.signal import fftconvolve, resample_poly

from fedvox.errors import ConfigError, DataError


@dataclass(frozen=True)
class AugmentConfig:
    """Probabilities and ranges of on-the-fly augmentation; speed factors make new speakers."""

    noise_prob: float = 0.0
    snr_db: tuple[float, float] = (0.0, 15.0)
    reverb_prob: float = 0.0
    rt60_s: tuple[float, float] = (0.2, 0.8)
    speed_factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name in ("noise_prob", "reverb_prob"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ConfigError(f"augment.{name}", f"must be in [0, 1], got {p}")
        for name in ("snr_db", "rt60_s"):
            lo_hi = tuple(float(v) for v in getattr(self, name))
            if len(lo_hi) != 2 or lo_hi[0] > lo_hi[1]:
                raise ConfigError(f"augment.{name}", f"must be [low, high], got {lo_hi}")
            object.__setattr__(self, name, lo_hi)
        if self.rt60_s[0] <= 0:
            raise ConfigError("augment.rt60_s", f"must be > 0 s, got {self.rt60_s}")
        factors = tuple(float(f) for f in self.speed_factors)
        if any(f <= 0 for f in factors) or len(set(factors)) != len(factors):
            raise ConfigError(
                "augment.speed_factors",
                f"need distinct factors > 0, got {factors}",
                "e.g. [0.9, 1.1]",
            )
        object.__setattr__(self, "speed_factors", factors)


def _power(x: np.ndarray) -> float:
    return float(np.mean(np.square(x, dtype=np.float64))) if x.size else 0.0


def coloured_noise(rng: np.random.Generator, n: int, slope: float) -> np.ndarray:
    """Gaussian noise with power spectrum ~ 1/f^slope (0 white, 1 pink, 2 brown), unit power."""
    if n == 0:
        return np.zeros(0)
    spec = np.fft.rfft(rng.standard_normal(n))
    f = np.arange(spec.shape[0], dtype=np.float64)
    f[0] = 1.0
    spec *= f ** (-slope / 2.0)
    spec[0] = 0.0  # no DC: it would only shift the mean
    x = np.fft.irfft(spec, n=n)
    p = _power(x)
    return x / np.sqrt(p) if p > 0 else x


def add_noise(
    wave: np.ndarray, rng: np.random.Generator, snr_db: float, noise: np.ndarray | None = None
) -> np.ndarray:
    """`wave` plus noise scaled so that 10 log10(P_wave / P_noise) equals `snr_db` exactly.

    Without `noise`, coloured synthetic noise with a random spectral slope in [0, 2] (white
    to brown). A given noise is cropped at a random offset, or tiled if shorter. A silent
    `wave` is returned unchanged (no SNR defines a level). No clipping is applied.
    """
    x = np.asarray(wave)
    n = x.shape[0]
    p_signal = _power(x)
    if p_signal == 0.0:
        return x.copy()
    if noise is None:
        nz = coloured_noise(rng, n, float(rng.uniform(0.0, 2.0)))
    else:
        noise = np.asarray(noise, dtype=np.float64).reshape(-1)
        if noise.size == 0 or _power(noise) == 0.0:
            raise DataError(None, "noise recording is empty or silent", "pass a non-silent noise")
        reps = -(-n // noise.size) + 1
        start = int(rng.integers(0, noise.size))
        nz = np.tile(noise, reps)[start : start + n]
    # Scale the noise as it will be added (after the cast), so the SNR is exact.
    nz = nz * np.sqrt(p_signal / (_power(nz) * 10.0 ** (snr_db / 10.0)))
    return (x.astype(np.float64) + nz).astype(x.dtype if x.dtype.kind == "f" else np.float32)


def synthetic_rir(rng: np.random.Generator, sample_rate: int, rt60_s: float) -> np.ndarray:
    """Room impulse response: a unit direct path at t=0 then an exponentially decaying noise tail.

    The tail's energy falls by 60 dB in `rt60_s` (amplitude envelope exp(-3 ln10 t / rt60)),
    starts 1-5 ms after the direct path, and carries a direct-to-reverberant ratio drawn in
    [-3, 6] dB. Normalised to unit energy.
    """
    if rt60_s <= 0:
        raise ConfigError("augment.rt60_s", f"must be > 0, got {rt60_s}")
    n = int(np.ceil(1.2 * rt60_s * sample_rate))
    delay = int(rng.integers(int(0.001 * sample_rate), int(0.005 * sample_rate) + 1))
    t = np.arange(n - delay) / sample_rate
    tail = rng.standard_normal(t.shape[0]) * np.exp(-3.0 * np.log(10.0) * t / rt60_s)
    drr_db = rng.uniform(-3.0, 6.0)
    tail *= np.sqrt(10.0 ** (-drr_db / 10.0) / np.sum(tail**2))
    rir = np.zeros(n)
    rir[0] = 1.0
    rir[delay:] = tail
    return rir / np.sqrt(np.sum(rir**2))


def reverberate(wave: np.ndarray, rir: np.ndarray) -> np.ndarray:
    """Convolve with `rir`, aligned on its direct path (largest tap), same length and RMS."""
    x = np.asarray(wave)
    rir = np.asarray(rir, dtype=np.float64).reshape(-1)
    if rir.size == 0 or not np.any(rir):
        raise DataError(None, "room impulse response is empty or all zeros", "pass a real RIR")
    p_in = _power(x)
    if p_in == 0.0:
        return x.copy()
    d = int(np.argmax(np.abs(rir)))
    y = fftconvolve(x.astype(np.float64), rir)[d : d + x.shape[0]]
    y *= np.sqrt(p_in / max(_power(y), 1e-30))
    return y.astype(x.dtype if x.dtype.kind == "f" else np.float32)


def speed_perturb(wave: np.ndarray, factor: float, sample_rate: int) -> np.ndarray:
    """Like sox `speed factor`: duration scales by 1/factor, pitch by factor.

    Resamples with scipy.signal.resample_poly from rate sample_rate*factor to sample_rate
    (factor as a ratio of small integers, so 0.9 -> up 10, down 9). `sample_rate` is kept
    for interface symmetry; the result is at the same rate as the input.
    """
    if factor <= 0:
        raise ConfigError("augment.speed_factors", f"factor must be > 0, got {factor}")
    x = np.asarray(wave)
    if factor == 1.0 or x.shape[0] == 0:
        return x.copy()
    ratio = Fraction(factor).limit_denominator(1000)
    y = resample_poly(x.astype(np.float64), ratio.denominator, ratio.numerator)
    return y.astype(x.dtype if x.dtype.kind == "f" else np.float32)


class Augmenter:
    """Applies reverberation then additive noise, each with its probability.

    All randomness comes from the generator passed to each call, so a (seed, utt, epoch)
    derived generator reproduces the same augmented waveform.
    """

    def __init__(self, cfg: AugmentConfig, sample_rate: int = 16000) -> None:
        self.cfg = cfg
        self.sample_rate = sample_rate

    def __call__(self, wave: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        cfg = self.cfg
        out = np.asarray(wave)
        # Draw both coins first so one choice does not shift the other's random stream.
        do_reverb = rng.random() < cfg.reverb_prob
        do_noise = rng.random() < cfg.noise_prob
        if do_reverb:
            rir = synthetic_rir(rng, self.sample_rate, float(rng.uniform(*cfg.rt60_s)))
            out = reverberate(out, rir)
        if do_noise:
            out = add_noise(out, rng, float(rng.uniform(*cfg.snr_db)))
        return out if (do_reverb or do_noise) else out.copy()


class SpeakerCorpus(Protocol):
    """What the corpus wrappers below need from the corpus they wrap."""

    sample_rate: int

    def utt_ids(self) -> Sequence[str]: ...

    def speaker_of(self, utt_id: str) -> str: ...

    def speakers(self) -> list[str]: ...

    def load(self, utt_id: str) -> np.ndarray: ...


def _factor_tag(factor: float) -> str:
    return f"sp{factor:g}"


class SpeedPerturbedCorpus:
    """A corpus plus speed-perturbed copies that count as new speakers (Kaldi, WeSpeaker).

    For each factor f != 1 an utterance u of speaker s gets a copy f"sp{f:g}-{u}" of
    speaker f"sp{f:g}-{s}" (e.g. "sp0.9-id10001"), loaded by resampling the original.
    """

    def __init__(self, corpus: SpeakerCorpus, factors: Sequence[float]) -> None:
        self.corpus = corpus
        self.sample_rate = corpus.sample_rate
        self.factors = tuple(float(f) for f in factors if float(f) != 1.0)
        if any(f <= 0 for f in self.factors) or len(set(self.factors)) != len(self.factors):
            raise ConfigError("augment.speed_factors", f"need distinct factors > 0, got {factors}")
        base = list(corpus.utt_ids())
        self._source: dict[str, tuple[str, float]] = {u: (u, 1.0) for u in base}
        self._utts = list(base)
        for f in self.factors:
            for u in base:
                new = f"{_factor_tag(f)}-{u}"
                if new in self._source:
                    raise DataError(
                        None, f"perturbed id {new!r} collides with an existing utterance", ""
                    )
                self._source[new] = (u, f)
                self._utts.append(new)
        self._spk = {}
        for u, (orig, f) in self._source.items():
            spk = corpus.speaker_of(orig)
            self._spk[u] = spk if f == 1.0 else f"{_factor_tag(f)}-{spk}"

    def utt_ids(self) -> list[str]:
        return list(self._utts)

    def speaker_of(self, utt_id: str) -> str:
        return self._spk[self._lookup(utt_id)]

    def speakers(self) -> list[str]:
        return sorted(set(self._spk.values()))

    def spk2utt(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {s: [] for s in self.speakers()}
        for u in self._utts:
            out[self._spk[u]].append(u)
        return out

    def load(self, utt_id: str) -> np.ndarray:
        orig, f = self._source[self._lookup(utt_id)]
        wave = self.corpus.load(orig)
        return wave if f == 1.0 else speed_perturb(wave, f, self.sample_rate)

    def _lookup(self, utt_id: str) -> str:
        if utt_id not in self._source:
            raise DataError(None, f"unknown utterance id {utt_id!r}", "use an id from utt_ids()")
        return utt_id


class AugmentedCorpus:
    """A corpus plus `copies` noisy/reverberant copies of each utterance (Kaldi-style).

    Copy c of utterance u is `aug{c}-{u}` with u's speaker; its randomness comes from
    (seed, u, c) only, so it is the same audio whatever else is in the corpus.
    """

    def __init__(self, base: SpeakerCorpus, cfg: AugmentConfig, copies: int, seed: int) -> None:
        self.base = base
        self.copies = copies
        self.seed = seed
        self.sample_rate = base.sample_rate
        self.augmenter = Augmenter(cfg, sample_rate=base.sample_rate)
        self._origin: dict[str, tuple[str, int]] = {}
        for u in base.utt_ids():
            for c in range(self.copies):
                self._origin[f"aug{c}-{u}"] = (u, c)

    def utt_ids(self) -> list[str]:
        return sorted([*self.base.utt_ids(), *self._origin])

    def speaker_of(self, utt_id: str) -> str:
        return self.base.speaker_of(self._origin.get(utt_id, (utt_id, 0))[0])

    def speakers(self) -> list[str]:
        return self.base.speakers()

    def load(self, utt_id: str) -> np.ndarray:
        if utt_id not in self._origin:
            return self.base.load(utt_id)
        u, c = self._origin[utt_id]
        rng = np.random.default_rng([self.seed, 0xA116, zlib.crc32(u.encode()), c])
        return self.augmenter(self.base.load(u), rng).astype(np.float32)
