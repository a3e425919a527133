"""Data preparation for a run: corpora, trial list, cached features and public speakers.

The first stages of the pipeline (audio → features → feature store); everything after it
works on the in-memory feature matrices (and the server's public store) this returns, so
wiring a run does no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from torch import nn

from fedvox.data.augment import AugmentConfig, AugmentedCorpus, SpeedPerturbedCorpus
from fedvox.data.corpus import Corpus, load_corpus, load_kaldi_dir
from fedvox.data.features import FeatureConfig
from fedvox.data.store import FeatureStore, extract_corpus
from fedvox.data.synthetic import ensure_corpus
from fedvox.data.trials import TrialList, read_trials
from fedvox.data.world import ensure_world
from fedvox.errors import ConfigError, DataError
from fedvox.experiment.config import (
    SYNTHETIC_TRAIN,
    WORLD_FIELDS,
    WORLD_PREFIX,
    DataSection,
    ExperimentConfig,
    FederatedSection,
)
from fedvox.models.io import MODEL_FILE, load_model, model_info, weights_hash
from fedvox.tasks.speakers import (
    PUBLIC_SEED_OFFSET,
    PublicStore,
    public_speaker_store,
    public_store_from_features,
)


def synthetic_corpus_dir(data: DataSection, progress: bool = True, seed_offset: int = 0) -> Path:
    """Generate (or reuse from the cache) the embedded corpus (at seed + `seed_offset`: other
    voices, same settings); returns its folder."""
    gen = data.synthetic.generator_config()
    return ensure_corpus(
        replace(gen, seed=gen.seed + seed_offset),
        cache_root=Path(data.cache_dir) / "corpora",
        workers=data.workers,
        progress=progress,
    )


def world_part_dir(data: DataSection, key: str, progress: bool = True) -> Path:
    """The path data.<key> names: a world part ("world:devices", ...) generated once through
    ensure_world (cached by its settings under cache_dir/corpora), or the path as given."""
    value = getattr(data, key)
    assert value is not None
    if not value.startswith(WORLD_PREFIX):
        return Path(value)
    assert data.world is not None  # enforced by the config schema
    part = value.removeprefix(WORLD_PREFIX)
    try:
        paths = ensure_world(
            data.world.world_config(),
            cache_root=Path(data.cache_dir) / "corpora",
            workers=data.workers,
            progress=progress,
            parts=("test",) if part == "trials" else (part,),
        )
    except ConfigError as err:  # e.g. the trial list's needs: name the [data.world] key
        field = WORLD_FIELDS.get(err.field, f"data.world ({err.field})")
        raise ConfigError(field, err.problem, err.fix) from None
    return paths.trials if part == "trials" else getattr(paths, part)


def resolve_corpora(data: DataSection, progress: bool = True) -> tuple[Corpus, Corpus, Path]:
    """(training corpus, evaluation corpus, trial-list path) named by the [data] table."""
    if data.train in SYNTHETIC_TRAIN:
        root = synthetic_corpus_dir(data, progress)
        train = load_kaldi_dir(root / "train")
        if data.train == "synthetic:public":  # the public voices; the embedded test set
            public_root = synthetic_corpus_dir(data, progress, seed_offset=PUBLIC_SEED_OFFSET)
            train = load_kaldi_dir(public_root / "train")
        if data.test is None:
            return train, load_kaldi_dir(root / "test"), root / "test" / "trials.txt"
    else:
        train = load_corpus(world_part_dir(data, "train", progress))
    assert data.test is not None and data.trials is not None  # enforced by the config schema
    test = load_corpus(world_part_dir(data, "test", progress))
    return train, test, world_part_dir(data, "trials", progress)


def training_corpus(train: Corpus, cfg: ExperimentConfig):
    """The corpus training sees: speed-perturbed speakers and augmented copies if configured."""
    aug = cfg.train.augment
    corpus = train
    if aug.speed_factors:
        corpus = SpeedPerturbedCorpus(corpus, tuple(aug.speed_factors))
    if aug.copies > 0:
        noisy = AugmentConfig(
            noise_prob=aug.noise_prob, snr_db=tuple(aug.snr_db), reverb_prob=aug.reverb_prob
        )
        corpus = AugmentedCorpus(corpus, noisy, aug.copies, cfg.seed)
    return corpus


@dataclass(frozen=True)
class InitModel:
    """The extractor a run starts from (federated.init_from / train.init_from) and its
    weights hash."""

    path: Path
    extractor: nn.Module
    weights_sha256: str


@dataclass
class PreparedData:
    """Everything training and evaluation need, in memory."""

    train_corpus: object  # Corpus or a wrapper with utt_ids/speaker_of/load
    test_corpus: Corpus
    trials: TrialList
    train_feats: dict[str, np.ndarray]
    test_feats: dict[str, np.ndarray]
    feature_config: FeatureConfig
    corpus_dir: Path | None
    public: PublicStore | None = None  # the server's public speakers (negatives), if used
    public_train: PublicStore | None = None  # all of data.public, for server learning
    init: InitModel | None = None  # federated.init_from / train.init_from, loaded and checked
    backend_corpus: Corpus | None = None  # data.backend: what the back end is fit on
    backend_feats: dict[str, np.ndarray] | None = None

    def backend_data(self) -> tuple[dict[str, np.ndarray], Callable[[str], str]]:
        """(features, speaker_of) the scoring back end is fit on: data.backend's corpus if
        set, else the training data."""
        if self.backend_feats is None or self.backend_corpus is None:
            return self.train_feats, self.train_corpus.speaker_of
        return self.backend_feats, self.backend_corpus.speaker_of

    @property
    def feat_dim(self) -> int:
        return next(iter(self.train_feats.values())).shape[1]

    def train_speakers(self) -> list[str]:
        return sorted({self.train_corpus.speaker_of(u) for u in self.train_feats})

    def train_labels(self) -> tuple[list[str], np.ndarray]:
        """(utt ids sorted, speaker index of each) for the training set."""
        spk_index = {s: i for i, s in enumerate(self.train_speakers())}
        utts = sorted(self.train_feats)
        return utts, np.array([spk_index[self.train_corpus.speaker_of(u)] for u in utts])


def needs_public(cfg: ExperimentConfig) -> bool:
    """Whether the run's server holds public speakers (the local-speaker mode's negatives)."""
    return cfg.federated is not None and cfg.federated.speakers == "local"


def load_public_corpus(data: DataSection, progress: bool = False) -> Corpus:
    """The corpus at data.public (a path or a world part), its errors named by that field."""
    assert data.public is not None
    try:
        return load_corpus(world_part_dir(data, "public", progress))
    except DataError as err:
        raise ConfigError(
            "data.public",
            f"{data.public}: {err.problem}",
            f"point data.public at a Kaldi data dir, VoxCeleb/LibriSpeech folder or raw.list "
            f"({err.fix}), or remove it to use synthetic public speakers",
        ) from None


def public_store(cfg: ExperimentConfig, progress: bool = False) -> PublicStore:
    """The public speakers' fixed chunks: the first reconstruction.public_speakers speakers
    (sorted ids) of data.public with their first public_chunks chunks, or, with data.public
    unset, the embedded generator's other-seed speakers. [federated] defaults without it."""
    f = cfg.federated if cfg.federated is not None else FederatedSection()
    r = f.reconstruction
    cache = Path(cfg.data.cache_dir)
    store = FeatureStore(cache / "features")
    if cfg.data.public is None:
        return public_speaker_store(
            cfg.data.synthetic.generator_config(),
            cfg.features.feature_config(),
            n_speakers=r.public_speakers,
            chunks_per_speaker=r.public_chunks,
            chunk_frames=f.chunk_frames,
            cache_root=cache / "corpora",
            feature_store=store,
            workers=cfg.data.workers,
            progress=progress,
        )
    corpus = load_public_corpus(cfg.data, progress)
    speakers = corpus.speakers()
    if len(speakers) < r.public_speakers:
        raise ConfigError(
            "data.public",
            f"{cfg.data.public} holds {len(speakers)} speakers, "
            f"federated.reconstruction.public_speakers asks for {r.public_speakers}",
            f"set federated.reconstruction.public_speakers <= {len(speakers)} or point "
            "data.public at a corpus with more speakers",
        )
    sub = corpus.subset(speakers=speakers[: r.public_speakers])
    sub.validate()
    fcfg = cfg.features.feature_config()
    feats = extract_corpus(sub, fcfg, store, workers=cfg.data.workers, progress=progress)
    try:
        return public_store_from_features(
            feats, sub.speaker_of, r.public_speakers, r.public_chunks, f.chunk_frames
        )
    except DataError as err:
        raise ConfigError(
            "federated.reconstruction.public_chunks",
            f"data.public ({cfg.data.public}): {err.problem}",
            "lower federated.reconstruction.public_chunks or federated.chunk_frames, or give "
            "data.public longer or more utterances per speaker",
        ) from None


def public_training_store(cfg: ExperimentConfig, progress: bool = False) -> PublicStore:
    """Every speaker and every fixed chunk of data.public: the server-learning corpus."""
    f = cfg.federated if cfg.federated is not None else FederatedSection()
    corpus = load_public_corpus(cfg.data, progress)
    corpus.validate()
    store = FeatureStore(Path(cfg.data.cache_dir) / "features")
    fcfg = cfg.features.feature_config()
    feats = extract_corpus(corpus, fcfg, store, workers=cfg.data.workers, progress=progress)
    return public_store_from_features(feats, corpus.speaker_of, None, None, f.chunk_frames)


def init_from_setting(cfg: ExperimentConfig) -> tuple[str, str] | None:
    """(field, value) of the model the run starts from: federated.init_from for a federated
    run, train.init_from for a centralised one; None when it starts from random weights."""
    if cfg.federated is not None:
        f = cfg.federated.init_from
        return None if f is None else ("federated.init_from", f)
    t = cfg.train.init_from
    return None if t is None else ("train.init_from", t)


def load_init_model(cfg: ExperimentConfig, feat_dim: int) -> InitModel:
    """The model at federated.init_from / train.init_from (a run folder or a model file),
    refused unless it rebuilds as this run's extractor (preset, norm, embedding layer, input
    size)."""
    setting = init_from_setting(cfg)
    assert setting is not None
    field, value = setting
    given = Path(value)
    path = given / MODEL_FILE if given.is_dir() else given
    if not path.is_file():
        raise ConfigError(
            field,
            f"no model at {path}" + (" (the run has not finished)" if given.is_dir() else ""),
            f"point it at a finished run folder (with {MODEL_FILE}) or a model file, or "
            "finish that run first",
        )
    info = model_info(path)
    want = {
        "model_name": cfg.model.name,
        "norm": cfg.model_norm(),
        "embedding_layer": cfg.model.embedding_layer,
        "feat_dim": feat_dim,
    }
    diff = [f"{k} {info.get(k)!r} (this run: {v!r})" for k, v in want.items() if info.get(k) != v]
    if diff:
        raise ConfigError(
            field,
            f"{path} is not this run's extractor: {', '.join(diff)}",
            "train the init model with this run's model.name, model.embedding_layer, "
            'model.norm and [features] (federated runs use model.norm = "layer"), or drop '
            f"{field}",
        )
    extractor = load_model(path)
    return InitModel(path, extractor, weights_hash(extractor))


def prepare(cfg: ExperimentConfig, progress: bool = True) -> PreparedData:
    """Corpora → validated audio → features (through the cache) for train and test, the
    server's public stores when the run uses them, and the model the run starts from."""
    train, test, trials_path = resolve_corpora(cfg.data, progress)
    train.validate()
    test.validate()
    trials = read_trials(trials_path, test)
    fcfg = cfg.features.feature_config()
    store = FeatureStore(Path(cfg.data.cache_dir) / "features")
    train_c = training_corpus(train, cfg)
    train_feats = extract_corpus(train_c, fcfg, store, workers=cfg.data.workers, progress=progress)
    test_feats = extract_corpus(test, fcfg, store, workers=cfg.data.workers, progress=progress)
    corpus_dir = train.root.parent if cfg.data.train == "synthetic" else None
    data = PreparedData(train_c, test, trials, train_feats, test_feats, fcfg, corpus_dir)
    if cfg.data.backend is not None and cfg.data.backend != cfg.data.train:
        data.backend_corpus = load_corpus(world_part_dir(cfg.data, "backend", progress))
        data.backend_corpus.validate()
        data.backend_feats = extract_corpus(
            data.backend_corpus, fcfg, store, workers=cfg.data.workers, progress=progress
        )
    f = cfg.federated
    if needs_public(cfg):
        data.public = public_store(cfg, progress)
    if f is not None and f.server_learning is not None:
        data.public_train = public_training_store(cfg, progress)
    if init_from_setting(cfg) is not None:
        data.init = load_init_model(cfg, data.feat_dim)
    return data
