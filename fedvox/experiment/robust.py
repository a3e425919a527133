"""Robust-aggregation wiring: the `[federated.robust]` section → norm bound and robust combiner.

Beside experiment/privacy.py, between the config and the simulator's aggregation pipeline
(fl/aggregation.py): refuses, before training, a rule that cannot work with the run's other
settings (secure aggregation, DP noise, FedAsync, too few updates per step for Krum).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fedvox.errors import ConfigError
from fedvox.fl.aggregation import SumStage
from fedvox.fl.robust import NormBound, RobustCombiner

if TYPE_CHECKING:  # config imports this module lazily (check_engine), so no cycle at run time
    from fedvox.experiment.config import FederatedSection

ROBUST_PATHS = {
    "robust.rule": "federated.robust.rule",
    "robust.trim": "federated.robust.trim",
    "robust.byzantine": "federated.robust.byzantine",
    "robust.krum_average": "federated.robust.krum_average",
    "robust.norm_bound": "federated.robust.norm_bound",
}


@dataclass
class RobustPipeline:
    """The robust parts of a run's aggregation: per-client stages and the step's combiner."""

    stages: list[SumStage] = field(default_factory=list)
    combiner: RobustCombiner | None = None


def updates_per_step(f: FederatedSection) -> int:
    """The most updates one server step aggregates: the cohort, the buffer, or 1 (FedAsync)."""
    return {"fedavg": f.concurrency, "fedbuff": f.buffer_size}.get(f.algorithm, 1)


def check_robust(f: FederatedSection) -> None:
    """Refuse a robust rule that cannot work with the rest of `f` (ConfigError naming it)."""
    build_robust(f)


def build_robust(f: FederatedSection) -> RobustPipeline:
    """The norm-bound stage and robust combiner of `f.robust`, checked against the run."""
    from fedvox.experiment.config import toml_paths

    r = f.robust
    pipe = RobustPipeline()
    with toml_paths(ROBUST_PATHS):
        if r.norm_bound > 0:
            pipe.stages.append(NormBound(r.norm_bound))
        if r.rule == "mean":
            return pipe
        _check_composes(f)
        pipe.combiner = RobustCombiner(r.rule, r.trim, r.byzantine, r.krum_average)
        pipe.combiner.validate(updates_per_step(f))
    return pipe


def _check_composes(f: FederatedSection) -> None:
    """The rules over single updates against what hides or perturbs single updates."""
    rule = f.robust.rule
    keep = "per-update bounding (federated.robust.norm_bound) and DP clipping"
    if f.privacy.secure_aggregation:
        raise ConfigError(
            "federated.robust.rule",
            f"{rule} needs every single update, and with secure aggregation the server only "
            "ever sees their sum",
            f'use rule = "mean" with secure_aggregation: {keep} compose with it (they scale '
            "each update on the device, before the secure sum)",
        )
    if f.privacy.mechanism != "none":
        raise ConfigError(
            "federated.robust.rule",
            f"DP noise is calibrated to a sum of clipped updates (one client moves it by at "
            f"most the clip norm); the {rule} of clipped updates has another sensitivity, which "
            "the accountant does not analyse, so the ε it reports would not hold",
            f'use rule = "mean" with DP ({keep} compose with it), or privacy.mechanism = "none"',
        )
    if f.algorithm == "fedasync":
        raise ConfigError(
            "federated.robust.rule",
            f"FedAsync aggregates one update per server step, and the {rule} of one update is "
            "that update (or, for Krum, undefined)",
            'use rule = "mean" with norm_bound to limit each update, or algorithm = "fedavg" / '
            '"fedbuff"',
        )
