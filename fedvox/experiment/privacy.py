"""Privacy wiring for federated runs: config → clipping, secure sum, noise, and ε as it goes.

Between the `[federated.privacy]` config section and the simulator's aggregation pipeline
(fl/aggregation.py): builds the stages from fedvox.privacy, refuses a DP claim the
accountant cannot back, and computes (ε, δ) from what the simulator has actually done.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from fedvox.errors import ConfigError
from fedvox.experiment.compression import (
    FLOAT16_MODULUS_BITS,
    FLOAT16_SCALE_BITS,
    levels_ring_bits,
    shared_grid,
)
from fedvox.experiment.config import FederatedSection
from fedvox.fl.aggregation import NoiseStage, Summer, SumStage
from fedvox.privacy.accounting import PrivacyAccountant, check_dp_setup
from fedvox.privacy.dp import AdaptiveClip, FixedClip, GaussianNoise, combined_noise_multiplier
from fedvox.privacy.secagg import SecAggConfig, SecureSum
from fedvox.privacy.tree import TreeNoise
from fedvox.rng import Purpose, derived_seed

# SecAgg's fixed-point resolution: the most bits (≤ this) whose ring still holds the cohort.
MAX_SCALE_BITS = 22


@dataclass
class PrivacyPipeline:
    """The aggregation stages of a run and how to account for them."""

    stages: list[SumStage] = field(default_factory=list)
    summer: Summer | None = None
    noise: list[NoiseStage] = field(default_factory=list)
    mechanism: str = "none"
    accounting: str = "rdp"
    noise_multiplier: float = 0.0  # z used by the accountant (joint z with adaptive clipping)
    cohort: int = 0
    num_clients: int = 0
    delta: float = 0.0

    @property
    def dp(self) -> bool:
        return self.mechanism != "none"

    def epsilon(self, server_steps: int) -> float | None:
        """ε at δ after `server_steps` steps (None without DP). Recomputed from the state of
        the noise stage and the step count, so nothing extra needs checkpointing."""
        if not self.dp or server_steps == 0:
            return None
        acc = PrivacyAccountant(self.accounting)
        if self.mechanism == "dp_ftrl":
            tree = next(s for s in self.noise if isinstance(s, TreeNoise))
            acc.trees(self.noise_multiplier, [c for c in tree.step_counts() if c > 0])
        else:
            acc.sampled_without_replacement(
                self.cohort, self.num_clients, self.noise_multiplier, steps=server_steps
            )
        return float(acc.epsilon(self.delta))


def build_privacy(f: FederatedSection, num_clients: int, seed: int) -> PrivacyPipeline:
    """The pipeline for `f.privacy`; raises ConfigError for a DP claim without valid accounting."""
    p = f.privacy
    cohort = f.concurrency if f.algorithm == "fedavg" else f.buffer_size
    pipe = PrivacyPipeline(
        mechanism=p.mechanism,
        accounting=p.accounting,
        cohort=cohort,
        num_clients=num_clients,
        delta=p.delta,
    )
    weighting = f.weighting if f.algorithm == "fedavg" else "uniform"  # staleness weights ≤ 1
    if p.mechanism != "none":
        _add_dp(pipe, f, num_clients, cohort, weighting, seed)
    if p.target_epsilon is not None:
        check_target_epsilon(pipe, f.server_steps, p.target_epsilon, f.privacy.noise_multiplier)
    if p.secure_aggregation:
        pipe.summer = SecureSum(_secure_config(f, cohort, weighting, seed))
    return pipe


def _add_dp(
    pipe: PrivacyPipeline,
    f: FederatedSection,
    num_clients: int,
    cohort: int,
    weighting: str,
    seed: int,
) -> None:
    """Check the DP claim's accounting, then add the clip stage and the noise to `pipe`."""
    p = f.privacy
    check_dp_setup(
        f.algorithm,
        "without_replacement" if f.algorithm == "fedavg" else "arrival",
        mechanism="dp_ftrl" if p.mechanism == "dp_ftrl" else "gaussian",
        noise_multiplier=p.noise_multiplier,
        delta=p.delta,
        num_clients=num_clients,
        cohort_size=cohort,
        clip=p.clip,
        clip_norm=p.clip_norm,
        count_noise_std=p.count_noise_std,
        accounting=p.accounting,
        weighting=weighting,
        over_selection=f.over_selection,
        dropout=f.dropout,
        availability=False,
        fixed_denominator=True,  # FedAvg divides by the fixed cohort, FedBuff by K
        once_per_tree=p.mechanism == "dp_ftrl",  # the simulator runs once_per_epoch
    )
    if p.clip == "adaptive":
        clip: FixedClip = AdaptiveClip(
            p.clip_norm,
            p.target_quantile,
            learning_rate=p.clip_lr,
            count_noise_std=p.count_noise_std,
            seed=seed,
        )
        pipe.noise_multiplier = combined_noise_multiplier(p.noise_multiplier, p.count_noise_std)
    else:
        clip = FixedClip(p.clip_norm)
        pipe.noise_multiplier = p.noise_multiplier
    pipe.stages.append(clip)
    if p.mechanism == "gaussian":
        pipe.noise.append(GaussianNoise(p.noise_multiplier, clip, seed=seed))
    else:
        pipe.noise.append(TreeNoise(p.noise_multiplier * p.clip_norm, seed=seed))


def _secure_config(f: FederatedSection, cohort: int, weighting: str, seed: int) -> SecAggConfig:
    """Secure aggregation's ring and protocol for [federated.privacy] (and compression)."""
    p = f.privacy
    if weighting == "examples":
        raise ConfigError(
            "federated.weighting",
            "secure aggregation needs a public bound on client weights, and example "
            "counts have none",
            'set federated.weighting = "uniform" with secure_aggregation',
        )
    bits = p.secagg_scale_bits
    modulus = 32
    if f.compression.kind == "float16":  # hold float16's 2^-24 steps exactly: a 64-bit ring
        bits = FLOAT16_SCALE_BITS if bits is None else bits
        modulus = FLOAT16_MODULUS_BITS
    if bits is None:  # the finest resolution whose ring still holds the whole cohort
        bits = MAX_SCALE_BITS
        while bits > 1 and SecAggConfig(scale_bits=bits).max_clients() < cohort:
            bits -= 1
    c = f.compression
    grid_range, grid_bits = None, None
    if shared_grid(f) and c.shared_range is not None:  # levels: bits + ⌈log2 cohort⌉ bits
        modulus = levels_ring_bits(c.bits, cohort)
        grid_range, grid_bits = float(c.shared_range), int(c.bits)
    config = SecAggConfig(
        modulus_bits=modulus,
        threshold=p.secagg_threshold,
        scale_bits=bits,
        max_weight=1.0,
        neighbours=p.secagg_neighbours,
        dropout=p.secagg_dropout,
        seed=derived_seed(seed, Purpose.SECAGG_SESSION),
        on_abort=p.secagg_on_abort,
        consistency_check=p.secagg_consistency_check,
        grid_range=grid_range,
        grid_bits=grid_bits,
    )
    config.check_capacity(cohort)
    return config


def least_noise_multiplier(
    epsilon_of: Callable[[float], float], target: float, start: float = 0.5
) -> float:
    """The smallest noise multiplier z (within +0.5 %) with epsilon_of(z) <= target; ε falls
    as z grows. Refuses a target no z up to 1e4 reaches."""
    lo = hi = start
    while epsilon_of(hi) > target:
        if hi >= 1e4:
            raise ConfigError("target ε", f"{target:g} is out of reach", "raise the target")
        lo, hi = hi, hi * 2
    if lo == hi:  # the start already fits: halve until it does not
        lo = hi / 2
        while epsilon_of(lo) <= target:
            lo, hi = lo / 2, lo
    while hi - lo > 0.005 * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if epsilon_of(mid) <= target else (mid, hi)
    return hi


def planned_epsilon(
    mechanism: str,
    delta: float,
    noise_multiplier: float,
    server_steps: int,
    cohort: int,
    num_clients: int,
) -> float:
    """ε a run plans to spend: Gaussian DP over fixed-size cohorts of `cohort` of
    `num_clients` drawn without replacement, or DP-FTRL whose trees are epochs of the
    population (num_clients / cohort steps each, cohort = FedBuff's K)."""
    acc = PrivacyAccountant("rdp")
    if mechanism == "gaussian":
        acc.sampled_without_replacement(cohort, num_clients, noise_multiplier, steps=server_steps)
    elif mechanism == "dp_ftrl":
        per_tree = max(1, num_clients // cohort)
        counts = [per_tree] * (server_steps // per_tree) + [server_steps % per_tree]
        acc.trees(noise_multiplier, counts)
    else:
        raise ConfigError("federated.privacy.mechanism", f"no ε for {mechanism!r}", "use DP")
    return float(acc.epsilon(delta))


def check_target_epsilon(
    pipe: PrivacyPipeline, server_steps: int, target: float, noise_multiplier: float
) -> None:
    """Refuse a run whose planned steps would spend more than `target` ε, before training,
    with the noise multiplier and the number of steps that would fit (fixed-size cohorts)."""
    field_name = "federated.privacy.target_epsilon"
    if pipe.mechanism != "gaussian" or pipe.noise_multiplier != noise_multiplier:
        raise ConfigError(
            field_name,
            'is checked for mechanism = "gaussian" with a fixed clip only: DP-FTRL\'s ε depends '
            "on the trees the run forms and adaptive clipping's on the count noise",
            "remove target_epsilon (the run still reports its ε at every evaluation)",
        )
    planned = pipe.epsilon(server_steps)
    assert planned is not None
    if planned <= target:
        return

    def eps(z: float, steps: int) -> float:
        acc = PrivacyAccountant(pipe.accounting)
        acc.sampled_without_replacement(pipe.cohort, pipe.num_clients, z, steps=steps)
        return acc.epsilon(pipe.delta)

    hi = least_noise_multiplier(lambda z: eps(z, server_steps), target, noise_multiplier)
    fits, over = 0, server_steps  # ε grows with the steps: the most steps within target
    while over - fits > 1:
        mid = (fits + over) // 2
        fits, over = (mid, over) if eps(noise_multiplier, mid) <= target else (fits, mid)
    raise ConfigError(
        field_name,
        f"{target:g}, but {server_steps} server steps of {pipe.cohort} clients drawn from "
        f"{pipe.num_clients} with noise_multiplier {noise_multiplier:g} spend ε = {planned:.3g} "
        f"at δ = {pipe.delta:g}",
        f"raise noise_multiplier to {math.ceil(hi * 100) / 100:g} or more, "
        + (f"or lower server_steps to {fits}, " if fits else "(one step alone overspends) ")
        + "or train with more clients",
    )
