"""DP stages: clipping bounds, adaptive clip convergence, Gaussian and tree noise statistics,
determinism and bit-identical resume through the aggregation pipeline."""

import math

import numpy as np
import pytest
import torch
from scipy.stats import norm as normal

from fedvox.errors import ConfigError
from fedvox.fl.aggregation import Aggregator
from fedvox.privacy.dp import (
    AdaptiveClip,
    FixedClip,
    GaussianNoise,
    client_norms,
    combined_noise_multiplier,
    gaussian_like,
    mean_noise_std,
    update_noise_multiplier,
)
from fedvox.privacy.tree import TreeNoise, dyadic_nodes
from fedvox.rng import Purpose, derived_rng


def _deltas(gen, k, shapes=((3, 4), (5,))):
    return {f"p{i}": torch.randn(k, *s, generator=gen) for i, s in enumerate(shapes)}


def _with_norms(norms, dim=8, seed=0):
    """Stacked deltas with the given per-client L2 norms (split over two parameters)."""
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(len(norms), dim, generator=g, dtype=torch.float64)
    d = d / d.norm(dim=1, keepdim=True) * torch.as_tensor(norms, dtype=torch.float64)[:, None]
    return {"a": d[:, :3].float(), "b": d[:, 3:].float()}


# -- clipping ---------------------------------------------------------------------------------


def test_fixed_clip_bounds_norm_and_keeps_small_updates():
    gen = torch.Generator().manual_seed(1)
    deltas = _deltas(gen, 50)
    scale = torch.linspace(0.01, 3, 50)
    deltas = {n: d * scale.reshape(-1, *[1] * (d.dim() - 1)) for n, d in deltas.items()}
    clip = FixedClip(1.0)
    out, w = clip(deltas, torch.ones(50))
    assert torch.equal(w, torch.ones(50))
    before, after = client_norms(deltas), client_norms(out)
    assert float(after.max()) <= 1.0 * (1 + 1e-6)
    small = before <= 1.0
    assert small.any() and (~small).any()
    for n in deltas:
        assert torch.equal(out[n][small], deltas[n][small])  # untouched, bit for bit
    assert torch.allclose(after[~small], torch.ones(int((~small).sum()), dtype=torch.float64))
    clip.end_step(50)
    m = clip.last_metrics()
    assert m["fraction_clipped"] == pytest.approx(float((~small).double().mean()))
    assert m["norm_max"] == pytest.approx(float(before.max()))


def test_clip_norm_is_joint_over_all_parameters():
    # each parameter alone has norm 0.8 < 1, jointly 0.8·√2 > 1: must be clipped
    deltas = {"a": torch.tensor([[0.8, 0.0]]), "b": torch.tensor([[0.0, 0.8]])}
    out, _ = FixedClip(1.0)(deltas, torch.ones(1))
    assert float(client_norms(out)[0]) == pytest.approx(1.0, rel=1e-6)


def test_clip_refuses_weights_above_one():
    with pytest.raises(ConfigError) as e:
        FixedClip(1.0)({"a": torch.ones(2, 3)}, torch.tensor([1.0, 7.0]))
    assert e.value.field == "federated.weighting"


@pytest.mark.parametrize(("gamma", "sigma_b"), [(0.5, 0.0), (0.9, 0.0), (0.5, 5.0), (0.9, 5.0)])
def test_adaptive_clip_converges_to_quantile(gamma, sigma_b):
    rng = np.random.default_rng(7)
    clip = AdaptiveClip(0.1, gamma, learning_rate=0.2, count_noise_std=sigma_b, seed=3)
    logs = []
    for _ in range(400):
        norms = rng.lognormal(0.0, 1.0, size=100)
        clip(_with_norms(norms), torch.ones(100))
        clip.end_step(100)
        logs.append(math.log(clip.clip_norm))
    target = math.exp(normal.ppf(gamma))  # γ-quantile of lognormal(0, 1)
    settled = math.exp(np.mean(logs[-150:]))
    assert abs(settled / target - 1) < 0.10, (settled, target)


def test_adaptive_clip_sign_uses_unclipped_fraction():
    clip = AdaptiveClip(10.0, 0.5, learning_rate=0.2)
    clip(_with_norms([1.0] * 10), torch.ones(10))  # none clipped: b̄ = 1 > γ, S must shrink
    clip.end_step(10)
    assert clip.clip_norm == pytest.approx(10.0 * math.exp(-0.2 * 0.5))
    clip(_with_norms([100.0] * 10), torch.ones(10))  # all clipped: b̄ = 0 < γ, S grows
    clip.end_step(10)
    assert clip.clip_norm == pytest.approx(10.0)


def test_adaptive_clip_state_round_trip_continues_identically():
    rng = np.random.default_rng(0)
    batches = [rng.lognormal(size=20) for _ in range(30)]
    a = AdaptiveClip(1.0, 0.7, count_noise_std=2.0, seed=11)
    trace_a = []
    for i, norms in enumerate(batches):
        a(_with_norms(norms), torch.ones(20))
        a.end_step(20)
        trace_a.append(a.clip_norm)
        if i == 14:
            saved = a.state_dict()
    b = AdaptiveClip(5.0, 0.7, count_noise_std=2.0, seed=11)
    b.load_state_dict(saved)
    for norms in batches[15:]:
        b(_with_norms(norms), torch.ones(20))
        b.end_step(20)
    assert b.clip_norm == trace_a[-1]
    c = AdaptiveClip(1.0, 0.7, count_noise_std=2.0, seed=12)  # another seed: other noise
    for norms in batches:
        c(_with_norms(norms), torch.ones(20))
        c.end_step(20)
    assert c.clip_norm != trace_a[-1]


# -- Gaussian noise ---------------------------------------------------------------------------


def test_gaussian_noise_std_and_determinism():
    clip = FixedClip(0.5)
    noise = GaussianNoise(1.3, clip, seed=5)
    zeros = {"a": torch.zeros(300, 200), "b": torch.zeros(10_000)}
    out, w = noise(zeros, 4.0, 4)
    flat = torch.cat([t.flatten() for t in out.values()])
    assert w == 4.0
    assert float(flat.std()) == pytest.approx(1.3 * 0.5, rel=0.02)
    assert abs(float(flat.mean())) < 0.01
    again, _ = GaussianNoise(1.3, clip, seed=5)(zeros, 4.0, 4)
    assert all(torch.equal(out[n], again[n]) for n in out)
    second, _ = noise(zeros, 4.0, 4)  # next step: fresh noise
    assert not torch.equal(out["a"], second["a"])
    resumed = GaussianNoise(1.3, clip, seed=5)
    resumed.load_state_dict({"step": 1})
    third, _ = resumed(zeros, 4.0, 4)
    assert all(torch.equal(second[n], third[n]) for n in out)
    _, pw = GaussianNoise(1.0, clip, public_weight=10.0)(zeros, 4.0, 4)
    assert pw == 10.0


def test_noise_helpers():
    assert mean_noise_std(1.0, 2.0, 50) == pytest.approx(0.04)
    z_delta = update_noise_multiplier(1.0, 5.0)
    assert z_delta == pytest.approx((1.0 - 0.01) ** -0.5)
    assert combined_noise_multiplier(z_delta, 5.0) == pytest.approx(1.0)
    with pytest.raises(ConfigError):
        update_noise_multiplier(1.0, 0.4)  # 2σ_b < z: the count alone exceeds the budget
    with pytest.raises(ConfigError):
        combined_noise_multiplier(1.0, 0.0)


def _pipeline(adaptive: bool):
    if adaptive:
        clip = AdaptiveClip(1.0, 0.5, count_noise_std=1.5, seed=2)
    else:
        clip = FixedClip(1.0)
    return Aggregator(stages=[clip], noise=[GaussianNoise(0.8, clip, seed=9)]), clip


def test_aggregator_end_to_end_sum_is_clipped_plus_noise():
    gen = torch.Generator().manual_seed(4)
    deltas = {n: 3 * d for n, d in _deltas(gen, 6).items()}
    agg, clip = _pipeline(adaptive=False)
    agg.accumulate({n: d[:4] for n, d in deltas.items()}, torch.ones(4))
    agg.accumulate({n: d[4:] for n, d in deltas.items()}, torch.ones(2))
    total, weight, count = agg.result()
    factor = (1.0 / client_norms(deltas)).clamp(max=1).float()
    clipped = {n: d * factor.reshape(-1, *[1] * (d.dim() - 1)) for n, d in deltas.items()}
    noise = gaussian_like(total, 0.8 * 1.0, derived_rng(9, Purpose.DP_NOISE, 0))
    for n in total:
        assert torch.allclose(total[n], clipped[n].sum(0) + noise[n], atol=1e-5)
    assert (weight, count) == (6.0, 6)
    assert clip.last_metrics()["clients"] == 6


def test_aggregator_resume_is_bit_identical():
    gen = torch.Generator().manual_seed(8)
    steps = [[_deltas(gen, 3), _deltas(gen, 2)] for _ in range(5)]

    def run(agg, batches):
        out = []
        for parts in batches:
            for d in parts:
                agg.accumulate(d, torch.ones(d["p0"].shape[0]))
            out.append(agg.result()[0])
        return out

    full, _ = _pipeline(adaptive=True)
    ref = run(full, steps)
    first, _ = _pipeline(adaptive=True)
    run(first, steps[:2])
    first.accumulate(steps[2][0], torch.ones(3))  # checkpoint in the middle of a step
    state = first.state_dict()
    second, clip2 = _pipeline(adaptive=True)
    second.load_state_dict(state)
    second.accumulate(steps[2][1], torch.ones(2))
    got = [second.result()[0], *run(second, steps[3:])]
    for a, b in zip(ref[2:], got, strict=True):
        assert all(torch.equal(a[n], b[n]) for n in a)
    assert clip2.clip_norm == full.stages[0].clip_norm


# -- DP-FTRL tree noise -----------------------------------------------------------------------


def test_dyadic_nodes_partition_the_prefix():
    for t in range(1, 70):
        covered = []
        for level, index in dyadic_nodes(t):
            covered += range(index * 2**level + 1, (index + 1) * 2**level + 1)
        assert sorted(covered) == list(range(1, t + 1))
        assert len(dyadic_nodes(t)) == bin(t).count("1")


def test_tree_cumulative_variance_is_sigma2_times_popcount():
    sigma, like = 0.7, {"w": torch.zeros(400)}
    samples = {t: [] for t in range(1, 17)}
    for seed in range(50):
        tree = TreeNoise(sigma, seed=seed)
        for t in samples:
            samples[t].append(tree.cumulative_noise(t, like)["w"])
    for t, xs in samples.items():
        x = torch.cat(xs).double()
        k = bin(t).count("1")
        # 20,000 samples: the variance estimate has relative std √(2/20000) = 1%
        assert float(x.var()) == pytest.approx(sigma**2 * k, rel=0.05), t


def test_tree_increments_telescope_and_sgd_tracks_cumulative_noise():
    like = {"a": torch.zeros(5, 3), "b": torch.zeros(7)}
    g = {"a": torch.full((5, 3), 0.1), "b": torch.full((7,), -0.2)}
    tree = TreeNoise(1.5, seed=4, restart_every=11)
    ref = TreeNoise(1.5, seed=4)
    w0 = {n: torch.ones_like(v) for n, v in like.items()}
    w = {n: v.clone() for n, v in w0.items()}
    lr, total_inc = 0.5, {n: torch.zeros_like(v) for n, v in like.items()}
    for t in range(1, 24):
        noisy, _ = tree(g, 1.0, 1)
        inc = {n: noisy[n] - g[n] for n in g}
        total_inc = {n: total_inc[n] + inc[n] for n in g}
        w = {n: w[n] - lr * noisy[n] for n in w}
        if t == 11:
            n11 = ref.cumulative_noise(11, like, tree=0)
            assert all(torch.allclose(total_inc[n], n11[n], atol=1e-5) for n in g)
    # after the automatic restart at 11 and 22: w = w0 − η(Σg + N_11⁽⁰⁾ + N_11⁽¹⁾ + N_1⁽²⁾)
    assert tree.restarts == 2 and tree.step_counts() == [11, 11, 1]
    parts = [
        ref.cumulative_noise(11, like, tree=0),
        ref.cumulative_noise(11, like, tree=1),
        ref.cumulative_noise(1, like, tree=2),
    ]
    for n in w:
        want = w0[n] - lr * (23 * g[n] + sum(p[n] for p in parts))
        assert torch.allclose(w[n], want, atol=1e-4)
    # trees are independent: the new tree's first node is not the old one's
    first_nodes = [ref.node_noise(like, 0, 0, tree=r)["a"] for r in range(3)]
    assert not torch.equal(first_nodes[0], first_nodes[1])
    assert not torch.equal(first_nodes[1], first_nodes[2])


def test_tree_restart_manual_and_resume():
    like = {"w": torch.zeros(6)}
    a = TreeNoise(1.0, seed=1)
    outs = []
    for t in range(1, 10):
        outs.append(a(like, 1.0, 1)[0]["w"])
        if t == 4:
            a.restart()
            a.restart()  # empty tree: no-op
        if t == 6:
            state = a.state_dict()
    assert a.step_counts() == [4, 5]
    b = TreeNoise(1.0, seed=1)
    b.load_state_dict(state)
    for t in range(7, 10):
        assert torch.equal(b(like, 1.0, 1)[0]["w"], outs[t - 1])
    assert torch.equal(outs[4], a.cumulative_noise(1, like, tree=1)["w"])


def test_tree_refuses_bad_settings():
    with pytest.raises(ConfigError):
        TreeNoise(0.0)
    with pytest.raises(ConfigError):
        TreeNoise(1.0, restart_every=0)
