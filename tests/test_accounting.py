"""Privacy accounting: ε against dp_accounting computed directly, tree closed form, refusals."""

import math

import dp_accounting
import pytest
from dp_accounting import pld, rdp

from fedvox.errors import ConfigError
from fedvox.privacy.accounting import PrivacyAccountant, check_dp_setup, tree_rdp
from fedvox.privacy.tree import tree_depth

Rel = dp_accounting.NeighboringRelation


def _direct_poisson(acc, q=0.01, z=1.0, steps=1000, delta=1e-5):
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    acc.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    return acc.get_epsilon(delta)


def test_poisson_rdp_matches_dp_accounting():
    a = PrivacyAccountant("rdp")
    for _ in range(1000):  # streamed one step at a time, merged into one event
        a.sampled_gaussian(0.01, 1.0)
    assert len(a.events) == 1 and a.steps() == 1000
    want = _direct_poisson(rdp.RdpAccountant())
    assert a.epsilon(1e-5) == pytest.approx(want, rel=1e-12)
    assert 1.0 < want < 4.0  # sanity: the well-known regime (≈2.1)


def test_poisson_pld_matches_dp_accounting():
    a = PrivacyAccountant("pld")
    a.sampled_gaussian(0.01, 1.0, steps=1000)
    want = _direct_poisson(pld.PLDAccountant())
    assert a.epsilon(1e-5) == pytest.approx(want, rel=1e-9)
    # PLD is tighter than RDP on the same mechanism
    r = PrivacyAccountant("rdp")
    r.sampled_gaussian(0.01, 1.0, steps=1000)
    assert a.epsilon(1e-5) < r.epsilon(1e-5)


def test_without_replacement_matches_dp_accounting_and_pld_refused():
    a = PrivacyAccountant("rdp")
    a.sampled_without_replacement(10, 1000, 1.0, steps=500)
    a.sampled_without_replacement(10, 1000, 1.0, steps=500)
    direct = rdp.RdpAccountant(neighboring_relation=Rel.REPLACE_ONE)
    event = dp_accounting.SampledWithoutReplacementDpEvent(
        1000, 10, dp_accounting.GaussianDpEvent(1.0)
    )
    direct.compose(dp_accounting.SelfComposedDpEvent(event, 1000))
    assert a.epsilon(1e-5) == pytest.approx(direct.get_epsilon(1e-5), rel=1e-12)
    with pytest.raises(ConfigError) as e:
        PrivacyAccountant("pld").sampled_without_replacement(10, 1000, 1.0)
    assert e.value.field == "privacy.accounting" and "rdp" in str(e.value)
    with pytest.raises(ConfigError):  # replace-one cannot mix with add/remove events
        a.sampled_gaussian(0.01, 1.0)


def test_tree_depth_is_floor_log2_plus_one():
    for steps in range(1, 300):
        assert tree_depth(steps) == math.floor(math.log2(steps)) + 1


def test_tree_accounting_matches_closed_form():
    z, trees = 4.0, [100, 100, 37, 5]
    a = PrivacyAccountant("rdp")
    for steps in trees[:-1]:
        for _ in range(steps):
            a.tree_step(z)
        a.restart_tree()
    a.tree_step(z, steps=trees[-1])  # the running tree counts too
    orders = rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS
    closed = tree_rdp(orders, z, trees)
    assert closed[0] == pytest.approx(orders[0] * (7 + 7 + 6 + 3) / (2 * z**2))
    want, _ = rdp.compute_epsilon(orders, closed, 1e-6)
    assert a.epsilon(1e-6) == pytest.approx(want, rel=1e-12)
    # batch form gives the same, and the PLD form (exact Gaussian equivalent) is tighter
    b = PrivacyAccountant("rdp")
    b.trees(z, trees)
    assert b.epsilon(1e-6) == pytest.approx(want, rel=1e-12)
    p = PrivacyAccountant("pld")
    p.trees(z, trees)
    direct = pld.PLDAccountant()
    direct.compose(dp_accounting.GaussianDpEvent(z / math.sqrt(23)))
    assert p.epsilon(1e-6) == pytest.approx(direct.get_epsilon(1e-6), rel=1e-9)
    assert p.epsilon(1e-6) < want


def test_tree_noise_multiplier_fixed_within_tree():
    a = PrivacyAccountant()
    a.tree_step(2.0)
    with pytest.raises(ConfigError):
        a.tree_step(3.0)
    a.restart_tree()
    a.tree_step(3.0)  # allowed in a new tree
    assert a.steps() == 2


def test_state_dict_round_trip_and_empty():
    a = PrivacyAccountant("rdp")
    assert a.epsilon(1e-5) == 0.0
    a.sampled_gaussian(0.02, 1.1, steps=50)
    a.tree_step(3.0, steps=9)
    b = PrivacyAccountant()
    b.load_state_dict(a.state_dict())
    assert b.epsilon(1e-5) == a.epsilon(1e-5) > 0
    a.sampled_gaussian(0.02, 1.1, steps=5)
    b.sampled_gaussian(0.02, 1.1, steps=5)
    assert b.epsilon(1e-5) == a.epsilon(1e-5)


def test_epsilon_grows_with_steps_and_falls_with_noise():
    eps = []
    for z, steps in ((1.0, 100), (1.0, 200), (2.0, 200)):
        a = PrivacyAccountant()
        a.sampled_gaussian(0.05, z, steps=steps)
        eps.append(a.epsilon(1e-5))
    assert eps[0] < eps[1] and eps[2] < eps[1]


# -- check_dp_setup --------------------------------------------------------------------------

OK = {"noise_multiplier": 1.0, "delta": 1e-5, "num_clients": 1000, "cohort_size": 50}


def test_valid_setups_pass():
    check_dp_setup("fedavg", "poisson", fixed_denominator=True, **OK)
    check_dp_setup("fedavg", "without_replacement", **OK)
    check_dp_setup("fedavg", "without_replacement", clip="adaptive", count_noise_std=2.5, **OK)
    # DP-FTRL tolerates what breaks sampling: arrivals, dropouts, availability, over-selection
    check_dp_setup(
        "fedbuff",
        "arrival",
        mechanism="dp_ftrl",
        once_per_tree=True,
        dropout=0.1,
        availability=True,
        over_selection=0.3,
        **OK,
    )


@pytest.mark.parametrize(
    ("args", "kwargs", "field"),
    [
        (("fedbuff", "arrival"), {}, "privacy.mechanism"),
        (("fedasync", "arrival"), {}, "privacy.mechanism"),
        (("fedavg", "epoch"), {}, "privacy.sampling"),
        (("fedavg", "without_replacement"), {"availability": True}, "federated.availability"),
        (("fedavg", "without_replacement"), {"over_selection": 0.3}, "federated.over_selection"),
        (("fedavg", "without_replacement"), {"dropout": 0.1}, "federated.dropout"),
        (("fedavg", "without_replacement"), {"accounting": "pld"}, "privacy.accounting"),
        (("fedavg", "poisson"), {}, "privacy.public_weight"),
        (("fedavg", "without_replacement"), {"weighting": "examples"}, "federated.weighting"),
        (("fedbuff", "arrival"), {"mechanism": "dp_ftrl"}, "privacy.once_per_tree"),
        (
            ("fedavg", "epoch"),
            {"mechanism": "dp_ftrl", "once_per_tree": True, "clip": "adaptive"},
            "privacy.clip",
        ),
        (
            ("fedavg", "without_replacement"),
            {"clip": "adaptive", "count_noise_std": 0.0},
            "privacy.count_noise_std",
        ),
        (("fedavg", "without_replacement"), {"noise_multiplier": 0.0}, "privacy.noise_multiplier"),
        (("fedavg", "without_replacement"), {"delta": 1e-3}, "privacy.delta"),
        (("fedavg", "without_replacement"), {"cohort_size": 5000}, "federated.cohort"),
        (("fedavg", "without_replacement"), {"clip_norm": -1.0}, "privacy.clip_norm"),
    ],
)
def test_refusals_name_field_and_fix(args, kwargs, field):
    with pytest.raises(ConfigError) as e:
        check_dp_setup(*args, **{**OK, **kwargs})
    assert e.value.field == field
    assert e.value.fix  # every refusal says what to do
