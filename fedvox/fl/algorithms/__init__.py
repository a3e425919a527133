"""Federated algorithms expressed in aggregation primitives (weights + server apply).

The simulator (fl/simulator.py) drives them; `make_algorithm` builds one by name.
"""

from __future__ import annotations

from typing import Any

from fedvox.errors import ConfigError
from fedvox.fl.algorithms.base import Algorithm, AlgorithmWrapper, staleness_weight
from fedvox.fl.algorithms.fedasync import FedAsync
from fedvox.fl.algorithms.fedavg import FedAvg
from fedvox.fl.algorithms.fedbuff import FedBuff

ALGORITHMS: dict[str, type[Algorithm]] = {
    "fedavg": FedAvg,
    "fedbuff": FedBuff,
    "fedasync": FedAsync,
}


def make_algorithm(name: str, **kwargs: Any) -> Algorithm:
    """Build an algorithm by name ('fedavg', 'fedbuff', 'fedasync')."""
    if name not in ALGORITHMS:
        raise ConfigError(
            "algorithm.name", f"unknown algorithm {name!r}", f"use one of {', '.join(ALGORITHMS)}"
        )
    return ALGORITHMS[name](**kwargs)


__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "AlgorithmWrapper",
    "FedAsync",
    "FedAvg",
    "FedBuff",
    "make_algorithm",
    "staleness_weight",
]
