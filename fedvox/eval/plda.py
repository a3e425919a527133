"""Kaldi-style PLDA back end: mean subtraction, LDA, length normalisation, two-covariance PLDA.

Fitted on training-speaker embeddings, then used by `fedvox.eval.scoring.score_trials`
(backend="plda") to turn (enroll, test) embedding pairs into log-likelihood ratios.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from scipy import linalg

from fedvox.atomic import atomic_write
from fedvox.errors import DataError
from fedvox.eval.scoring import labelled_vectors

_FORMAT_VERSION = 1
_LOG_2PI = float(np.log(2.0 * np.pi))


def _class_stats(
    x: np.ndarray, labels: Any, what: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate (x, labels) and return (x as float64 [N, d], class index [N], counts [K])."""
    x, inverse, counts = labelled_vectors(x, labels, what)
    if not np.isfinite(x).all():
        raise DataError(None, f"{what} training vectors contain NaN or inf", "re-extract them")
    if counts.size < 2:
        raise DataError(
            None, f"{what} needs at least 2 speakers, got {counts.size}", "train on more speakers"
        )
    if np.all(counts < 2):
        raise DataError(
            None,
            f"{what} needs some speakers with 2 or more vectors to estimate within-speaker "
            "variability; every speaker has one",
            "train on several utterances per speaker",
        )
    return x, inverse.ravel(), counts


def _class_means(x: np.ndarray, inverse: np.ndarray, counts: np.ndarray) -> np.ndarray:
    sums = np.zeros((counts.size, x.shape[1]))
    np.add.at(sums, inverse, x)
    return sums / counts[:, None]


def _sym(m: np.ndarray) -> np.ndarray:
    return 0.5 * (m + m.T)


class LDA:
    """Linear discriminant analysis: projects onto the `dim` most speaker-discriminative axes.

    The projection whitens the within-class covariance (it becomes I) and diagonalises the
    between-class one, as Kaldi's ivector-compute-lda does.
    """

    def __init__(self) -> None:
        self.mean: np.ndarray | None = None
        self.matrix: np.ndarray | None = None  # [d_in, dim]; y = (x - mean) @ matrix
        self.eigenvalues: np.ndarray | None = None  # between/within ratio per kept axis

    def fit(self, x: np.ndarray, labels: Any, dim: int) -> LDA:
        """Estimate the projection from vectors `x` [N, d] with class `labels`."""
        x, inverse, counts = _class_stats(x, labels, "LDA")
        if not 1 <= dim <= min(x.shape[1], counts.size - 1):
            raise DataError(
                None,
                f"LDA dimension {dim} must be between 1 and min(input dim {x.shape[1]}, "
                f"speakers - 1 = {counts.size - 1})",
                "lower the LDA dimension (PLDABackend clips it for you)",
            )
        self.mean = x.mean(axis=0)
        xc = x - self.mean
        means = _class_means(xc, inverse, counts)
        n = x.shape[0]
        within = (xc.T @ xc - (means * counts[:, None]).T @ means) / n
        between = (means * counts[:, None]).T @ means / n
        # A small ridge keeps the generalised eigenproblem defined when dim > N - K.
        ridge = 1e-6 * np.trace(within) / within.shape[0] + 1e-12
        vals, vecs = linalg.eigh(_sym(between), _sym(within) + ridge * np.eye(within.shape[0]))
        order = np.argsort(vals)[::-1][:dim]
        self.matrix, self.eigenvalues = vecs[:, order], vals[order]
        return self

    def transform(self, x: np.ndarray) -> np.ndarray:
        """Project `x` [n, d_in] (or one vector) -> [n, dim]."""
        if self.matrix is None or self.mean is None:
            raise RuntimeError("LDA.transform called before fit")
        return (np.asarray(x, dtype=np.float64) - self.mean) @ self.matrix


class TwoCovPLDA:
    """Two-covariance PLDA: x = mean + y + e, y ~ N(0, between), e ~ N(0, within).

    Trained by EM (Kaldi ivector-plda, Brümmer's two-covariance recipe) from a closed-form
    start (class-scatter moments). The mean is the global mean and stays fixed, as in Kaldi.
    Internally both covariances are diagonalised at once: A within A^T = I,
    A between A^T = diag(psi), which makes the E-step and scoring per-dimension.
    """

    def __init__(self) -> None:
        self.mean: np.ndarray | None = None
        self.between: np.ndarray | None = None  # Sb
        self.within: np.ndarray | None = None  # Sw
        self.log_likelihoods: list[float] = []  # training-data log-likelihood: init, each EM step
        self._transform: np.ndarray | None = None  # A
        self._psi: np.ndarray | None = None

    # --- model algebra ---------------------------------------------------------------------
    def _set(self, mean: np.ndarray, between: np.ndarray, within: np.ndarray) -> None:
        self.mean, self.between, self.within = mean, _sym(between), _sym(within)
        self._transform, self._psi = self._diagonalise(self.between, self.within)

    @staticmethod
    def _diagonalise(between: np.ndarray, within: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A and psi with A within A^T = I, A between A^T = diag(psi), psi descending >= 0."""
        chol = linalg.cholesky(within, lower=True)
        chol_inv = linalg.solve_triangular(chol, np.eye(within.shape[0]), lower=True)
        psi, vecs = linalg.eigh(_sym(chol_inv @ between @ chol_inv.T))
        order = np.argsort(psi)[::-1]
        return vecs[:, order].T @ chol_inv, np.maximum(psi[order], 0.0)

    def _loglik(self, means_t: np.ndarray, counts: np.ndarray, within_ss: float, n: int) -> float:
        """Log-likelihood of the training data given class means and scatter, in A-space.

        Per dimension a class of n_i points factorises into its within-class deviations
        (unit variance) and its mean ~ N(0, psi + 1/n_i); log|det A| is the Jacobian.
        """
        assert self._transform is not None and self._psi is not None
        d = self._psi.size
        var = self._psi[None, :] + 1.0 / counts[:, None]
        mean_term = -0.5 * (np.log(var) + _LOG_2PI + means_t**2 / var).sum()
        rest = (
            -0.5 * n * d * _LOG_2PI - 0.5 * within_ss + 0.5 * d * np.sum(_LOG_2PI - np.log(counts))
        )
        logdet = np.linalg.slogdet(self._transform)[1]
        return float(n * logdet + rest + mean_term)

    def log_likelihood(self, x: np.ndarray, labels: Any) -> float:
        """Log-likelihood of vectors `x` grouped by `labels` under the fitted model."""
        if self._transform is None or self.mean is None:
            raise RuntimeError("TwoCovPLDA.log_likelihood called before fit")
        x = np.asarray(x, dtype=np.float64)
        _, inverse, counts = np.unique(np.asarray(labels), return_inverse=True, return_counts=True)
        u = (x - self.mean) @ self._transform.T
        means = _class_means(u, inverse.ravel(), counts)
        within_ss = float(((u - means[inverse.ravel()]) ** 2).sum())
        return self._loglik(means, counts.astype(np.float64), within_ss, x.shape[0])

    # --- training --------------------------------------------------------------------------
    def fit(self, x: np.ndarray, labels: Any, n_iter: int = 10) -> TwoCovPLDA:
        """Fit mean, between and within covariances to vectors `x` [N, d] with `labels`."""
        x, inverse, counts = _class_stats(x, labels, "PLDA")
        n, d = x.shape
        k = counts.size
        mean = x.mean(axis=0)
        xc = x - mean
        means = _class_means(xc, inverse, counts)
        nc = counts.astype(np.float64)
        scatter = _sym(xc.T @ xc - (means * nc[:, None]).T @ means)  # around class means
        floor = 1e-6 * np.trace(scatter) / (n * d) + 1e-12

        # Closed-form start: unbiased within-class covariance; between = covariance of class
        # means minus the part of it that within-class noise explains (E[Sw / n_i]).
        within = scatter / max(n - k, 1) + floor * np.eye(d)
        between = means.T @ means / k - within * np.mean(1.0 / nc)
        vals, vecs = linalg.eigh(_sym(between))
        between = (vecs * np.maximum(vals, floor)) @ vecs.T
        self._set(mean, between, within)

        def loglik() -> float:
            assert self._transform is not None
            within_ss = float(np.trace(self._transform @ scatter @ self._transform.T))
            return self._loglik(means @ self._transform.T, nc, within_ss, n)

        self.log_likelihoods = [loglik()]
        for _ in range(n_iter):
            a, psi = self._transform, self._psi
            assert a is not None and psi is not None
            z = means @ a.T  # class means in A-space, [K, d]
            post_var = psi[None, :] / (1.0 + nc[:, None] * psi[None, :])  # [K, d]
            post_mean = post_var * nc[:, None] * z
            b_t = (post_mean.T @ post_mean + np.diag(post_var.sum(axis=0))) / k
            r = z - post_mean
            w_t = (
                a @ scatter @ a.T
                + (r * nc[:, None]).T @ r
                + np.diag((nc[:, None] * post_var).sum(0))
            ) / n
            a_inv = linalg.inv(a)
            self._set(mean, a_inv @ b_t @ a_inv.T, a_inv @ w_t @ a_inv.T + floor * np.eye(d))
            self.log_likelihoods.append(loglik())
        return self

    # --- scoring ---------------------------------------------------------------------------
    def score(self, enroll: np.ndarray, test: np.ndarray) -> np.ndarray:
        """Log-likelihood ratio, same speaker vs different, for each (enroll[i], test[i]) pair.

        With one enrollment vector u and test v in A-space, per dimension:
        log N(v; psi/(psi+1) u, 1 + psi/(psi+1)) - log N(v; 0, 1 + psi)  (Kaldi's form, n=1).
        """
        if self._transform is None or self._psi is None or self.mean is None:
            raise RuntimeError("TwoCovPLDA.score called before fit")
        u = (np.atleast_2d(np.asarray(enroll, dtype=np.float64)) - self.mean) @ self._transform.T
        v = (np.atleast_2d(np.asarray(test, dtype=np.float64)) - self.mean) @ self._transform.T
        if u.shape != v.shape:
            raise DataError(
                None,
                f"enroll and test arrays differ in shape: {u.shape} vs {v.shape}",
                "pass one enroll and one test vector per trial",
            )
        psi = self._psi
        gain = psi / (psi + 1.0)
        var_same = 1.0 + gain
        var_diff = 1.0 + psi
        same = -0.5 * (np.log(var_same) + (v - gain * u) ** 2 / var_same)
        diff = -0.5 * (np.log(var_diff) + v**2 / var_diff)
        return (same - diff).sum(axis=1)


class PLDABackend:
    """The full Kaldi PLDA recipe as one fitted object: centre, LDA, length-norm, PLDA."""

    def __init__(self, lda_dim: int = 200) -> None:
        if lda_dim < 1:
            raise ValueError(f"lda_dim must be at least 1, got {lda_dim}")
        self.lda_dim = lda_dim
        self.lda_dim_used: int | None = None
        self.notes: list[str] = []
        self.mean: np.ndarray | None = None
        self.lda = LDA()
        self.plda = TwoCovPLDA()

    def _prepare(self, x: np.ndarray) -> np.ndarray:
        """Centre, project, and scale each vector to norm sqrt(dim) (Kaldi's length norm)."""
        if self.mean is None:
            raise RuntimeError("PLDABackend used before fit or load")
        y = self.lda.transform(np.atleast_2d(np.asarray(x, dtype=np.float64)) - self.mean)
        norm = np.maximum(np.linalg.norm(y, axis=1, keepdims=True), 1e-12)
        return y * (np.sqrt(y.shape[1]) / norm)

    def fit(self, x: np.ndarray, labels: Any, n_iter: int = 10) -> PLDABackend:
        """Fit every stage on training embeddings `x` [N, d] with speaker `labels`."""
        x, _, counts = _class_stats(x, labels, "PLDA back end")
        dim = min(self.lda_dim, x.shape[1], counts.size - 1)
        self.notes = []
        if dim != self.lda_dim:
            note = (
                f"LDA dimension {self.lda_dim} clipped to {dim} = min(embedding dim "
                f"{x.shape[1]}, speakers - 1 = {counts.size - 1})"
            )
            self.notes.append(note)
            warnings.warn(note, stacklevel=2)
        self.lda_dim_used = dim
        self.mean = x.mean(axis=0)
        self.lda = LDA().fit(x - self.mean, labels, dim)
        self.plda = TwoCovPLDA().fit(self._prepare(x), labels, n_iter=n_iter)
        return self

    def score(self, enroll: np.ndarray, test: np.ndarray) -> np.ndarray:
        """PLDA log-likelihood ratio for each (enroll[i], test[i]) embedding pair."""
        return self.plda.score(self._prepare(enroll), self._prepare(test))

    def save(self, path: Path) -> None:
        """Write every fitted array to an .npz file atomically (temp file + rename)."""
        if self.mean is None or self.lda.matrix is None or self.plda.mean is None:
            raise RuntimeError("PLDABackend.save called before fit")
        arrays = {
            "format_version": np.array(_FORMAT_VERSION),
            "lda_dim": np.array(self.lda_dim),
            "mean": self.mean,
            "lda_mean": self.lda.mean,
            "lda_matrix": self.lda.matrix,
            "plda_mean": self.plda.mean,
            "plda_between": self.plda.between,
            "plda_within": self.plda.within,
        }
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        atomic_write(Path(path), lambda f: f.write(buf.getvalue()))

    @classmethod
    def load(cls, path: Path) -> PLDABackend:
        """Read a back end written by `save`; a missing or foreign file is a DataError."""
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                data = {k: z[k] for k in z.files}
        except FileNotFoundError:
            raise DataError(
                path, "PLDA model file not found", "fit and save the back end first"
            ) from None
        except (OSError, ValueError) as exc:
            raise DataError(
                path, f"not a readable PLDA model file ({exc})", "refit and save it"
            ) from None
        needed = {"format_version", "lda_dim", "mean", "lda_mean", "lda_matrix"} | {
            f"plda_{k}" for k in ("mean", "between", "within")
        }
        if not needed <= data.keys() or int(data["format_version"]) != _FORMAT_VERSION:
            raise DataError(
                path,
                f"not a fedvox PLDA model (version {_FORMAT_VERSION}) file",
                "refit the back end with this fedvox version and save it",
            )
        obj = cls(int(data["lda_dim"]))
        obj.mean = data["mean"]
        obj.lda.mean, obj.lda.matrix = data["lda_mean"], data["lda_matrix"]
        obj.lda_dim_used = int(obj.lda.matrix.shape[1])
        obj.plda._set(data["plda_mean"], data["plda_between"], data["plda_within"])
        return obj
