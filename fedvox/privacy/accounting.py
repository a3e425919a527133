"""Privacy accounting for user-level DP (RDP or PLD via Google's `dp_accounting`).

Fed by the server once per step (sampled Gaussian, fixed-size sampling, or DP-FTRL tree
steps); `check_dp_setup` refuses configurations whose participation no accountant models.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import dp_accounting
import numpy as np
from dp_accounting import pld, rdp

from fedvox.errors import ConfigError
from fedvox.privacy.tree import tree_depth

NeighborRel = dp_accounting.NeighboringRelation
METHODS = ("rdp", "pld")


def _positive(field: str, value: float, fix: str) -> float:
    if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
        raise ConfigError(field, f"must be a positive finite number, got {value!r}", fix)
    return float(value)


def tree_rdp(orders: Sequence[float], noise_multiplier: float, step_counts: Sequence[int]):
    """Closed form for DP-FTRL trees, each client at most once per tree: α·Σ depths/(2z²)."""
    depths = sum(tree_depth(s) for s in step_counts)
    return np.asarray(orders, dtype=np.float64) * depths / (2 * noise_multiplier**2)


class PrivacyAccountant:
    """Composes the DP events of a run and answers ε(δ); state is a list of plain events.

    Events (merged when consecutive and equal):
    - Poisson-sampled Gaussian (q, z) per step: add/remove-one neighbours;
    - fixed-size sampling of m of n clients without replacement: replace-one neighbours,
      RDP only (dp_accounting has no PLD for it) and not mixable with the other events;
    - DP-FTRL trees (z, steps per tree), each client at most once per tree: RDP uses
      dp_accounting's `SingleEpochTreeAggregationDpEvent` per tree (composed over trees);
      PLD uses the exact equivalent Gaussian: one tree is a Gaussian mechanism of L2
      sensitivity S·√depth, so a tree set is GaussianDpEvent(z/√Σdepth).
    ε is recomputed from scratch from the events on every `epsilon()` call.
    """

    def __init__(self, method: str = "rdp") -> None:
        if method not in METHODS:
            raise ConfigError(
                "privacy.accounting", f"unknown method {method!r}", f"use one of {METHODS}"
            )
        self.method = method
        self.events: list[dict[str, Any]] = []
        self.open_tree: dict[str, float] | None = None  # {"z", "steps"} of the running tree

    # -- recording -------------------------------------------------------------------------

    def _check_mix(self, kind: str) -> None:
        kinds = {e["kind"] for e in self.events} | {kind}
        if self.open_tree is not None:
            kinds.add("tree")
        if "fixed" in kinds and len(kinds) > 1:
            raise ConfigError(
                "privacy.sampling",
                "fixed-size sampling (replace-one neighbours) cannot be composed with Poisson "
                "sampling or DP-FTRL (add/remove neighbours) in one accountant",
                "use one sampling scheme for the whole run",
            )

    def _add(self, event: dict[str, Any]) -> None:
        self._check_mix(event["kind"])
        last = self.events[-1] if self.events else None
        same = last is not None and all(last.get(k) == v for k, v in event.items() if k != "steps")
        if same and last is not None and "steps" in last:
            last["steps"] += event["steps"]
        else:
            self.events.append(event)

    def sampled_gaussian(self, sampling_rate: float, noise_multiplier: float, steps: int = 1):
        """`steps` server steps of Poisson sampling (rate q) and Gaussian noise z·S on the sum."""
        q = _positive("privacy.sampling_rate", sampling_rate, "expected cohort / clients")
        if q > 1:
            raise ConfigError("privacy.sampling_rate", f"must be <= 1, got {q}", "use m/n <= 1")
        z = _positive("privacy.noise_multiplier", noise_multiplier, "use e.g. 1.0")
        self._add({"kind": "poisson", "q": q, "z": z, "steps": int(steps)})

    def sampled_without_replacement(
        self, sample_size: int, population_size: int, noise_multiplier: float, steps: int = 1
    ) -> None:
        """`steps` rounds of m clients drawn uniformly without replacement from n, noise z·S."""
        if self.method == "pld":
            raise ConfigError(
                "privacy.accounting",
                "PLD accounting cannot model fixed-size sampling without replacement "
                "(dp_accounting implements it for RDP only)",
                "set accounting: rdp, or use Poisson sampling with PLD",
            )
        if not 0 < sample_size <= population_size:
            raise ConfigError(
                "federated.cohort",
                f"need 0 < m <= n clients, got m={sample_size}, n={population_size}",
                "choose a cohort no larger than the population",
            )
        z = _positive("privacy.noise_multiplier", noise_multiplier, "use e.g. 1.0")
        event = {"kind": "fixed", "m": int(sample_size), "n": int(population_size), "z": z}
        self._add({**event, "steps": int(steps)})

    def tree_step(self, noise_multiplier: float, steps: int = 1) -> None:
        """`steps` DP-FTRL server steps in the current tree (node noise z·S)."""
        z = _positive("privacy.noise_multiplier", noise_multiplier, "use e.g. 1.0")
        self._check_mix("tree")
        if self.open_tree is not None and self.open_tree["z"] != z:
            raise ConfigError(
                "privacy.noise_multiplier",
                "the noise multiplier changed inside a DP-FTRL tree (node noise is fixed per tree)",
                "change it only right after restart_tree()",
            )
        if self.open_tree is None:
            self.open_tree = {"z": z, "steps": 0}
        self.open_tree["steps"] += int(steps)

    def restart_tree(self) -> None:
        """Close the current tree (the server restarted TreeNoise); a no-op if it is empty."""
        if self.open_tree is not None and self.open_tree["steps"] > 0:
            tree = {
                "kind": "tree",
                "z": self.open_tree["z"],
                "trees": [int(self.open_tree["steps"])],
            }
            self.events.append(tree)
            self._merge_trees()
        self.open_tree = None

    def trees(self, noise_multiplier: float, step_counts: Sequence[int]) -> None:
        """Finished DP-FTRL trees with the given step counts (e.g. TreeNoise.step_counts())."""
        z = _positive("privacy.noise_multiplier", noise_multiplier, "use e.g. 1.0")
        counts = [int(s) for s in step_counts if int(s) > 0]
        self._check_mix("tree")
        if counts:
            self.restart_tree()
            self.events.append({"kind": "tree", "z": z, "trees": counts})
            self._merge_trees()

    def _merge_trees(self) -> None:
        if len(self.events) >= 2:
            a, b = self.events[-2], self.events[-1]
            if a["kind"] == b["kind"] == "tree" and a["z"] == b["z"]:
                a["trees"] = a["trees"] + b["trees"]
                self.events.pop()

    # -- answering -------------------------------------------------------------------------

    def _tree_events(self) -> list[dict[str, Any]]:
        out = list(self.events)
        if self.open_tree is not None and self.open_tree["steps"] > 0:
            out.append(
                {"kind": "tree", "z": self.open_tree["z"], "trees": [self.open_tree["steps"]]}
            )
        return out

    def dp_event(self) -> dp_accounting.DpEvent:
        """The whole run so far as one dp_accounting event (the running tree included)."""
        parts: list[dp_accounting.DpEvent] = []
        for e in self._tree_events():
            if e["kind"] == "poisson":
                inner = dp_accounting.PoissonSampledDpEvent(
                    e["q"], dp_accounting.GaussianDpEvent(e["z"])
                )
                parts.append(dp_accounting.SelfComposedDpEvent(inner, e["steps"]))
            elif e["kind"] == "fixed":
                inner = dp_accounting.SampledWithoutReplacementDpEvent(
                    e["n"], e["m"], dp_accounting.GaussianDpEvent(e["z"])
                )
                parts.append(dp_accounting.SelfComposedDpEvent(inner, e["steps"]))
            elif self.method == "rdp":
                # one event per tree: each client at most once per tree, trees compose
                for steps in e["trees"]:
                    parts.append(dp_accounting.SingleEpochTreeAggregationDpEvent(e["z"], steps))
            else:
                depth = sum(tree_depth(s) for s in e["trees"])
                parts.append(dp_accounting.GaussianDpEvent(e["z"] / math.sqrt(depth)))
        return dp_accounting.ComposedDpEvent(parts)

    def _relation(self) -> NeighborRel:
        kinds = {e["kind"] for e in self._tree_events()}
        if "fixed" in kinds:
            return NeighborRel.REPLACE_ONE
        if "tree" in kinds and self.method == "rdp":
            # dp_accounting's tree event is stated for replace-with-null; its Poisson-Gaussian
            # RDP is the same under this relation as under add/remove
            return NeighborRel.REPLACE_SPECIAL
        return NeighborRel.ADD_OR_REMOVE_ONE

    def epsilon(self, delta: float) -> float:
        """ε of the run so far at this δ (0 before any step)."""
        if not 0 < delta < 1:
            raise ConfigError("privacy.delta", f"must be in (0, 1), got {delta!r}", "e.g. 1e-5")
        event = self.dp_event()
        if not event.events:
            return 0.0
        relation = self._relation()
        if self.method == "rdp":
            acc = rdp.RdpAccountant(neighboring_relation=relation)
        else:
            acc = pld.PLDAccountant(neighboring_relation=relation)
        acc.compose(event)
        return float(acc.get_epsilon(delta))

    def steps(self) -> int:
        """Server steps composed so far."""
        n = sum(e.get("steps", 0) + sum(e.get("trees", [])) for e in self.events)
        return n + (int(self.open_tree["steps"]) if self.open_tree else 0)

    def state_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "events": [dict(e) for e in self.events],
            "open_tree": None if self.open_tree is None else dict(self.open_tree),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.method = state["method"]
        self.events = [dict(e) for e in state["events"]]
        self.open_tree = None if state["open_tree"] is None else dict(state["open_tree"])


SAMPLINGS = ("poisson", "without_replacement", "arrival", "epoch")
MECHANISMS = ("gaussian", "dp_ftrl")


def check_dp_setup(
    algorithm: str,
    sampling: str,
    *,
    mechanism: str = "gaussian",
    noise_multiplier: float,
    delta: float,
    num_clients: int,
    cohort_size: int | None = None,
    clip: str = "fixed",
    clip_norm: float = 1.0,
    count_noise_std: float = 0.0,
    accounting: str = "rdp",
    weighting: str = "uniform",
    over_selection: float = 0.0,
    dropout: float = 0.0,
    availability: bool = False,
    fixed_denominator: bool = False,
    once_per_tree: bool = False,
) -> None:
    """Refuse (ConfigError) any DP configuration whose guarantee the accountant cannot back.

    `sampling`: how clients come to contribute — "poisson" (each client independently with
    rate cohort/n), "without_replacement" (m of n uniformly per round), "arrival" (whoever
    finishes, FedBuff/FedAsync), "epoch" (passes over the clients). `mechanism`: "gaussian"
    (noise per step, amplified by sampling) or "dp_ftrl" (tree noise, no amplification).
    `fixed_denominator`: the mean divides by a public constant, not the realised Σw.
    `once_per_tree`: the selector guarantees no client contributes twice to one tree.
    """
    _check_names_and_values(
        mechanism, sampling, accounting, noise_multiplier, clip_norm, num_clients, delta, weighting
    )
    _check_clip(clip, mechanism, noise_multiplier, count_noise_std)
    if mechanism == "dp_ftrl":
        _check_once_per_tree(once_per_tree)
        return
    _check_sampled_gaussian(
        algorithm,
        sampling,
        accounting=accounting,
        num_clients=num_clients,
        cohort_size=cohort_size,
        over_selection=over_selection,
        dropout=dropout,
        availability=availability,
        fixed_denominator=fixed_denominator,
    )


def _check_names_and_values(
    mechanism: str,
    sampling: str,
    accounting: str,
    noise_multiplier: float,
    clip_norm: float,
    num_clients: int,
    delta: float,
    weighting: str,
) -> None:
    """Known names, a positive noise and clip, δ below 1/n, and uniform client weights."""
    if mechanism not in MECHANISMS:
        raise ConfigError("privacy.mechanism", f"unknown {mechanism!r}", f"use one of {MECHANISMS}")
    if sampling not in SAMPLINGS:
        raise ConfigError("privacy.sampling", f"unknown {sampling!r}", f"use one of {SAMPLINGS}")
    if accounting not in METHODS:
        raise ConfigError("privacy.accounting", f"unknown {accounting!r}", f"use one of {METHODS}")
    if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise ConfigError(
            "privacy.noise_multiplier",
            f"must be > 0 for a DP claim, got {noise_multiplier!r} (no noise means ε = ∞)",
            "set e.g. noise_multiplier: 1.0, or turn privacy off",
        )
    if not (clip_norm > 0 and math.isfinite(clip_norm)):
        raise ConfigError(
            "privacy.clip_norm", f"must be > 0, got {clip_norm!r}", "set e.g. clip_norm: 1.0"
        )
    if num_clients < 1:
        raise ConfigError("privacy.num_clients", f"got {num_clients}", "need at least 1 client")
    if not 0 < delta < 1 / num_clients:
        raise ConfigError(
            "privacy.delta",
            f"δ = {delta!r} must lie in (0, 1/n) = (0, {1 / num_clients:.3g}) for n = "
            f"{num_clients} clients: with δ ≥ 1/n a mechanism that publishes one random "
            "client's data outright satisfies the claim",
            f"use δ well below 1/n, e.g. {10 ** math.floor(math.log10(0.1 / num_clients)):.0e}",
        )
    if weighting != "uniform":
        raise ConfigError(
            "federated.weighting",
            f"{weighting!r} weights let a client with much data move the sum by more than the "
            "clip norm, so the noise no longer covers one client's contribution",
            "use weighting: uniform (each clipped update counts once)",
        )


def _check_clip(clip: str, mechanism: str, noise_multiplier: float, count_noise_std: float) -> None:
    """Adaptive clipping: not with DP-FTRL, and only with a noised unclipped count."""
    if clip not in ("fixed", "adaptive"):
        raise ConfigError("privacy.clip", f"unknown {clip!r}", "use fixed or adaptive")
    if clip == "adaptive":
        if mechanism == "dp_ftrl":
            raise ConfigError(
                "privacy.clip",
                "adaptive clipping with DP-FTRL is not supported: the tree's node noise is "
                "fixed at z·S when a node is drawn, so S may not change within a tree",
                "use clip: fixed with DP-FTRL",
            )
        if not count_noise_std > noise_multiplier / 2:
            raise ConfigError(
                "privacy.count_noise_std",
                f"adaptive clipping needs count noise σ_b > z/2 = {noise_multiplier / 2:g}, got "
                f"{count_noise_std!r}: the unclipped count is released too and must be noised",
                "use count_noise_std ≈ expected cohort / 20 and account with the joint z",
            )


def _check_once_per_tree(once_per_tree: bool) -> None:
    """DP-FTRL's accounting holds only if no client contributes twice to one tree."""
    if not once_per_tree:
        raise ConfigError(
            "privacy.once_per_tree",
            "DP-FTRL's accounting assumes each client contributes at most once per tree; "
            "this selector does not guarantee it",
            "restart the tree every epoch and exclude clients already used in the current "
            "tree from selection (or restart the tree before any client could repeat)",
        )


def _check_sampled_gaussian(
    algorithm: str,
    sampling: str,
    *,
    accounting: str,
    num_clients: int,
    cohort_size: int | None,
    over_selection: float,
    dropout: float,
    availability: bool,
    fixed_denominator: bool,
) -> None:
    """The Gaussian mechanism's guarantee rests on uniform sampling amplification."""
    if algorithm in ("fedbuff", "fedasync") or sampling == "arrival":
        raise ConfigError(
            "privacy.mechanism",
            f"{algorithm} with arrival-driven participation: which clients are aggregated "
            "depends on who finishes first, not on a uniform sampling scheme, so no "
            "sampled-Gaussian accountant applies",
            "use mechanism: dp_ftrl (tree noise needs no sampling), or fedavg with Poisson or "
            "fixed-size sampling",
        )
    if sampling == "epoch":
        raise ConfigError(
            "privacy.sampling",
            "epoch passes are not a sampling scheme with amplification for the Gaussian mechanism",
            "use mechanism: dp_ftrl for epoch passes, or sampling: poisson / without_replacement",
        )
    for field, bad, why in (
        ("federated.availability", availability, "only available clients can be picked"),
        ("federated.over_selection", over_selection > 0, "the fastest m of m' are kept"),
        ("federated.dropout", dropout > 0, "dropped clients leave the aggregated set"),
    ):
        if bad:
            raise ConfigError(
                field,
                f"sampled-Gaussian accounting assumes uniform sampling of the aggregated "
                f"clients, but {why}, so the sample is no longer uniform",
                "turn it off for DP runs, or use mechanism: dp_ftrl (no sampling assumption)",
            )
    if cohort_size is None or not 0 < cohort_size <= num_clients:
        raise ConfigError(
            "federated.cohort",
            f"need a cohort of 1..{num_clients} clients for sampled accounting, got "
            f"{cohort_size!r}",
            "set the (expected) cohort size m <= number of clients",
        )
    if sampling == "without_replacement" and accounting == "pld":
        raise ConfigError(
            "privacy.accounting",
            "PLD accounting cannot model fixed-size sampling without replacement",
            "set accounting: rdp, or sampling: poisson",
        )
    if sampling == "poisson" and not fixed_denominator:
        raise ConfigError(
            "privacy.public_weight",
            "with Poisson sampling the realised cohort size reveals participation; dividing "
            "the noisy sum by it is not covered by the accountant",
            "divide by the expected cohort size (GaussianNoise(public_weight=q·n))",
        )
