"""FedAvg / FedAvgM / FedAdam / FedYogi / FedAdagrad: synchronous rounds with a server optimiser.

McMahan et al. 2017 and Reddi et al. 2021: Δ̄ = Σ n_i Δ_i / Σ n_i, then a server optimiser
step with Δ̄ as the pseudo-gradient. FedProx is the client option ClientConfig.mu.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fedvox.errors import ConfigError
from fedvox.fl.algorithms.base import Algorithm
from fedvox.fl.server_opt import ServerOptimizer
from fedvox.types import Params

WEIGHTINGS = ("examples", "uniform")


class FedAvg(Algorithm):
    """Synchronous: a cohort of `concurrency` clients per round, the server waits (barrier).

    weighting "examples" (Σ n_i Δ_i / Σ n_i, McMahan) or "uniform" (plain mean of Δ_i).
    """

    name = "fedavg"
    barrier = True

    def __init__(self, server_opt: ServerOptimizer | None = None, weighting: str = "examples"):
        super().__init__(server_opt)
        if weighting not in WEIGHTINGS:
            raise ConfigError(
                "algorithm.weighting",
                f"unknown weighting {weighting!r}",
                f"use one of {', '.join(WEIGHTINGS)}",
            )
        self.weighting = weighting

    def updates_per_step(self, concurrency: int) -> int:
        return concurrency

    def client_weights(self, num_examples: Tensor, staleness: Tensor) -> Tensor:
        if self.weighting == "uniform":
            return torch.ones(len(num_examples))
        return num_examples.to(torch.float32)

    def apply(
        self,
        params: Params,
        total: Params,
        weight: float,
        count: int,
        starts: Sequence[Params],
        staleness: Tensor,
    ) -> Params:
        if weight == 0:  # every update was refused (e.g. non-finite FedRecon deltas)
            return {n: t.clone() for n, t in params.items()}
        mean = {n: t / weight for n, t in total.items()}
        return self.server_opt.step(params, mean)
