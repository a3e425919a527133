"""Client selection: which clients a server invites, drawn from (seed, SELECT, selection no.).

Shared by the simulator and a deployed server (fedvox.deploy), so both invite the same
cohorts for the same seed and selection counter.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np

from fedvox.rng import Purpose, derived_rng

# Rejection-sampling tries before a one-client selection falls back to scanning every client.
SELECT_TRIES = 64


def draw_cohort(
    seed: int, selection: int, num_clients: int, m: int, eligible: np.ndarray | None = None
) -> list[int]:
    """m distinct clients (fewer if fewer are eligible); `eligible` None means every client."""
    rng = derived_rng(seed, Purpose.SELECT, selection)
    if eligible is None:
        return [int(c) for c in rng.choice(num_clients, size=m, replace=False)]
    m = min(m, len(eligible))
    return [int(c) for c in rng.choice(eligible, size=m, replace=False)]


def draw_one(
    seed: int,
    selection: int,
    num_clients: int,
    blocked: Collection[int],
    available: Callable[[int], bool] | None = None,
) -> int | None:
    """One client not in `blocked` (and `available`), uniformly; None when nobody is free."""
    rng = derived_rng(seed, Purpose.SELECT, selection)
    for _ in range(SELECT_TRIES):
        c = int(rng.integers(num_clients))
        if c not in blocked and (available is None or available(c)):
            return c
    eligible = [
        c for c in range(num_clients) if c not in blocked and (available is None or available(c))
    ]
    return int(rng.choice(eligible)) if eligible else None
