"""Aggregation primitives: broadcast, client delta, weighted sum (a pipeline of stages).

Between the client update (fl/client.py) and the server optimiser (fl/server_opt.py).
Algorithms only choose weights and how to turn (sum, total weight) into Δ̄; clipping,
secure summation and DP noise will be `SumStage`s here, invisible to the algorithms.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

Params = dict[str, Tensor]


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
    """A stage applied to stacked client deltas before they are summed (clip, quantise, ...)."""

    def __call__(self, deltas: Params, weights: Tensor) -> tuple[Params, Tensor]: ...


class Aggregator:
    """Accumulates Σ w_i Δ_i, Σ w_i and a count; `stages` transform each batch on the way in."""

    def __init__(self, stages: Sequence[SumStage] = ()) -> None:
        self.stages = list(stages)
        self.reset()

    def reset(self) -> None:
        self.total: Params | None = None
        self.weight = 0.0
        self.count = 0

    def accumulate(self, deltas: Params, weights: Tensor) -> None:
        """Add a batch of client deltas (stacked, leading axis = client) with their weights."""
        for stage in self.stages:
            deltas, weights = stage(deltas, weights)
        part = weighted_sum(deltas, weights)
        if self.total is None:
            self.total = part
        else:
            self.total = {n: self.total[n] + part[n] for n in part}
        self.weight += float(weights.sum())
        self.count += int(weights.shape[0])

    def result(self) -> tuple[Params, float, int]:
        """(Σ w_i Δ_i, Σ w_i, number of updates) and reset for the next server step."""
        if self.total is None:
            raise RuntimeError("aggregator is empty")
        out = (self.total, self.weight, self.count)
        self.reset()
        return out

    def state_dict(self) -> dict[str, Any]:
        total = None if self.total is None else {n: t.clone() for n, t in self.total.items()}
        return {"total": total, "weight": self.weight, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        total = state["total"]
        self.total = None if total is None else {n: t.clone() for n, t in total.items()}
        self.weight = float(state["weight"])
        self.count = int(state["count"])
