"""Trial scoring back ends: cosine, adaptive S-norm (AS-norm) and PLDA.

Sits between embedding extraction and the metrics: (embeddings, trial list) -> one score per
trial, which `fedvox.eval.metrics` turns into EER/minDCF.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from fedvox.errors import ConfigError, DataError

if TYPE_CHECKING:
    from fedvox.eval.plda import PLDABackend

BACKENDS = ("cosine", "asnorm", "plda")
_EPS = 1e-12
# Rows of cohort scores computed at once in AS-norm: bounds memory to ~chunk x cohort floats.
_COHORT_CHUNK = 2048


def length_normalize(x: np.ndarray) -> np.ndarray:
    """Scale each row (or a single vector) to unit L2 norm; an all-zero row stays zero."""
    x = np.asarray(x, dtype=np.float64)
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.maximum(norm, _EPS)


def _centre(x: np.ndarray, mean: np.ndarray | None) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if mean is None:
        return x
    mean = np.asarray(mean, dtype=np.float64)
    if mean.shape != (x.shape[-1],):
        raise DataError(
            None,
            f"the mean vector has shape {mean.shape} but embeddings have dimension {x.shape[-1]}",
            "pass the training-set mean of embeddings from the same model",
        )
    return x - mean


def cosine_score(
    enroll: np.ndarray, test: np.ndarray, mean: np.ndarray | None = None
) -> np.ndarray:
    """Cosine similarity of each (enroll[i], test[i]) pair after subtracting `mean` -> [n].

    `mean` is the training-set mean embedding (WeSpeaker's "sub mean of vox2_dev"); centring
    removes the common offset that otherwise inflates every cosine.
    """
    e = np.atleast_2d(_centre(enroll, mean))
    t = np.atleast_2d(_centre(test, mean))
    if e.shape != t.shape:
        raise DataError(
            None,
            f"enroll and test arrays differ in shape: {e.shape} vs {t.shape}",
            "pass one enroll and one test embedding per trial",
        )
    return np.einsum("ij,ij->i", length_normalize(e), length_normalize(t))


def _top_n_stats(cohort_scores: np.ndarray, top_n: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean and (population) std of each row's `top_n` largest scores; all if fewer."""
    if top_n < 1:
        raise ConfigError("top_n", f"must be at least 1, got {top_n}", "use e.g. 300")
    s = np.asarray(cohort_scores, dtype=np.float64)
    n = min(top_n, s.shape[-1])
    if n < s.shape[-1]:
        # partition is O(C); only the set of the top n matters, not their order.
        s = np.partition(s, s.shape[-1] - n, axis=-1)[..., -n:]
    return s.mean(axis=-1), s.std(axis=-1)


def _snorm(raw, mu_e, sd_e, mu_t, sd_t) -> np.ndarray:
    return 0.5 * ((raw - mu_e) / np.maximum(sd_e, _EPS) + (raw - mu_t) / np.maximum(sd_t, _EPS))


def as_norm(
    raw: np.ndarray, enroll_cohort: np.ndarray, test_cohort: np.ndarray, top_n: int = 300
) -> np.ndarray:
    """Adaptive symmetric score normalisation (AS-norm, as in WeSpeaker).

    raw [n]: trial scores; enroll_cohort / test_cohort [n, C]: each trial side scored against
    the cohort. score' = 0.5*((s - mu_e)/sd_e + (s - mu_t)/sd_t), with mu/sd over the top-N
    cohort scores of each side (all C when top_n > C).
    """
    raw = np.asarray(raw, dtype=np.float64).ravel()
    enroll_cohort = np.atleast_2d(enroll_cohort)
    test_cohort = np.atleast_2d(test_cohort)
    if enroll_cohort.shape[0] != raw.size or test_cohort.shape[0] != raw.size:
        raise DataError(
            None,
            f"{raw.size} trial scores but cohort score rows {enroll_cohort.shape[0]} (enroll) "
            f"and {test_cohort.shape[0]} (test)",
            "pass one row of cohort scores per trial for each side",
        )
    mu_e, sd_e = _top_n_stats(enroll_cohort, top_n)
    mu_t, sd_t = _top_n_stats(test_cohort, top_n)
    return _snorm(raw, mu_e, sd_e, mu_t, sd_t)


def labelled_vectors(
    x: np.ndarray, labels: Sequence[str] | np.ndarray, what: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Check one label per row of a 2-D matrix; (x as float64, class index [N], counts [K])."""
    x = np.asarray(x, dtype=np.float64)
    lab = np.asarray(labels)
    if x.ndim != 2 or lab.shape != (x.shape[0],):
        raise DataError(
            None,
            f"{what} needs vectors [n, dim] and one label each, got {x.shape} and {lab.shape}",
            "pass a 2-D embedding matrix and a speaker label per row",
        )
    _, inverse, counts = np.unique(lab, return_inverse=True, return_counts=True)
    return x, inverse, counts


def cohort_from_training(
    embeddings: np.ndarray, speakers: Sequence[str] | np.ndarray
) -> np.ndarray:
    """Cohort for AS-norm: one mean embedding per training speaker -> [n_speakers, dim].

    Means are taken of the raw embeddings and not length-normalised here: `score_trials`
    subtracts the training mean from cohort rows exactly as from trial embeddings and then
    length-normalises (WeSpeaker's order); normalising first would put the cohort on a
    different scale from that mean. Rows are ordered by sorted speaker id (deterministic).
    """
    x, inverse, counts = labelled_vectors(embeddings, speakers, "the AS-norm cohort")
    sums = np.zeros((counts.size, x.shape[1]))
    np.add.at(sums, inverse, x)
    return sums / counts[:, None]


def _lookup(
    embeddings: dict[str, np.ndarray] | tuple[Sequence[str], np.ndarray], ids: Sequence[str]
) -> tuple[np.ndarray, np.ndarray]:
    """Unique embedding matrix for `ids` and, per id, its row -> (matrix [u, d], index [n])."""
    uniq, index = np.unique(np.asarray(ids, dtype=object).astype(str), return_inverse=True)
    if isinstance(embeddings, dict):
        missing = [k for k in uniq if k not in embeddings]
        if missing:
            raise DataError(
                None,
                f"{len(missing)} trial utterances have no embedding, e.g. {missing[:3]}",
                "extract embeddings for every utterance in the trial list",
            )
        mat = np.stack([np.asarray(embeddings[k], dtype=np.float64).ravel() for k in uniq])
    else:
        keys, matrix = embeddings
        matrix = np.asarray(matrix, dtype=np.float64)
        if matrix.ndim != 2 or len(keys) != matrix.shape[0]:
            raise DataError(
                None,
                f"{len(keys)} keys for an embedding matrix of shape {matrix.shape}",
                "pass (keys, matrix) with one key per row",
            )
        pos = {k: i for i, k in enumerate(keys)}
        if len(pos) != len(keys):
            raise DataError(None, "duplicate keys in the embedding list", "make keys unique")
        missing = [k for k in uniq if k not in pos]
        if missing:
            raise DataError(
                None,
                f"{len(missing)} trial utterances have no embedding, e.g. {missing[:3]}",
                "extract embeddings for every utterance in the trial list",
            )
        mat = matrix[[pos[k] for k in uniq]]
    if not np.isfinite(mat).all():
        raise DataError(
            None,
            "some embeddings contain NaN or inf",
            "re-extract them; a diverged model or an empty utterance gives non-finite vectors",
        )
    return mat, index


def _cohort_stats(
    unit: np.ndarray, cohort_unit: np.ndarray, top_n: int
) -> tuple[np.ndarray, np.ndarray]:
    """Top-N mean/std of each unit row against the unit cohort, chunked to bound memory."""
    mu = np.empty(unit.shape[0])
    sd = np.empty(unit.shape[0])
    for start in range(0, unit.shape[0], _COHORT_CHUNK):
        sl = slice(start, start + _COHORT_CHUNK)
        mu[sl], sd[sl] = _top_n_stats(unit[sl] @ cohort_unit.T, top_n)
    return mu, sd


def score_trials(
    embeddings: dict[str, np.ndarray] | tuple[Sequence[str], np.ndarray],
    enroll_ids: Sequence[str],
    test_ids: Sequence[str],
    backend: str = "cosine",
    mean: np.ndarray | None = None,
    plda: PLDABackend | None = None,
    cohort: np.ndarray | None = None,
    top_n: int = 300,
) -> np.ndarray:
    """Score each trial (enroll_ids[i], test_ids[i]) with one back end -> [n] scores.

    cosine: centred cosine (`mean` = training mean). asnorm: that cosine, AS-normalised against
    `cohort` (e.g. `cohort_from_training`; centred with the same `mean`). plda: the fitted
    `PLDABackend` (which does its own centring, so `mean` is not used).
    """
    if backend not in BACKENDS:
        raise ConfigError(
            "backend", f"unknown scoring back end {backend!r}", f"use one of {BACKENDS}"
        )
    if len(enroll_ids) != len(test_ids):
        raise DataError(
            None,
            f"{len(enroll_ids)} enroll ids but {len(test_ids)} test ids",
            "pass one enroll and one test id per trial",
        )
    if len(enroll_ids) == 0:
        return np.zeros(0)
    both, index = _lookup(embeddings, [*enroll_ids, *test_ids])
    ei, ti = index[: len(enroll_ids)], index[len(enroll_ids) :]
    if backend == "plda":
        if plda is None:
            raise ConfigError("plda", "backend 'plda' needs a fitted PLDA model", "pass plda=...")
        return plda.score(both[ei], both[ti])
    unit = length_normalize(_centre(both, mean))
    raw = np.einsum("ij,ij->i", unit[ei], unit[ti])
    if backend == "cosine":
        return raw
    if cohort is None or np.asarray(cohort).ndim != 2 or len(cohort) == 0:
        raise ConfigError(
            "cohort",
            "backend 'asnorm' needs a cohort matrix [n_cohort, dim]",
            "pass cohort=cohort_from_training(train_embeddings, train_speakers)",
        )
    cohort_unit = length_normalize(_centre(cohort, mean))
    if cohort_unit.shape[1] != unit.shape[1]:
        raise DataError(
            None,
            f"cohort dimension {cohort_unit.shape[1]} differs from embeddings' {unit.shape[1]}",
            "build the cohort from embeddings of the same model",
        )
    # Statistics per distinct utterance, not per trial: a VoxCeleb list reuses each utterance
    # in many trials, and [n_trials, C] cohort matrices would not fit in memory.
    mu, sd = _cohort_stats(unit, cohort_unit, top_n)
    return _snorm(raw, mu[ei], sd[ei], mu[ti], sd[ti])
