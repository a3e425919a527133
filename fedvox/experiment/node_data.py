"""A deployed node's own data: a Kaldi data dir or VoxCeleb folder on the node's machine.

Between the node's folder and deployment.load_node: the node reads its audio, extracts the
run's features itself (cached in its own folder) and holds its speakers as local speakers
(Federated Reconstruction), so neither its audio nor its speaker labels leave the machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fedvox.data.corpus import Corpus, load_kaldi_dir, load_voxceleb
from fedvox.data.store import FeatureStore, extract_corpus
from fedvox.errors import ConfigError, DataError
from fedvox.experiment.config import ExperimentConfig
from fedvox.fl.population import Population
from fedvox.training.chunks import chunk_store

# node-config keys naming the node's own data (instead of `shard`), and their loaders
DATA_KEYS = {"kaldi-dir": load_kaldi_dir, "voxceleb-dir": load_voxceleb}
CACHE_KEY = "cache-dir"  # node-config key: where the node caches its features
CLIENT_KEY = "client"  # node-config key: the federation-wide client id the node holds
FEATURES_KEY = "features-sha256"  # run-config key: the server's feature configuration
FEAT_DIM_KEY = "feat-dim"  # run-config key: the feature dimension the model is built for


def own_data_key(node_config: dict[str, Any]) -> str | None:
    """Which own-data key the node config uses (None: a shard); refuses two sources."""
    given = [k for k in ("shard", *DATA_KEYS) if k in node_config]
    if len(given) > 1:
        raise ConfigError(
            f"node-config.{given[1]}",
            f"the node config names {' and '.join(given)}",
            "give a node one source of data: shard=..., kaldi-dir=... or voxceleb-dir=...",
        )
    return next((k for k in given if k in DATA_KEYS), None)


def check_own_data(cfg: ExperimentConfig) -> None:
    """Refuse, naming the field, a run config that nodes on their own data cannot train."""
    f = cfg.federated
    assert f is not None
    if f.speakers != "local":
        raise ConfigError(
            "federated.speakers",
            f"{f.speakers!r}: a node training on its own data holds speaker labels only it "
            "knows, so the server cannot keep a head over them",
            'set federated.speakers = "local" (Federated Reconstruction: speakers stay local)',
        )
    r = f.reconstruction
    refusals = {
        "federated.reconstruction.centre": (
            r.centre != "none",
            "the domain centre needs a panel of devices' embeddings, which the server does "
            'not have when nodes hold their own data; set centre = "none"',
        ),
        "federated.reconstruction.device_clusters": (
            r.device_clusters > 0,
            "device clusters need a panel of devices' embeddings, which the server does not "
            "have when nodes hold their own data; set device_clusters = 0",
        ),
        "federated.privacy.secure_aggregation": (
            f.privacy.secure_aggregation,
            "secure aggregation is not wired for nodes on their own data yet; set it to false "
            "(or give the nodes shards)",
        ),
    }
    for field, (bad, fix) in refusals.items():
        if bad:
            raise ConfigError(field, "not supported with nodes on their own data", fix)


def load_own_corpus(key: str, path: Path, sample_rate: int) -> Corpus:
    """The node's corpus, every audio header read (unreadable or foreign audio names its file
    and the fix)."""
    if not path.is_absolute():
        raise ConfigError(
            f"node-config.{key}",
            f"{str(path)!r} is relative (Flower's app processes do not share the shell's folder)",
            "give an absolute path",
        )
    if not path.exists():
        raise DataError(path, "no such folder", f"point node-config {key} at the node's data")
    corpus = DATA_KEYS[key](path, sample_rate)
    corpus.validate()  # headers: readable, mono, at the run's sample rate, non-empty
    return corpus


def own_population(
    cfg: ExperimentConfig,
    corpus: Corpus,
    client: int,
    num_clients: int,
    cache: Path,
    feat_dim: int | None = None,
) -> tuple[Population, int]:
    """The node's population (its chunks under `client`, a "slot" per chunk: its speaker's
    index among the node's sorted speakers) and its number of speakers; features extracted
    with the run's settings through a cache in `cache`."""
    f = cfg.federated
    assert f is not None
    fcfg = cfg.features.feature_config()
    feats = extract_corpus(corpus, fcfg, FeatureStore(cache / "features"), progress=False)
    dims = {v.shape[1] for v in feats.values()}
    if feat_dim is not None and dims != {feat_dim}:
        raise ConfigError(
            "features",
            f"the node's features have {sorted(dims)} dimensions, the run's model {feat_dim}",
            "run the same fedvox on the node as on the server (same [features] config)",
        )
    speakers = corpus.speakers()
    index = {s: i for i, s in enumerate(speakers)}
    utts = sorted(feats)
    labels = np.array([index[corpus.speaker_of(u)] for u in utts], dtype=np.int64)
    store, rows, take = chunk_store(feats, utts, labels, f.chunk_frames, f.chunk_hop)
    store["slot"] = store["y"].clone()  # the node's speakers are its local speakers
    crops = {} if take is None else {"groups": store["group"].numpy(), "take": take}
    own = np.concatenate(rows)
    placeholder = np.zeros(1, dtype=np.int64)  # other clients: never trained here
    clients = [own if c == client else placeholder for c in range(max(num_clients, client + 1))]
    return Population(store, clients, seed=cfg.seed, **crops), len(speakers)


def node_client(node_config: dict[str, Any]) -> int:
    """The federation-wide client id a node on its own data holds (node config `client`)."""
    if CLIENT_KEY not in node_config:
        raise ConfigError(
            f"node-config.{CLIENT_KEY}",
            "missing: a node on its own data must say which client it is",
            "start the SuperNode with --node-config 'kaldi-dir=\"/data\" client=0' "
            "(0..n-1, a different number on every node)",
        )
    try:
        client = int(node_config[CLIENT_KEY])
    except (TypeError, ValueError):
        client = -1
    if client < 0:
        raise ConfigError(
            f"node-config.{CLIENT_KEY}",
            f"{node_config[CLIENT_KEY]!r} is not a client number",
            "give 0..n-1, a different number on every node",
        )
    return client


def node_cache(key: str, node_config: dict[str, Any]) -> Path:
    """The node's feature cache: node config `cache-dir`, else `.fedvox-cache` in its data
    folder; refuses one it cannot write."""
    where = node_config.get(CACHE_KEY)
    cache = Path(str(node_config[key])) / ".fedvox-cache" if where is None else Path(str(where))
    try:
        cache.mkdir(parents=True, exist_ok=True)
        probe = cache / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise DataError(
            cache,
            f"the node cannot write its feature cache here ({err.strerror})",
            f"give the node a writable folder: --node-config '... {CACHE_KEY}=\"/path\"'",
        ) from None
    return cache


def features_sha256(cfg: ExperimentConfig) -> str:
    """What the server's feature extraction is: the hash of the run's FeatureConfig."""
    return cfg.features.feature_config().hash()
