"""Scoring back ends fitted on training embeddings, and evaluation of an extractor with them.

After embedding extraction: a training subset fits the mean, AS-norm cohort and PLDA; trial
scores per back end become EER/minDCF. The fitted `Backend` is saved for `fedvox eval`/`verify`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from torch import nn

from fedvox.atomic import atomic_write
from fedvox.data.trials import TrialList
from fedvox.eval.extract import embed_dict, stats_embeddings
from fedvox.eval.metrics import VerificationMetrics, compute_eer, evaluate_scores
from fedvox.eval.plda import PLDABackend
from fedvox.eval.scoring import cohort_from_training, score_trials


def train_subset(utts: list[str], speakers: list[str], max_utts: int) -> list[int]:
    """Indices of at most `max_utts` training utterances, spread evenly over speakers.

    Round-robin over speakers (each speaker's utterances in sorted order) so the mean, the
    AS-norm cohort and PLDA see every speaker; deterministic, no randomness needed. With at
    least max_utts speakers (every one would give one utterance, and PLDA cannot estimate
    within-speaker variability from those), an evenly spaced max_utts / 2 of them (in sorted
    order), two utterances each where they have them.
    """
    by_spk: dict[str, list[int]] = {}
    for i, s in enumerate(speakers):
        by_spk.setdefault(s, []).append(i)
    queues = [sorted(v, key=lambda i: utts[i]) for _, v in sorted(by_spk.items())]
    keep = max(1, max_utts // 2)
    if len(queues) >= max_utts > 1:
        queues = [queues[i] for i in np.linspace(0, len(queues) - 1, keep).round().astype(int)]
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
        """Write backend.npz (and plda.npz when PLDA was fitted) into `folder`."""
        folder.mkdir(parents=True, exist_ok=True)
        arrays = {"mean": self.mean}
        if self.cohort is not None:
            arrays["cohort"] = self.cohort
        atomic_write(folder / "backend.npz", lambda f: np.savez(f, **arrays))
        if self.plda is not None:
            self.plda.save(folder / "plda.npz")

    @classmethod
    def load(cls, folder: Path) -> Backend:
        """The back end `save` wrote into `folder`."""
        with np.load(folder / "backend.npz") as z:
            mean = z["mean"]
            cohort = z["cohort"] if "cohort" in z else None
        plda_path = folder / "plda.npz"
        plda = PLDABackend.load(plda_path) if plda_path.exists() else None
        return cls(mean, cohort, plda)


@dataclass(frozen=True)
class BackendConfig:
    """Which back ends to fit and score, and their settings (a run's [eval] table)."""

    backends: tuple[str, ...]
    asnorm_top_n: int
    lda_dim: int
    max_train_utts: int


def fit_backend(train_emb: np.ndarray, train_spk: list[str], cfg: BackendConfig) -> Backend:
    """Training mean always; the cohort for AS-norm and PLDA only when those back ends run."""
    mean = train_emb.mean(axis=0)
    # raw embeddings: score_trials subtracts `mean` from cohort rows itself (WeSpeaker order)
    cohort = cohort_from_training(train_emb, train_spk) if "asnorm" in cfg.backends else None
    plda = None
    if "plda" in cfg.backends and len(set(train_spk)) > 2:
        plda = PLDABackend(lda_dim=cfg.lda_dim).fit(train_emb, np.asarray(train_spk))
    return Backend(mean, cohort, plda)


@dataclass
class EvalResult:
    """Metrics and raw scores per back end for one trial list."""

    metrics: dict[str, VerificationMetrics]
    scores: dict[str, np.ndarray]
    labels: np.ndarray
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        """Metrics per back end as plain dicts (what metrics.json holds)."""
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


def speaker_offset(embeddings: dict[str, np.ndarray], speaker_of: Callable[[str], str]) -> float:
    """Mean cosine between different speakers' un-centred prototypes (normalised mean of
    normalised embeddings): ~0 when speakers spread around the origin, → 1 when a common
    offset dominates every embedding (docs/federated.md, "A common offset")."""
    utts = sorted(embeddings)
    speakers = sorted({speaker_of(u) for u in utts})
    if len(speakers) < 2:
        return float("nan")
    index = {s: i for i, s in enumerate(speakers)}
    e = np.stack([embeddings[u] for u in utts]).astype(np.float64)
    e /= np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-12)
    protos = np.zeros((len(speakers), e.shape[1]))
    np.add.at(protos, [index[speaker_of(u)] for u in utts], e)
    protos /= np.maximum(np.linalg.norm(protos, axis=1, keepdims=True), 1e-12)
    cos = protos @ protos.T
    n = len(speakers)
    return float((cos.sum() - np.trace(cos)) / (n * (n - 1)))


def evaluate_extractor(
    extractor: nn.Module,
    train_feats: dict[str, np.ndarray],
    train_speaker_of: Callable[[str], str],
    test_feats: dict[str, np.ndarray],
    trials: TrialList,
    cfg: BackendConfig,
    progress: bool = True,
    test_speaker_of: Callable[[str], str] | None = None,
) -> tuple[EvalResult, Backend]:
    """Embed a training subset (for the back end) and the trial utterances, then score;
    with `test_speaker_of`, extra["offset"] is the test speakers' speaker_offset."""
    utts = sorted(train_feats)
    spks = [train_speaker_of(u) for u in utts]
    idx = train_subset(utts, spks, cfg.max_train_utts)
    sub = [utts[i] for i in idx]
    train_emb = embed_dict(extractor, train_feats, sub, "embed train", progress)
    backend = fit_backend(np.stack([train_emb[u] for u in sub]), [spks[i] for i in idx], cfg)
    test_emb = embed_dict(extractor, test_feats, trials.utt_ids(), "embed test", progress)
    result = score_with_backend(test_emb, trials, backend, cfg.backends, cfg.asnorm_top_n)
    if test_speaker_of is not None:
        result.extra["offset"] = speaker_offset(test_emb, test_speaker_of)
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
