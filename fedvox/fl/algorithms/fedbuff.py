"""FedBuff (Nguyen et al. 2022): asynchronous clients, a buffer of K updates per server step.

Δ̄ = (1/K) Σ s(τ_i) Δ_i with τ_i the staleness in server steps; fedvox divides by K here,
whereas FLSim sums and folds 1/K into the server learning rate.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from fedvox.errors import ConfigError
from fedvox.fl.algorithms.base import (
    Algorithm,
    Params,
    check_max_staleness,
    check_staleness,
    staleness_weight,
)
from fedvox.fl.server_opt import ServerOptimizer


class FedBuff(Algorithm):
    """K = `buffer_size` updates per step, each weighted by s(τ); τ > max_staleness dropped."""

    name = "fedbuff"
    barrier = False

    def __init__(
        self,
        buffer_size: int = 10,
        server_opt: ServerOptimizer | None = None,
        staleness: str = "sqrt",
        staleness_a: float = 0.5,
        staleness_b: float = 0.0,
        max_staleness: int | None = None,
    ) -> None:
        super().__init__(server_opt)
        if buffer_size < 1:
            raise ConfigError("algorithm.buffer_size", f"must be >= 1, got {buffer_size}")
        check_staleness(staleness, staleness_a, staleness_b)
        check_max_staleness(max_staleness)
        self.buffer_size = int(buffer_size)
        self.staleness = staleness
        self.staleness_a, self.staleness_b = float(staleness_a), float(staleness_b)
        self.max_staleness = max_staleness

    def updates_per_step(self, concurrency: int) -> int:
        return self.buffer_size

    def validate(self, concurrency: int) -> None:
        if self.buffer_size > concurrency:
            raise ConfigError(
                "algorithm.buffer_size",
                f"K={self.buffer_size} exceeds concurrency C={concurrency}",
                "use K <= C (the buffer could never fill)",
            )

    def client_weights(self, num_examples: Tensor, staleness: Tensor) -> Tensor:
        return staleness_weight(staleness, self.staleness, self.staleness_a, self.staleness_b)

    def apply(
        self,
        params: Params,
        total: Params,
        weight: float,
        count: int,
        starts: Sequence[Params],
        staleness: Tensor,
    ) -> Params:
        if weight == 0:  # every update was dropped (non-finite, or a skipped robust step)
            return {n: t.clone() for n, t in params.items()}
        mean = {n: t / self.buffer_size for n, t in total.items()}
        return self.server_opt.step(params, mean)
