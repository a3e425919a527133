"""Evaluation of a run: embeddings of trial utterances, back ends, metrics and artefacts.

Takes an extractor and prepared features; returns metrics per back end (cosine, AS-norm,
PLDA) and the fitted back-end state that `fedvox eval` and `fedvox verify` reuse.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from torch import nn

from fedvox.atomic import atomic_write
from fedvox.data.trials import TrialList
from fedvox.eval.extract import embed_utterances, stats_embeddings
from fedvox.eval.metrics import VerificationMetrics, compute_eer, evaluate_scores
from fedvox.eval.plda import PLDABackend
from fedvox.eval.scoring import cohort_from_training, score_trials
from fedvox.experiment.config import EvalSection, ExperimentConfig
from fedvox.experiment.prepare import PreparedData
from fedvox.progress import task_progress


def train_subset(utts: list[str], speakers: list[str], max_utts: int) -> list[int]:
    """Indices of at most `max_utts` training utterances, spread evenly over speakers.

    Round-robin over speakers (each speaker's utterances in sorted order) so the mean, the
    AS-norm cohort and PLDA see every speaker; deterministic, no randomness needed.
    """
    by_spk: dict[str, list[int]] = {}
    for i, s in enumerate(speakers):
        by_spk.setdefault(s, []).append(i)
    queues = [sorted(v, key=lambda i: utts[i]) for _, v in sorted(by_spk.items())]
    out: list[int] = []
    depth = 0
    while len(out) < max_utts and any(depth < len(q) for q in queues):
        for q in queues:
            if depth < len(q) and len(out) < max_utts:
                out.append(q[depth])
        depth += 1
    return sorted(out)


@dataclass
class Backend:
    """Fitted scoring state: training mean, AS-norm cohort, PLDA (any may be absent)."""

    mean: np.ndarray
    cohort: np.ndarray | None = None
    plda: PLDABackend | None = None

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        arrays = {"mean": self.mean}
        if self.cohort is not None:
            arrays["cohort"] = self.cohort
        atomic_write(folder / "backend.npz", lambda f: np.savez(f, **arrays))
        if self.plda is not None:
            self.plda.save(folder / "plda.npz")

    @classmethod
    def load(cls, folder: Path) -> Backend:
        with np.load(folder / "backend.npz") as z:
            mean = z["mean"]
            cohort = z["cohort"] if "cohort" in z else None
        plda_path = folder / "plda.npz"
        plda = PLDABackend.load(plda_path) if plda_path.exists() else None
        return cls(mean, cohort, plda)


def fit_backend(
    train_emb: np.ndarray, train_spk: list[str], section: EvalSection, backends=None
) -> Backend:
    """Training mean always; the cohort for AS-norm and PLDA only when those back ends run."""
    backends = section.backends if backends is None else backends
    mean = train_emb.mean(axis=0)
    # raw embeddings: score_trials subtracts `mean` from cohort rows itself (WeSpeaker order)
    cohort = cohort_from_training(train_emb, train_spk) if "asnorm" in backends else None
    plda = None
    if "plda" in backends and len(set(train_spk)) > 2:
        plda = PLDABackend(lda_dim=section.lda_dim).fit(train_emb, np.asarray(train_spk))
    return Backend(mean, cohort, plda)


@dataclass
class EvalResult:
    """Metrics and raw scores per back end for one trial list."""

    metrics: dict[str, VerificationMetrics]
    scores: dict[str, np.ndarray]
    labels: np.ndarray
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        return {name: m.to_dict() for name, m in self.metrics.items()}


def score_with_backend(
    embeddings: dict[str, np.ndarray],
    trials: TrialList,
    backend: Backend,
    backends: tuple[str, ...],
    top_n: int,
) -> EvalResult:
    """Score every trial with each requested back end and compute EER/minDCF."""
    enroll = [t.enroll for t in trials.trials]
    test = [t.test for t in trials.trials]
    labels = trials.labels()
    metrics, scores = {}, {}
    for name in backends:
        if name == "plda" and backend.plda is None:
            continue
        if name == "asnorm" and backend.cohort is None:
            continue
        s = score_trials(
            embeddings,
            enroll,
            test,
            backend=name,
            mean=backend.mean,
            plda=backend.plda,
            cohort=backend.cohort,
            top_n=top_n,
        )
        scores[name] = s
        metrics[name] = evaluate_scores(s, labels)
    return EvalResult(metrics, scores, labels)


def embed_dict(
    extractor: nn.Module, feats: dict[str, np.ndarray], utts: list[str], label: str, progress: bool
) -> dict[str, np.ndarray]:
    with task_progress(label, len(utts), enabled=progress) as tick:
        emb = embed_utterances(extractor, [feats[u] for u in utts], progress=tick)
    return dict(zip(utts, emb, strict=True))


def evaluate_extractor(
    extractor: nn.Module,
    train_feats: dict[str, np.ndarray],
    train_speaker_of,
    test_feats: dict[str, np.ndarray],
    trials: TrialList,
    section: EvalSection,
    backends: tuple[str, ...] | None = None,
    progress: bool = True,
) -> tuple[EvalResult, Backend]:
    """Embed a training subset (for the back end) and the trial utterances, then score."""
    backends = section.backends if backends is None else backends
    utts = sorted(train_feats)
    spks = [train_speaker_of(u) for u in utts]
    idx = train_subset(utts, spks, section.max_train_utts)
    sub = [utts[i] for i in idx]
    train_emb = embed_dict(extractor, train_feats, sub, "embed train", progress)
    backend = fit_backend(
        np.stack([train_emb[u] for u in sub]), [spks[i] for i in idx], section, backends
    )
    test_emb = embed_dict(extractor, test_feats, trials.utt_ids(), "embed test", progress)
    result = score_with_backend(test_emb, trials, backend, backends, section.asnorm_top_n)
    return result, backend


def evaluate_baseline(
    train_feats: dict[str, np.ndarray],
    test_feats: dict[str, np.ndarray],
    trials: TrialList,
    max_train_utts: int = 4000,
) -> VerificationMetrics:
    """The non-learned baseline: mean+std of filterbanks per utterance, cosine with the
    training mean subtracted."""
    utts = sorted(train_feats)[:: max(1, len(train_feats) // max_train_utts)]
    mean = stats_embeddings([train_feats[u] for u in utts]).mean(axis=0)
    test_utts = trials.utt_ids()
    emb = dict(zip(test_utts, stats_embeddings([test_feats[u] for u in test_utts]), strict=True))
    s = score_trials(
        emb, [t.enroll for t in trials.trials], [t.test for t in trials.trials], "cosine", mean=mean
    )
    return evaluate_scores(s, trials.labels())


def eer_threshold(result: EvalResult, backend: str = "cosine") -> float:
    """The score threshold at the EER point of a back end (the default verify threshold)."""
    s, y = result.scores[backend], result.labels
    return float(compute_eer(s[y], s[~y])[1])


def quick_eval(extractor: nn.Module, cfg: ExperimentConfig, data: PreparedData) -> dict:
    """Held-out cosine metrics with at most 500 training utterances for the mean: cheap
    enough to run during training (centralised and federated alike)."""
    section = cfg.eval.model_copy(update={"max_train_utts": min(500, cfg.eval.max_train_utts)})
    res, _ = evaluate_extractor(
        extractor,
        data.train_feats,
        data.train_corpus.speaker_of,
        data.test_feats,
        data.trials,
        section,
        backends=("cosine",),
        progress=False,
    )
    return res.metrics["cosine"].to_dict()
