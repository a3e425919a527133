"""[federated.privacy] target_epsilon: a Gaussian-DP run that would overspend is refused before
training, and the ε, noise multiplier and step count it names are checked against
dp-accounting's own fixed-size (sampling without replacement) accountant."""

from __future__ import annotations

import re

import dp_accounting
import pytest
from dp_accounting import rdp

from fedvox.errors import ConfigError
from fedvox.experiment.config import config_from_dict
from fedvox.experiment.privacy import build_privacy

N, COHORT, STEPS, DELTA = 2000, 20, 12, 1e-4


def reference_epsilon(z: float, steps: int) -> float:
    """ε of `steps` rounds of COHORT of N drawn without replacement, straight from dp-accounting."""
    event = dp_accounting.SampledWithoutReplacementDpEvent(
        N, COHORT, dp_accounting.GaussianDpEvent(z)
    )
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    acc.compose(event, steps)
    return float(acc.get_epsilon(DELTA))


def _federated(z: float, target: float, mechanism: str = "gaussian"):
    privacy = {"mechanism": mechanism, "noise_multiplier": z, "delta": DELTA}
    privacy["target_epsilon"] = target
    f = {"weighting": "uniform", "concurrency": COHORT, "server_steps": STEPS, "privacy": privacy}
    return config_from_dict({"federated": f}).federated


def test_an_overspending_run_is_refused_with_numbers_dp_accounting_confirms() -> None:
    z, target = 0.5, 4.0
    with pytest.raises(ConfigError) as err:
        build_privacy(_federated(z, target), N, seed=0)
    text = str(err.value)
    assert "federated.privacy.target_epsilon" in text
    planned = float(re.search(r"spend ε = ([0-9.]+)", text).group(1))
    assert planned == pytest.approx(reference_epsilon(z, STEPS), rel=1e-2) and planned > target
    z_fit = float(re.search(r"noise_multiplier to ([0-9.]+)", text).group(1))
    assert reference_epsilon(z_fit, STEPS) <= target  # the suggestion fits…
    assert reference_epsilon(z_fit - 0.02, STEPS) > target  # …and is not far above the least
    steps_fit = int(re.search(r"server_steps to (\d+)", text).group(1))
    assert reference_epsilon(z, steps_fit) <= target < reference_epsilon(z, steps_fit + 1)


def test_a_run_within_its_target_builds_and_dp_ftrl_is_refused_naming_the_field() -> None:
    pipe = build_privacy(_federated(1.0, 3.0), N, seed=0)
    eps = pipe.epsilon(STEPS)
    assert eps == pytest.approx(reference_epsilon(1.0, STEPS), rel=1e-9) and eps <= 3.0
    with pytest.raises(ConfigError, match=r"target_epsilon.*gaussian"):
        build_privacy(_federated(1.0, 3.0, mechanism="dp_ftrl"), N, seed=0)
