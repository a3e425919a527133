"""RECONEVAL on unseen speakers: a trained run's extractor, prototypes reconstructed per device.

Run folder → test features → fixed chunks → one client per held-out speaker (support/query by
utterance, fl.local's split) → prototype (closed form, then k SGD epochs against public negatives) → cosine EER.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedvox.atomic import atomic_write_text
from fedvox.errors import ConfigError, DataError
from fedvox.experiment.config import ExperimentConfig, FederatedSection
from fedvox.experiment.prepare import prepare, public_store
from fedvox.experiment.runfolder import RunFolder, load_run_model
from fedvox.fl import ClientConfig, Population, ReconConfig
from fedvox.fl.local import GROUP_FIELD, broadcast_view, eval_splits, reconstruct_stacked
from fedvox.tasks.speakers import (
    NEGATIVES,
    PROTOTYPES,
    PublicStore,
    SpeakerReconTask,
    enrollment_prototypes,
    public_prototypes,
    score_prototypes,
)
from fedvox.training.centralised import set_determinism
from fedvox.training.chunks import fixed_chunks

JSON_FILE = "reconeval.json"
MD_FILE = "reconeval.md"
EMBED_BATCH = 256  # chunks per extractor call (fixed, so the bits do not depend on memory)
QUERY_EMBEDDING = "chunk_mean"  # query utterance = normalised mean of normalised chunk embs


UNSEEN_SPLIT = ReconConfig(split="groups", support_fraction=0.5)  # half the recordings


@dataclass(frozen=True)
class UnseenSplit:
    """Held-out speakers as clients: speaker i's support and query utterance ids (sorted),
    and the chunk rows of its support in the order the reconstruction walks them."""

    speakers: tuple[str, ...]
    support: tuple[tuple[str, ...], ...]
    query: tuple[tuple[str, ...], ...]
    support_rows: tuple[np.ndarray, ...]


def unseen_population(
    utts: Sequence[str], speaker_of: Callable[[str], str], owner: np.ndarray
) -> tuple[Population, tuple[str, ...]]:
    """One client per speaker (sorted ids) over the chunks of `utts`; chunk j belongs to
    utterance owner[j], its group (recording), as in the training store. Needs >= 2
    speakers with >= 2 utterances each (else nothing to hold out)."""
    by_speaker: dict[str, list[int]] = {}
    for i, u in enumerate(utts):
        by_speaker.setdefault(speaker_of(u), []).append(i)
    speakers = tuple(sorted(by_speaker))
    few = [s for s in speakers if len(by_speaker[s]) < 2]
    if few:
        raise DataError(
            None,
            f"test speaker(s) {', '.join(few[:3])} have a single utterance: no support/query split",
            "give every test speaker at least 2 utterances",
        )
    if len(speakers) < 2:
        raise DataError(None, f"{len(speakers)} test speaker(s)", "give at least 2 test speakers")
    owner = np.asarray(owner, dtype=np.int64)
    rows = [np.flatnonzero(np.isin(owner, by_speaker[s])) for s in speakers]
    return Population({GROUP_FIELD: torch.from_numpy(owner)}, rows), speakers


def split_unseen(
    utts: Sequence[str],
    speaker_of: Callable[[str], str],
    owner: np.ndarray,
    batch_size: int,
    seed: int,
) -> UnseenSplit:
    """Each speaker's support/query by utterance from fl.local's split (eval_splits with the
    "groups" split, half the recordings each side), keyed by (seed, speaker index) exactly as
    Federated Reconstruction's evaluation: training and RECONEVAL share one split function."""
    population, speakers = unseen_population(utts, speaker_of, owner)
    splits = eval_splits(population, range(len(speakers)), batch_size, UNSEEN_SPLIT, seed)

    def names(batches: list[np.ndarray]) -> tuple[str, ...]:
        return tuple(utts[i] for i in np.unique(owner[np.concatenate(batches)]))

    return UnseenSplit(
        speakers,
        tuple(names(sp.support) for sp in splits),
        tuple(names(sp.query) for sp in splits),
        tuple(np.concatenate(sp.support) for sp in splits),
    )


def chunk_embeddings(
    extractor: nn.Module,
    feats: Mapping[str, np.ndarray],
    utts: Sequence[str],
    chunk_frames: int,
    batch: int = EMBED_BATCH,
) -> tuple[Tensor, Tensor]:
    """Raw embeddings [N, D] of the fixed chunks of `utts` (in order) and each chunk's index
    into `utts` [N]. Streams the chunks, so a large test set never sits in memory as a store."""
    embs: list[Tensor] = []
    owners: list[np.ndarray] = []
    pending: list[np.ndarray] = []
    n_pending = 0

    def flush() -> None:
        nonlocal pending, n_pending
        if pending:
            x = torch.from_numpy(np.ascontiguousarray(np.concatenate(pending), dtype=np.float32))
            for i in range(0, len(x), batch):
                embs.append(extractor(x[i : i + batch]))
        pending, n_pending = [], 0

    with torch.no_grad():
        for j, u in enumerate(utts):
            c = fixed_chunks(feats[u], chunk_frames)
            pending.append(c)
            owners.append(np.full(len(c), j, dtype=np.int64))
            n_pending += len(c)
            if n_pending >= batch:
                flush()
        flush()
    return torch.cat(embs), torch.from_numpy(np.concatenate(owners))


def pooled(emb: Tensor, owner: Tensor, n: int) -> Tensor:
    """[n, D]: per owner, the normalised mean of its normalised embeddings."""
    e = F.normalize(emb, dim=-1)
    return F.normalize(torch.zeros(n, e.shape[1], dtype=e.dtype).index_add_(0, owner, e), dim=-1)


class _Identity(nn.Module):
    """Stands in for the frozen extractor: batches already hold its embeddings."""

    def forward(self, x: Tensor) -> Tensor:
        return x


def _embedding_task(dim: int, scale: float, margin: float) -> SpeakerReconTask:
    return SpeakerReconTask(_Identity(), scale=scale, margin=margin, emb_dim=dim)


def support_loss(
    prototypes: Tensor,
    support: Tensor,
    label: Tensor,
    negatives: Tensor,
    scale: float = 30.0,
    margin: float = 0.0,
) -> Tensor:
    """[S]: each speaker's mean SpeakerReconTask loss over all its support chunks, the
    objective the SGD epochs descend (it rises when their lr overshoots)."""
    task = _embedding_task(support.shape[1], scale, margin)
    out = torch.empty(len(prototypes))
    with torch.no_grad():
        for s in range(len(prototypes)):
            e = support[label == s]
            b = {"x": e, "slot": torch.zeros(len(e), dtype=torch.long)}
            out[s] = task.loss({PROTOTYPES: prototypes[s : s + 1], NEGATIVES: negatives}, b).mean()
    return out


def refine_prototypes(
    prototypes: Tensor,
    support: Tensor,
    label: Tensor,
    negatives: Tensor,
    steps: int,
    lr: float,
    batch_size: int,
    scale: float = 30.0,
    margin: float = 0.0,
) -> Tensor:
    """`steps` SGD epochs per speaker on its prototype alone: fl.local's reconstruction, as on
    a device (the extractor is frozen, global params = the public negatives).

    prototypes [S, D] (closed form), support [N, D] embeddings with speaker `label` [N],
    negatives [P, D] public prototypes. Each epoch walks speaker s's support chunks in order,
    batches of `batch_size`, one step each on the masked mean of SpeakerReconTask's loss. The
    embeddings are computed once and the task wraps an identity map: the same loss code, none
    of the extractor's cost.
    """
    if steps == 0:
        return prototypes.clone()
    task = _embedding_task(support.shape[1], scale, margin)
    store = {"x": support.detach(), "slot": torch.zeros(len(support), dtype=torch.long)}
    rows = [np.flatnonzero(label.numpy() == s) for s in range(len(prototypes))]
    population = Population(store, rows)
    batches = [[r[i : i + batch_size] for i in range(0, len(r), batch_size)] for r in rows]
    g = broadcast_view([{NEGATIVES: negatives.detach()}] * len(prototypes))
    local = {PROTOTYPES: prototypes.unsqueeze(1)}  # one slot per speaker
    cfg = ClientConfig(batch_size=batch_size)
    out = reconstruct_stacked(
        task, population, batches, g, local, cfg, ReconConfig(steps=steps, lr=lr)
    )
    return out[PROTOTYPES][:, 0]


@dataclass
class ReconEvalInputs:
    """What every k of the ablation shares: the embeddings (the extractor is frozen)."""

    cfg: ExperimentConfig
    extractor: nn.Module
    split: UnseenSplit
    chunk_frames: int
    support: Tensor  # [N, D] raw support chunk embeddings
    support_label: Tensor  # [N] speaker index
    query: Tensor  # [Q, D] query utterance embeddings (QUERY_EMBEDDING)
    query_label: Tensor  # [Q]
    public: PublicStore | None = None  # prepared with the data (runs with local speakers)

    def federated(self) -> FederatedSection:
        """The run's [federated] table, or its defaults for a centralised run."""
        return self.cfg.federated if self.cfg.federated is not None else FederatedSection()

    def closed_form(self) -> Tensor:
        """Enrollment prototypes [S, D] on the support chunks (as on a device)."""
        onehot = (self.support_label.unsqueeze(1) == torch.arange(len(self.split.speakers))).to(
            self.support.dtype
        )
        return enrollment_prototypes(self.support, onehot)


def load_inputs(run_path: Path, progress: bool = False) -> ReconEvalInputs:
    """A finished run's extractor and its test speakers' embeddings, split per speaker."""
    run = RunFolder.open(run_path)
    extractor, cfg = load_run_model(run)
    set_determinism(cfg.train.threads)
    data = prepare(cfg, progress=progress)
    f = cfg.federated or FederatedSection()
    utts = sorted(data.test_feats)
    emb, owner = chunk_embeddings(extractor, data.test_feats, utts, f.chunk_frames)
    split = split_unseen(
        utts, data.test_corpus.speaker_of, owner.numpy(), f.local_batch_size, cfg.seed
    )
    index = {u: i for i, u in enumerate(utts)}
    qry = [index[u] for us in split.query for u in us]
    qry_spk = np.concatenate([np.full(len(us), i) for i, us in enumerate(split.query)])
    sup_spk = np.concatenate([np.full(len(r), i) for i, r in enumerate(split.support_rows)])
    return ReconEvalInputs(
        cfg,
        extractor,
        split,
        f.chunk_frames,
        emb[torch.from_numpy(np.concatenate(split.support_rows))],
        torch.from_numpy(sup_spk),
        pooled(emb, owner, len(utts))[torch.tensor(qry, dtype=torch.long)],
        torch.from_numpy(qry_spk),
        data.public,
    )


def public_negatives(inputs: ReconEvalInputs, store: PublicStore) -> Tensor:
    """[P, D] public prototypes under the run's extractor (what the server broadcasts)."""
    task = SpeakerReconTask(
        inputs.extractor, scale=inputs.cfg.model.scale, margin=0.0, emb_dim=inputs.support.shape[1]
    )
    return public_prototypes(task, task.init_params(), store)


def recon_eval_speakers(
    run_path: Path,
    steps: Sequence[int] = (0, 1, 5),
    lr: float | None = None,
    progress: bool = False,
) -> dict:
    """RECONEVAL of a finished run on its held-out test speakers, one row per k in `steps`.

    Per speaker: prototype = closed form on the support utterances' chunks, then k SGD epochs
    (lr = `lr` or reconstruction.lr, batches of local_batch_size, margin = model.margin, the
    device's at the end of training) against the public negatives; the extractor is frozen.
    Scores every (query utterance, prototype) pair by cosine. Writes reconeval.json (this
    result) and appends a section to reconeval.md in the run folder; returns the result.
    """
    steps = list(dict.fromkeys(int(k) for k in steps))
    if not steps or min(steps) < 0:
        raise ConfigError("steps", f"need reconstruction epochs >= 0, got {steps}", "e.g. 0 1 5")
    t0 = time.perf_counter()
    inputs = load_inputs(Path(run_path), progress=progress)
    f = inputs.federated()
    rate = f.reconstruction.lr if lr is None else float(lr)
    if not rate > 0:
        raise ConfigError("lr", f"must be > 0, got {rate}", "use e.g. 0.1")
    rows, n_public = _rows(inputs, steps, rate)
    result = {
        "run": str(run_path),
        "speakers_mode": inputs.cfg.federated.speakers if inputs.cfg.federated else "centralised",
        "query_embedding": QUERY_EMBEDDING,
        "split": "by utterance: fl.local's groups split, half of each speaker's recordings "
        "support (drawn from (seed, speaker)), the rest query",
        "lr": rate,
        "batch_size": f.local_batch_size,
        "margin": inputs.cfg.model.margin,
        "scale": inputs.cfg.model.scale,
        "chunk_frames": inputs.chunk_frames,
        "public_speakers": n_public,
        "n_speakers": len(inputs.split.speakers),
        "n_support_utts": sum(len(u) for u in inputs.split.support),
        "n_query_utts": sum(len(u) for u in inputs.split.query),
        "n_support_chunks": len(inputs.support),
        "seconds": round(time.perf_counter() - t0, 2),
        "results": rows,
    }
    folder = Path(run_path)
    atomic_write_text(folder / JSON_FILE, json.dumps(result, indent=2) + "\n")
    md = folder / MD_FILE
    old = md.read_text() if md.is_file() else "# RECONEVAL on unseen speakers\n"
    atomic_write_text(md, old.rstrip("\n") + "\n\n" + markdown_table(result))
    return result


def _rows(inputs: ReconEvalInputs, steps: Sequence[int], rate: float) -> tuple[list[dict], int]:
    """One result row per k in `steps` (scores, and the support loss with negatives) and the
    number of public negatives used (0 when every k is the closed form)."""
    f = inputs.federated()
    base = inputs.closed_form()
    negatives = None
    n_public = 0
    if max(steps) > 0:
        store = inputs.public if inputs.public is not None else public_store(inputs.cfg)
        negatives = public_negatives(inputs, store)
        n_public = store.n_speakers
    rows = []
    for k in steps:
        protos = base
        if k > 0:
            assert negatives is not None
            protos = refine_prototypes(
                base,
                inputs.support,
                inputs.support_label,
                negatives,
                k,
                rate,
                f.local_batch_size,
                inputs.cfg.model.scale,
                inputs.cfg.model.margin,
            )
        row = {"steps": k, **score_prototypes(protos, inputs.query, inputs.query_label)}
        if negatives is not None:
            loss = support_loss(
                protos,
                inputs.support,
                inputs.support_label,
                negatives,
                inputs.cfg.model.scale,
                inputs.cfg.model.margin,
            )
            row["support_loss"] = float(loss.mean())
        rows.append(row)
    return rows, n_public


def markdown_table(result: Mapping) -> str:
    """One section: the settings line and a row per k (EER, minDCF, spread, pairs)."""
    lines = [
        f"## steps {', '.join(str(r['steps']) for r in result['results'])}, "
        f"lr {result['lr']:g}, {result['public_speakers']} public negatives",
        "",
        f"{result['n_speakers']} unseen speakers, {result['n_support_utts']} support / "
        f"{result['n_query_utts']} query utterances, {result['chunk_frames']}-frame chunks, "
        f"query = {result['query_embedding']}, margin {result['margin']:g}, "
        f"batch {result['batch_size']}.",
        "",
        "| steps | EER | minDCF p=0.01 | spread | accuracy | support loss | target | nontarget |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["results"]:
        lines.append(
            f"| {r['steps']} | {100 * r['eer']:.2f}% | {r['min_dcf_01']:.3f} | "
            f"{r['spread']:.4f} | {r['accuracy']:.3f} | {_fmt(r.get('support_loss'))} | "
            f"{r['n_target']} | {r['n_nontarget']} |"
        )
    return "\n".join(lines) + "\n"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"
