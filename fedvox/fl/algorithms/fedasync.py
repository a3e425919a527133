"""FedAsync (Xie et al. 2019): every arrival is mixed into the global model at once.

w ← (1 − α_t)·w + α_t·w_local with α_t = α·s(τ); w_local = w_start − Δ is rebuilt on the
server from the version the client downloaded, so the client still only sends Δ.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fedvox.errors import ConfigError
from fedvox.fl.algorithms.base import (
    Algorithm,
    Params,
    check_max_staleness,
    check_staleness,
    staleness_weight,
)


class FedAsync(Algorithm):
    """One update per server step; no server optimiser (the mixing is the server rule)."""

    name = "fedasync"
    barrier = False

    def __init__(
        self,
        alpha: float = 0.6,
        staleness: str = "polynomial",
        staleness_a: float = 0.5,
        staleness_b: float = 0.0,
        max_staleness: int | None = None,
    ) -> None:
        super().__init__(None)
        if not 0 < alpha <= 1:
            raise ConfigError("algorithm.alpha", f"must be in (0, 1], got {alpha}", "use 0.6")
        check_staleness(staleness, staleness_a, staleness_b)
        check_max_staleness(max_staleness)
        self.alpha = float(alpha)
        self.staleness = staleness
        self.staleness_a, self.staleness_b = float(staleness_a), float(staleness_b)
        self.max_staleness = max_staleness

    def updates_per_step(self, concurrency: int) -> int:
        return 1

    def client_weights(self, num_examples: Tensor, staleness: Tensor) -> Tensor:
        return torch.ones(len(staleness))

    def apply(
        self,
        params: Params,
        total: Params,
        weight: float,
        count: int,
        starts: Sequence[Params],
        staleness: Tensor,
    ) -> Params:
        if weight == 0:  # the update was dropped (non-finite): Σ/Σw would be 0/0
            return {n: t.clone() for n, t in params.items()}
        s = staleness_weight(staleness, self.staleness, self.staleness_a, self.staleness_b)
        a = self.alpha * float(s[0])
        start = starts[0]
        return {n: (1 - a) * p + a * (start[n] - total[n] / weight) for n, p in params.items()}
