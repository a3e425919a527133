"""Speakers as local parameters: Federated Reconstruction of speaker prototypes, and FedAwS.

Fixed chunks → speaker_population (local speaker slots) → SpeakerReconTask (extractor global,
prototypes local) trained by fl.Simulator through make_speaker_recon_update; FedAwSTask with the
FedAwS algorithm is the positive-labels baseline (Yu et al. 2020, server-side spreadout).

A device's speaker prototype is its local parameter: enrolled in closed form (the normalised
mean embedding of its support chunks) on every trip and never sent. With one speaker per
device there are no negatives on the device, so the loss is AAM-softmax with the device's
prototype as target and, as negatives, prototypes of P PUBLIC synthetic speakers that the
server embeds with the extractor of the client's start version and broadcasts with the model.

Why this does not collapse. The public prototypes are embedded by the same extractor as the
device's speaker. If the extractor mapped every input to one point, the device's prototype,
its query embeddings and all P public prototypes would coincide: every cosine is 1, every
logit equal (up to the margin), and the loss is log(P + 1) (log(1 + P·e^{s(1−cos m)}) with
margin m), the chance-level value of an uninformative model. Lowering it requires
cos(e, own) > cos(e, public) for the device's speaker, i.e. separating it from the public
speakers, so collapse is never a minimum (it is a plateau: the gradient, ∝ the cosine gaps,
vanishes there, so training should not be pushed towards it; an early AAM margin does, see
the margin ramp in heads.margin_schedule). Contrast positive-only training (negatives="none"),
whose loss 1 − cos(e, own) is 0, its global minimum, exactly at collapse; and a bank of
impostor vectors learned only from clients' gradients, which drifts away from every speaker
until its logits vanish and the loss is positive-only again (the FedAwS paper's starting
observation; docs/algorithms.md §3, design.md principle 4). The negatives are a function of
the GLOBAL parameters of the start version only (recomputed, never stored), so the
simulator's bit-identical resume holds, and they are stop-gradient on the device.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from fedvox.data.corpus import load_kaldi_dir
from fedvox.data.features import FeatureConfig
from fedvox.data.store import FeatureStore, extract_corpus
from fedvox.data.synthetic import SyntheticConfig, ensure_corpus
from fedvox.errors import ConfigError, DataError
from fedvox.eval.metrics import compute_eer
from fedvox.fl.algorithms.fedavg import FedAvg
from fedvox.fl.algorithms.fedbuff import FedBuff
from fedvox.fl.client import ClientConfig, ClientResults
from fedvox.fl.population import Population
from fedvox.fl.recon import ReconConfig, train_clients_recon
from fedvox.fl.server_opt import ServerOptimizer
from fedvox.models.heads import aam_logits, check_margin
from fedvox.training.chunks import fixed_chunks
from fedvox.types import Batch, Params

EXTRACTOR = "extractor."  # prefix of the global (extractor) parameter names
PROTOTYPES = "prototypes"  # the local parameter: [max_local, emb_dim] per client
NEGATIVES = "public_negatives"  # reserved broadcast key: [P, emb_dim], never aggregated
CLASS_VECTORS = "head.weight"  # FedAwS's global class-vector matrix W [n_classes, emb_dim]
NEGATIVE_MODES = ("public", "local", "none")
PUBLIC_SEED_OFFSET = 1_000_003  # public speakers: synthetic seed + this (disjoint voices)

# Logit of an absent slot: exp() underflows to 0 against logits of magnitude <= scale.
_ABSENT = -1.0e4


def _strip(params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    n = len(EXTRACTOR)
    return {k[n:]: v for k, v in params.items() if k.startswith(EXTRACTOR)}


def _emb_dim(extractor: nn.Module, emb_dim: int | None) -> int:
    dim = emb_dim if emb_dim is not None else getattr(extractor, "emb_dim", None)
    if not isinstance(dim, int) or dim < 1:
        raise ConfigError(
            "model.emb_dim",
            f"cannot tell the embedding size of {type(extractor).__name__}",
            "pass emb_dim=... (or give the extractor an `emb_dim` attribute)",
        )
    return dim


class _Margin:
    """AAM margin state (radians); the logits are heads.aam_logits of given cosines."""

    def set_margin(self, m: float) -> None:
        """Set the angular margin, e.g. from heads.margin_schedule each round."""
        self.margin = check_margin(m)

    def aam_logits(self, cosine: Tensor, is_target: Tensor, scale: float) -> Tensor:
        """s·cos θ_j, and s·cos(θ_y + m) in the target column (heads.aam_logits)."""
        return aam_logits(cosine, is_target, scale, self.margin)


# -- public speakers --------------------------------------------------------------------------


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
    chunks_per_speaker: int = 2,
    chunk_frames: int = 200,
) -> PublicStore:
    """PublicStore from extracted features {utt: [frames, dim]}: the first `n_speakers`
    speakers (sorted ids; None = all), each with its first `chunks_per_speaker` fixed chunks
    over its utterances in sorted order. Deterministic: no randomness involved."""
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
    if chunks_per_speaker < 1 or chunk_frames < 1 or not speakers:
        raise ConfigError(
            "public",
            f"{len(speakers)} speakers, chunks_per_speaker={chunks_per_speaker}, "
            f"chunk_frames={chunk_frames}",
            "use at least one speaker, chunk and frame",
        )
    xs, ys = [], []
    for i, s in enumerate(speakers):
        chunks = np.concatenate([fixed_chunks(feats[u], chunk_frames) for u in by_speaker[s]])
        if len(chunks) < chunks_per_speaker:
            raise DataError(
                None,
                f"public speaker {s} has {len(chunks)} chunks of {chunk_frames} frames, "
                f"{chunks_per_speaker} needed",
                "use fewer chunks per speaker or longer/more utterances",
            )
        xs.append(chunks[:chunks_per_speaker])
        ys.append(np.full(chunks_per_speaker, i, dtype=np.int64))
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
    features with the run's FeatureConfig (experiment.prepare.feature_config) → PublicStore."""
    cfg = public_synthetic_config(synthetic, n_speakers, chunks_per_speaker, seed_offset)
    root = ensure_corpus(cfg, cache_root=cache_root, workers=workers, progress=progress)
    corpus = load_kaldi_dir(root / "train")
    feats = extract_corpus(corpus, features, feature_store, workers=workers, progress=progress)
    return public_store_from_features(
        feats, corpus.speaker_of, n_speakers, chunks_per_speaker, chunk_frames
    )


def public_prototypes(
    task: SpeakerReconTask, params: Mapping[str, Tensor], store: PublicStore, batch: int = 256
) -> Tensor:
    """Normalised mean normalised embedding of each public speaker [P, emb_dim] under the
    extractor in `params` (no gradient; fixed batching, so the bits depend on params only)."""
    with torch.no_grad():
        embs = [
            F.normalize(task.embed(params, store.x[i : i + batch]), dim=-1)
            for i in range(0, len(store.x), batch)
        ]
        e = torch.cat(embs)
        sums = torch.zeros(store.n_speakers, e.shape[1], dtype=e.dtype).index_add_(0, store.y, e)
    return F.normalize(sums, dim=-1)


# -- population -------------------------------------------------------------------------------


def speaker_population(
    store: Mapping[str, Tensor],
    client_rows: Sequence[Sequence[int] | np.ndarray],
    seed: int = 0,
    max_local: int = 1,
    groups: np.ndarray | None = None,
    take: np.ndarray | None = None,
) -> Population:
    """The Population with a "slot" field: each chunk's local speaker index on its client
    (the client's speakers in label order). Refuses a client with more than `max_local`
    speakers, which one prototype per slot could not hold. `groups`/`take`: random crops
    (Population)."""
    if "y" not in store:
        raise ConfigError("population.store", "no speaker labels 'y'", "pass {'x': X, 'y': Y}")
    y = np.asarray(store["y"])
    slot = np.full(len(y), -1, dtype=np.int64)
    for c, rows in enumerate(client_rows):
        rows = np.asarray(rows, dtype=np.int64)
        labels, local = np.unique(y[rows], return_inverse=True)
        if len(labels) > max_local:
            raise ConfigError(
                "reconstruction.max_local",
                f"client {c} holds {len(labels)} speakers, max_local is {max_local}",
                f"use max_local >= {len(labels)}, or a partition with fewer speakers per client",
            )
        clash = (slot[rows] >= 0) & (slot[rows] != local)
        if clash.any():
            raise ConfigError(
                "population.clients",
                f"store row {int(rows[clash][0])} is shared by clients with different speakers",
                "give every client its own rows",
            )
        slot[rows] = local
    return Population(
        {**store, "slot": torch.from_numpy(slot)}, client_rows, seed=seed, groups=groups, take=take
    )


# -- speaker reconstruction -------------------------------------------------------------------


def enrollment_prototypes(embeddings: Tensor, weights: Tensor) -> Tensor:
    """The closed-form reconstruction of speaker prototypes [S, D]: for each of S speakers the
    normalised weighted mean of its length-normalised embeddings [n, D] (weights [n, S], 0/1
    membership × mask). Used on devices during training and by `fedvox enroll`."""
    return F.normalize(weights.transpose(0, 1) @ F.normalize(embeddings, dim=-1), dim=-1)


class SpeakerReconTask(_Margin, nn.Module):
    """fl.recon.ReconTask: extractor global, speaker prototypes local (one per local slot).

    negatives: "public" (AAM-softmax over the client's own prototypes plus the public
    speakers broadcast under NEGATIVES; needs make_speaker_recon_update), "local" (over the
    client's own prototypes only: the cross-silo case, needs max_local >= 2), or "none"
    (positive-only 1 − cos(e, own prototype): the baseline that collapses).
    Batches carry "x" [B, L, F] and "slot" [B] (speaker_population). A slot without support
    chunks has a zero prototype: it is left out of the softmax, and its query chunks get
    loss 0. Reconstruction must be closed form (enrollment); SGD steps may refine it.
    """

    def __init__(
        self,
        extractor: nn.Module,
        scale: float = 30.0,
        margin: float = 0.2,
        max_local: int = 1,
        negatives: str = "public",
        emb_dim: int | None = None,
    ) -> None:
        nn.Module.__init__(self)
        if negatives not in NEGATIVE_MODES:
            raise ConfigError(
                "model.negatives",
                f"unknown negatives {negatives!r}",
                f"use one of {', '.join(NEGATIVE_MODES)}",
            )
        if max_local < 1:
            raise ConfigError("reconstruction.max_local", f"must be >= 1, got {max_local}")
        if negatives == "local" and max_local < 2:
            raise ConfigError(
                "model.negatives",
                "'local' negatives need several speakers per client (max_local >= 2)",
                "use negatives = 'public' for one speaker per device",
            )
        if not scale > 0:
            raise ConfigError("model.scale", f"must be > 0, got {scale}", "use 30-32")
        self.extractor = extractor
        self.emb_dim = _emb_dim(extractor, emb_dim)
        self.scale = float(scale)
        self.max_local = int(max_local)
        self.negatives = negatives
        self.set_margin(margin)

    # global parameters
    def init_params(self) -> Params:
        return {EXTRACTOR + n: p.detach().clone() for n, p in self.extractor.named_parameters()}

    def load_params(self, params: Mapping[str, Tensor]) -> None:
        """Copy global params (e.g. sim.params) into the extractor, for extraction/eval."""
        with torch.no_grad():
            for n, p in self.extractor.named_parameters():
                p.copy_(params[EXTRACTOR + n])

    def embed(self, params: Mapping[str, Tensor], x: Tensor) -> Tensor:
        """Embeddings [B, emb_dim] (un-normalised) of chunks x under the global params."""
        return functional_call(self.extractor, _strip(params), (x,))

    # local parameters
    def init_local(self, client_ids: Sequence[int], generator: torch.Generator) -> Params:
        # zeros: every prototype is set by closed_form_local before it is used
        return {PROTOTYPES: torch.zeros(len(client_ids), self.max_local, self.emb_dim)}

    def closed_form_local(self, global_params: Params, batch: Batch, mask: Tensor) -> Params:
        """Enrollment: prototype of slot j = normalised mean of the normalised embeddings of
        the support chunks in slot j (masked sums: vmappable; an empty slot stays 0)."""
        e = F.normalize(self.embed(global_params, batch["x"]), dim=-1)
        onehot = (batch["slot"].unsqueeze(-1) == torch.arange(self.max_local)).to(e.dtype)
        return {PROTOTYPES: enrollment_prototypes(e, onehot * mask.to(e.dtype).unsqueeze(-1))}

    def public_prototypes(self, params: Mapping[str, Tensor], store: PublicStore) -> Tensor:
        return public_prototypes(self, params, store)

    def loss(self, params: Params, batch: Batch) -> Tensor:
        """Per-example loss [B] of one client (global ∪ local params; see class docstring)."""
        if "slot" not in batch:
            raise ConfigError(
                "population", "batches have no 'slot' field", "build it with speaker_population"
            )
        e = F.normalize(self.embed(params, batch["x"]), dim=-1)
        protos = params[PROTOTYPES]
        present = protos.detach().abs().sum(-1) > 0  # [S]: slots enrolled on this trip
        own = e @ F.normalize(protos, dim=-1).transpose(0, 1)  # [B, S]
        is_target = batch["slot"].unsqueeze(-1) == torch.arange(self.max_local)
        has_target = (is_target & present).any(-1)
        if self.negatives == "none":
            per = 1.0 - (own * is_target).sum(-1)
            return torch.where(has_target, per, torch.zeros_like(per))
        cos, target = own, is_target
        valid = present.unsqueeze(0).expand_as(own)
        if self.negatives == "public":
            if NEGATIVES not in params:
                raise ConfigError(
                    "client_update",
                    f"no public negatives ({NEGATIVES!r}) next to the global params",
                    "train with make_speaker_recon_update(public_store, recon), or pass "
                    "with_negatives(task, params, public_store) to evaluation",
                )
            # a constant of the start version, computed by the server: never trained here
            neg = F.normalize(params[NEGATIVES].detach(), dim=-1)
            extra = e @ neg.transpose(0, 1)  # [B, P]
            cos = torch.cat([own, extra], -1)
            target = torch.cat([is_target, torch.zeros_like(extra, dtype=torch.bool)], -1)
            valid = torch.cat([valid, torch.ones_like(extra, dtype=torch.bool)], -1)
        logits = self.aam_logits(cos, target, self.scale)
        logits = torch.where(valid, logits, torch.full_like(logits, _ABSENT))
        per = torch.logsumexp(logits, -1) - (logits * target).sum(-1)
        return torch.where(has_target, per, torch.zeros_like(per))


def with_negatives(task: SpeakerReconTask, params: Params, public: PublicStore) -> Params:
    """Global params plus the public negatives of that version, as a client receives them
    (for fl.recon.recon_eval with task.loss as a metric)."""
    return {**params, NEGATIVES: public_prototypes(task, params, public)}


ClientUpdate = Callable[
    [SpeakerReconTask, Population, list[tuple[int, int]], list[Params], ClientConfig],
    ClientResults,
]


def make_speaker_recon_update(
    public: PublicStore | None, recon: ReconConfig, cache_size: int = 256
) -> ClientUpdate:
    """A Simulator `client_update` for SpeakerReconTask (the task the simulator passes).

    For each distinct start version the server computes the public negatives with that
    version's extractor once, adds them under NEGATIVES to a copy of the start params (one
    copy per version per call, so clients of one version still share a broadcast view), runs
    fl.recon.train_clients_recon, and removes NEGATIVES from the deltas (zero anyway: they
    are detached in the loss).

    The negatives are memoised per version: by the identity of the start dict, validated by
    a weak reference to its first tensor (so a reused id is detected without keeping old
    models alive: only the [P, emb] prototypes are held, for at most `cache_size` versions).
    FedBuff keeps about C/K versions in flight and completes them interleaved; a cache of 4
    (the first version of this) recomputed the negatives for most completions and spent 72 %
    of a C = 200, K = 10 run there. The prototypes are a pure function of the version, so
    the cache never changes a bit.
    """
    if not recon.closed_form:
        raise ConfigError(
            "reconstruction.closed_form",
            "speaker prototypes are enrolled in closed form (the mean support embedding)",
            "set closed_form = true (steps = 0, or a few refinement steps)",
        )
    if cache_size < 1:
        raise ConfigError("cache_size", f"must be >= 1, got {cache_size}", "use e.g. 256")
    cache: OrderedDict[int, tuple[weakref.ref, Tensor]] = OrderedDict()

    def client_update(
        task: SpeakerReconTask,
        population: Population,
        jobs: list[tuple[int, int]],
        starts: list[Params],
        cfg: ClientConfig,
    ) -> ClientResults:
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
        if task.negatives != "public":
            return train_clients_recon(task, population, jobs, starts, cfg, recon)
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
                    hit = (weakref.ref(first), public_prototypes(task, st, public))
                    cache[key] = hit
                    while len(cache) > cache_size:
                        cache.popitem(last=False)
                cache.move_to_end(key)
                merged[key] = {**st, NEGATIVES: hit[1]}
            sent.append(merged[key])
        results = train_clients_recon(task, population, jobs, sent, cfg, recon)
        results.delta.pop(NEGATIVES)
        return results

    return client_update


# -- evaluation on unseen speakers ------------------------------------------------------------


def speaker_separation(
    task: SpeakerReconTask | FedAwSTask, params: Params, x: Tensor, y: Tensor, batch: int = 256
) -> dict[str, float]:
    """How well the extractor in `params` separates speakers it never saw (x [N, L, F], y [N]).

    Per speaker, the chunks at even positions (in order) enroll a prototype (closed form, as
    on a device) and the odd ones are tests. Returns "spread" (mean pairwise cosine distance
    1 − cos between prototypes: → 0 when speakers collapse; a common offset that only narrows
    the cone lowers it too, so read it with the others), "min_distance" (the smallest),
    "accuracy" (a test chunk's closest prototype is its own) and "eer" (every test chunk
    cosine-scored against every prototype).
    Needs >= 2 speakers with >= 2 chunks each.
    """
    y_np = np.asarray(y)
    speakers = np.unique(y_np)
    rank = np.empty(len(y_np), dtype=np.int64)
    for s in speakers:
        idx = np.flatnonzero(y_np == s)
        if len(idx) < 2:
            raise DataError(None, f"speaker {int(s)} has {len(idx)} chunk(s)", "give >= 2 each")
        rank[idx] = np.arange(len(idx))
    if len(speakers) < 2:
        raise DataError(None, "one speaker only", "give at least 2 speakers")
    with torch.no_grad():
        raw = torch.cat([task.embed(params, x[i : i + batch]) for i in range(0, len(x), batch)])
    label = torch.from_numpy(np.searchsorted(speakers, y_np))
    enroll = torch.from_numpy(rank % 2 == 0)
    off = ~torch.eye(len(speakers), dtype=torch.bool)
    e = F.normalize(raw, dim=-1)
    sums = torch.zeros(len(speakers), e.shape[1]).index_add_(0, label[enroll], e[enroll])
    protos = F.normalize(sums, dim=-1)
    dist = 1.0 - protos @ protos.T
    scores = e[~enroll] @ protos.T  # [tests, speakers]
    truth = label[~enroll]
    is_tgt = truth.unsqueeze(1) == torch.arange(len(speakers))
    eer, _ = compute_eer(scores[is_tgt].numpy(), scores[~is_tgt].numpy())
    return {
        "spread": float(dist[off].mean()),
        "min_distance": float(dist[off].min()),
        "accuracy": float((scores.argmax(1) == truth).float().mean()),
        "eer": eer,
    }


# -- FedAwS baseline --------------------------------------------------------------------------


class FedAwSTask(nn.Module):
    """Extractor + global class vectors W [n_classes, emb_dim] (one row per training speaker),
    trained with a POSITIVE-ONLY loss: each client sees only its own speakers' rows.

    Loss (Yu et al. 2020, the positive part of their cosine contrastive loss):
    (max(0, pos_margin − cos(e, w_y)))², pos_margin 0.9 as in the paper. Without the
    server's spreadout (FedAwS algorithm) this collapses every row and embedding together.
    """

    def __init__(
        self,
        extractor: nn.Module,
        n_classes: int,
        pos_margin: float = 0.9,
        emb_dim: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if n_classes < 2:
            raise ConfigError("model.n_classes", f"need >= 2 classes, got {n_classes}")
        if not -1.0 < pos_margin <= 1.0:
            raise ConfigError("model.pos_margin", f"must be in (-1, 1], got {pos_margin}")
        self.extractor = extractor
        self.emb_dim = _emb_dim(extractor, emb_dim)
        self.n_classes = int(n_classes)
        self.pos_margin = float(pos_margin)
        self.head = nn.Linear(self.emb_dim, n_classes, bias=False)
        gen = torch.Generator().manual_seed(int(seed))
        with torch.no_grad():
            self.head.weight.copy_(
                F.normalize(torch.randn(n_classes, self.emb_dim, generator=gen), dim=-1)
            )

    def init_params(self) -> Params:
        return {n: p.detach().clone() for n, p in self.named_parameters()}

    def load_params(self, params: Mapping[str, Tensor]) -> None:
        with torch.no_grad():
            for n, p in self.named_parameters():
                p.copy_(params[n])

    def embed(self, params: Mapping[str, Tensor], x: Tensor) -> Tensor:
        return functional_call(self.extractor, _strip(params), (x,))

    def loss(self, params: Params, batch: Batch) -> Tensor:
        e = F.normalize(self.embed(params, batch["x"]), dim=-1)
        w = F.normalize(params[CLASS_VECTORS], dim=-1)
        is_target = batch["y"].unsqueeze(-1) == torch.arange(self.n_classes)
        cos_y = ((e @ w.transpose(0, 1)) * is_target).sum(-1)
        return (self.pos_margin - cos_y).clamp(min=0.0) ** 2


def spreadout_loss(w: Tensor, nu: float) -> Tensor:
    """reg_sp(W) = Σ_{i≠j} max(0, ν − ‖ŵ_i − ŵ_j‖)² on L2-normalised rows ŵ (Yu et al. 2020;
    ν is their margin, configurable; on the unit sphere distances lie in [0, 2])."""
    wn = F.normalize(w, dim=-1)
    d2 = (2.0 - 2.0 * wn @ wn.T).clamp(min=1e-12)  # the clamp keeps sqrt's gradient finite
    off = ~torch.eye(len(w), dtype=torch.bool)
    return ((nu - d2.sqrt()).clamp(min=0.0) ** 2 * off).sum()


def spreadout(w: Tensor, nu: float, lr: float, steps: int) -> Tensor:
    """`steps` gradient steps of spreadout_loss on W (a new tensor; deterministic)."""
    w = w.detach().clone()
    for _ in range(steps):
        with torch.enable_grad():
            v = w.requires_grad_(True)
            (g,) = torch.autograd.grad(spreadout_loss(v, nu), v)
        w = (w - lr * g).detach()
    return w


class _Spreadout:
    """After the server optimiser's step: `spread_steps` steps of spreadout on the class
    vectors (FedAwS: the server alone sees every class, so it alone can push them apart)."""

    def _init_spreadout(self, nu: float, spread_lr: float, spread_steps: int, key: str) -> None:
        if not nu > 0:
            raise ConfigError("algorithm.nu", f"must be > 0, got {nu}", "use e.g. 1.0")
        if not spread_lr > 0:
            raise ConfigError("algorithm.spread_lr", f"must be > 0, got {spread_lr}")
        if spread_steps < 1:
            raise ConfigError("algorithm.spread_steps", f"must be >= 1, got {spread_steps}")
        self.nu, self.spread_lr, self.spread_steps = float(nu), float(spread_lr), spread_steps
        self.class_key = key

    def apply(
        self,
        params: Params,
        total: Params,
        weight: float,
        count: int,
        starts: Sequence[Params],
        staleness: Tensor,
    ) -> Params:
        new = super().apply(params, total, weight, count, starts, staleness)  # type: ignore[misc]
        if weight == 0:  # nothing was aggregated: the model stays as it was
            return new
        if self.class_key not in new:
            raise ConfigError(
                "algorithm.class_key", f"no parameter {self.class_key!r}", "use FedAwSTask"
            )
        w = spreadout(new[self.class_key], self.nu, self.spread_lr, self.spread_steps)
        return {**new, self.class_key: w}


class FedAwS(_Spreadout, FedAvg):
    """FedAvg (any server optimiser) + server-side spreadout on the class vectors."""

    name = "fedaws"

    def __init__(
        self,
        server_opt: ServerOptimizer | None = None,
        weighting: str = "examples",
        nu: float = 1.0,
        spread_lr: float = 0.1,
        spread_steps: int = 1,
        class_key: str = CLASS_VECTORS,
    ) -> None:
        FedAvg.__init__(self, server_opt, weighting)
        self._init_spreadout(nu, spread_lr, spread_steps, class_key)


class FedBuffAwS(_Spreadout, FedBuff):
    """FedBuff (asynchronous, K updates per step) + server-side spreadout."""

    name = "fedbuff-aws"

    def __init__(
        self,
        buffer_size: int = 10,
        server_opt: ServerOptimizer | None = None,
        staleness: str = "sqrt",
        max_staleness: int | None = None,
        nu: float = 1.0,
        spread_lr: float = 0.1,
        spread_steps: int = 1,
        class_key: str = CLASS_VECTORS,
    ) -> None:
        FedBuff.__init__(
            self, buffer_size, server_opt, staleness=staleness, max_staleness=max_staleness
        )
        self._init_spreadout(nu, spread_lr, spread_steps, class_key)
