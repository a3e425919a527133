"""The client update of the local-prototype task: the server's public negatives, per version.

Part of fedvox.tasks.speakers: wraps fl's Federated Reconstruction client update so each
start version travels with its public prototypes (memoised per version). A deployment splits
it in two: the server's `make_version_broadcast` and the device's `received_broadcast_update`.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from fedvox.errors import ConfigError
from fedvox.fl.local import ClientConfig, ClientResults, ReconConfig, train_clients_recon
from fedvox.fl.population import Population
from fedvox.tasks.speakers.prototypes import SpeakerReconTask
from fedvox.tasks.speakers.public import (
    DOMAIN_CENTRE,
    NEGATIVES,
    DomainClusters,
    PublicStore,
    domain_clusters,
    normalised_embeddings,
    public_prototypes,
)
from fedvox.types import Params

ClientUpdate = Callable[
    [SpeakerReconTask, Population, list[tuple[int, int]], list[Params], ClientConfig],
    ClientResults,
]


def make_speaker_recon_update(
    public: PublicStore | None,
    recon: ReconConfig,
    cache_size: int = 256,
    centre_panel: Tensor | None = None,
    clusters: DomainClusters | None = None,
) -> ClientUpdate:
    """A Simulator `client_update` for SpeakerReconTask (the task the simulator passes).

    For each distinct start version the server computes the public negatives with that
    version's extractor once, adds them under NEGATIVES to a copy of the start params (one
    copy per version per call, so clients of one version still share a broadcast view), runs
    fl.local.train_clients_recon, and removes NEGATIVES from the deltas (zero anyway: they
    are detached in the loss).

    The negatives are memoised per version: by the identity of the start dict, validated by
    a weak reference to its first tensor (so a reused id is detected without keeping old
    models alive: only the [P, emb] prototypes are held, for at most `cache_size` versions).
    FedBuff keeps about C/K versions in flight and completes them interleaved, hence the
    default (docs/federated.md, notes). The prototypes are a pure function of the version,
    so the cache never changes a bit.

    With `centre_panel` (chunks [N, L, F] of a fixed panel of devices) the loss is domain-
    centred: each version also broadcasts DOMAIN_CENTRE, the panel's mean normalised
    embedding (a secure-aggregated statistic: no single device's embedding is revealed),
    devices centre their embeddings on it and the public negatives are centred on the
    public speakers' own mean, so a direction shared by a whole domain cannot separate a
    device speaker from the public ones (docs/federated.md, "A common offset").

    With `clusters` each version also appends device-domain negatives to NEGATIVES: the
    centroids of a spherical k-means of a device panel's embeddings (domain_clusters), so a
    direction that devices share without sharing a speaker (their channel) is penalised.
    """
    received = received_broadcast_update(recon)  # refuses a recon config it cannot train
    if cache_size < 1:
        raise ConfigError("cache_size", f"must be >= 1, got {cache_size}", "use e.g. 256")
    cache: OrderedDict[int, tuple[weakref.ref, dict[str, Tensor]]] = OrderedDict()

    def client_update(
        task: SpeakerReconTask,
        population: Population,
        jobs: list[tuple[int, int]],
        starts: list[Params],
        cfg: ClientConfig,
    ) -> ClientResults:
        _check_recon_inputs(task, population)
        if task.negatives != "public":
            return received(task, population, jobs, starts, cfg)
        if public is None:
            raise ConfigError(
                "public", "negatives = 'public' but no public speakers were given", "pass one"
            )
        sent: list[Params] = []
        merged: dict[int, Params] = {}
        for st in starts:
            key = id(st)
            if key not in merged:
                first = next(iter(st.values()))
                hit = cache.get(key)
                if hit is None or hit[0]() is not first:
                    extra = _version_broadcast(task, st, public, centre_panel, clusters)
                    hit = (weakref.ref(first), extra)
                    cache[key] = hit
                    while len(cache) > cache_size:
                        cache.popitem(last=False)
                cache.move_to_end(key)
                merged[key] = {**st, **hit[1]}
            sent.append(merged[key])
        return received(task, population, jobs, sent, cfg)

    return client_update


def make_version_broadcast(
    task: SpeakerReconTask,
    public: PublicStore,
    centre_panel: Tensor | None = None,
    clusters: DomainClusters | None = None,
) -> Callable[[Params], dict[str, Tensor]]:
    """The server's half of make_speaker_recon_update: what one model version's broadcast
    adds to the start params (NEGATIVES, and DOMAIN_CENTRE when centred), as it computes it."""
    return lambda params: _version_broadcast(task, params, public, centre_panel, clusters)


def received_broadcast_update(recon: ReconConfig) -> ClientUpdate:
    """The device's half of make_speaker_recon_update: each start dict already carries the
    server's broadcast (NEGATIVES, DOMAIN_CENTRE); they are used, never trained, and left
    out of the delta, so only the extractor's update leaves the device."""
    if not recon.closed_form:
        raise ConfigError(
            "reconstruction.closed_form",
            "speaker prototypes are enrolled in closed form (the mean support embedding)",
            "set closed_form = true (steps = 0, or a few refinement steps)",
        )

    def client_update(
        task: SpeakerReconTask,
        population: Population,
        jobs: list[tuple[int, int]],
        starts: list[Params],
        cfg: ClientConfig,
    ) -> ClientResults:
        _check_recon_inputs(task, population)
        if task.negatives == "public" and any(NEGATIVES not in st for st in starts):
            raise ConfigError(
                "client_update",
                f"no public negatives ({NEGATIVES!r}) came with the start params",
                "the server must broadcast them (DeployServer's `broadcast`)",
            )
        results = train_clients_recon(task, population, jobs, starts, cfg, recon)
        for name in (NEGATIVES, DOMAIN_CENTRE):
            results.delta.pop(name, None)
        return results

    return client_update


def _check_recon_inputs(task: Any, population: Population) -> None:
    """A reconstruction task and a population with a local-speaker slot per row."""
    if not isinstance(task, SpeakerReconTask):
        raise ConfigError(
            "task", f"{type(task).__name__} is not a SpeakerReconTask", "use SpeakerReconTask"
        )
    slots = population.store.get("slot")
    if slots is None or int(slots.max()) >= task.max_local:
        raise ConfigError(
            "population",
            "no 'slot' field, or more local speakers than the task's max_local",
            "build the population with speaker_population(..., max_local=task.max_local)",
        )


def _version_broadcast(
    task: SpeakerReconTask,
    st: Params,
    public: PublicStore,
    centre_panel: Tensor | None,
    clusters: DomainClusters | None,
) -> dict[str, Tensor]:
    """What the server adds to one model version's broadcast: the public negatives (and
    cluster centroids), and the domain centre when the loss is centred."""
    out: dict[str, Tensor] = {}
    if centre_panel is None:
        neg = public_prototypes(task, st, public)
    else:
        out[DOMAIN_CENTRE] = normalised_embeddings(task, st, centre_panel).mean(0)
        neg = public_prototypes(task, st, public, centred=True)
    if clusters is not None:
        e = normalised_embeddings(task, st, clusters.panel)
        if DOMAIN_CENTRE in out:
            e = F.normalize(e - out[DOMAIN_CENTRE], dim=-1)
        neg = torch.cat([neg, domain_clusters(e, neg, clusters.k, clusters.min_size)])
    out[NEGATIVES] = neg
    return out
