"""Aggregation primitives: broadcast, client delta, weighted sum (a pipeline of stages).

Between the client update (fl/local/) and the server optimiser (fl/server_opt.py).
Algorithms only choose weights and how to turn (sum, total weight) into Δ̄; clipping,
secure summation and DP noise will be `SumStage`s here, invisible to the algorithms.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from fedvox.types import Params


def broadcast(versions: dict[int, Params], version: int, names: Sequence[str]) -> Params:
    """What the server sends a client: the global parameters of `version` (shared, read-only)."""
    params = versions[version]
    return {n: params[n] for n in names}


def client_delta(start: Params, local: Params) -> Params:
    """Δ = w_start − w_local: gradient-like, so SGD(lr=1) on Δ̄ of one client returns w_local."""
    return {n: start[n] - local[n] for n in start}


def stack(params: Sequence[Params]) -> Params:
    """Stack a list of parameter dicts along a new leading client axis."""
    return {n: torch.stack([p[n] for p in params]) for n in params[0]}


def unstack(stacked: Params, i: int) -> Params:
    return {n: t[i] for n, t in stacked.items()}


def weighted_sum(deltas: Params, weights: Tensor) -> Params:
    """Σ_i w_i Δ_i over the leading client axis of stacked deltas."""
    return {n: torch.tensordot(weights.to(d.dtype), d, dims=1) for n, d in deltas.items()}


class SumStage(Protocol):
    """A per-client stage applied to stacked deltas before they are summed (clip, quantise).

    May also define `end_step(count)` (called once per server step, after the sum, e.g. for
    adaptive clipping) and `state_dict()` / `load_state_dict()` (saved with the simulator).
    """

    def __call__(self, deltas: Params, weights: Tensor) -> tuple[Params, Tensor]: ...


class Summer(Protocol):
    """Turns stacked deltas and weights into (Σ w_i Δ_i, Σ w_i, number of inputs summed).

    The plain summer is `weighted_sum`; secure aggregation replaces it with a protocol whose
    server only ever sees masked inputs. Fewer inputs than given may survive (dropouts).
    """

    def __call__(self, deltas: Params, weights: Tensor) -> tuple[Params, float, int]: ...


class NoiseStage(Protocol):
    """A stage on the aggregated sum, before the server optimiser (DP noise, DP-FTRL tree)."""

    def __call__(self, total: Params, weight: float, count: int) -> tuple[Params, float]: ...


def plain_sum(deltas: Params, weights: Tensor) -> tuple[Params, float, int]:
    """The default Summer: the server sees every weighted delta (no secure aggregation)."""
    return weighted_sum(deltas, weights), float(weights.sum()), int(weights.shape[0])


class Aggregator:
    """The aggregation pipeline: per-client stages → sum → noise stages → (Σ, Σw, count).

    `names` fixes the parameters it accepts: a delta with any other key (e.g. a parameter
    kept local on the device, Federated Reconstruction) is refused, so a local parameter
    structurally cannot reach the server's sum.
    """

    def __init__(
        self,
        stages: Sequence[SumStage] = (),
        names: Sequence[str] | None = None,
        summer: Summer | None = None,
        noise: Sequence[NoiseStage] = (),
    ) -> None:
        self.stages = list(stages)
        self.names = None if names is None else frozenset(names)
        self.summer: Summer = summer if summer is not None else plain_sum
        self.noise = list(noise)
        self.reset()

    def reset(self) -> None:
        self.total: Params | None = None
        self.weight = 0.0
        self.count = 0

    def accumulate(self, deltas: Params, weights: Tensor) -> None:
        """Add a batch of client deltas (stacked, leading axis = client) with their weights."""
        if self.names is not None and set(deltas) != self.names:
            extra = sorted(set(deltas) - self.names)
            missing = sorted(self.names - set(deltas))
            raise ValueError(
                f"aggregator refuses this update: unexpected parameters {extra}, "
                f"missing {missing} (only global parameters may be aggregated)"
            )
        for stage in self.stages:
            deltas, weights = stage(deltas, weights)
        part, weight, count = self.summer(deltas, weights)
        if self.total is None:
            self.total = part
        else:
            self.total = {n: self.total[n] + part[n] for n in part}
        self.weight += weight
        self.count += count

    def result(self) -> tuple[Params, float, int]:
        """(Σ w_i Δ_i + noise, Σ w_i, number of updates); resets for the next server step."""
        if self.total is None:
            raise RuntimeError("aggregator is empty")
        total, weight, count = self.total, self.weight, self.count
        for stage in self.noise:
            total, weight = stage(total, weight, count)
        for stage in [*self.stages, self.summer, *self.noise]:
            end = getattr(stage, "end_step", None)
            if end is not None:
                end(count)
        self.reset()
        return total, weight, count

    def metrics(self) -> dict[str, float]:
        """What the stages report about the last server step (e.g. clip_norm,
        fraction_clipped); a server-step record stores them as agg_<name>."""
        out: dict[str, float] = {}
        for stage in [*self.stages, self.summer, *self.noise]:
            last = getattr(stage, "last_metrics", None)
            if last is not None:
                out.update(last())
        return out

    def _stateful(self) -> list[Any]:
        return [s for s in [*self.stages, self.summer, *self.noise] if hasattr(s, "state_dict")]

    def state_dict(self) -> dict[str, Any]:
        total = None if self.total is None else {n: t.clone() for n, t in self.total.items()}
        stages = [s.state_dict() for s in self._stateful()]
        return {"total": total, "weight": self.weight, "count": self.count, "stages": stages}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        total = state["total"]
        self.total = None if total is None else {n: t.clone() for n, t in total.items()}
        self.weight = float(state["weight"])
        self.count = int(state["count"])
        for stage, st in zip(self._stateful(), state.get("stages", []), strict=False):
            stage.load_state_dict(st)
