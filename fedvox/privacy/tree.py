"""DP-FTRL tree-aggregation noise (Kairouz et al. 2021) as a NoiseStage in differenced form.

Sits on the aggregated sum like `GaussianNoise` (fl/aggregation.py), but needs no sampling:
each step adds N_t − N_{t−1}, so a plain server SGD ends at w_0 − η(Σ ḡ + N_t).

Why the differenced ("elegant") form is DP-FTRL: the tree mechanism releases noisy node sums
over the dyadic intervals of [1, T]; the noisy prefix sum Σ_{s≤t} g_s + N_t is a sum of
released nodes, and each step's output g_t + N_t − N_{t−1} is the difference of two noisy
prefix sums, i.e. post-processing. A client present at most once in a tree touches one leaf
and its ancestors: ⌊log2 T⌋+1 nodes, hence RDP(α) = α·depth/(2z²) (privacy/accounting.py).

What a restart requires of the server: nothing beyond calling `restart()`. DP-FTRL restarts
with w_0 ← w and Σ ← 0; here the old tree's final noise N_T is already inside w (it was
added step by step and is never subtracted), so the current w *is* the new w_0, and the new
tree starts from N_0 = 0 with its own, independent node noises; there is no running sum.
Conditions for the identity w_t = w_0 − η(Σ ḡ + N_t) within a tree (utility, not privacy —
any server optimiser is post-processing and stays private): plain SGD with a learning rate
constant within the tree, and a mean with a constant denominator (fixed buffer or cohort
size; `public_weight` pins it); with momentum/Adam or a varying lr the increments no longer
telescope and the noise on w grows like that of independent per-step noise.
"""

from __future__ import annotations

from typing import Any

import torch

from fedvox.errors import ConfigError
from fedvox.privacy.dp import gaussian_like
from fedvox.rng import Purpose, derived_rng
from fedvox.types import Params


def dyadic_nodes(t: int) -> list[tuple[int, int]]:
    """(level, index) of the tree nodes whose intervals partition [1, t] (one per set bit).

    Node (level ℓ, index i) covers steps [i·2^ℓ + 1, (i+1)·2^ℓ].
    """
    if t < 0:
        raise ValueError(f"step must be >= 0, got {t}")
    return [(lvl, (t >> lvl) - 1) for lvl in range(t.bit_length()) if (t >> lvl) & 1]


def tree_depth(steps: int) -> int:
    """Nodes a single leaf's contribution reaches in a tree of `steps` leaves: ⌊log2 T⌋+1."""
    return int(steps).bit_length()


class TreeNoise:
    """NoiseStage: DP-FTRL tree noise, N(0, σ²) per node, σ = z·S on the sum, added differenced.

    Node (restart r, level, index) derives its noise from (seed, Purpose.TREE_NOISE, r,
    level, index), so state is only the step within the tree and the restart count.
    `restart()` starts a new tree (the server calls it, e.g. at each epoch end); it also
    happens automatically before a step once the tree has `restart_every` steps.
    """

    def __init__(
        self,
        noise_std: float,
        seed: int = 0,
        restart_every: int | None = None,
        public_weight: float | None = None,
    ) -> None:
        if not noise_std > 0:
            raise ConfigError(
                "privacy.noise_multiplier",
                f"tree node noise std must be > 0, got {noise_std!r}",
                "set noise std = noise_multiplier × clip_norm with both > 0",
            )
        if restart_every is not None and restart_every < 1:
            raise ConfigError(
                "privacy.restart_every",
                f"must be a positive number of server steps or None, got {restart_every!r}",
                "restart once per epoch of clients, e.g. num_clients / cohort steps",
            )
        self.noise_std = float(noise_std)
        self.seed = int(seed)
        self.restart_every = restart_every
        self.public_weight = public_weight
        self.step = 0  # steps done in the current tree
        self.restarts = 0  # index r of the current tree
        self.finished: list[int] = []  # step counts of finished trees (for accounting)

    def restart(self) -> None:
        """Start a new tree; a no-op on an empty tree (so epoch-end calls never waste one)."""
        if self.step == 0:
            return
        self.finished.append(self.step)
        self.restarts += 1
        self.step = 0

    def step_counts(self) -> list[int]:
        """Steps of every tree so far (finished trees, then the current one if non-empty)."""
        return [*self.finished, self.step] if self.step else list(self.finished)

    def node_noise(self, like: Params, level: int, index: int, tree: int | None = None) -> Params:
        r = self.restarts if tree is None else tree
        rng = derived_rng(self.seed, Purpose.TREE_NOISE, r, level, index)
        return gaussian_like(like, self.noise_std, rng)

    def cumulative_noise(self, t: int, like: Params, tree: int | None = None) -> Params:
        """N_t of the current (or given) tree: the sum of the node noises covering [1, t]."""
        out = {n: torch.zeros_like(v) for n, v in like.items()}
        for level, index in dyadic_nodes(t):
            node = self.node_noise(like, level, index, tree)
            out = {n: out[n] + node[n] for n in out}
        return out

    def increment(self, t: int, like: Params, tree: int | None = None) -> Params:
        """N_t − N_{t−1}: with k trailing zeros in t, the new level-k node minus the k nodes
        below it that it replaces (t−1 ends in k ones), so about 2 node draws per step."""
        k = (t & -t).bit_length() - 1
        out = self.node_noise(like, k, (t >> k) - 1, tree)
        for level in range(k):
            old = self.node_noise(like, level, ((t - 1) >> level) - 1, tree)
            out = {n: out[n] - old[n] for n in out}
        return out

    def __call__(self, total: Params, weight: float, count: int) -> tuple[Params, float]:
        if self.restart_every is not None and self.step >= self.restart_every:
            self.restart()
        self.step += 1
        inc = self.increment(self.step, total)
        noisy = {n: total[n] + inc[n] for n in total}
        return noisy, (self.public_weight if self.public_weight is not None else weight)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "restarts": self.restarts, "finished": list(self.finished)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.restarts = int(state["restarts"])
        self.finished = [int(s) for s in state.get("finished", [])]
