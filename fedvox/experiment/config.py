"""The typed experiment config: one TOML file plus a seed describes a whole run.

Validated once at the edge (load time) with errors that name the field; the rest of fedvox
receives typed values, never raw dictionaries.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import tomllib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fedvox.errors import ConfigError

# fedvox.device.DEVICE_PATTERN, repeated so that loading a config does not import torch
DEVICE_PATTERN = r"^(cpu|cuda(:\d+)?)$"

if TYPE_CHECKING:  # engine types, imported lazily so `fedvox config` stays light
    from fedvox.data.features import FeatureConfig
    from fedvox.data.partition import PartitionConfig
    from fedvox.data.synthetic import SyntheticConfig
    from fedvox.data.world import WorldConfig
    from fedvox.fl import Algorithm, ClientConfig, ReconConfig, ServerOptimizer, SimulatorConfig
    from fedvox.fl.attack import AttackConfig
    from fedvox.scale import BackendConfig


@contextmanager
def toml_paths(paths: Mapping[str, str]) -> Iterator[None]:
    """Re-raise an engine's ConfigError under the TOML path the user wrote.

    Engine objects name their own fields (`client.lr`); a config section that builds one
    maps those names to its keys (`federated.local_lr`), so the user reads their own words.
    """
    try:
        yield
    except ConfigError as err:
        if err.field not in paths:
            raise
        raise ConfigError(paths[err.field], err.problem, err.fix, err.source) from None


class _Strict(BaseModel):
    """Unknown keys are errors: a typo must not silently fall back to a default."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class SyntheticSection(_Strict):
    """Settings of the embedded synthetic corpus (see docs/synthetic.md)."""

    seed: int = Field(0, ge=0, description="integer >= 0: seeds every random stream")
    n_train_speakers: int = Field(200, ge=2)
    n_test_speakers: int = Field(40, ge=2)
    train_utts_per_speaker: int = Field(16, ge=2)
    test_utts_per_speaker: int = Field(8, ge=2)
    min_duration_s: float = Field(2.5, gt=0)
    max_duration_s: float = Field(5.0, gt=0)
    difficulty: Literal["clean", "mild", "hard"] = "mild"
    nontarget_ratio: int = Field(10, ge=1)

    @model_validator(mode="after")
    def _durations(self) -> SyntheticSection:
        if self.max_duration_s < self.min_duration_s:
            raise ValueError("max_duration_s must be >= min_duration_s")
        return self

    def generator_config(self) -> SyntheticConfig:
        """The generator's settings (fedvox.data.synthetic) for this table."""
        from fedvox.data.synthetic import SyntheticConfig

        return SyntheticConfig(**self.model_dump())


WORLD_PREFIX = "world:"
# Which world parts each data field may name: train on a domain, test on the held-out devices.
# data.train values that name the embedded generator (its speakers, or its public voices)
SYNTHETIC_TRAIN = ("synthetic", "synthetic:public")

WORLD_PARTS: dict[str, tuple[str, ...]] = {
    "train": ("public", "devices"),
    "public": ("public", "devices"),
    "backend": ("public", "devices"),
    "test": ("test",),
    "trials": ("trials",),
}


def _world_default(name: str) -> Any:
    """A WorldConfig default, read when a [data.world] table is built (so the two cannot
    drift apart, and `fedvox config` without a world does not import the generator)."""
    from fedvox.data.world import WorldConfig

    return getattr(WorldConfig(), name)


# WorldConfig's own field names -> the [data.world] keys a user writes.
WORLD_FIELDS = {
    "public_speakers": "data.world.public_speakers",
    "train_devices": "data.world.train_devices",
    "test_devices": "data.world.test_devices",
    "public.style.utts_per_speaker": "data.world.public_utts",
    "public.style.duration_s": "data.world.public_duration_s",
    "device.style.utts_per_speaker": "data.world.device_utts",
    "device.style.duration_s": "data.world.device_duration_s",
}


class WorldSection(_Strict):
    """The two-domain world (fedvox.data.world; docs/synthetic.md, "Two-domain world").

    With this table set, data.train / data.public may be "world:public" or "world:devices",
    data.test "world:test" and data.trials "world:trials"; prepare() generates the parts a
    run names once (cached by their settings under data.cache_dir/corpora). Counts default
    to WorldConfig()'s; the four optional ranges shrink a domain's recordings (quick tests),
    None keeping the domain's own. Domain details beyond these are set in Python.
    """

    seed: int = Field(default_factory=lambda: _world_default("seed"), ge=0)
    public_speakers: int = Field(
        default_factory=lambda: _world_default("public_speakers"),
        ge=1,
        description="labelled speakers of the public/server domain",
    )
    train_devices: int = Field(
        default_factory=lambda: _world_default("train_devices"),
        ge=1,
        description="one-speaker training devices",
    )
    test_devices: int = Field(
        default_factory=lambda: _world_default("test_devices"),
        ge=2,
        description="held-out devices: the speakers of the trial list",
    )
    public_utts: tuple[int, int] | None = Field(
        None, description="utterances per public speaker (low, high); None = the domain's"
    )
    public_duration_s: tuple[float, float] | None = Field(
        None, description="public utterance length, seconds (low, high); None = the domain's"
    )
    device_utts: tuple[int, int] | None = Field(
        None, description="recordings per device (low, high, log-uniform); None = the domain's"
    )
    device_duration_s: tuple[float, float] | None = Field(
        None, description="device recording length, seconds (low, high); None = the domain's"
    )

    @model_validator(mode="after")
    def _generator_accepts(self) -> WorldSection:
        try:
            self.world_config()
        except ConfigError as err:
            where = WORLD_FIELDS.get(err.field, f"data.world ({err.field})")
            raise ValueError(f"{where}: {err.problem}; {err.fix}") from None
        return self

    def world_config(self) -> WorldConfig:
        """The generator's WorldConfig for this table (its own checks run here)."""
        from dataclasses import replace

        from fedvox.data.world import WorldConfig

        base = WorldConfig()

        def domain(d, utts, duration):
            style = d.style
            if utts is not None:
                style = replace(style, utts_per_speaker=tuple(utts))
            if duration is not None:
                style = replace(style, duration_s=tuple(duration))
            return replace(d, style=style)

        return WorldConfig(
            seed=self.seed,
            public_speakers=self.public_speakers,
            train_devices=self.train_devices,
            test_devices=self.test_devices,
            public=domain(base.public, self.public_utts, self.public_duration_s),
            device=domain(base.device, self.device_utts, self.device_duration_s),
        )


class DataSection(_Strict):
    """Where training and evaluation audio come from.

    `train = "synthetic"` uses the embedded generator; `"synthetic:public"` trains on the
    generator's public voices instead (the seed the public negatives come from, the same
    counts), still scored on the embedded held-out speakers — what a server reaches alone
    with public data like the devices'. Otherwise `train` is a path to a Kaldi data
    dir, VoxCeleb/LibriSpeech folder or WeSpeaker raw.list, or, with [data.world] set, a part
    of the two-domain world ("world:public", "world:devices"; then test = "world:test",
    trials = "world:trials"). `test` and `trials` default to the synthetic corpus's held-out
    split when training on it. `public` is the server's labelled public corpus (same formats,
    or a world part); unset, public speakers come from the generator (other seed).
    `backend` is the corpus the scoring back end is fit on (the cosine back end's centring
    mean, the AS-norm cohort, LDA/PLDA); unset, the training data.
    """

    train: str = "synthetic"
    test: str | None = None
    trials: str | None = None
    public: str | None = Field(
        None,
        description="server's labelled public corpus (data dir/folder/raw.list, or "
        '"world:public"); None = synthetic public speakers',
    )
    backend: str | None = Field(
        None,
        description="corpus the scoring back end is fit on (data dir/folder/raw.list, or a "
        'world part such as "world:devices"); None = the training data',
    )
    synthetic: SyntheticSection = SyntheticSection()
    world: WorldSection | None = None
    cache_dir: str = ".cache/fedvox"
    workers: int = Field(2, ge=1, description="processes for generation and features")

    @model_validator(mode="after")
    def _test_needs_trials(self) -> DataSection:
        for key in WORLD_PARTS:
            value = getattr(self, key)
            if value is None or not value.startswith(WORLD_PREFIX):
                continue
            part = value.removeprefix(WORLD_PREFIX)
            allowed = WORLD_PARTS[key]
            if part not in allowed:
                names = " or ".join(f'"{WORLD_PREFIX}{p}"' for p in allowed)
                why = (
                    " (the held-out devices are the test speakers: training on them would "
                    "score seen voices)"
                    if part == "test"
                    else ""
                )
                raise ValueError(
                    f"data.{key} = {value!r} is not a world part here{why}; use {names}"
                )
            if self.world is None:
                raise ValueError(
                    f"data.{key} = {value!r} names a part of the two-domain world and "
                    "[data.world] is unset; add a [data.world] table (e.g. `seed = 0`; "
                    "the rest defaults) or give a path"
                )
        on_world = [
            (self.test or "").startswith(WORLD_PREFIX),
            (self.trials or "").startswith(WORLD_PREFIX),
        ]
        if any(on_world) and not all(on_world):
            raise ValueError(
                "data.test and data.trials name one test set: the world's trial list scores "
                'the world\'s test devices, so use data.test = "world:test" with '
                'data.trials = "world:trials" (or paths for both)'
            )
        if self.train not in SYNTHETIC_TRAIN and (self.test is None or self.trials is None):
            hint = (
                ' (for the world: data.test = "world:test", data.trials = "world:trials")'
                if self.train.startswith(WORLD_PREFIX)
                else ""
            )
            raise ValueError(
                "with a real training corpus, set both data.test (an evaluation data dir) "
                f"and data.trials (its trial list){hint}"
            )
        if (self.test is None) != (self.trials is None):
            raise ValueError("data.test and data.trials go together: set both or neither")
        return self


class FeaturesSection(_Strict):
    """Front end: Kaldi fbank, energy VAD, mean normalisation (Kaldi conventions; docs/verification.md)."""

    num_mel_bins: int = Field(30, ge=4, le=256)
    frame_shift_ms: float = Field(
        10.0,
        ge=1.0,
        le=25.0,
        description="hop between 25 ms analysis frames (Kaldi's 10; 20 halves every frame "
        "count downstream: features, model FLOPs, chunk_frames and cmn_window are in frames)",
    )
    vad: bool = True
    cmn: Literal["sliding", "utterance", "none"] = "sliding"
    cmn_window: int = Field(300, ge=3)

    def feature_config(self) -> FeatureConfig:
        """The data layer's FeatureConfig for this table (dither off: deterministic)."""
        from fedvox.data.features import CmnConfig, FbankConfig, FeatureConfig, VadConfig

        return FeatureConfig(
            fbank=FbankConfig(
                num_mel_bins=self.num_mel_bins, frame_shift_ms=self.frame_shift_ms, dither=0.0
            ),
            vad=VadConfig(enabled=self.vad),
            cmn=CmnConfig(mode=self.cmn, window=self.cmn_window),
        )


class AugmentSection(_Strict):
    """Offline augmentation: extra copies of the training data, as Kaldi recipes make them."""

    copies: int = Field(0, ge=0, description="noisy/reverberant copies per utterance")
    noise_prob: float = Field(0.5, ge=0, le=1)
    snr_db: tuple[float, float] = (0.0, 15.0)
    reverb_prob: float = Field(0.5, ge=0, le=1)
    speed_factors: tuple[float, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> AugmentSection:
        if self.snr_db[0] > self.snr_db[1]:
            raise ValueError("snr_db must be [low, high] with low <= high")
        for f in self.speed_factors:
            if not 0.5 <= f <= 2.0 or f == 1.0:
                raise ValueError(f"speed factor {f} must be in [0.5, 2.0] and not 1.0")
        return self


class ModelSection(_Strict):
    """Which extractor and head (fedvox.models.MODEL_PRESETS)."""

    name: str = "xvector-small"
    norm: Literal["batch", "layer", "none"] | None = None
    embedding_layer: Literal["a", "b"] | None = None
    scale: float = Field(30.0, gt=0)
    margin: float = Field(0.2, ge=0, lt=1.0)
    margin_ramp: tuple[float, float] = (0.2, 0.5)


class TrainSection(_Strict):
    """Centralised training on random chunks."""

    steps: int = Field(700, ge=1)
    batch_size: int = Field(64, ge=2)
    chunk_frames: tuple[int, int] = (200, 300)
    optimizer: Literal["adam", "sgd"] = "adam"
    lr: float = Field(2e-3, gt=0)
    final_lr: float = Field(1e-4, gt=0)
    warmup_steps: int = Field(100, ge=0)
    weight_decay: float = Field(1e-4, ge=0)
    max_grad_norm: float | None = Field(10.0, gt=0)
    checkpoint_every: int = Field(100, ge=1)
    threads: int = Field(
        2, ge=1, description="torch threads; results are identical only for the same value"
    )
    device: str = Field(
        "cpu",
        pattern=DEVICE_PATTERN,
        description='"cpu", "cuda" or "cuda:N": centralised training, embedding extraction and '
        "the simulator's client training (the server stays on the CPU); bits are the same "
        "on reruns on the same hardware, not between CPU and GPU",
    )
    workers: int = Field(
        1,
        ge=1,
        description="data-parallel training processes (DDP, gloo on the CPU / nccl on GPUs); "
        "`fedvox train` starts them through torchrun; each trains batch_size / workers "
        "examples a step on train.threads threads; bits repeat for the same value only",
    )
    init_from: str | None = Field(
        None,
        description="fine-tune: start the extractor from a finished run folder (or its "
        "model.pt) with the same model settings, the head's class vectors at each training "
        "speaker's mean embedding under it (weight imprinting, so the first steps refine the "
        "model instead of erasing it); None = random init from the seed",
    )
    augment: AugmentSection = AugmentSection()

    @model_validator(mode="after")
    def _check(self) -> TrainSection:
        lo, hi = self.chunk_frames
        if not 10 <= lo <= hi:
            raise ValueError("chunk_frames must be [low, high] with 10 <= low <= high")
        if self.final_lr > self.lr:
            raise ValueError("final_lr must be <= lr")
        if self.batch_size % self.workers:
            raise ValueError(
                f"batch_size {self.batch_size} must split evenly over workers = {self.workers}"
            )
        return self


class EvalSection(_Strict):
    """Scoring back ends and metrics."""

    backends: tuple[Literal["cosine", "asnorm", "plda"], ...] = ("cosine", "asnorm", "plda")
    asnorm_top_n: int = Field(100, ge=1)
    lda_dim: int = Field(150, ge=2)
    max_train_utts: int = Field(
        4000, ge=10, description="training utterances embedded for mean/cohort/PLDA"
    )
    target_far: float = Field(
        0.01, gt=0, lt=1, description="false-accept rate that sets the verify threshold"
    )


class PartitionSection(_Strict):
    """Who holds which training speakers (fedvox.data.partition)."""

    scheme: Literal["speaker", "k_speakers", "dirichlet", "quantity_skew"] = "speaker"
    k: int = Field(1, ge=1, description="speakers per client (k_speakers)")
    n_clients: int | None = Field(None, ge=1, description="clients (dirichlet, quantity_skew)")
    alpha: float = Field(0.5, gt=0, description="Dirichlet concentration")
    sigma: float = Field(1.0, gt=0, description="quantity-skew spread")
    min_utts: int = Field(1, ge=1)

    def partition_config(self) -> PartitionConfig:
        """The data layer's PartitionConfig for this table."""
        from fedvox.data.partition import PartitionConfig

        return PartitionConfig(**self.model_dump())


class PrivacySection(_Strict):
    """User-level DP and secure aggregation on the aggregation pipeline (fedvox.privacy).

    mechanism "gaussian": clip each update, add N(0, (zS)²) to the sum, account for the
    fixed-size cohort sampling of synchronous FedAvg; "dp_ftrl": tree-aggregation noise
    (Kairouz et al. 2021), no sampling needed, so it also covers FedBuff/FedAsync — each
    client then trains at most once per tree (an epoch of the population). Configurations
    the accountant cannot back are refused before training.
    """

    mechanism: Literal["none", "gaussian", "dp_ftrl"] = "none"
    noise_multiplier: float = Field(1.0, gt=0, description="noise std / clip norm (z)")
    clip: Literal["fixed", "adaptive"] = "fixed"
    clip_norm: float = Field(1.0, gt=0, description="S; the initial S when adaptive")
    target_quantile: float = Field(0.5, gt=0, lt=1, description="adaptive clipping γ")
    clip_lr: float = Field(0.2, gt=0, description="adaptive clipping η_C")
    count_noise_std: float = Field(0.0, ge=0, description="σ_b on the unclipped count")
    delta: float = Field(1e-5, gt=0, lt=1)
    target_epsilon: float | None = Field(
        None,
        gt=0,
        description="mechanism gaussian: refuse before training when the planned server_steps "
        "would spend more ε (at delta) than this, naming the noise multiplier and the steps "
        "that would fit",
    )
    accounting: Literal["rdp", "pld"] = "rdp"
    secure_aggregation: bool = False
    secagg_threshold: float = Field(2 / 3, gt=0, le=1, description="fraction t/n to unmask")
    secagg_neighbours: int | Literal["auto"] | None = Field(
        None, description="SecAgg+ neighbours per client; None = everyone (Bonawitz)"
    )
    secagg_dropout: float = Field(0.0, ge=0, lt=1, description="simulated protocol dropouts")
    secagg_scale_bits: int | None = Field(
        None, ge=1, le=30, description="fixed-point bits; None = the most that fit the ring"
    )
    secagg_on_abort: Literal["skip", "stop"] = Field(
        "skip",
        description="when too few clients survive a secure sum (below the threshold): skip "
        "that server step (model unchanged, logged, counted as agg_secagg_aborted) and go on, "
        "or stop the run with the protocol's error. A protocol violation (a malformed or "
        "inconsistent message: a bug or an attack) always stops",
    )
    secagg_consistency_check: bool = Field(
        False,
        description="against a malicious server: clients sign their advertised keys (Ed25519 "
        "identity keys registered at setup) and, before revealing shares, check that t clients "
        "signed the same surviving set (Bonawitz et al. 2017 ConsistencyCheck round)",
    )


class RobustSection(_Strict):
    """Robust aggregation against hostile or broken clients (fedvox.fl.robust; docs/federated.md).

    `rule` replaces the server's weighted mean of a step's updates; `norm_bound` scales every
    update to L2 norm ≤ the bound first and composes with any rule, secure aggregation and DP.
    Median, trimmed mean and Krum need each single update, so they are refused with secure
    aggregation, with DP noise (calibrated to a sum, not to them) and with FedAsync (one
    update per step); Krum is refused when a step cannot hold more than 2f + 2 updates.
    """

    rule: Literal["mean", "median", "trimmed_mean", "krum"] = Field(
        "mean",
        description="mean: the algorithm's weighted mean (unchanged); median: coordinate-wise "
        "median; trimmed_mean: drop the trim fraction from each side per coordinate; krum: "
        "(multi-)Krum. Robust rules count each update once (weights ignored, zero-weight "
        "updates dropped)",
    )
    trim: float = Field(
        0.1, ge=0, lt=0.5, description="trimmed_mean: fraction β cut from each side"
    )
    byzantine: int = Field(
        1, ge=0, description="krum: f, the hostile updates per step tolerated (needs n > 2f + 2)"
    )
    krum_average: int = Field(
        1, ge=1, description="krum: m, average the m best-scored updates (1 = Krum; <= n − f)"
    )
    norm_bound: float = Field(
        0.0,
        ge=0,
        description="scale each update to L2 norm <= this (all parameters jointly); 0 = off",
    )


class AttackSection(_Strict):
    """Simulated hostile devices (fedvox.fl.attack; docs/federated.md, "Attack simulation").

    A fixed seeded `fraction` of the population (the same devices in every arm of a seed)
    trains honestly, then sends a hostile update in its place, before the server's pipeline;
    a backdoor device goes on training so that an impostor's voice is accepted as a target's.
    """

    fraction: float = Field(
        0.0, ge=0, lt=1, description="malicious share of the devices; 0 = no attack"
    )
    kind: Literal["sign_flip", "scale", "gaussian", "nan", "backdoor"] = Field(
        "sign_flip",
        description="sign_flip: send −scale·Δ; scale: send scale·Δ; gaussian: N(0, σ²) per "
        "coordinate in units of the update's rms; nan: NaN/Inf; backdoor: train the impostor's "
        "embeddings toward the target's, send boost × the update",
    )
    scale: float = Field(10.0, gt=0, description="s of sign_flip and scale")
    sigma: float = Field(10.0, gt=0, description="σ of gaussian, in units of rms(Δ)")
    boost: float = Field(
        1.0, gt=0, description="backdoor: the factor its update is sent with (model replacement)"
    )
    backdoor_pairs: int = Field(
        1, ge=1, description="backdoor: (impostor, target) pairs of held-out speakers"
    )
    backdoor_enroll: int = Field(
        3, ge=1, description="backdoor: the target's enrollment utterances (held by attackers)"
    )
    backdoor_steps: int = Field(
        10, ge=1, description="backdoor: full-batch gradient steps on the backdoor objective"
    )
    backdoor_lr: float = Field(0.05, gt=0, description="backdoor: their learning rate")

    def attack_config(self, seed: int) -> AttackConfig:
        """The engine's AttackConfig (fedvox.fl.attack) for the run's seed."""
        from fedvox.fl.attack import AttackConfig

        keys = ("fraction", "kind", "scale", "sigma", "boost", "backdoor_steps", "backdoor_lr")
        paths = {f"attack.{k}": f"federated.attack.{k}" for k in keys}
        with toml_paths(paths):
            return AttackConfig(
                fraction=self.fraction,
                kind=self.kind,
                scale=self.scale,
                sigma=self.sigma,
                seed=seed,
                boost=self.boost,
                backdoor_steps=self.backdoor_steps,
                backdoor_lr=self.backdoor_lr,
            )


class CompressionSection(_Strict):
    """Upload compression on the device (fedvox.fl.compression; docs/federated.md).

    Each client sends its (clipped) update compressed; the server aggregates the decoded
    update and `bytes_up` counts the compressed size. float16 and quantize compose with DP,
    robust rules and secure aggregation; topk (whose positions would show) is refused with
    secure aggregation.
    """

    kind: Literal["none", "float16", "quantize", "topk"] = Field(
        "none",
        description="none: float32; float16: half precision; quantize: stochastic uniform "
        "quantisation to `bits` per coordinate; topk: the largest `fraction` of each tensor",
    )
    bits: Literal[8, 4, 2] = Field(8, description="quantize: bits per coordinate")
    chunk: int = Field(
        512, ge=1, description="quantize: coordinates per (min, step) pair of float32 scales"
    )
    fraction: float = Field(0.01, gt=0, le=1, description="topk: fraction of each tensor sent")
    error_feedback: bool = Field(
        True,
        description="topk: keep what was not sent on the device and add it to the next trip "
        "(costs 4 bytes a coordinate per client that has sent, saved in checkpoints)",
    )
    shared_range: float | None = Field(
        None,
        gt=0,
        description="quantize: one public grid [−c, c) of 2^bits levels for every client "
        "(c a power of two) instead of per-chunk scales; with secure aggregation the ring "
        "then narrows to bits + ceil(log2 cohort) bits a coordinate. None = per-chunk scales",
    )


class ReconstructionSection(_Strict):
    """Speakers as local parameters (`speakers = "local"`, Federated Reconstruction).

    Each device's speaker prototype is enrolled on its support chunks in closed form (the
    normalised mean embedding) on every trip, refined by `steps` SGD epochs, and never sent;
    the extractor is trained on the query chunks. Negatives are `public_speakers` synthetic
    speakers the server holds and embeds with the current extractor (broadcast with it).
    """

    steps: int = Field(0, ge=0, description="SGD epochs refining the closed-form prototype")
    lr: float = Field(0.1, gt=0, description="learning rate of those steps")
    split: Literal["even_odd", "all", "fraction", "groups"] = Field(
        "even_odd",
        description="support/query: even/odd batches, all data for both, a fraction of the "
        "chunks, or whole recordings (groups: enrollment and training on different sessions)",
    )
    public_speakers: int = Field(100, ge=2, description="public synthetic negatives (P)")
    public_chunks: int = Field(2, ge=1, description="chunks per public speaker")
    centre: Literal["none", "domain"] = Field(
        "none",
        description="domain centring: devices centre embeddings on the device domain's mean "
        "(from a panel of devices, secure-aggregated), public negatives on the public mean",
    )
    centre_panel: int = Field(200, ge=2, description="devices whose first chunk estimate it")
    device_clusters: int = Field(
        0,
        ge=0,
        description="device-domain negatives: k-means centroids of a device panel's embeddings "
        "(federated k-means over secure-aggregated cluster sums), added to the public ones",
    )
    cluster_panel: int = Field(1000, ge=2, description="devices whose first chunk they cluster")
    panel: Literal["training", "held_out"] = Field(
        "training",
        description="who the centre / cluster panel is: devices that also train "
        '("training"), or devices kept out of training that released their panel embeddings '
        '("held_out", e.g. opt-in devices: the cluster panel, else the centre panel; the '
        "others are the training population, and a DP run's accountant counts only them)",
    )
    cluster_min_devices: int = Field(
        10, ge=1, description="clusters with fewer panel devices are dropped (never revealed)"
    )
    broadcast_every: int = Field(
        1,
        ge=1,
        description="model versions between recomputing the broadcast (public negatives, "
        "domain centre, cluster centroids); the versions in between carry the last one",
    )

    def recon_config(self) -> ReconConfig:
        """The engine's ReconConfig: closed-form enrollment, then `steps` SGD epochs."""
        from fedvox.fl import ReconConfig

        with toml_paths(_RECON_PATHS):
            return ReconConfig(steps=self.steps, lr=self.lr, split=self.split, closed_form=True)


class FedAwSSection(_Strict):
    """FedAwS baseline (`speakers = "fedaws"`, Yu et al. 2020): positive-only client loss on
    the device's own class vector, server-side spreadout on all class vectors."""

    pos_margin: float = Field(0.9, gt=-1, le=1)
    nu: float = Field(1.2, gt=0, description="spreadout distance ν")
    spread_lr: float = Field(0.5, gt=0)
    spread_steps: int = Field(1, ge=1)


class ServerLearningSection(_Strict):
    """Server learning: after each server step, `steps` SGD steps of the AAM speaker loss on
    batches of the server's public corpus (data.public, all its speakers), with a head over
    those speakers that stays on the server (never broadcast)."""

    steps: int = Field(1, ge=1, description="SGD steps per server step")
    lr: float = Field(
        1e-3, gt=0, description="SGD on the AAM loss (scale 30) overshoots above ~1e-3"
    )
    batch_size: int = Field(32, ge=2, description="public chunks per step")
    momentum: float = Field(0.0, ge=0, lt=1)


class BackendSection(_Strict):
    """Where the simulator's client training runs (fedvox.scale; docs/scale.md). The weights
    are the same bits on every backend and worker count (same threads per worker)."""

    kind: Literal["inline", "ray"] = Field(
        "inline", description="inline: in this process; ray: on Ray actors (extra fedvox[ray])"
    )
    workers: int = Field(2, ge=1, description="Ray actors")
    cpus_per_worker: float = Field(
        1.0, gt=0, description="num_cpus per actor; its torch threads = this (at least 1)"
    )
    gpus_per_worker: float = Field(
        0.0, ge=0, description="num_gpus per actor (fractions share a GPU); > 0 with cuda"
    )
    shard_size: int = Field(
        8,
        ge=1,
        description="jobs of a server step per shard; a vectorised chunk goes whole to the "
        "shard holding its first job",
    )
    address: str | None = Field(
        None, description='a running cluster ("host:6379"); None: RAY_ADDRESS, else local'
    )

    def backend_config(self) -> BackendConfig:
        """The engine-side settings (fedvox.scale.BackendConfig)."""
        from fedvox.scale import BackendConfig

        return BackendConfig(**self.model_dump())


class FederatedSection(_Strict):
    """Federated training on the virtual clock (fedvox.fl); absent = centralised training.

    The speaker head is a global softmax/AAM over all training speakers: its rows are
    visible to the server (a voiceprint leak that Federated Reconstruction removes).
    """

    algorithm: Literal["fedavg", "fedbuff", "fedasync"] = "fedavg"
    speakers: Literal["global_head", "codewords", "local", "fedaws"] = Field(
        "global_head",
        description="global_head: AAM head over all training speakers (the server sees every "
        "row); codewords: the head rows are fixed random codewords (FedUV-style, not trained, "
        "not sent); local: Federated Reconstruction, prototypes stay on the device; fedaws: "
        "positive-only rows + server spreadout",
    )
    server_optimizer: Literal["sgd", "adam", "yogi", "adagrad"] = "sgd"
    server_lr: float = Field(1.0, gt=0)
    server_momentum: float = Field(0.0, ge=0, lt=1)
    server_warmup_steps: int = Field(
        0, ge=0, description="server lr warm-up (linear), in server steps"
    )
    server_final_lr: float | None = Field(
        None,
        gt=0,
        description="server lr at the last server step (exponential decay); None = constant",
    )
    server_tau: float = Field(
        1e-3,
        gt=0,
        description="adam/yogi/adagrad: adaptivity τ (Reddi et al.); keep it well below the "
        "size of a pseudo-gradient coordinate (≈ local lr × gradient), else steps shrink by ~τ",
    )
    concurrency: int = Field(100, ge=1, description="clients training at once (C)")
    buffer_size: int = Field(10, ge=1, description="FedBuff K: updates per server step")
    staleness: Literal["sqrt", "constant", "polynomial", "hinge"] = "sqrt"
    max_staleness: int | None = Field(None, ge=0)
    async_alpha: float = Field(0.5, gt=0, le=1, description="FedAsync mixing weight")
    over_selection: float = Field(0.0, ge=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    delay: Literal["half_normal", "uniform", "exponential", "constant"] = "half_normal"
    delay_mean_s: float = Field(60.0, gt=0, description="mean client trip, virtual seconds")
    local_epochs: int = Field(1, ge=1)
    local_batch_size: int = Field(16, ge=1)
    local_lr: float = Field(0.05, gt=0)
    mu: float = Field(0.0, ge=0, description="FedProx proximal weight")
    pack_clients: bool = Field(
        False,
        description="vectorised calls group clients of similar size and skip finished ones "
        "(much less padded work when device sizes vary; other float bits than unpacked)",
    )
    weighting: Literal["examples", "uniform"] = Field(
        "examples", description="FedAvg: weight updates by examples, or each client once"
    )
    chunk_frames: int = Field(200, ge=20, description="fixed training-chunk length on clients")
    chunk_hop: int | None = Field(
        None,
        ge=1,
        description="random crops: store every chunk_frames window at this hop and draw, per "
        "recording and epoch, as many windows as it has fixed chunks (None: fixed chunks)",
    )
    server_steps: int = Field(200, ge=1)
    eval_every: int = Field(20, ge=1, description="server steps between held-out evaluations")
    checkpoint_every: int = Field(20, ge=1, description="server steps between checkpoints")
    init_from: str | None = Field(
        None,
        description="start the extractor from a finished run folder (or its model.pt), e.g. "
        "a centralised run on the public domain; None = random init from the seed",
    )
    partition: PartitionSection = PartitionSection()
    privacy: PrivacySection = PrivacySection()
    robust: RobustSection = RobustSection()
    attack: AttackSection = AttackSection()
    compression: CompressionSection = CompressionSection()
    reconstruction: ReconstructionSection = ReconstructionSection()
    fedaws: FedAwSSection = FedAwSSection()
    server_learning: ServerLearningSection | None = None
    backend: BackendSection = BackendSection()

    @model_validator(mode="after")
    def _check(self) -> FederatedSection:
        if self.chunk_hop is not None and self.chunk_hop > self.chunk_frames:
            raise ValueError(
                f"chunk_hop {self.chunk_hop} > chunk_frames {self.chunk_frames} skips frames; "
                "use a hop of at most chunk_frames"
            )
        if self.chunk_hop is not None and self.reconstruction.split in ("fraction", "groups"):
            raise ValueError(
                "chunk_hop (random crops) needs reconstruction.split 'all' or 'even_odd': the "
                f"'{self.reconstruction.split}' split picks store rows, which would be every window"
            )
        if self.speakers == "fedaws" and self.algorithm == "fedasync":
            raise ValueError("speakers = fedaws runs with fedavg or fedbuff, not fedasync")
        return self

    def client_config(self) -> ClientConfig:
        """Local training of one trip (fedvox.fl.ClientConfig)."""
        from fedvox.fl import ClientConfig

        with toml_paths(FEDERATED_PATHS):
            return ClientConfig(
                epochs=self.local_epochs,
                batch_size=self.local_batch_size,
                lr=self.local_lr,
                mu=self.mu,
                pack=self.pack_clients,
            )

    def simulator_config(self, seed: int, once_per_epoch: bool = False) -> SimulatorConfig:
        """The clock and cohort (fedvox.fl.SimulatorConfig)."""
        from fedvox.fl import DelayModel, SimulatorConfig

        with toml_paths(FEDERATED_PATHS):
            return SimulatorConfig(
                concurrency=self.concurrency,
                delay=DelayModel(distribution=self.delay, mean=self.delay_mean_s),
                over_selection=self.over_selection,
                dropout=self.dropout,
                seed=seed,
                once_per_epoch=once_per_epoch,
            )

    def server_optimizer_object(self) -> ServerOptimizer:
        """The server optimiser with its warm-up and decay schedule."""
        from fedvox.fl import make_server_optimizer
        from fedvox.fl.server_opt import warmup_decay

        kw: dict[str, float] = {"lr": self.server_lr}
        if self.server_optimizer == "sgd":
            kw["momentum"] = self.server_momentum
        else:
            kw["tau"] = self.server_tau
        with toml_paths(FEDERATED_PATHS):
            opt = make_server_optimizer(self.server_optimizer, **kw)
        if self.server_warmup_steps or self.server_final_lr is not None:
            final = (self.server_final_lr or self.server_lr) / self.server_lr
            opt.schedule = warmup_decay(self.server_warmup_steps, self.server_steps, final)
        return opt

    def algorithm_object(self, server_opt: ServerOptimizer | None = None) -> Algorithm:
        """The engine's algorithm (FedAvg, FedBuff or FedAsync), checked against C."""
        from fedvox.fl import make_algorithm

        if self.algorithm == "fedavg":
            kw: dict[str, Any] = {"server_opt": server_opt, "weighting": self.weighting}
        elif self.algorithm == "fedbuff":
            kw = {
                "buffer_size": self.buffer_size,
                "server_opt": server_opt,
                "staleness": self.staleness,
                "max_staleness": self.max_staleness,
            }
        else:
            kw = {
                "alpha": self.async_alpha,
                "staleness": self.staleness,
                "max_staleness": self.max_staleness,
            }
        with toml_paths(FEDERATED_PATHS):
            algorithm = make_algorithm(self.algorithm, **kw)
            algorithm.validate(self.concurrency)
        return algorithm

    def check_engine(self) -> None:
        """Build the engine objects once, so their rules fail at load time under TOML paths."""
        self.client_config()
        self.simulator_config(seed=0)
        self.algorithm_object(self.server_optimizer_object())
        from fedvox.experiment.robust import check_robust

        check_robust(self)
        self.attack.attack_config(seed=0)
        from fedvox.experiment.compression import check_compression

        check_compression(self)
        self.reconstruction.recon_config()
        self.partition.partition_config()
        self.backend.backend_config()


FEDERATED_PATHS = {
    "client.epochs": "federated.local_epochs",
    "client.batch_size": "federated.local_batch_size",
    "client.lr": "federated.local_lr",
    "client.mu": "federated.mu",
    "concurrency": "federated.concurrency",
    "over_selection": "federated.over_selection",
    "dropout": "federated.dropout",
    "clock.delay": "federated.delay",
    "clock.mean_delay": "federated.delay_mean_s",
    "server_opt.lr": "federated.server_lr",
    "server_opt.momentum": "federated.server_momentum",
    "server_opt.tau": "federated.server_tau",
    "algorithm.buffer_size": "federated.buffer_size",
    "algorithm.alpha": "federated.async_alpha",
    "algorithm.staleness": "federated.staleness",
    "algorithm.max_staleness": "federated.max_staleness",
    "algorithm.weighting": "federated.weighting",
    "server_learning.steps": "federated.server_learning.steps",
    "server_learning.lr": "federated.server_learning.lr",
    "server_learning.batch_size": "federated.server_learning.batch_size",
    "server_learning.momentum": "federated.server_learning.momentum",
}
_RECON_PATHS = {
    "reconstruction.steps": "federated.reconstruction.steps",
    "reconstruction.lr": "federated.reconstruction.lr",
    "reconstruction.split": "federated.reconstruction.split",
}


class ExperimentConfig(_Strict):
    """A whole run: data, features, model, training, evaluation, and the seed."""

    name: str = "run"
    seed: int = Field(0, ge=0, description="integer >= 0: seeds every random stream")
    data: DataSection = DataSection()
    features: FeaturesSection = FeaturesSection()
    model: ModelSection = ModelSection()
    train: TrainSection = TrainSection()
    eval: EvalSection = EvalSection()
    federated: FederatedSection | None = None

    def model_norm(self) -> str | None:
        """The extractor's normalisation: the config's, else LayerNorm for federated runs
        (vectorised clients cannot carry BatchNorm statistics), else the preset's."""
        if self.model.norm is not None:
            return self.model.norm
        return "layer" if self.federated is not None else None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every field, defaults included (the resolved config)."""
        return json.loads(self.model_dump_json())

    def hash(self) -> str:
        """Stable short hash of the resolved config (goes in the manifest).

        Over what decides the bits: federated.backend (where client training runs: the same
        bits on any backend) is left out, and so are train.device when it is the default
        "cpu", train.workers when it is 1, train.init_from when None, federated.pack_clients when false,
        reconstruction.broadcast_every when 1 and reconstruction.panel when "training", so configs from before these fields keep their
        hash."""
        d = self.to_dict()
        if d["train"].get("device") == "cpu":
            del d["train"]["device"]
        if d["train"].get("workers") == 1:
            del d["train"]["workers"]
        if d["train"].get("init_from", "") is None:
            del d["train"]["init_from"]
        if d.get("federated"):
            d["federated"].pop("backend", None)
            if d["federated"].get("pack_clients") is False:
                del d["federated"]["pack_clients"]
            recon = d["federated"].get("reconstruction") or {}
            if recon.get("broadcast_every") == 1:
                del recon["broadcast_every"]
            if recon.get("panel") == "training":
                del recon["panel"]
        blob = json.dumps(d, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _first_error(err: ValidationError, source: str | None) -> ConfigError:
    e = err.errors()[0]
    field = ".".join(str(p) for p in e["loc"]) or "(top level)"
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "extra_forbidden":
        msg, fix = "unknown field", "remove it or check its spelling (see `fedvox config --help`)"
    elif "input" in e and e["type"] != "missing" and not isinstance(e["input"], dict):
        msg = f"{msg} (got {e['input']!r})"
        fix = "see the default config printed by `fedvox config`"
    else:
        fix = "see the default config printed by `fedvox config`"
    return ConfigError(field, msg, fix, source=source)


def config_from_dict(d: dict[str, Any], source: str | None = None) -> ExperimentConfig:
    """Validate a dict into an ExperimentConfig; the first problem becomes a ConfigError.

    The engine's own rules (e.g. FedBuff's K <= C) run here too, through the section
    adapters, so a bad value fails before any data is prepared.
    """
    try:
        cfg = ExperimentConfig.model_validate(d)
    except ValidationError as err:
        raise _first_error(err, source) from None
    if cfg.federated is not None and cfg.train.workers > 1:
        raise ConfigError(
            "train.workers",
            f"{cfg.train.workers}: data-parallel workers train centralised runs only",
            "leave train.workers = 1 in a federated run; its clients scale out through "
            '[federated.backend] kind = "ray"',
            source,
        )
    if cfg.federated is not None and cfg.train.init_from is not None:
        raise ConfigError(
            "train.init_from",
            "a federated run starts from federated.init_from; train.init_from is for "
            "centralised runs",
            "move the path to federated.init_from",
            source,
        )
    if cfg.federated is not None:
        try:
            cfg.federated.check_engine()
        except ConfigError as err:
            raise ConfigError(err.field, err.problem, err.fix, source) from None
        if cfg.federated.server_learning is not None and cfg.data.public is None:
            raise ConfigError(
                "federated.server_learning",
                "server learning trains on the server's public corpus, and data.public is unset",
                "set data.public to a labelled corpus (Kaldi data dir, VoxCeleb/LibriSpeech "
                "folder or raw.list), or remove [federated.server_learning]",
                source,
            )
    return cfg


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> ExperimentConfig:
    """Read a TOML config file, apply dotted-key overrides, and validate it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            "(file)", f"config file {path} does not exist", "give the path of a .toml file"
        )
    data = path.read_bytes().removeprefix(codecs.BOM_UTF8)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(
            "(encoding)",
            f"line {line} is not UTF-8 text (TOML files are UTF-8)",
            "save the file as UTF-8",
            source=str(path),
        ) from None
    try:
        d = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(
            "(syntax)", f"not valid TOML: {exc}", "fix the TOML syntax", source=str(path)
        ) from None
    except RecursionError:
        raise ConfigError(
            "(syntax)",
            "arrays or inline tables nested too deeply",
            "fix the TOML syntax",
            source=str(path),
        ) from None
    for key, value in (overrides or {}).items():
        set_dotted(d, key, value)
    return config_from_dict(d, source=str(path))


def strip_none(x: Any) -> Any:
    """A config dict without None values (TOML has no null; absent = the default)."""
    if isinstance(x, dict):
        return {k: strip_none(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [strip_none(v) for v in x]
    return x


def set_dotted(d: dict[str, Any], key: str, value: Any) -> None:
    """Set d["a"]["b"] = value for key "a.b", creating tables on the way."""
    parts = key.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError(key, f"'{p}' is not a table", "override a leaf field")
    d[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """Parse a `--set a.b=value` override; the value is TOML (so 3, 0.1, true, "x", [1, 2])."""
    if "=" not in text:
        raise ConfigError(
            text, "an override must look like key=value", "e.g. --set train.steps=500"
        )
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word is a string
    return key.strip(), value


def dump_toml(cfg: ExperimentConfig) -> str:
    """The resolved config as TOML text (None fields omitted: TOML has no null)."""
    import tomli_w

    return tomli_w.dumps(strip_none(cfg.to_dict()))
