"""The algorithm interface and staleness weightings shared by the federated algorithms.

An algorithm speaks only in aggregation primitives: how each client update is weighted in
the sum, and how the server turns (sum, total weight, count) into new global parameters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from fedvox.errors import ConfigError
from fedvox.fl.server_opt import ServerOptimizer, ServerSGD
from fedvox.types import Params

STALENESS_KINDS = ("constant", "sqrt", "polynomial", "hinge")


def check_staleness(kind: str, a: float, b: float) -> None:
    if kind not in STALENESS_KINDS:
        raise ConfigError(
            "algorithm.staleness",
            f"unknown staleness weighting {kind!r}",
            f"use one of {', '.join(STALENESS_KINDS)}",
        )
    if kind in ("polynomial", "hinge") and not a > 0:
        raise ConfigError("algorithm.staleness_a", f"must be > 0, got {a}", "use e.g. 0.5")
    if kind == "hinge" and b < 0:
        raise ConfigError("algorithm.staleness_b", f"must be >= 0, got {b}", "use e.g. 4")


def staleness_weight(tau: Tensor, kind: str = "sqrt", a: float = 0.5, b: float = 0.0) -> Tensor:
    """s(τ): constant 1; sqrt 1/√(1+τ) (FedBuff default); polynomial (1+τ)^−a;
    hinge 1 for τ ≤ b else 1/(a(τ−b)+1) (FedAsync). τ counts server steps."""
    tau = tau.to(torch.float64)
    if kind == "constant":
        w = torch.ones_like(tau)
    elif kind == "sqrt":
        w = (1.0 + tau) ** -0.5
    elif kind == "polynomial":
        w = (1.0 + tau) ** -a
    elif kind == "hinge":
        w = torch.where(tau <= b, torch.ones_like(tau), 1.0 / (a * (tau - b) + 1.0))
    else:
        check_staleness(kind, a, b)
        raise AssertionError  # unreachable: check_staleness raised
    return w.to(torch.float32)


class Algorithm:
    """Base class. `barrier`: synchronous rounds (the server waits for its cohort)."""

    name = "base"
    barrier = False
    max_staleness: int | None = None

    def __init__(self, server_opt: ServerOptimizer | None = None) -> None:
        self.server_opt = server_opt if server_opt is not None else ServerSGD(1.0)

    def updates_per_step(self, concurrency: int) -> int:
        """How many client updates one server step aggregates (K, or the cohort size)."""
        raise NotImplementedError

    def validate(self, concurrency: int) -> None:
        """Refuse settings impossible at this concurrency (raises ConfigError)."""

    def client_weights(self, num_examples: Tensor, staleness: Tensor) -> Tensor:
        raise NotImplementedError

    def apply(
        self,
        params: Params,
        total: Params,
        weight: float,
        count: int,
        starts: Sequence[Params],
        staleness: Tensor,
    ) -> Params:
        """New global parameters from the aggregated sum (never modifies `params` in place)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"server_opt": self.server_opt.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.server_opt.load_state_dict(state["server_opt"])


class AlgorithmWrapper(Algorithm):
    """Another algorithm, then a server-side stage on the model it produced (as Flower wraps
    strategies): weights, barrier, staleness, K and state are the inner algorithm's."""

    def __init__(self, inner: Algorithm, suffix: str) -> None:
        self.inner = inner
        self.name = f"{inner.name}+{suffix}"
        self.barrier = inner.barrier
        self.max_staleness = inner.max_staleness
        self.server_opt = inner.server_opt

    def updates_per_step(self, concurrency: int) -> int:
        return self.inner.updates_per_step(concurrency)

    def validate(self, concurrency: int) -> None:
        self.inner.validate(concurrency)

    def client_weights(self, num_examples: Tensor, staleness: Tensor) -> Tensor:
        return self.inner.client_weights(num_examples, staleness)

    def after_step(self, new: Params) -> Params:
        """The wrapper's own stage on the inner algorithm's new parameters."""
        raise NotImplementedError

    def apply(
        self,
        params: Params,
        total: Params,
        weight: float,
        count: int,
        starts: Sequence[Params],
        staleness: Tensor,
    ) -> Params:
        new = self.inner.apply(params, total, weight, count, starts, staleness)
        if weight == 0:  # nothing was aggregated: the model stays as it was
            return new
        return self.after_step(new)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


def check_max_staleness(value: int | None) -> None:
    if value is not None and (value < 0 or math.isnan(value)):
        raise ConfigError("algorithm.max_staleness", f"must be >= 0, got {value}", "or None")
