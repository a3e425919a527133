"""Virtual clock: trip durations, availability and the event queue of the simulator.

The simulator (fl/simulator.py) advances this clock from event to event; no wall-clock time
is ever read, so a run's timeline is a pure function of its config and seed.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedvox.errors import ConfigError

DELAY_DISTRIBUTIONS = ("half_normal", "uniform", "exponential", "constant")

Availability = Callable[[int, float], bool]


@dataclass(frozen=True)
class DelayModel:
    """Duration of one client trip (download, local training, upload) in virtual seconds.

    `mean` is the mean of the base distribution: half-normal (FedBuff paper's default) with
    sigma = mean·sqrt(pi/2), uniform on [0, 2·mean], exponential, or constant. The draw is
    multiplied by the client's `speed` factor (if given) and, with `scale_by_examples`, by
    n_client / mean n, so clients with more data take proportionally longer.
    """

    distribution: str = "half_normal"
    mean: float = 1.0
    speed: np.ndarray | None = None
    scale_by_examples: bool = False

    def __post_init__(self) -> None:
        if self.distribution not in DELAY_DISTRIBUTIONS:
            raise ConfigError(
                "clock.delay",
                f"unknown delay distribution {self.distribution!r}",
                f"use one of {', '.join(DELAY_DISTRIBUTIONS)}",
            )
        if not (self.mean > 0 and math.isfinite(self.mean)):
            raise ConfigError("clock.mean_delay", f"must be > 0, got {self.mean}", "use e.g. 1.0")
        if self.speed is not None and np.any(np.asarray(self.speed) <= 0):
            raise ConfigError("clock.speed", "speed factors must be > 0", "use positive factors")

    def base(self, rng: np.random.Generator) -> float:
        if self.distribution == "half_normal":
            return abs(float(rng.normal(0.0, self.mean * math.sqrt(math.pi / 2))))
        if self.distribution == "uniform":
            return float(rng.uniform(0.0, 2.0 * self.mean))
        if self.distribution == "exponential":
            return float(rng.exponential(self.mean))
        return self.mean

    def sample(
        self, client_id: int, n_examples: int, mean_examples: float, rng: np.random.Generator
    ) -> float:
        d = self.base(rng)
        if self.speed is not None:
            d *= float(self.speed[client_id])
        if self.scale_by_examples:
            d *= n_examples / mean_examples
        return d


def diurnal_availability(
    num_clients: int,
    seed: int,
    period: float = 24.0,
    online_fraction: float = 0.5,
) -> Availability:
    """Each client is online for `online_fraction` of every `period`, at its own random phase.

    An example of the availability hook: phases differ per client (think time zones), so the
    set of reachable clients rotates through the day.
    """
    if not 0 < online_fraction <= 1:
        raise ConfigError("availability.online_fraction", "must be in (0, 1]", "use e.g. 0.5")
    phase = np.random.default_rng([seed, 99]).uniform(0.0, period, size=num_clients)

    def available(client_id: int, time: float) -> bool:
        return ((time + phase[client_id]) % period) < online_fraction * period

    return available


class EventQueue:
    """A heap of (time, seq, kind, payload); seq breaks ties in insertion order."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, str, Any]] = []
        self.seq = 0

    def push(self, time: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.heap, (time, self.seq, kind, payload))
        self.seq += 1

    def pop(self) -> tuple[float, int, str, Any]:
        return heapq.heappop(self.heap)

    def __len__(self) -> int:
        return len(self.heap)

    def state_dict(self) -> dict[str, Any]:
        return {"heap": list(self.heap), "seq": self.seq}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.heap = list(state["heap"])
        heapq.heapify(self.heap)
        self.seq = int(state["seq"])
