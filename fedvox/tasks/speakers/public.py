"""The public speakers: fixed chunks of synthetic voices the server holds, and their prototypes.

Part of fedvox.tasks.speakers: the server embeds them with each model version and broadcasts
the prototypes as negatives for devices that hold one speaker (prototypes.SpeakerReconTask).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fedvox.data.corpus import load_kaldi_dir
from fedvox.data.features import FeatureConfig
from fedvox.data.store import FeatureStore, extract_corpus
from fedvox.data.synthetic import SyntheticConfig, ensure_corpus
from fedvox.errors import ConfigError, DataError
from fedvox.training.chunks import fixed_chunks
from fedvox.types import Params

NEGATIVES = "public_negatives"  # reserved broadcast key: [P, emb_dim], never aggregated
# reserved broadcast key: the device domain's mean normalised embedding [emb_dim] under the
# start version (domain centring), never aggregated
DOMAIN_CENTRE = "domain_centre"
PUBLIC_SEED_OFFSET = 1_000_003  # public speakers: synthetic seed + this (disjoint voices)


class Embedder(Protocol):
    """A task that embeds chunks under given global parameters (every speaker task does)."""

    def embed(self, params: Mapping[str, Tensor], x: Tensor) -> Tensor: ...


@dataclass(frozen=True)
class PublicStore:
    """Fixed chunks of P public speakers held by the server: x [N, L, F], y [N] in 0..P-1."""

    x: Tensor
    y: Tensor
    speakers: tuple[str, ...]

    @property
    def n_speakers(self) -> int:
        return len(self.speakers)

    def broadcast_bytes(self, emb_dim: int) -> int:
        """Extra download per client trip: the float32 negatives [P, emb_dim]."""
        return 4 * self.n_speakers * emb_dim


def public_store_from_features(
    feats: Mapping[str, np.ndarray],
    speaker_of: Mapping[str, str] | Callable[[str], str],
    n_speakers: int | None = None,
    chunks_per_speaker: int | None = 2,
    chunk_frames: int = 200,
) -> PublicStore:
    """PublicStore from extracted features {utt: [frames, dim]}: the first `n_speakers`
    speakers (sorted ids; None = all), each with its first `chunks_per_speaker` fixed chunks
    (None = all of them) over its utterances in sorted order. Deterministic: no randomness."""
    spk = speaker_of if callable(speaker_of) else speaker_of.__getitem__
    by_speaker: dict[str, list[str]] = {}
    for u in sorted(feats):
        by_speaker.setdefault(spk(u), []).append(u)
    speakers = sorted(by_speaker)
    if n_speakers is not None:
        if n_speakers > len(speakers):
            raise DataError(
                None,
                f"{n_speakers} public speakers requested, the features hold {len(speakers)}",
                "ask for fewer public speakers or pass more",
            )
        speakers = speakers[:n_speakers]
    if (
        (chunks_per_speaker is not None and chunks_per_speaker < 1)
        or chunk_frames < 1
        or not speakers
    ):
        raise ConfigError(
            "public",
            f"{len(speakers)} speakers, chunks_per_speaker={chunks_per_speaker}, "
            f"chunk_frames={chunk_frames}",
            "use at least one speaker, chunk and frame",
        )
    xs, ys = [], []
    for i, s in enumerate(speakers):
        chunks = np.concatenate([fixed_chunks(feats[u], chunk_frames) for u in by_speaker[s]])
        take = len(chunks) if chunks_per_speaker is None else chunks_per_speaker
        if len(chunks) < take:
            raise DataError(
                None,
                f"public speaker {s} has {len(chunks)} chunks of {chunk_frames} frames, "
                f"{chunks_per_speaker} needed",
                "use fewer chunks per speaker or longer/more utterances",
            )
        xs.append(chunks[:take])
        ys.append(np.full(take, i, dtype=np.int64))
    x = torch.from_numpy(np.ascontiguousarray(np.concatenate(xs), dtype=np.float32))
    return PublicStore(x, torch.from_numpy(np.concatenate(ys)), tuple(speakers))


def public_synthetic_config(
    synthetic: SyntheticConfig,
    n_speakers: int = 100,
    chunks_per_speaker: int = 2,
    seed_offset: int = PUBLIC_SEED_OFFSET,
) -> SyntheticConfig:
    """The public corpus: the training corpus's generator settings with another seed (so other
    voices), `n_speakers` train speakers with one utterance per chunk wanted."""
    return replace(
        synthetic,
        seed=synthetic.seed + seed_offset,
        n_train_speakers=n_speakers,
        train_utts_per_speaker=chunks_per_speaker,
        n_test_speakers=2,
        test_utts_per_speaker=2,
    )


def public_speaker_store(
    synthetic: SyntheticConfig,
    features: FeatureConfig,
    n_speakers: int = 100,
    chunks_per_speaker: int = 2,
    chunk_frames: int = 200,
    cache_root: Path | None = None,
    feature_store: FeatureStore | None = None,
    seed_offset: int = PUBLIC_SEED_OFFSET,
    workers: int = 1,
    progress: bool = False,
) -> PublicStore:
    """Generate (or reuse from the cache) the public synthetic corpus and extract its
    features with the run's FeatureConfig ([features] FeaturesSection.feature_config()) → PublicStore."""
    cfg = public_synthetic_config(synthetic, n_speakers, chunks_per_speaker, seed_offset)
    root = ensure_corpus(cfg, cache_root=cache_root, workers=workers, progress=progress)
    corpus = load_kaldi_dir(root / "train")
    feats = extract_corpus(corpus, features, feature_store, workers=workers, progress=progress)
    return public_store_from_features(
        feats, corpus.speaker_of, n_speakers, chunks_per_speaker, chunk_frames
    )


def normalised_embeddings(
    task: Embedder, params: Mapping[str, Tensor], x: Tensor, batch: int = 256
) -> Tensor:
    """Length-normalised embeddings [N, emb_dim] of chunks x (no gradient; fixed batching,
    so the bits depend on params and x only)."""
    with torch.no_grad():
        return torch.cat(
            [
                F.normalize(task.embed(params, x[i : i + batch]), dim=-1)
                for i in range(0, len(x), batch)
            ]
        )


def public_prototypes(
    task: Embedder,
    params: Mapping[str, Tensor],
    store: PublicStore,
    batch: int = 256,
    centred: bool = False,
) -> Tensor:
    """Normalised mean normalised embedding of each public speaker [P, emb_dim] under the
    extractor in `params`; `centred`: of the embeddings minus their mean (the public
    domain's centre), the counterpart of a device's domain-centred embeddings."""
    e = normalised_embeddings(task, params, store.x, batch)
    if centred:
        e = e - e.mean(0)
    sums = torch.zeros(store.n_speakers, e.shape[1], dtype=e.dtype).index_add_(0, store.y, e)
    return F.normalize(sums, dim=-1)


@dataclass(frozen=True)
class DomainClusters:
    """Device-domain negatives: k-means of a fixed panel's chunks [N, L, F] into at most k
    clusters, those of at least `min_size` panel devices kept (each an aggregate of that many)."""

    panel: Tensor
    k: int
    min_size: int = 10

    def __post_init__(self) -> None:
        if self.k < 1 or self.min_size < 1:
            raise ConfigError(
                "k", f"k = {self.k}, min_size = {self.min_size}", "use k >= 1 and min_size >= 1"
            )
        if self.min_size > len(self.panel):  # k is an upper bound: small clusters drop
            raise ConfigError(
                "panel",
                f"{len(self.panel)} panel devices cannot fill one cluster of >= {self.min_size}",
                f"use a panel of at least {self.min_size} devices or a smaller minimum",
            )


def domain_clusters(
    e: Tensor, seeds: Tensor, k: int, min_size: int = 10, iters: int = 20
) -> Tensor:
    """Centroids [k, emb] of a spherical k-means of unit embeddings e [N, emb]; a cluster of
    fewer than `min_size` members is an all-zero row (absent: the loss skips it), so every
    version broadcasts the same shape (FedBuff trains clients of several versions together).

    Initialised from k of the server's own unit vectors `seeds` (the public prototypes,
    spread by farthest-point selection), so every Lloyd step needs only per-cluster sums and
    counts of the devices' embeddings: what secure aggregation reveals in a deployment
    (federated k-means); a small cluster is never revealed. Deterministic: no random draw,
    ties broken by index.
    """
    with torch.no_grad():
        pick = [0]
        best = seeds @ seeds[0]
        for _ in range(1, min(k, len(seeds))):
            j = int(torch.argmin(best))
            pick.append(j)
            best = torch.maximum(best, seeds @ seeds[j])
        c = seeds[pick].clone()
        counts = torch.zeros(len(c))
        for _ in range(iters):
            assign = torch.argmax(e @ c.transpose(0, 1), dim=1)
            sums = torch.zeros_like(c).index_add_(0, assign, e)
            counts = torch.bincount(assign, minlength=len(c)).to(e.dtype)
            # an empty cluster keeps its centroid (it is zeroed below if it stays small)
            c = torch.where(counts.unsqueeze(1) > 0, F.normalize(sums, dim=-1), c)
        out = torch.zeros(k, e.shape[1], dtype=e.dtype)
        out[: len(c)] = torch.where((counts >= min_size).unsqueeze(1), c, torch.zeros_like(c))
        return out


def with_negatives(task: Embedder, params: Params, public: PublicStore) -> Params:
    """Global params plus the public negatives of that version, as a client receives them
    (for fl.recon_eval with task.loss as a metric)."""
    return {**params, NEGATIVES: public_prototypes(task, params, public)}
