"""Robust aggregation: per-update norm bounding, and rules over a whole step's updates.

Stages of the aggregation pipeline (fl/aggregation.py): `NormBound` is a per-client SumStage;
`RobustCombiner` takes the summer's place, buffers the step's deltas and combines them at its
end (coordinate-wise median, trimmed mean, (multi-)Krum) into (aggregate × Σw, Σw, count).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from fedvox.errors import ConfigError
from fedvox.privacy.dp import clip_deltas
from fedvox.types import Params

RULES = ("median", "trimmed_mean", "krum")


def coordinate_median(deltas: Params) -> Params:
    """Per-coordinate median over the client axis; an even count averages the middle two."""
    out = {}
    for n, d in deltas.items():
        k = d.shape[0]
        s = torch.sort(d, dim=0, stable=True).values
        out[n] = s[k // 2] if k % 2 else (s[k // 2 - 1] + s[k // 2]) / 2
    return out


def trimmed_mean(deltas: Params, trim: float) -> Params:
    """Per coordinate: drop the ⌊trim·n⌋ smallest and largest values, average the rest."""
    out = {}
    for n, d in deltas.items():
        k = d.shape[0]
        cut = math.floor(trim * k)
        s = torch.sort(d, dim=0, stable=True).values
        out[n] = s[cut : k - cut].mean(0)
    return out


def pairwise_sq_distances(deltas: Params) -> Tensor:
    """‖Δ_i − Δ_j‖² over all parameters jointly, in float64 (a Gram matrix: O(n²·d))."""
    n = next(iter(deltas.values())).shape[0]
    gram = torch.zeros(n, n, dtype=torch.float64)
    for d in deltas.values():
        x = d.reshape(n, -1).to(torch.float64)
        gram += x @ x.T
    sq = gram.diagonal()
    return (sq[:, None] + sq[None, :] - 2 * gram).clamp_min(0.0)


def krum_scores(deltas: Params, byzantine: int) -> Tensor:
    """Krum's score of each update: the sum of its squared distances to its n − f − 2
    nearest other updates (Blanchard et al. 2017); needs n > 2f + 2."""
    d2 = pairwise_sq_distances(deltas)
    n = d2.shape[0]
    if n <= 2 * byzantine + 2:
        raise ValueError(f"Krum needs n > 2f + 2 updates, got n={n}, f={byzantine}")
    d2.fill_diagonal_(math.inf)
    return torch.sort(d2, dim=1).values[:, : n - byzantine - 2].sum(1)


def krum(deltas: Params, byzantine: int, average: int = 1) -> tuple[Params, Tensor]:
    """Multi-Krum: the mean of the `average` updates with the lowest scores (1: Krum itself,
    the chosen update unchanged); returns (aggregate, chosen row indices, best first)."""
    scores = krum_scores(deltas, byzantine)
    chosen = torch.sort(scores, stable=True).indices[:average]
    if average == 1:
        return {n: d[chosen[0]].clone() for n, d in deltas.items()}, chosen
    return {n: d.index_select(0, chosen).mean(0) for n, d in deltas.items()}, chosen


class NormBound:
    """SumStage: scale each update so its L2 norm over all parameters is at most `bound`.

    Bounds what one client can move the aggregate by, with any rule, algorithm, secure
    aggregation or DP (it runs before DP clipping; on a device it needs no server trust).
    """

    def __init__(self, bound: float) -> None:
        if not (bound > 0 and math.isfinite(bound)):
            raise ConfigError("robust.norm_bound", f"must be > 0, got {bound!r}", "e.g. 10.0")
        self.bound = float(bound)
        self._seen = 0
        self._bounded = 0
        self._last: dict[str, float] = {}

    def __call__(self, deltas: Params, weights: Tensor) -> tuple[Params, Tensor]:
        out, norms = clip_deltas(deltas, self.bound)
        self._seen += int(norms.numel())
        self._bounded += int((norms > self.bound).sum())
        return out, weights

    def end_step(self, count: int) -> None:
        frac = self._bounded / self._seen if self._seen else 0.0
        self._last = {"norm_bound": self.bound, "fraction_bounded": frac}
        self._seen = self._bounded = 0

    def last_metrics(self) -> dict[str, float]:
        """The last step: the bound and the fraction of updates it scaled down."""
        return dict(self._last)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self._seen, "bounded": self._bounded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._seen, self._bounded = int(state["seen"]), int(state["bounded"])


class RobustCombiner:
    """Combiner (fl/aggregation.py): a robust rule over all updates of one server step.

    Weights: a zero-weight row is dropped (it would not count in a weighted mean); otherwise
    every rule counts each kept update once — median and Krum ignore weights, the trimmed
    mean is unweighted over the rows it keeps. The result is (aggregate × Σw, Σw, count) so
    FedAvg's Σ/Σw gives the aggregate and FedBuff's Σ/K the aggregate times the mean
    staleness weight. Krum with n ≤ 2f + 2 updates in a step (dropouts) skips the step
    (weight 0: the model stays) rather than trust a score it cannot compute.
    """

    def __init__(
        self, rule: str, trim: float = 0.1, byzantine: int = 1, krum_average: int = 1
    ) -> None:
        if rule not in RULES:
            raise ConfigError("robust.rule", f"unknown rule {rule!r}", f"use one of {RULES}")
        if not 0 <= trim < 0.5:
            raise ConfigError("robust.trim", f"must be in [0, 0.5), got {trim}", "e.g. 0.1")
        if byzantine < 0:
            raise ConfigError("robust.byzantine", f"must be >= 0, got {byzantine}", "e.g. 1")
        if krum_average < 1:
            raise ConfigError("robust.krum_average", f"must be >= 1, got {krum_average}")
        self.rule = rule
        self.trim = float(trim)
        self.byzantine = int(byzantine)
        self.krum_average = int(krum_average)
        self._parts: list[tuple[Params, Tensor]] = []
        self._last: dict[str, float] = {}

    def validate(self, updates: int) -> None:
        """Refuse a rule that cannot work with `updates` per server step (before training)."""
        if self.rule != "krum":
            return
        f, m = self.byzantine, self.krum_average
        if updates <= 2 * f + 2:
            raise ConfigError(
                "robust.byzantine",
                f"Krum needs more than 2f + 2 = {2 * f + 2} updates per server step to "
                f"tolerate f = {f}, and a step aggregates {updates}",
                f"use f <= {max((updates - 3) // 2, 0)} or more updates per step"
                if updates >= 3
                else "aggregate at least 3 updates per step (cohort / buffer size)",
            )
        if m > updates - f:
            raise ConfigError(
                "robust.krum_average",
                f"multi-Krum averages at most n − f = {updates - f} updates, got m = {m}",
                f"use krum_average <= {updates - f}",
            )

    def add(self, deltas: Params, weights: Tensor) -> None:
        keep = weights > 0
        if not bool(keep.all()):
            idx = keep.nonzero().flatten()
            deltas = {n: d.index_select(0, idx) for n, d in deltas.items()}
            weights = weights.index_select(0, idx)
        self._parts.append((deltas, weights))

    def combine(self) -> tuple[Params, float, int]:
        parts, self._parts = self._parts, []
        if not parts:
            raise RuntimeError("robust combiner is empty")
        like = parts[0][0]
        if len(parts) == 1:
            deltas, weights = parts[0]
        else:
            deltas = {n: torch.cat([p[n] for p, _ in parts]) for n in like}
            weights = torch.cat([w for _, w in parts])
        n = int(weights.shape[0])
        zeros = {name: d.new_zeros(d.shape[1:]) for name, d in like.items()}
        self._last = {"robust_inputs": float(n), "robust_skipped": 0.0}
        if n == 0:
            return zeros, 0.0, 0
        if self.rule == "median":
            agg = coordinate_median(deltas)
        elif self.rule == "trimmed_mean":
            agg = trimmed_mean(deltas, self.trim)
        else:
            if n <= 2 * self.byzantine + 2:
                self._last["robust_skipped"] = 1.0
                return zeros, 0.0, 0
            agg, _ = krum(deltas, self.byzantine, min(self.krum_average, n - self.byzantine))
        weight = float(weights.sum())
        return {name: t * weight for name, t in agg.items()}, weight, n

    def last_metrics(self) -> dict[str, float]:
        """The last step: how many updates were combined, and whether Krum skipped it."""
        return dict(self._last)

    def state_dict(self) -> dict[str, Any]:
        parts = [({n: t.clone() for n, t in d.items()}, w.clone()) for d, w in self._parts]
        return {"parts": parts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._parts = [
            ({n: t.clone() for n, t in d.items()}, w.clone()) for d, w in state.get("parts", [])
        ]
