"""Speaker-verification metrics: EER, normalised minDCF and the DET curve.

Last step of the evaluation path: trial scores (from `fedvox.eval.scoring`) in, numbers out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from fedvox.errors import ConfigError, DataError


def _as_scores(x: np.ndarray, name: str) -> np.ndarray:
    """A 1-D float64 copy of `x`; empty or non-finite lists are a user error, not a NaN result."""
    a = np.asarray(x, dtype=np.float64).ravel()
    if a.size == 0:
        raise DataError(
            None,
            f"no {name} scores to evaluate",
            "the trial list needs at least one target and one non-target trial",
        )
    bad = ~np.isfinite(a)
    if bad.any():
        raise DataError(
            None,
            f"{int(bad.sum())} of {a.size} {name} scores are not finite (NaN or inf)",
            "check the embeddings behind these trials (a zero or NaN embedding gives NaN scores)",
        )
    return a


def det_curve(
    target_scores: np.ndarray, nontarget_scores: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Miss and false-alarm rates at every distinct threshold, ascending.

    A trial is accepted when its score >= threshold. The thresholds are the sorted distinct
    scores followed by +inf, so the curve runs from (P_miss=0, P_fa=1) to (P_miss=1, P_fa=0);
    tied scores form one operating point (no dependence on the order of ties).
    """
    tgt = np.sort(_as_scores(target_scores, "target"))
    non = np.sort(_as_scores(nontarget_scores, "non-target"))
    thresholds = np.append(np.unique(np.concatenate([tgt, non])), np.inf)
    p_miss = np.searchsorted(tgt, thresholds, side="left") / tgt.size
    p_fa = 1.0 - np.searchsorted(non, thresholds, side="left") / non.size
    return p_miss, p_fa, thresholds


def compute_eer(target_scores: np.ndarray, nontarget_scores: np.ndarray) -> tuple[float, float]:
    """Equal error rate (fraction in [0, 1]) and its threshold, ROC-interpolated.

    Convention of WeSpeaker and the VoxSRC scorer: find the first pair of neighbouring
    operating points where P_miss - P_fa changes sign and interpolate linearly between them.
    The threshold is interpolated the same way (it lies between two observed scores).
    """
    p_miss, p_fa, thr = det_curve(target_scores, nontarget_scores)
    diff = p_miss - p_fa  # -1 at the lowest threshold, +1 at +inf: a crossing always exists
    i2 = int(np.flatnonzero(diff >= 0)[0])
    if diff[i2] == 0.0:
        return float(p_miss[i2]), float(thr[i2] if np.isfinite(thr[i2]) else thr[i2 - 1])
    i1 = i2 - 1
    t = -diff[i1] / (diff[i2] - diff[i1])
    eer = p_miss[i1] + t * (p_miss[i2] - p_miss[i1])
    # The last point's threshold is +inf; the crossing never lands strictly inside that
    # segment (see det_curve), but stay finite regardless.
    hi = thr[i2] if np.isfinite(thr[i2]) else thr[i1]
    threshold = thr[i1] + t * (hi - thr[i1])
    return float(eer), float(threshold)


def compute_min_dcf(
    target_scores: np.ndarray,
    nontarget_scores: np.ndarray,
    p_target: float,
    c_miss: float = 1.0,
    c_fa: float = 1.0,
) -> tuple[float, float]:
    """Normalised minimum detection cost (Kaldi/NIST) and the threshold that attains it.

    min over thresholds of (c_miss*P_miss*p + c_fa*P_fa*(1-p)) / min(c_miss*p, c_fa*(1-p)).
    Normalised, so 1.0 is the cost of always accepting or always rejecting; SpeechBrain
    reports the unnormalised value, which is not comparable.
    """
    if not 0.0 < p_target < 1.0:
        raise ConfigError("p_target", f"must lie strictly between 0 and 1, got {p_target}", "")
    if c_miss <= 0 or c_fa <= 0:
        raise ConfigError("c_miss/c_fa", f"costs must be positive, got {c_miss}, {c_fa}", "")
    p_miss, p_fa, thr = det_curve(target_scores, nontarget_scores)
    dcf = c_miss * p_miss * p_target + c_fa * p_fa * (1.0 - p_target)
    c_def = min(c_miss * p_target, c_fa * (1.0 - p_target))
    i = int(np.argmin(dcf))
    return float(dcf[i] / c_def), float(thr[i])


def acceptance_rate(scores: np.ndarray, threshold: float) -> float:
    """Fraction of trials accepted at `threshold` (score >= threshold, det_curve's rule): a
    backdoor's success on its impostor-vs-target trials."""
    s = _as_scores(scores, "attack")
    if not np.isfinite(threshold):
        raise DataError(None, f"threshold {threshold} is not finite", "pass the EER threshold")
    return float(np.mean(s >= threshold))


@dataclass(frozen=True)
class VerificationMetrics:
    """The numbers a verification report carries for one trial list."""

    eer: float  # fraction, not percent
    eer_threshold: float
    min_dcf_01: float  # p_target = 0.01
    min_dcf_05: float  # p_target = 0.05
    n_target: int
    n_nontarget: int

    def to_dict(self) -> dict:
        """Plain JSON-ready dict (floats and ints)."""
        return asdict(self)


def evaluate_scores(scores: np.ndarray, labels: np.ndarray) -> VerificationMetrics:
    """EER and minDCF(0.01, 0.05) for trial `scores` with boolean target `labels`."""
    s = np.asarray(scores, dtype=np.float64).ravel()
    lab = np.asarray(labels).ravel()
    if s.shape != lab.shape:
        raise DataError(
            None,
            f"{s.size} scores but {lab.size} labels",
            "pass one boolean label (True = target trial) per score",
        )
    if lab.dtype != np.bool_:
        uniq = set(np.unique(lab).tolist())
        if not uniq <= {0, 1}:
            raise DataError(
                None,
                f"labels must be boolean (target/non-target), got values {sorted(uniq)[:5]}",
                "map 'target' -> True and 'nontarget' -> False",
            )
        lab = lab.astype(bool)
    n_t, n_n = int(lab.sum()), int((~lab).sum())
    if n_t == 0 or n_n == 0:
        kind = "target" if n_t == 0 else "non-target"
        raise DataError(
            None,
            f"the trial list has no {kind} trials ({n_t} target, {n_n} non-target)",
            "EER and minDCF need both kinds; check the trial file's labels",
        )
    tgt, non = _as_scores(s[lab], "target"), _as_scores(s[~lab], "non-target")
    eer, thr = compute_eer(tgt, non)
    return VerificationMetrics(
        eer=eer,
        eer_threshold=thr,
        min_dcf_01=compute_min_dcf(tgt, non, 0.01)[0],
        min_dcf_05=compute_min_dcf(tgt, non, 0.05)[0],
        n_target=n_t,
        n_nontarget=n_n,
    )
