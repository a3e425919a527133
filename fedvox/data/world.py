"""The two-domain federated world: a public/server domain and a device domain.

Built on the generator's stages (`fedvox.data.synthetic`): a *domain* sets the population
prior (accent, sex/age mix, pitch), the speaking style (rate, pitch movement, utterance count
and length) and the channel. The public domain is studio speech of labelled speakers; the
device domain is one-speaker devices whose recordings share a persistent channel (a device
model from a catalogue, the unit's tolerance, the owner's rooms). See docs/synthetic.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np
import soundfile as sf
from scipy.fft import irfft, next_fast_len, rfft
from scipy.signal import fftconvolve, istft, stft

from fedvox.data.synthetic import (
    _PHONES,
    GENERATOR_VERSION,
    Drift,
    DriftStd,
    Prosody,
    SpeakerParams,
    _Channel,
    _progress_map,
    _remove_stale_temps,
    _session_filter,
    _session_noise_and_level,
    _session_reverb,
    _write_lines,
    add_at_snr,
    at_level,
    band_gain,
    coloured_noise,
    draw_voice,
    eq_db,
    inverse_stft,
    reverb_tail,
    voice_spectrogram,
)
from fedvox.errors import ConfigError, DataError

# Bump whenever the audio or the layout a WorldConfig produces changes: it is part of the keys.
WORLD_VERSION = "1"

Part = Literal["public", "devices", "test"]
Codec = Literal["none", "mulaw", "apcm", "coarse"]

_FS = 16000.0
# Stream keys: (seed, _TAG, scope, index, slot, purpose). The tag keeps world streams apart
# from the corpus generator's; a scope is a part, the catalogue or the accents.
_TAG = 0x5752_4C44
_SCOPE = {"public": 1, "devices": 2, "test": 3, "catalogue": 4, "accent": 5}
(
    _W_SPEAKER,
    _W_COUNT,
    _W_CONTENT,
    _W_DRIFT,
    _W_SOURCE,
    _W_SESSION,
    _W_NOISE,
    _W_UNIT,
    _W_ROOM,
    _W_TAIL,
    _W_MODEL,
    _W_ACCENT,
    _W_TRIALS,
) = range(13)
_ID_PREFIX = {"public": ("pub", 5), "devices": ("dev", 6), "test": ("tst", 5)}
_ACCENT_PHONES = np.array([k in ("V", "A") for _, k, _ in _PHONES])
_ACCENT_FORMANT_SD = np.array([1.0, 1.0, 0.8, 0.4, 0.3])  # accents move F1-F3 most


def _rng(seed: int, scope: str, index: int, slot: int, purpose: int) -> np.random.Generator:
    return np.random.default_rng(
        np.random.SeedSequence([seed, _TAG, _SCOPE[scope], index, slot, purpose])
    )


# ---------------------------------------------------------------------------------------------
# Domains
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Population:
    """Who speaks in a domain: accent (shared vowel formant targets), sex/age mix, pitch."""

    accent: int = 1  # which accent table; domains with the same number share it
    accent_sd: float = 0.08  # std of the accent's log offsets per (vowel/approximant, F1)
    female_fraction: float = 0.5
    child_fraction: float = 0.0  # children: shorter tract, higher pitch
    age_years: tuple[float, float] = (20.0, 60.0)  # adults; over 65 voices get rougher
    f0_scale: float = 1.0  # multiplies every speaker's mean F0
    f0_range_st: tuple[float, float] = (1.5, 6.0)  # size of pitch accents, semitones


_MILD_DRIFT = DriftStd(f0_st=1.5, rate=0.08, tilt_db=1.2, vtl=0.012)  # the generator's "mild"
_READ_PROSODY = Prosody()


@dataclass(frozen=True)
class Style:
    """How a domain speaks: rate, pitch movement, per-utterance drift, count and length."""

    speaking_rate: tuple[float, float] = (3.5, 6.0)  # syllables/s, speaker habit
    prosody: Prosody = _READ_PROSODY
    drift: DriftStd = _MILD_DRIFT
    duration_s: tuple[float, float] = (2.5, 5.0)
    utts_per_speaker: tuple[int, int] = (16, 16)  # log-uniform between the two (quantity skew)


@dataclass(frozen=True)
class StudioChannel:
    """A fresh, mild channel per session (the generator's session channel, studio settings)."""

    snr_db: tuple[float, float] = (30.0, 45.0)
    eq_db: float = 1.0
    highpass_hz: tuple[float, float] = (20.0, 60.0)
    lowpass_hz: tuple[float, float] = (7600.0, 7900.0)
    reverb_prob: float = 0.1
    rt60_s: tuple[float, float] = (0.1, 0.3)
    level_db: float = 1.5

    def session(self) -> _Channel:
        """The generator's channel record for these settings (its drift fields are unused)."""
        return _Channel(
            self.snr_db, self.eq_db, self.highpass_hz, self.lowpass_hz, self.reverb_prob,
            self.rt60_s, self.level_db, 0.0, 0.0, 0.0, 0.0,
        )  # fmt: skip


@dataclass(frozen=True)
class ModelKind:
    """A family of device models (phone, earbuds...): ranges each catalogue model draws from."""

    name: str
    highpass_hz: tuple[float, float]
    lowpass_hz: tuple[float, float]
    codec: Codec
    self_noise_snr_db: tuple[float, float]  # microphone/electronics hiss re speech
    far_field: bool = False  # used across the room: lower direct-to-reverberant ratio


# Band limits and codecs of common device families (narrowband calls, Bluetooth headsets,
# smart speakers, laptops, watches, wideband phones).
DEVICE_KINDS: tuple[ModelKind, ...] = (
    ModelKind("phone-call", (200.0, 320.0), (3300.0, 3700.0), "mulaw", (35.0, 45.0)),
    ModelKind("earbuds", (150.0, 300.0), (4000.0, 6000.0), "apcm", (30.0, 40.0)),
    ModelKind("smart-speaker", (80.0, 150.0), (6500.0, 7800.0), "coarse", (35.0, 45.0), True),
    ModelKind("laptop", (120.0, 250.0), (5000.0, 7000.0), "none", (25.0, 35.0)),
    ModelKind("watch", (300.0, 500.0), (3000.0, 4200.0), "apcm", (25.0, 35.0)),
    ModelKind("smartphone-wb", (80.0, 160.0), (6800.0, 7600.0), "coarse", (35.0, 45.0)),
)


@dataclass(frozen=True)
class DeviceChannel:
    """A persistent per-device channel: catalogue model x unit tolerance x the owner's rooms,
    with small per-session variation."""

    n_models: int = 12  # catalogue size; model k is of kind DEVICE_KINDS[k % len]
    kinds: tuple[ModelKind, ...] = DEVICE_KINDS
    mic_eq_db: float = 6.0  # std of a model's 5 microphone-response bumps
    unit_eq_db: float = 1.0  # std of a unit's 2 tolerance bumps
    codec_severity: float = 1.0  # >1 coarser quantisation, <1 finer
    rooms: tuple[int, int] = (1, 3)  # the owner's usual rooms
    rt60_s: tuple[float, float] = (0.2, 0.7)
    drr_db: tuple[float, float] = (2.0, 10.0)  # near-field direct-to-reverberant ratio
    snr_db: tuple[float, float] = (8.0, 25.0)  # a room's usual SNR
    session_snr_sd: float = 2.0  # per-session variation around the room's SNR
    session_drr_sd: float = 1.5
    session_eq_db: float = 0.5  # per-session (handling, orientation) EQ bumps
    level_db: float = 3.0


@dataclass(frozen=True)
class Domain:
    """A named set of generator settings: population prior, style and channel model."""

    name: str
    population: Population
    style: Style
    channel: StudioChannel | DeviceChannel


PUBLIC_DOMAIN = Domain(
    name="public",
    population=Population(accent=1),
    style=Style(
        speaking_rate=(3.5, 5.5),
        drift=DriftStd(f0_st=1.0, rate=0.05, tilt_db=0.8, vtl=0.008),
        duration_s=(4.0, 8.0),
        utts_per_speaker=(24, 24),
    ),
    channel=StudioChannel(),
)

DEVICE_DOMAIN = Domain(
    name="device",
    population=Population(
        accent=2, child_fraction=0.1, age_years=(16.0, 80.0), f0_range_st=(3.0, 9.0)
    ),
    style=Style(
        speaking_rate=(4.5, 7.0),
        prosody=Prosody(
            declination_st=(0.5, 3.0),
            accents_per_s=(0.8, 1.8),
            accent_height=(0.4, 1.2),
            wander_st=3.0,
        ),
        drift=DriftStd(f0_st=2.0, rate=0.10, tilt_db=1.5, vtl=0.015),
        duration_s=(2.0, 4.0),
        utts_per_speaker=(4, 40),
    ),
    channel=DeviceChannel(),
)


@dataclass(frozen=True)
class WorldConfig:
    """A whole two-domain world: the two domains, how many speakers/devices, the trials."""

    seed: int = 0
    public_speakers: int = 300
    train_devices: int = 2000
    test_devices: int = 200
    public: Domain = PUBLIC_DOMAIN
    device: Domain = DEVICE_DOMAIN
    targets_per_test_device: int = 10  # target pairs per held-out device (all if fewer)
    nontarget_ratio: int = 10  # nontarget trials per target trial
    same_model_fraction: float = 0.5  # of the nontargets: pairs of one device model

    def __post_init__(self) -> None:
        for name, domain, kind in (
            ("public", self.public, StudioChannel),
            ("device", self.device, DeviceChannel),
        ):
            if not isinstance(domain.channel, kind):
                raise ConfigError(
                    f"{name}.channel", "wrong channel model", f"use a {kind.__name__}"
                )
            _check_domain(name, domain)
        limits = [
            ("public_speakers", self.public_speakers, 1, 10**5),
            ("train_devices", self.train_devices, 1, 10**6),
            ("test_devices", self.test_devices, 2, 10**5),
            ("targets_per_test_device", self.targets_per_test_device, 1, None),
            ("nontarget_ratio", self.nontarget_ratio, 1, None),
        ]
        for name, value, lo, hi in limits:
            if value < lo or (hi is not None and value >= hi):
                want = f"at least {lo}" + (f" and below {hi}" if hi else "")
                raise ConfigError(name, f"got {value}", f"use {want}")
        if self.device.style.utts_per_speaker[0] < 2:
            raise ConfigError(
                "device.style.utts_per_speaker",
                f"got {self.device.style.utts_per_speaker}",
                "held-out devices need at least 2 utterances (target trials): use >= 2",
            )
        if not 0.0 <= self.same_model_fraction <= 1.0:
            raise ConfigError(
                "same_model_fraction", f"got {self.same_model_fraction}", "use a value in [0, 1]"
            )

    def key(self, part: Part) -> str:
        """Short hex cache key of the settings one part depends on (plus the versions)."""
        rec = self.record(part)
        return hashlib.sha256(json.dumps(rec, sort_keys=True).encode()).hexdigest()[:16]

    def record(self, part: Part) -> dict[str, object]:
        """The settings of one part as JSON-able data: what its key hashes."""
        rec: dict[str, object] = {
            "part": part,
            "seed": self.seed,
            "world_version": WORLD_VERSION,
            "generator_version": GENERATOR_VERSION,
        }
        if part == "public":
            rec |= {"domain": asdict(self.public), "speakers": self.public_speakers}
        else:
            rec |= {"domain": asdict(self.device)}
            if part == "devices":
                rec["devices"] = self.train_devices
            else:
                rec |= {
                    "devices": self.test_devices,
                    "targets_per_test_device": self.targets_per_test_device,
                    "nontarget_ratio": self.nontarget_ratio,
                    "same_model_fraction": self.same_model_fraction,
                }
        return rec


def _check_range(name: str, pair: tuple[float, float], lo: float, hi: float | None = None) -> None:
    a, b = pair
    if not (lo <= a <= b and (hi is None or b <= hi)):
        bound = f"{lo} <= low <= high" + (f" <= {hi}" if hi is not None else "")
        raise ConfigError(name, f"got {tuple(pair)}", f"use (low, high) with {bound}")


def _check_domain(name: str, d: Domain) -> None:
    """Refuse settings the generator cannot honour, naming the field."""
    p, s = d.population, d.style
    _check_range(f"{name}.population.age_years", p.age_years, 1.0, 110.0)
    _check_range(f"{name}.population.f0_range_st", p.f0_range_st, 0.0, 24.0)
    _check_range(f"{name}.style.speaking_rate", s.speaking_rate, 1.0, 12.0)
    _check_range(f"{name}.style.duration_s", s.duration_s, 0.5)
    _check_range(f"{name}.style.utts_per_speaker", s.utts_per_speaker, 1, 9999)
    for field_name, v in (
        ("female_fraction", p.female_fraction),
        ("child_fraction", p.child_fraction),
    ):
        if not 0.0 <= v <= 1.0:
            raise ConfigError(f"{name}.population.{field_name}", f"got {v}", "use [0, 1]")
    if p.accent_sd < 0 or p.f0_scale <= 0:
        raise ConfigError(
            f"{name}.population", "accent_sd must be >= 0 and f0_scale > 0", "fix the value"
        )
    c = d.channel
    if isinstance(c, DeviceChannel):
        if c.n_models < 1 or not c.kinds:
            raise ConfigError(f"{name}.channel.n_models", f"got {c.n_models}", "use >= 1 model")
        _check_range(f"{name}.channel.rooms", c.rooms, 1, 16)
        _check_range(f"{name}.channel.rt60_s", c.rt60_s, 0.05, 3.0)
        if c.codec_severity <= 0:
            raise ConfigError(
                f"{name}.channel.codec_severity", f"got {c.codec_severity}", "use > 0"
            )
    else:
        _check_range(f"{name}.channel.lowpass_hz", c.lowpass_hz, 500.0, 7950.0)
        _check_range(f"{name}.channel.rt60_s", c.rt60_s, 0.05, 3.0)


# ---------------------------------------------------------------------------------------------
# Speakers and devices
# ---------------------------------------------------------------------------------------------


def speaker_id(part: Part, index: int) -> str:
    """`pub-00042`, `dev-000042`, `tst-00042`: fixed width, so lexical order is numeric."""
    prefix, width = _ID_PREFIX[part]
    return f"{prefix}-{index:0{width}d}"


def _domain(cfg: WorldConfig, part: Part) -> Domain:
    return cfg.public if part == "public" else cfg.device


def _check_index(part: str, index: int) -> None:
    if part not in _ID_PREFIX:
        raise ConfigError("part", f"got {part!r}", "use 'public', 'devices' or 'test'")
    if index < 0:
        raise ConfigError("index", f"got {index}", "use an index >= 0")


def accent_offsets(seed: int, accent: int, sd: float) -> np.ndarray:
    """(phones, 5) log formant offsets every speaker of an accent shares (vowels, glides)."""
    rng = _rng(seed, "accent", accent, 0, _W_ACCENT)
    z = rng.standard_normal((len(_PHONES), 5)) * _ACCENT_FORMANT_SD
    return sd * z * _ACCENT_PHONES[:, None]


def _rescale(x: float, old: tuple[float, float], new: tuple[float, float]) -> float:
    return new[0] + (x - old[0]) / (old[1] - old[0]) * (new[1] - new[0])


def world_speaker(cfg: WorldConfig, part: Part, index: int) -> SpeakerParams:
    """A speaker (or a device's owner) of a part: the shared voice prior, then the domain's
    accent, age and style habits. Depends on (seed, part, index) only."""
    _check_index(part, index)
    d = _domain(cfg, part)
    p = d.population
    rng = _rng(cfg.seed, part, index, 0, _W_SPEAKER)
    v = draw_voice(rng, speaker_id(part, index), p.female_fraction)
    child = bool(rng.random() < p.child_fraction)
    age = float(rng.uniform(*p.age_years))
    offsets = np.asarray(v.formant_offsets) + accent_offsets(cfg.seed, p.accent, p.accent_sd)
    vtl, f0 = v.vtl_scale, v.f0_mean_hz * p.f0_scale
    jitter, shimmer, breath = v.jitter, v.shimmer, v.breathiness
    if child:  # 8-14 years: a tract ~20-35 % shorter than an adult male's, F0 ~250-300 Hz
        vtl = float(np.exp(rng.normal(np.log(1.28), 0.05)))
        f0 = float(270.0 * np.exp(rng.normal(0.0, 0.1)) * p.f0_scale)
    elif age > 65.0:  # presbyphonia: rougher, breathier; F0 falls (women) or rises (men)
        k = (age - 65.0) / 15.0
        jitter, shimmer, breath = jitter * (1 + 0.6 * k), shimmer * (1 + 0.4 * k), breath + 0.05 * k
        f0 *= 1.0 + (0.06 if v.sex == "male" else -0.08) * k
    return replace(
        v,
        vtl_scale=vtl,
        formant_offsets=tuple(tuple(float(x) for x in row) for row in offsets),
        f0_mean_hz=float(f0),
        f0_range_st=_rescale(v.f0_range_st, (1.5, 6.0), p.f0_range_st),
        jitter=float(jitter),
        shimmer=float(shimmer),
        breathiness=float(breath),
        speaking_rate=_rescale(v.speaking_rate, (3.5, 6.0), d.style.speaking_rate),
        piriform_zero_hz=v.piriform_zero_hz * vtl / v.vtl_scale,
    )


def n_utterances(cfg: WorldConfig, part: Part, index: int) -> int:
    """Recordings of a speaker/device: log-uniform in the domain's range (quantity skew)."""
    _check_index(part, index)
    lo, hi = _domain(cfg, part).style.utts_per_speaker
    if lo == hi:
        return lo
    u = _rng(cfg.seed, part, index, 0, _W_COUNT).uniform(np.log(lo), np.log(hi + 1))
    return min(hi, int(np.exp(u)))


@dataclass(frozen=True)
class DeviceModel:
    """One catalogue entry: what every unit of this model does to sound."""

    index: int
    kind: str
    highpass_hz: float
    lowpass_hz: float
    mic_eq: tuple[tuple[float, float, float], ...]  # (log2 centre Hz, width oct, gain dB)
    codec: Codec
    self_noise_snr_db: float
    far_field: bool

    @property
    def name(self) -> str:
        """`<kind>-<index>`, e.g. `earbuds-07` (what utt2devmodel records)."""
        return f"{self.kind}-{self.index:02d}"


def device_model(cfg: WorldConfig, k: int) -> DeviceModel:
    """Catalogue model k of the device domain; depends on (seed, channel settings, k) only."""
    ch = cfg.device.channel
    assert isinstance(ch, DeviceChannel)
    if not 0 <= k < ch.n_models:
        raise ConfigError("device model", f"got {k}", f"use 0 <= k < {ch.n_models}")
    kind = ch.kinds[k % len(ch.kinds)]
    rng = _rng(cfg.seed, "catalogue", k, 0, _W_MODEL)
    eq = zip(
        rng.uniform(np.log2(150.0), np.log2(6500.0), 5),
        rng.uniform(0.3, 1.2, 5),
        rng.normal(0.0, ch.mic_eq_db, 5),
        strict=True,
    )
    return DeviceModel(
        index=k,
        kind=kind.name,
        highpass_hz=float(rng.uniform(*kind.highpass_hz)),
        lowpass_hz=float(rng.uniform(*kind.lowpass_hz)),
        mic_eq=tuple((float(c), float(w), float(g)) for c, w, g in eq),
        codec=kind.codec,
        self_noise_snr_db=float(rng.uniform(*kind.self_noise_snr_db)),
        far_field=kind.far_field,
    )


@dataclass(frozen=True)
class Room:
    """One of the owner's usual rooms: reverberation and background noise, persistent."""

    rt60_s: float
    drr_db: float
    snr_db: float
    noise_beta: float
    noise_bump: tuple[float, float, float]  # (log2 centre Hz, width oct, gain dB)


@dataclass(frozen=True)
class Device:
    """A physical device: its model, the unit's tolerance and its owner's rooms."""

    model: DeviceModel
    unit_eq: tuple[tuple[float, float, float], ...]
    rooms: tuple[Room, ...]
    room_weights: tuple[float, ...]  # how often each room is used


def device(cfg: WorldConfig, part: Part, index: int) -> Device:
    """The device of a training or held-out device owner; from (seed, part, index) only."""
    _check_index(part, index)
    if part == "public":
        raise ConfigError("part", "public speakers have no device", "use 'devices' or 'test'")
    ch = cfg.device.channel
    assert isinstance(ch, DeviceChannel)
    rng = _rng(cfg.seed, part, index, 0, _W_UNIT)
    # Model popularity falls with catalogue position (a few models dominate the market).
    pop = 1.0 / np.arange(1, ch.n_models + 1) ** 0.7
    model = device_model(cfg, int(rng.choice(ch.n_models, p=pop / pop.sum())))
    unit_eq = tuple(
        (float(rng.uniform(np.log2(200.0), np.log2(6000.0))), float(rng.uniform(0.5, 1.5)),
         float(rng.normal(0.0, ch.unit_eq_db)))
        for _ in range(2)
    )  # fmt: skip
    n_rooms = int(rng.integers(ch.rooms[0], ch.rooms[1] + 1))
    rooms = tuple(_room(cfg.seed, part, index, r, ch, model.far_field) for r in range(n_rooms))
    w = 0.5 ** np.arange(n_rooms)  # the usual room first
    return Device(model, unit_eq, rooms, tuple(float(x) for x in w / w.sum()))


def _room(seed: int, part: str, index: int, r: int, ch: DeviceChannel, far: bool) -> Room:
    rng = _rng(seed, part, index, r, _W_ROOM)
    drr = float(rng.uniform(*ch.drr_db)) - (8.0 if far else 0.0)
    bump = (
        float(rng.uniform(np.log2(100.0), np.log2(3000.0))),
        float(rng.uniform(0.3, 1.0)),
        float(rng.uniform(0.0, 10.0)),
    )
    return Room(
        rt60_s=float(rng.uniform(*ch.rt60_s)),
        drr_db=drr,
        snr_db=float(rng.uniform(*ch.snr_db)),
        noise_beta=float(rng.uniform(0.3, 1.8)),
        noise_bump=bump,
    )


# ---------------------------------------------------------------------------------------------
# Codecs (vectorised: block-wise, never a per-sample Python loop)
# ---------------------------------------------------------------------------------------------


def mulaw(y: np.ndarray, bits: int) -> np.ndarray:
    """G.711-style mu-law companding quantised to `bits` bits (telephony)."""
    mu = 255.0
    c = np.sign(y) * np.log1p(mu * np.abs(np.clip(y, -1.0, 1.0))) / np.log1p(mu)
    q = np.round(c * (2 ** (bits - 1) - 1)) / (2 ** (bits - 1) - 1)
    return np.sign(q) * np.expm1(np.abs(q) * np.log1p(mu)) / mu


def apcm(y: np.ndarray, bits: int, block: int = 160) -> np.ndarray:
    """Adaptive PCM: `bits`-bit quantisation with one step size per 10 ms block (the adaptive
    step of ADPCM, as in Bluetooth/wearable codecs, without its sample-serial predictor)."""
    n = y.size
    pad = np.pad(y, (0, (-n) % block)).reshape(-1, block)
    levels = 2 ** (bits - 1)
    step = np.max(np.abs(pad), axis=1, keepdims=True) / levels + 1e-9
    q = np.clip(np.round(pad / step), -levels, levels - 1) * step
    return q.reshape(-1)[:n]


def spectral_coarsening(y: np.ndarray, step_db: float, floor_db: float) -> np.ndarray:
    """Low-bitrate transform coding stand-in: band energies quantised to `step_db`, fine
    structure flattened, and bins more than `floor_db` below the frame peak zeroed."""
    _, _, spec = stft(y, nperseg=256, noverlap=128, window="hann")
    mag = np.abs(spec) + 1e-12
    edges = np.unique(np.round(np.geomspace(2, mag.shape[0], 21)).astype(int))
    edges = np.concatenate([[0], edges])
    band = np.zeros(mag.shape[0], dtype=np.int64)
    for i in range(len(edges) - 1):
        band[edges[i] : edges[i + 1]] = i
    n_b = band.max() + 1
    e = np.zeros((n_b, mag.shape[1]))
    np.add.at(e, band, mag**2)
    e_db = 10 * np.log10(e / np.bincount(band, minlength=n_b)[:, None] + 1e-24)
    q_db = np.round(e_db / step_db) * step_db
    fine = mag / np.sqrt(10 ** (e_db[band] / 10))
    new = np.sqrt(10 ** (q_db[band] / 10)) * fine**0.6
    peak = 20 * np.log10(new.max(axis=0, keepdims=True) + 1e-12)
    new = np.where(20 * np.log10(new + 1e-12) < peak - floor_db, 0.0, new)
    _, out = istft(new * np.exp(1j * np.angle(spec)), nperseg=256, noverlap=128, window="hann")
    return np.pad(out[: y.size], (0, max(0, y.size - out.size)))


def apply_codec(y: np.ndarray, codec: Codec, severity: float) -> np.ndarray:
    """A device model's coding; `severity` > 1 codes coarser."""
    if codec == "mulaw":
        return mulaw(y, max(4, round(8 / severity)))
    if codec == "apcm":
        return apcm(y, max(2, round(4 / severity)))
    if codec == "coarse":
        return spectral_coarsening(y, 3.0 * severity, 35.0 / severity)
    return y


# ---------------------------------------------------------------------------------------------
# Synthesis
# ---------------------------------------------------------------------------------------------


_COARSE_HZ = np.fft.rfftfreq(1024, 1.0 / _FS)  # 15.6 Hz grid: finer than any response detail


def _fft_filter(y: np.ndarray, gain_of_hz) -> np.ndarray:
    """y through a zero-phase filter given by its amplitude gain per frequency (one FFT);
    the gain is evaluated on a 15.6 Hz grid and interpolated, which keeps it cheap."""
    n_fast = next_fast_len(y.size, real=True)
    f = np.fft.rfftfreq(n_fast, 1.0 / _FS)
    gain = np.interp(f, _COARSE_HZ, gain_of_hz(_COARSE_HZ))
    return irfft(rfft(y, n_fast) * gain, n_fast)[: y.size]


def _bumps(eq: tuple[tuple[float, float, float], ...]) -> tuple[np.ndarray, ...]:
    c, w, g = (np.array(v) for v in zip(*eq, strict=True))
    return c, g, w


def device_channel(
    cfg: WorldConfig, part: Part, index: int, utt: int, dry: np.ndarray
) -> np.ndarray:
    """The recording of dry audio `dry` on device `index` in session `utt` (float32).

    Room (persistent reverberation and noise colour, per-session SNR and distance), then the
    model's microphone response and band limit with the unit's tolerance and the session's
    handling, self-noise, level, and the model's codec.
    """
    ch = cfg.device.channel
    assert isinstance(ch, DeviceChannel)
    dev = device(cfg, part, index)
    s = _rng(cfg.seed, part, index, utt, _W_SESSION)
    r = int(s.choice(len(dev.rooms), p=dev.room_weights))
    room = dev.rooms[r]
    snr = room.snr_db + ch.session_snr_sd * s.standard_normal()
    drr = room.drr_db + ch.session_drr_sd * s.standard_normal()
    level = s.uniform(-ch.level_db, ch.level_db)
    handling = tuple(
        (float(s.uniform(np.log2(200.0), np.log2(6000.0))), 1.0,
         float(s.normal(0.0, ch.session_eq_db)))
        for _ in range(2)
    )  # fmt: skip
    noise = _rng(cfg.seed, part, index, utt, _W_NOISE)
    # The room's impulse response keeps its shape across sessions; only the distance moves.
    tail = reverb_tail(_rng(cfg.seed, part, index, r, _W_TAIL), room.rt60_s, drr, _FS)
    y = fftconvolve(dry, tail)[: dry.size]
    y = add_at_snr(y, coloured_noise(noise, y.size, room.noise_beta, room.noise_bump, _FS), snr)
    m = dev.model
    eq = _bumps(m.mic_eq + dev.unit_eq + handling)

    def response(f: np.ndarray) -> np.ndarray:
        return 10.0 ** (eq_db(f, *eq) / 20.0) * band_gain(f, m.highpass_hz, m.lowpass_hz)

    y = _fft_filter(y, response)
    y = add_at_snr(y, noise.standard_normal(y.size), m.self_noise_snr_db)
    y = at_level(y, level).astype(np.float64)
    return np.clip(apply_codec(y, m.codec, ch.codec_severity), -1.0, 1.0).astype(np.float32)


def synthesize(cfg: WorldConfig, part: Part, index: int, utt: int) -> np.ndarray:
    """Utterance `utt` of speaker/device `index` of a part, float32 at 16 kHz.

    Depends on (seed, the part's settings, index, utt) only, so any subset regenerates
    identically and generation parallelises.
    """
    _check_index(part, index)
    if utt < 0:
        raise ConfigError("utt", f"got {utt}", "use an index >= 0")
    d = _domain(cfg, part)
    spk = world_speaker(cfg, part, index)
    content = _rng(cfg.seed, part, index, utt, _W_CONTENT)
    drift = Drift.draw(_rng(cfg.seed, part, index, utt, _W_DRIFT), d.style.drift)
    source = _rng(cfg.seed, part, index, utt, _W_SOURCE)
    n = round(content.uniform(*d.style.duration_s) * _FS)
    spec, freqs = voice_spectrogram(spk, drift, d.style.prosody, content, source, n, _FS)
    if isinstance(d.channel, StudioChannel):
        chan = _rng(cfg.seed, part, index, utt, _W_SESSION)
        session = d.channel.session()
        y = inverse_stft(spec * _session_filter(chan, session, freqs)[:, None], n)
        y = _session_reverb(y, chan, session, _FS)
        return _session_noise_and_level(y, chan, session, _FS)
    return device_channel(cfg, part, index, utt, inverse_stft(spec, n))


def channel_probe(cfg: WorldConfig, part: Part, index: int, utt: int, n: int = 32000) -> np.ndarray:
    """A fixed white-noise probe recorded through a device's channel in session `utt`:
    what the channel alone does, with no speaker in it."""
    probe = np.random.default_rng(12345).standard_normal(n) * 0.05
    return device_channel(cfg, part, index, utt, probe)


# ---------------------------------------------------------------------------------------------
# On disk: one cache entry per part (public, training devices, held-out devices + trials)
# ---------------------------------------------------------------------------------------------

PARTS: tuple[Part, ...] = ("public", "devices", "test")


def _n_speakers(cfg: WorldConfig, part: Part) -> int:
    return {"public": cfg.public_speakers, "devices": cfg.train_devices}.get(part, cfg.test_devices)


def _write_speaker(cfg: WorldConfig, part: Part, index: int, root: str) -> int:
    """Synthesize and write every recording of one speaker/device; returns samples written."""
    d = Path(root) / "wav" / speaker_id(part, index)
    d.mkdir(parents=True, exist_ok=True)
    total = 0
    for u in range(n_utterances(cfg, part, index)):
        audio = synthesize(cfg, part, index, u)
        sf.write(d / f"{u:04d}.wav", audio, int(_FS), subtype="PCM_16", format="WAV")
        total += audio.size
    return total


def _utts(cfg: WorldConfig, part: Part) -> list[list[str]]:
    """Utterance ids per speaker/device, in index order."""
    return [
        [f"{speaker_id(part, i)}-{u:04d}" for u in range(n_utterances(cfg, part, i))]
        for i in range(_n_speakers(cfg, part))
    ]


def _utt_path(utt: str) -> str:
    return f"{utt[:-5]}/{utt[-4:]}.wav"


def _write_lists(cfg: WorldConfig, part: Part, root: Path) -> None:
    """wav.scp, utt2spk, spk2utt (relative paths), and the device model of each recording."""
    per = _utts(cfg, part)
    flat = [u for us in per for u in us]
    _write_lines(root / "wav.scp", (f"{u} wav/{_utt_path(u)}" for u in flat))
    _write_lines(root / "utt2spk", (f"{u} {u[:-5]}" for u in flat))
    _write_lines(root / "spk2utt", (f"{us[0][:-5]} {' '.join(us)}" for us in per))
    if part != "public":
        models = [device(cfg, part, i).model.name for i in range(len(per))]
        _write_lines(
            root / "spk2devmodel", (f"{us[0][:-5]} {m}" for us, m in zip(per, models, strict=True))
        )
        _write_lines(
            root / "utt2devmodel",
            (f"{u} {m}" for us, m in zip(per, models, strict=True) for u in us),
        )


def make_world_trials(cfg: WorldConfig) -> list[tuple[int, str, str]]:
    """(label, utt1, utt2) over the held-out devices, sorted: up to targets_per_test_device
    target pairs per device, nontarget_ratio x as many nontargets, same_model_fraction of
    them between two devices of one model (so a channel shortcut cannot pass)."""
    per = _utts(cfg, "test")
    models = [device(cfg, "test", d).model.index for d in range(len(per))]
    targets: list[tuple[str, str]] = []
    for d, us in enumerate(per):
        pairs = [(us[i], us[j]) for i in range(len(us)) for j in range(i + 1, len(us))]
        if len(pairs) > cfg.targets_per_test_device:
            pick = _rng(cfg.seed, "test", d, 0, _W_TRIALS).choice(
                len(pairs), cfg.targets_per_test_device, replace=False
            )
            pairs = [pairs[k] for k in sorted(pick.tolist())]
        targets.extend(pairs)
    want = cfg.nontarget_ratio * len(targets)
    by_model: dict[int, list[int]] = {}
    for d, m in enumerate(models):
        by_model.setdefault(m, []).append(d)
    shared = {m: ds for m, ds in by_model.items() if len(ds) >= 2}
    n_utts = [len(us) for us in per]
    avail_same = sum(
        (sum(n_utts[d] for d in ds) ** 2 - sum(n_utts[d] ** 2 for d in ds)) // 2
        for ds in shared.values()
    )
    total = sum(n_utts)
    avail_all = (total**2 - sum(n**2 for n in n_utts)) // 2
    want_same = min(round(cfg.same_model_fraction * want), avail_same)
    if want_same == 0 and cfg.same_model_fraction > 0:
        raise ConfigError(
            "test_devices",
            f"no two of the {len(per)} held-out devices share a device model",
            "use more test devices or fewer catalogue models (device.channel.n_models)",
        )
    rng = _rng(cfg.seed, "test", 0, 1, _W_TRIALS)
    chosen: set[tuple[str, str]] = set()
    pools = [d for ds in shared.values() for d in ds]

    def draw(same: bool) -> None:
        a = pools[int(rng.integers(len(pools)))] if same else int(rng.integers(len(per)))
        group = shared[models[a]] if same else range(len(per))
        b = group[int(rng.integers(len(group)))]
        if a != b:
            x, y = per[a][int(rng.integers(n_utts[a]))], per[b][int(rng.integers(n_utts[b]))]
            chosen.add((min(x, y), max(x, y)))

    while len(chosen) < want_same:
        draw(True)
    want = min(want, avail_all)
    while len(chosen) < want:
        draw(False)
    trials = [(1, a, b) for a, b in targets] + [(0, a, b) for a, b in chosen]
    return sorted(trials, key=lambda t: (t[1], t[2]))


def _entry_name(cfg: WorldConfig, part: Part) -> str:
    return f"world-{part}-{cfg.key(part)}"


def _part_complete(path: Path, key: str) -> bool:
    try:
        rec = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return rec.get("key") == key


def generate_part(
    cfg: WorldConfig, part: Part, out_dir: Path, workers: int = 1, progress: bool = True
) -> Path:
    """Write one part as a Kaldi data dir into out_dir atomically (temp dir, then os.replace;
    config.json last marks it complete). The bytes do not depend on `workers`."""
    if part not in PARTS:
        raise ConfigError("part", f"got {part!r}", "use 'public', 'devices' or 'test'")
    if workers < 1:
        raise ConfigError("workers", f"got {workers}", "use 1 or more")
    out_dir = Path(out_dir).absolute()
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise DataError(out_dir, "output directory exists and is not empty", "remove it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-{os.getpid()}-", dir=out_dir.parent))
    try:
        jobs = [(cfg, part, i, str(tmp)) for i in range(_n_speakers(cfg, part))]
        samples = _progress_map(_write_speaker, jobs, min(workers, len(jobs)), progress)
        _write_lists(cfg, part, tmp)
        if part == "test":
            trials = make_world_trials(cfg)
            _write_lines(
                tmp / "trials.txt",
                (f"{lab} {_utt_path(a)} {_utt_path(b)}" for lab, a, b in trials),
            )
            _write_lines(
                tmp / "trials_kaldi.txt",
                (f"{a} {b} {'target' if lab else 'nontarget'}" for lab, a, b in trials),
            )
        stats = {"utterances": len(_utts_flat(cfg, part)), "hours": sum(samples) / _FS / 3600}
        record = {**cfg.record(part), **stats, "key": cfg.key(part)}
        (tmp / "config.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if _part_complete(out_dir, cfg.key(part)):  # another process finished it first
                shutil.rmtree(tmp, ignore_errors=True)
                return out_dir
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _utts_flat(cfg: WorldConfig, part: Part) -> list[str]:
    return [u for us in _utts(cfg, part) for u in us]


@dataclass(frozen=True)
class WorldPaths:
    """The world's data dirs: use as data.train (public or devices), data.test, data.trials."""

    public: Path
    devices: Path
    test: Path

    @property
    def trials(self) -> Path:
        """The held-out device trial list (VoxCeleb format; trials_kaldi.txt beside it)."""
        return self.test / "trials.txt"


def world_dirs(cfg: WorldConfig, cache_root: Path | None = None) -> WorldPaths:
    """Where ensure_world keeps each part of cfg (one cache entry per part)."""
    root = (Path(".cache/fedvox/corpora") if cache_root is None else Path(cache_root)).absolute()
    public, devices, test = (root / _entry_name(cfg, p) for p in PARTS)
    return WorldPaths(public, devices, test)


def ensure_world(
    cfg: WorldConfig,
    cache_root: Path | None = None,
    workers: int | None = None,
    progress: bool = True,
    parts: tuple[Part, ...] = PARTS,
) -> WorldPaths:
    """Return the world's data dirs, generating any part that is not cached yet.

    Parts are cached separately: changing the device domain leaves the public part reused.
    """
    paths = world_dirs(cfg, cache_root)
    if workers is None:
        workers = os.cpu_count() or 1
    for part in parts:
        path = getattr(paths, part)
        if _part_complete(path, cfg.key(part)):
            continue
        if path.exists() and any(path.iterdir()):
            raise DataError(
                path, "cache entry exists but has no matching config.json", "delete the directory"
            )
        _remove_stale_temps(path.parent, path.name)
        generate_part(cfg, part, path, workers=workers, progress=progress)
    return paths


__all__ = [
    "DEVICE_DOMAIN",
    "DEVICE_KINDS",
    "PARTS",
    "PUBLIC_DOMAIN",
    "WORLD_VERSION",
    "Device",
    "DeviceChannel",
    "DeviceModel",
    "Domain",
    "ModelKind",
    "Population",
    "Room",
    "StudioChannel",
    "Style",
    "WorldConfig",
    "WorldPaths",
    "accent_offsets",
    "apcm",
    "apply_codec",
    "channel_probe",
    "device",
    "device_channel",
    "device_model",
    "ensure_world",
    "generate_part",
    "make_world_trials",
    "mulaw",
    "n_utterances",
    "speaker_id",
    "spectral_coarsening",
    "synthesize",
    "world_dirs",
    "world_speaker",
]
