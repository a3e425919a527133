"""User-level central DP stages: per-client L2 clipping (fixed, adaptive) and Gaussian noise.

Clipping is a `SumStage` before the weighted sum; the noise is a `NoiseStage` on the sum
(fl/aggregation.py), so every algorithm gets DP without knowing it (docs/privacy.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedvox.errors import ConfigError
from fedvox.rng import Purpose, derived_rng
from fedvox.types import Params


def client_norms(deltas: Params) -> Tensor:
    """Per-client L2 norm over all parameters jointly (stacked deltas, leading client axis)."""
    sq = None
    for d in deltas.values():
        part = d.reshape(d.shape[0], -1).to(torch.float64).pow(2).sum(dim=1)
        sq = part if sq is None else sq + part
    if sq is None:
        raise ValueError("no parameters to clip")
    return sq.sqrt()


def clip_deltas(deltas: Params, clip_norm: float) -> tuple[Params, Tensor]:
    """Scale each client's delta by min(1, S/‖Δ‖); returns (clipped deltas, unclipped norms)."""
    norms = client_norms(deltas)
    # a zero delta has factor 1; S/0 = inf is clamped to 1
    factor = (clip_norm / norms).clamp(max=1.0)
    out = {}
    for n, d in deltas.items():
        f = factor.to(d.dtype).reshape(-1, *([1] * (d.dim() - 1)))
        out[n] = d * f
    return out, norms


def gaussian_like(like: Params, std: float, rng: np.random.Generator) -> Params:
    """I.i.d. N(0, std²) tensors shaped like `like`, drawn in sorted name order (reproducible)."""
    out = {}
    for n in sorted(like):
        t = like[n]
        z = rng.standard_normal(tuple(t.shape), dtype=np.float32)
        out[n] = torch.from_numpy(z).to(dtype=t.dtype, device=t.device) * std
    return {n: out[n] for n in like}


def _check_positive(field: str, value: float, fix: str) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(field, f"must be a positive finite number, got {value!r}", fix)


class FixedClip:
    """SumStage: clip every client delta to L2 norm `clip_norm` (user-level sensitivity S).

    DP needs each client's contribution to the weighted sum bounded by S, so weights above
    `max_weight` (default 1: uniform or staleness weights) are refused; None disables the check.
    """

    def __init__(self, clip_norm: float, max_weight: float | None = 1.0) -> None:
        _check_positive("privacy.clip_norm", clip_norm, "set a clip norm S > 0, e.g. 1.0")
        self.clip_norm = float(clip_norm)
        self.max_weight = max_weight
        self._norms: list[Tensor] = []
        self._last: dict[str, float] = {}

    def _check_weights(self, weights: Tensor) -> None:
        if self.max_weight is None or weights.numel() == 0:
            return
        w = float(weights.max())
        if w > self.max_weight * (1 + 1e-6):
            raise ConfigError(
                "federated.weighting",
                f"client weight {w:g} exceeds {self.max_weight:g}: a client could then move the "
                f"DP sum by more than the clip norm, so the noise would not cover it",
                "use uniform weights (weighting: uniform) or weights <= 1 (staleness weights)",
            )

    def _clip(self, deltas: Params, weights: Tensor) -> tuple[Params, Tensor]:
        self._check_weights(weights)
        clipped, norms = clip_deltas(deltas, self.clip_norm)
        self._norms.append(norms)
        return clipped, norms

    def __call__(self, deltas: Params, weights: Tensor) -> tuple[Params, Tensor]:
        clipped, _ = self._clip(deltas, weights)
        return clipped, weights

    def _close_metrics(self) -> Tensor:
        norms = torch.cat(self._norms) if self._norms else torch.zeros(0, dtype=torch.float64)
        self._norms = []
        if norms.numel():
            self._last = {
                "clip_norm": self.clip_norm,
                "clients": float(norms.numel()),
                "norm_mean": float(norms.mean()),
                "norm_median": float(norms.median()),
                "norm_max": float(norms.max()),
                "fraction_clipped": float((norms > self.clip_norm).double().mean()),
            }
        else:
            self._last = {"clip_norm": self.clip_norm, "clients": 0.0}
        return norms

    def end_step(self, count: int) -> None:
        self._close_metrics()

    def discard_step(self) -> None:
        """The step was skipped (its sum never formed): its norms are neither counted nor shown."""
        self._norms = []

    def last_metrics(self) -> dict[str, float]:
        """The last finished step: clip norm used, update norms, fraction of clients clipped."""
        return dict(self._last)

    def state_dict(self) -> dict[str, Any]:
        pending = torch.cat(self._norms) if self._norms else None
        return {"clip_norm": self.clip_norm, "pending_norms": pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clip_norm = float(state["clip_norm"])
        pending = state.get("pending_norms")
        self._norms = [] if pending is None else [pending.clone()]


class AdaptiveClip(FixedClip):
    """SumStage: clipping whose norm tracks the γ-quantile of update norms (Andrew et al. 2021).

    b_i = 1[‖Δ_i‖ ≤ S] (the *unclipped* indicator); at the end of a step
    b̄ = (Σ(b_i − ½) + N(0, σ_b²))/m + ½ and S ← S·exp(−η_C (b̄ − γ)). With m = the number of
    clients this stage clipped (default) this is (Σ b_i + N)/m. `denominator` fixes m to a
    public value (the expected cohort under Poisson sampling, where the realised count is
    private). The count noise costs privacy: see `update_noise_multiplier`.
    """

    def __init__(
        self,
        initial_clip: float,
        target_quantile: float,
        learning_rate: float = 0.2,
        count_noise_std: float = 0.0,
        seed: int = 0,
        denominator: float | None = None,
        max_weight: float | None = 1.0,
    ) -> None:
        super().__init__(initial_clip, max_weight)
        if not 0.0 < target_quantile < 1.0:
            raise ConfigError(
                "privacy.target_quantile",
                f"must lie in (0, 1), got {target_quantile!r}",
                "use e.g. 0.5 (median update norm)",
            )
        _check_positive("privacy.clip_learning_rate", learning_rate, "use e.g. 0.2")
        if count_noise_std < 0:
            raise ConfigError(
                "privacy.count_noise_std",
                f"must be >= 0, got {count_noise_std!r}",
                "use e.g. expected cohort / 20",
            )
        if denominator is not None:
            _check_positive("privacy.clip_denominator", denominator, "the expected cohort size")
        self.target_quantile = float(target_quantile)
        self.learning_rate = float(learning_rate)
        self.count_noise_std = float(count_noise_std)
        self.seed = int(seed)
        self.denominator = denominator
        self.step = 0

    def end_step(self, count: int) -> None:
        # `count` (inputs that survived the summer) is not used: b̄ must average the same
        # clients whose b_i were counted, i.e. those this stage clipped.
        norms = self._close_metrics()
        step = self.step
        self.step += 1
        n = norms.numel()
        if n == 0:
            return
        unclipped = float((norms <= self.clip_norm).double().sum())
        noise = 0.0
        if self.count_noise_std > 0:
            noise = float(derived_rng(self.seed, Purpose.CLIP_COUNT, step).normal())
            noise *= self.count_noise_std
        m = float(self.denominator) if self.denominator is not None else float(n)
        b_bar = (unclipped - n / 2 + noise) / m + 0.5
        self._last["fraction_unclipped_noisy"] = b_bar
        self.clip_norm *= math.exp(-self.learning_rate * (b_bar - self.target_quantile))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.step = int(state["step"])


class GaussianNoise:
    """NoiseStage: add N(0, (z·S)²) to every coordinate of the sum, S = the clip norm in effect.

    Noise for server step k derives from (seed, Purpose.DP_NOISE, k). `public_weight`, when
    given, replaces the realised Σw_i in the output: with Poisson sampling the realised count
    is itself private, so the mean must divide by a public constant (McMahan et al. 2018).
    """

    def __init__(
        self,
        noise_multiplier: float,
        clip: FixedClip,
        seed: int = 0,
        public_weight: float | None = None,
    ) -> None:
        _check_positive(
            "privacy.noise_multiplier", noise_multiplier, "use e.g. 1.0 (noise std / clip norm)"
        )
        if public_weight is not None:
            _check_positive("privacy.public_weight", public_weight, "the expected cohort size")
        self.noise_multiplier = float(noise_multiplier)
        self.clip = clip
        self.seed = int(seed)
        self.public_weight = public_weight
        self.step = 0

    @property
    def noise_std(self) -> float:
        """Std of the noise on the sum this step: z·S."""
        return self.noise_multiplier * self.clip.clip_norm

    def __call__(self, total: Params, weight: float, count: int) -> tuple[Params, float]:
        rng = derived_rng(self.seed, Purpose.DP_NOISE, self.step)
        self.step += 1
        noise = gaussian_like(total, self.noise_std, rng)
        noisy = {n: total[n] + noise[n] for n in total}
        return noisy, (self.public_weight if self.public_weight is not None else weight)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def mean_noise_std(noise_multiplier: float, clip_norm: float, cohort: float) -> float:
    """Std per coordinate of the noisy *mean* update: z·S/n for n clients (weights 1)."""
    return noise_multiplier * clip_norm / cohort


def _require_count_noise(count_noise_std: float) -> None:
    if not count_noise_std > 0:
        raise ConfigError(
            "privacy.count_noise_std",
            "adaptive clipping without count noise releases the exact unclipped count, "
            "which is not differentially private",
            "set count_noise_std > 0, e.g. expected cohort / 20",
        )


def combined_noise_multiplier(update_noise_multiplier: float, count_noise_std: float) -> float:
    """Noise multiplier of the joint (update sum, unclipped count) release (Andrew et al. 2021).

    The count query Σ(b_i − ½) has sensitivity ½, so noise σ_b on it is a Gaussian mechanism
    with multiplier 2σ_b; two Gaussian queries compose as one with z = (z_Δ⁻² + (2σ_b)⁻²)^−½.
    Account with this z, not with z_Δ, when adaptive clipping is on.
    """
    _check_positive("privacy.noise_multiplier", update_noise_multiplier, "use e.g. 1.0")
    _require_count_noise(count_noise_std)
    return (update_noise_multiplier**-2 + (2 * count_noise_std) ** -2) ** -0.5


def update_noise_multiplier(noise_multiplier: float, count_noise_std: float) -> float:
    """The z_Δ to put on the update sum so the joint release has multiplier `noise_multiplier`.

    z_Δ = (z⁻² − (2σ_b)⁻²)^−½ (Andrew et al. 2021); needs 2σ_b > z, else the count alone would
    already spend more than the whole budget.
    """
    _check_positive("privacy.noise_multiplier", noise_multiplier, "use e.g. 1.0")
    _require_count_noise(count_noise_std)
    rest = noise_multiplier**-2 - (2 * count_noise_std) ** -2
    if rest <= 0:
        raise ConfigError(
            "privacy.count_noise_std",
            f"count noise std {count_noise_std:g} is too small for noise multiplier "
            f"{noise_multiplier:g}: the clipped-count query alone needs 2·σ_b > z",
            f"use count_noise_std > {noise_multiplier / 2:g} (e.g. expected cohort / 20)",
        )
    return rest**-0.5


def stage_metrics(stages: Sequence[object]) -> dict[str, float]:
    """Merged `last_metrics()` of the clipping stages in a pipeline (for per-step logs)."""
    out: dict[str, float] = {}
    for s in stages:
        fn = getattr(s, "last_metrics", None)
        if fn is not None:
            out.update({f"dp/{k}": v for k, v in fn().items()})
    return out
