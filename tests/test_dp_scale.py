"""`fedvox repro dp-scale`: every DP arm's noise multiplier is the least that keeps its ε
within the target, checked against dp-accounting's own accountant for the arm's exact
sampling (fixed-size cohorts without replacement; DP-FTRL trees of one epoch each)."""

from __future__ import annotations

import dp_accounting
import pytest
from dp_accounting import rdp

from fedvox.experiment.privacy import build_privacy, least_noise_multiplier, planned_epsilon
from fedvox.experiment.repro import DP_SCALE_EPSILONS, STUDIES, arm_config

STUDY = STUDIES["dp-scale"]


def training_devices(cfg) -> int:
    """N: the world's devices less the held-out panel (its devices do not train)."""
    r = cfg.federated.reconstruction
    assert r.panel == "held_out" and r.device_clusters > 0
    return cfg.data.world.train_devices - r.cluster_panel


def reference_epsilon(cfg, z: float) -> float:
    """ε of the arm's plan straight from dp-accounting (no fedvox accountant involved)."""
    f, n = cfg.federated, training_devices(cfg)
    p = f.privacy
    if p.mechanism == "gaussian":
        event = dp_accounting.SelfComposedDpEvent(
            dp_accounting.SampledWithoutReplacementDpEvent(
                n, f.concurrency, dp_accounting.GaussianDpEvent(z)
            ),
            f.server_steps,
        )
        relation = dp_accounting.NeighboringRelation.REPLACE_ONE
    else:
        per_tree = n // f.buffer_size
        trees = [per_tree] * (f.server_steps // per_tree) + [f.server_steps % per_tree]
        event = dp_accounting.ComposedDpEvent(
            [dp_accounting.SingleEpochTreeAggregationDpEvent(z, t) for t in trees if t]
        )
        relation = dp_accounting.NeighboringRelation.REPLACE_SPECIAL
    acc = rdp.RdpAccountant(neighboring_relation=relation)
    acc.compose(event)
    return float(acc.get_epsilon(p.delta))


# the Gaussian arms' accounting takes ~1 s an ε; the --set case checks the cheap DP-FTRL arms
@pytest.mark.parametrize(
    ("sets", "mechanisms"),
    [({}, ("gaussian", "dp_ftrl")), ({"data.world.train_devices": 2000}, ("dp_ftrl",))],
)
def test_every_dp_arm_spends_at_most_its_epsilon_and_not_much_less(sets, mechanisms) -> None:
    seen = set()
    for arm in STUDY.arms:
        if not any(m.replace("_", "") in arm.name or m in arm.name for m in mechanisms):
            continue
        cfg = arm_config(STUDY, arm, sets)
        if cfg.federated is None or cfg.federated.privacy.mechanism == "none":
            continue
        p, n = cfg.federated.privacy, training_devices(cfg)
        assert p.delta == pytest.approx(n**-1.1) and p.delta < 1 / n
        target = float(arm.name.rsplit("eps", 1)[1])
        seen.add((cfg.federated.algorithm, target))
        z = p.noise_multiplier
        assert reference_epsilon(cfg, z) <= target
        assert reference_epsilon(cfg, 0.98 * z) > target  # the least z, within 2 %
        if p.mechanism == "gaussian":  # the run's own accountant agrees, and the run checks
            pipe = build_privacy(cfg.federated, n, seed=0)
            assert pipe.epsilon(cfg.federated.server_steps) == pytest.approx(
                reference_epsilon(cfg, z), rel=1e-9
            )
            assert p.target_epsilon == target
    algorithms = {"gaussian": "fedavg", "dp_ftrl": "fedbuff"}
    assert seen == {(algorithms[m], e) for m in mechanisms for e in DP_SCALE_EPSILONS}


def test_least_noise_multiplier_searches_both_ways() -> None:
    def eps(z: float) -> float:
        return planned_epsilon("dp_ftrl", 1e-5, z, 250, 10, 1000)  # 2.5 trees

    for start in (0.1, 3.0):  # from below (overspends) and from above (already fits)
        z = least_noise_multiplier(eps, 4.0, start)
        assert eps(z) <= 4.0 < eps(0.99 * z)


def test_the_dp_table_gives_each_arm_its_own_epsilon_delta_and_noise() -> None:
    from fedvox.experiment.repro import _dp_table

    rows = [
        {"arm": "public-only", "epsilon": None, "trips": None, "eer": 0.1835,
         "min_dcf_01": 0.985, "gap_closed": 0.0},
        {"arm": "fedavg-nodp", "epsilon": None, "trips": 5000, "eer": 0.15, "min_dcf_01": 0.9,
         "gap_closed": 0.38},
        {"arm": "fedavg-gaussian-eps8", "epsilon": 7.987, "delta": 4.4703e-05,
         "noise_multiplier": 0.528, "trips": 5000, "eer": 0.16, "min_dcf_01": 0.95,
         "gap_closed": 0.27},
    ]  # fmt: skip
    table = _dp_table(rows)
    assert table[0].startswith("| arm | ε | δ | noise z |")
    assert table[2] == "| public-only | — (centralised) | — | — | 18.35% | 0.985 | 0.00 |"
    assert table[3] == "| fedavg-nodp | ∞ (no DP) | — | — | 15.00% | 0.900 | 0.38 |"
    assert table[4] == "| fedavg-gaussian-eps8 | 7.99 | 4.47e-05 | 0.528 | 16.00% | 0.950 | 0.27 |"
