"""Upload compression: quantisation unbiased and within its step, bytes by hand, top-k error
feedback (carried, resumed bit-exactly), composition with DP clipping, secure aggregation
(exact 8-bit and float16 sums, top-k refused) and robust rules, and determinism."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_fl_toys import class_population, mlp_task

from fedvox.errors import ConfigError
from fedvox.experiment.compression import levels_ring_bits
from fedvox.experiment.config import config_from_dict
from fedvox.experiment.privacy import build_privacy
from fedvox.fl import ClientConfig, FedAvg, ServerSGD, Simulator, SimulatorConfig
from fedvox.fl.aggregation import Aggregator
from fedvox.fl.compression import (
    Compress,
    CompressionConfig,
    quantize,
    quantize_shared,
    tensor_bytes,
    to_float16,
    upload_bytes,
)
from fedvox.fl.robust import RobustCombiner, coordinate_median
from fedvox.privacy.dp import FixedClip, GaussianNoise, client_norms, gaussian_like
from fedvox.privacy.secagg import (
    Entropy,
    MaskedInput,
    SecAggConfig,
    SecureSum,
    encode,
    pack_ring,
    ring_bytes,
    run_protocol,
    unpack_ring,
    wire_size,
)
from fedvox.records import TripRecord
from fedvox.rng import Purpose, derived_rng

SHAPES = {"a": (3, 5), "b": (7,)}  # 15 and 7 coordinates


def _equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


def _deltas(n: int, seed: int = 0, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(n, *s, generator=g) * scale for k, s in SHAPES.items()}


# -- quantisation --------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("ring", [None, 2.0**-22])
def test_quantisation_is_unbiased_and_within_one_step(bits: int, ring: float | None) -> None:
    chunk, dim, draws = 16, 48, 4000
    x = torch.randn(dim, generator=torch.Generator().manual_seed(1))
    # `draws` independent quantisations at once: copies of x, chunks aligned with the copies
    u = torch.from_numpy(np.random.default_rng(0).random(dim * draws))
    dec = quantize(x.repeat(draws), bits, chunk, u, ring).double().view(draws, dim)
    parts = x.double().view(-1, chunk)
    span = parts.max(1).values - parts.min(1).values
    step = span / (2**bits - 1)
    if ring is not None:  # a power of two >= span/(L − 2): below twice span/(L − 2)
        step = 2 * span / (2**bits - 2)
    err = (dec - x.double()).abs().view(draws, -1, chunk).amax((0, 2))
    assert bool((err <= step + 1e-12).all())  # |Q(x) − x| < the chunk's step
    assert all(len(torch.unique(c)) <= 2**bits for c in dec.view(draws, -1, chunk)[0])
    # the mean of draws within one step has a standard error below step / (2√draws)
    tol = 5 * float(step.max()) / (2 * math.sqrt(draws))
    assert float((dec.mean(0) - x.double()).abs().max()) < tol


def test_constant_chunks_and_ring_grid_are_exact() -> None:
    x = torch.full((10,), 0.3)
    u = torch.rand(10, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.equal(quantize(x, 4, 4, u), x)  # min = max: no rounding at all
    y = torch.randn(100, generator=torch.Generator().manual_seed(2)) * 3
    dec = quantize(y, 2, 32, torch.rand(100, dtype=torch.float64), 2.0**-22)
    scaled = dec.double() * 2.0**22  # every decoded value lies on the ring's grid
    assert torch.equal(scaled, scaled.round())


# -- bytes, by hand ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        # codes ⌈n·bits/8⌉ + 8 bytes per chunk of 4: a = 15 coords (4 chunks), b = 7 (2 chunks)
        (CompressionConfig("quantize", bits=8, chunk=4), (15 + 32) + (7 + 16)),
        (CompressionConfig("quantize", bits=4, chunk=4), (8 + 32) + (4 + 16)),
        (CompressionConfig("quantize", bits=2, chunk=4), (4 + 32) + (2 + 16)),
        (CompressionConfig("float16"), 2 * 22),
        (CompressionConfig("none"), 4 * 22),
        # top-k 20%: a keeps 3 of 15 (4-bit indices: 12 bits → 2 bytes) + 3 float32 values;
        # b keeps ⌈1.4⌉ = 2 of 7 (3-bit indices: 6 bits → 1 byte) + 2 values
        (CompressionConfig("topk", fraction=0.2), (12 + 2) + (8 + 1)),
    ],
)
def test_bytes_as_computed_by_hand(config: CompressionConfig, expected: int) -> None:
    assert upload_bytes(SHAPES, config) == expected


def test_topk_indices_use_a_bitmask_when_cheaper() -> None:
    # 4 of 8: 4 × 3-bit indices = 12 bits > an 8-bit mask of which are sent → 1 byte
    assert tensor_bytes(8, CompressionConfig("topk", fraction=0.5)) == 4 * 4 + 1
    assert tensor_bytes(1, CompressionConfig("topk", fraction=0.01)) == 4  # no index needed


def test_trip_records_and_counters_carry_the_compressed_size() -> None:
    recs: list = []
    stage = Compress(CompressionConfig("quantize", bits=4, chunk=8))
    sim = _sim(stage, callback=recs.append)
    sim.run(max_server_steps=3)
    shapes = {n: tuple(t.shape) for n, t in sim.params.items()}
    per_trip = upload_bytes(shapes, stage.config)
    # mlp_task's tensors of 48, 8, 8, 8, 24 and 3 coordinates: ⌈n/2⌉ + 8 per chunk of 8
    assert per_trip == (24 + 48) + 3 * (4 + 8) + (12 + 24) + (2 + 8) == 154
    assert sim.bytes_per_trip == 4 * 99
    up = [r.bytes_up for r in recs if isinstance(r, TripRecord) and r.status == "aggregated"]
    assert up and set(up) == {per_trip}
    assert sim.counters["bytes_up"] == per_trip * sim.counters["trips_completed"]
    assert sim.bytes_down_per_trip == sim.bytes_per_trip  # downloads stay float32


# -- top-k and error feedback --------------------------------------------------------------


def test_error_feedback_carries_what_was_not_sent() -> None:
    stage = Compress(CompressionConfig("topk", fraction=0.2))
    g = torch.Generator().manual_seed(3)
    inputs = {n: torch.zeros(s, dtype=torch.float64) for n, s in SHAPES.items()}
    sent = {n: torch.zeros(s, dtype=torch.float64) for n, s in SHAPES.items()}
    for trip in range(6):
        x = {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in SHAPES.items()}
        out = stage.compress(x, client=7, trip=trip)
        assert int((out["a"] != 0).sum()) == 3 and int((out["b"] != 0).sum()) == 2
        for n in SHAPES:
            inputs[n] += x[n]
            sent[n] += out[n]
    for n in SHAPES:  # Σ sent + residual = Σ inputs over the trips
        assert torch.allclose(sent[n] + stage.residuals[7][n], inputs[n], rtol=0, atol=1e-12)
    assert list(stage.residuals) == [7]  # memory: one residual per client that has sent
    assert stage.residual_bytes() == 8 * 22


def _sim(stage: Compress, callback=None, seed: int = 0, stages=None) -> Simulator:
    pop = class_population([6 + (c % 5) for c in range(12)], seed=1)
    return Simulator(
        mlp_task(),
        pop,
        FedAvg(ServerSGD(1.0), weighting="uniform"),
        ClientConfig(batch_size=4, lr=0.2),
        SimulatorConfig(concurrency=4, seed=seed),
        callback=callback,
        stages=[stage] if stages is None else stages,
    )


def test_resume_restores_residuals_bit_exactly(tmp_path) -> None:
    def topk() -> Compress:
        return Compress(CompressionConfig("topk", fraction=0.1))

    full_stage = topk()
    full = _sim(full_stage).run(max_server_steps=8)
    sim = _sim(topk())
    sim.run(max_server_steps=4)
    torch.save(sim.state_dict(), tmp_path / "snap.pt")
    sim.run(max_server_steps=6)  # the snapshot must not share residuals with the live run
    stage = topk()
    fresh = _sim(stage)
    fresh.load_state_dict(torch.load(tmp_path / "snap.pt"))
    assert _equal(fresh.run(max_server_steps=8), full)
    assert set(stage.residuals) == set(full_stage.residuals)
    assert all(_equal(stage.residuals[c], full_stage.residuals[c]) for c in stage.residuals)
    with pytest.raises(ConfigError, match=r"compression\.kind"):
        _sim(Compress(CompressionConfig("float16"))).load_state_dict(
            torch.load(tmp_path / "snap.pt")
        )


@pytest.mark.parametrize("kind", ["quantize", "topk", "float16"])
def test_same_seed_same_bits_and_trips_differ(kind: str) -> None:
    def run(seed: int) -> dict:
        cfg = CompressionConfig(kind, bits=2, chunk=8, fraction=0.2, seed=seed)
        return _sim(Compress(cfg)).run(max_server_steps=4)

    assert _equal(run(0), run(0))
    stage = Compress(CompressionConfig("quantize", bits=2))
    x = {n: t[0] for n, t in _deltas(1).items()}
    assert not _equal(stage.compress(x, 0, 0), stage.compress(x, 0, 1))
    assert _equal(stage.compress(x, 0, 1), Compress(stage.config).compress(x, 0, 1))


# -- composition ---------------------------------------------------------------------------


def test_dp_clip_then_quantise_keeps_the_decoded_update_within_the_clip_norm() -> None:
    clip = FixedClip(1.0)
    deltas = _deltas(64, seed=4, scale=3.0)
    jobs = [(c, 0) for c in range(64)]
    weights = torch.ones(64)
    clipped, _ = clip(deltas, weights)
    loose = Compress(CompressionConfig("quantize", bits=2, chunk=4))
    raw, _ = loose(clipped, weights, jobs)
    assert float(client_norms(raw).max()) > 1.0  # rounding alone can break the clip bound
    bounded = Compress(CompressionConfig("quantize", bits=2, chunk=4), [lambda: clip.clip_norm])
    out, _ = bounded(clipped, weights, jobs)
    assert float(client_norms(out).max()) <= 1.0 + 1e-6
    bounded.end_step(64)
    assert bounded.last_metrics()["compress_rescaled"] > 0


def test_dp_pipeline_puts_compression_after_clipping_with_the_live_clip_norm() -> None:
    from fedvox.experiment.compression import build_compression
    from fedvox.experiment.robust import build_robust

    cfg = config_from_dict(
        {
            "federated": {
                "weighting": "uniform",
                "privacy": {
                    "mechanism": "gaussian",
                    "clip": "adaptive",
                    "clip_norm": 0.5,
                    "count_noise_std": 5.0,
                },
                "compression": {"kind": "quantize", "bits": 4},
            }
        }
    )
    f = cfg.federated
    assert f is not None
    privacy = build_privacy(f, 1000, 0)
    stage = build_compression(f, privacy, build_robust(f), 0)
    assert stage is not None and len(stage.bounds) == 1
    privacy.stages[0].clip_norm = 0.25  # adaptive clipping moved S: the stage follows it
    assert stage.bounds[0]() == 0.25


def test_secure_sum_of_8bit_updates_equals_the_plain_sum_of_the_decoded() -> None:
    ring = SecAggConfig(scale_bits=20)
    stage = Compress(
        CompressionConfig("quantize", bits=8, chunk=8, ring_scale_bits=20, ring_clip=8)
    )
    n = 6
    deltas = _deltas(n, seed=5, scale=2.0)
    weights = torch.ones(n)
    decoded, _ = stage(deltas, weights, [(c, 0) for c in range(n)])
    total, weight, count = SecureSum(ring, 1)(decoded, weights)
    assert (weight, count) == (6.0, 6)
    for name, d in decoded.items():  # exact: the ring holds every decoded value
        assert torch.equal(total[name], d.double().sum(0).float())


def test_secure_sum_of_float16_updates_is_exact_in_a_64_bit_ring() -> None:
    cfg = config_from_dict(
        {
            "federated": {
                "weighting": "uniform",
                "concurrency": 5,
                "privacy": {"secure_aggregation": True},
                "compression": {"kind": "float16"},
            }
        }
    ).federated
    assert cfg is not None
    summer = build_privacy(cfg, 50, 0).summer
    assert isinstance(summer, SecureSum)
    assert (summer.config.scale_bits, summer.config.modulus_bits) == (24, 62)
    deltas = _deltas(5, seed=6, scale=1e-3)  # small values: float16's finest steps
    decoded = {n: to_float16(t) for n, t in deltas.items()}
    total, _, _ = summer(decoded, torch.ones(5))
    for name, d in decoded.items():
        assert torch.equal(total[name], d.double().sum(0).float())
    shapes = {n: tuple(t.shape[1:]) for n, t in deltas.items()}
    assert summer.upload_bytes(shapes) == 4 + 8 * (22 + 1)  # uint64 ring elements


def test_bytes_under_secure_aggregation_are_the_masked_input_the_protocol_sends() -> None:
    cfg = SecAggConfig(scale_bits=16)
    summer = SecureSum(cfg, 2)
    n, dim = 3, 22 + 1
    params = summer.protocol_params(n, dim, 0)
    rng = np.random.default_rng(0)
    vectors = [encode(rng.normal(size=22), 1.0, cfg, rng) for _ in range(n)]
    transcript: list = []
    entropies = [Entropy(bytes([i]) * 32) for i in range(n)]
    run_protocol(params, lambda i: vectors[i], entropies, transcript=transcript)
    masked = [m for d, _, m in transcript if d == "up" and isinstance(m, MaskedInput)]
    assert len(masked) == n
    assert {wire_size(m) for m in masked} == {summer.upload_bytes(SHAPES)} == {4 + 4 * 23}
    # the simulator counts it per trip, whatever compression ran before the secure sum
    stage = Compress(CompressionConfig("quantize", ring_scale_bits=16, ring_clip=8))
    agg = Aggregator([stage], summer=summer)
    assert agg.upload_bytes(SHAPES) == 4 + 4 * 23
    assert Aggregator([stage]).upload_bytes(SHAPES) == upload_bytes(SHAPES, stage.config)


@pytest.mark.parametrize(
    ("federated", "field", "reason"),
    [
        (
            {"compression": {"kind": "topk"}},
            "federated.compression.kind",
            'use kind = "quantize" or "float16"',
        ),
        (
            {"algorithm": "fedbuff", "buffer_size": 2, "compression": {"kind": "quantize"}},
            "federated.staleness",
            "weights of 1",
        ),
        (
            {"compression": {"kind": "float16"}, "privacy": {"secagg_scale_bits": 20}},
            "federated.privacy.secagg_scale_bits",
            "2^-24",
        ),
    ],
)
def test_secure_aggregation_refusals_name_the_field(
    federated: dict, field: str, reason: str
) -> None:
    privacy = {"secure_aggregation": True, **federated.pop("privacy", {})}
    f = {"weighting": "uniform", "concurrency": 5, "privacy": privacy, **federated}
    with pytest.raises(ConfigError) as err:
        config_from_dict({"federated": f})
    assert err.value.field == field
    assert reason in str(err.value)


def test_topk_refusal_says_what_composes() -> None:
    with pytest.raises(ConfigError) as err:
        CompressionConfig("topk", ring_scale_bits=22, ring_clip=8)
    msg = str(err.value)
    assert "which coordinates" in msg and "quantize" in msg and "float16" in msg


def test_robust_median_sees_the_decoded_updates() -> None:
    stage = Compress(CompressionConfig("quantize", bits=4, chunk=8))
    deltas = _deltas(5, seed=7)
    jobs = [(c, 2) for c in range(5)]
    agg = Aggregator([stage], summer=RobustCombiner("median"))
    agg.accumulate(deltas, torch.ones(5), jobs)
    total, weight, count = agg.result()
    decoded, _ = Compress(stage.config)(deltas, torch.ones(5), jobs)
    expected = coordinate_median(decoded)
    assert count == 5 and all(torch.allclose(total[n], expected[n] * weight) for n in total)


def test_a_stage_with_device_state_needs_the_jobs() -> None:
    agg = Aggregator([Compress(CompressionConfig("float16"))])
    with pytest.raises(ValueError, match="client, trip"):
        agg.accumulate(_deltas(2), torch.ones(2))


# -- composition with secure aggregation and DP --------------------------------------------


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_secure_sum_of_quantised_updates_is_the_plain_sum_at_every_width(bits: int) -> None:
    ring = SecAggConfig(scale_bits=20)
    stage = Compress(
        CompressionConfig("quantize", bits=bits, chunk=8, ring_scale_bits=20, ring_clip=8)
    )
    n = 5
    deltas = _deltas(n, seed=8, scale=3.0)
    deltas["a"][0, 0, :3] = torch.tensor([50.0, -50.0, 8.0])  # beyond the ring's clip of 8
    decoded, _ = stage(deltas, torch.ones(n), [(c, 1) for c in range(n)])
    assert float(decoded["a"][0, 0, 0]) <= 8 and float(decoded["a"][0, 0, 1]) >= -8
    total, weight, count = SecureSum(ring, 3)(decoded, torch.ones(n))
    assert (weight, count) == (5.0, 5)
    for name, d in decoded.items():
        assert torch.equal(total[name], d.double().sum(0).float())


def _dp_secagg_quantise(z: float, bits: int = 4):
    clip = FixedClip(0.5)
    ring = SecAggConfig(scale_bits=20)
    stage = Compress(
        CompressionConfig("quantize", bits=bits, chunk=64, ring_scale_bits=20, ring_clip=8),
        [lambda: clip.clip_norm],
    )
    noise = [GaussianNoise(z, clip, seed=11)] if z > 0 else []
    return Aggregator([clip, stage], summer=SecureSum(ring, 4), noise=noise)


def test_dp_noise_is_added_after_decoding_with_std_z_times_the_clip_norm() -> None:
    n, dim = 4, 40_000
    g = torch.Generator().manual_seed(9)
    deltas = {"w": torch.randn(n, dim, generator=g)}
    jobs = [(c, 0) for c in range(n)]
    plain = _dp_secagg_quantise(0.0)
    plain.accumulate(deltas, torch.ones(n), jobs)
    exact, _, _ = plain.result()
    noisy_agg = _dp_secagg_quantise(2.0)
    noisy_agg.accumulate(deltas, torch.ones(n), jobs)
    noisy, weight, count = noisy_agg.result()
    assert (weight, count) == (4.0, 4)
    assert noisy_agg.noise[0].noise_std == 2.0 * 0.5  # the mechanism reads z·S, S = clip norm
    noise = (noisy["w"] - exact["w"]).double()
    # 40,000 draws: the sample std is within 2 % of z·S = 1 (its standard error is 0.35 %)
    assert abs(float(noise.std()) - 1.0) < 0.02 and abs(float(noise.mean())) < 0.02
    # drawn by the server on the decoded sum (step 0's draw, exactly), never through the ring
    drawn = gaussian_like(exact, 2.0 * 0.5, derived_rng(11, Purpose.DP_NOISE, 0))
    assert torch.equal(noisy["w"], exact["w"] + drawn["w"])
    # and the sensitivity holds after decoding: each decoded update is within S
    decoded, _ = Compress(plain.stages[1].config, [lambda: 0.5])(
        FixedClip(0.5)(deltas, torch.ones(n))[0], torch.ones(n), jobs
    )
    assert float(client_norms(decoded).max()) <= 0.5 + 1e-6


def test_dp_secure_aggregation_and_quantisation_run_end_to_end_in_the_simulator() -> None:
    def sim(summer) -> Simulator:
        clip = FixedClip(0.5)
        stage = Compress(
            CompressionConfig("quantize", bits=4, chunk=8, ring_scale_bits=20, ring_clip=8),
            [lambda: clip.clip_norm],
        )
        return Simulator(
            mlp_task(),
            class_population([8, 9, 10, 8, 9, 8], seed=4),
            FedAvg(ServerSGD(1.0), weighting="uniform"),
            ClientConfig(batch_size=4, lr=0.2),
            SimulatorConfig(concurrency=4, seed=2),
            stages=[clip, stage],
            summer=summer,
            noise=[GaussianNoise(0.3, clip, seed=5)],
        )

    secure = sim(SecureSum(SecAggConfig(scale_bits=20), 6))
    a = secure.run(max_server_steps=3)
    b = sim(None).run(max_server_steps=3)  # the same compression and noise, summed in the clear
    again = sim(SecureSum(SecAggConfig(scale_bits=20), 6)).run(max_server_steps=3)
    for n in a:
        assert torch.equal(a[n], again[n])  # bit-reproducible
        # rescaled (off-grid) updates are rounded by the ring: < 2^-20 per client and step
        assert torch.allclose(a[n], b[n], atol=1e-4), n
    assert secure.bytes_up_per_trip == 4 + 4 * (99 + 1)  # the 32-bit ring's masked input


# -- ring narrowing: a shared grid's levels in bits + ⌈log2 n⌉ bits -----------------------


def _grid_secure_sum(bits: int, n: int, c: float = 0.25) -> SecureSum:
    k = levels_ring_bits(bits, n)
    return SecureSum(SecAggConfig(modulus_bits=k, grid_range=c, grid_bits=bits), 7)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_shared_grid_levels_are_unbiased_exact_and_need_no_scales(bits: int) -> None:
    c, draws = 0.25, 3000
    x = torch.randn(16, generator=torch.Generator().manual_seed(1)) * 0.1
    u = torch.from_numpy(np.random.default_rng(0).random(16 * draws))
    dec, levels = quantize_shared(x.repeat(draws), bits, c, u)
    step = c * 2.0 ** (1 - bits)
    assert torch.equal(dec.double(), levels.double() * step - c)  # exact in float32
    assert int(levels.min()) >= 0 and int(levels.max()) < 2**bits
    inside = x.clamp(-c, c - step).double()
    assert float((dec.double().view(draws, 16) - inside).abs().max()) < step
    tol = 5 * step / (2 * math.sqrt(draws))
    assert float((dec.double().view(draws, 16).mean(0) - inside).abs().max()) < tol
    cfg = CompressionConfig("quantize", bits=bits, shared_range=c)
    assert upload_bytes(SHAPES, cfg) == math.ceil(15 * bits / 8) + math.ceil(7 * bits / 8)


@pytest.mark.parametrize(("bits", "n"), [(8, 5), (4, 8), (2, 3), (2, 16)])
def test_secure_sum_of_shared_grid_levels_is_exact_in_the_narrow_ring(bits: int, n: int) -> None:
    summer = _grid_secure_sum(bits, n)
    assert summer.config.modulus_bits == bits + math.ceil(math.log2(n))
    stage = Compress(CompressionConfig("quantize", bits=bits, shared_range=0.25, ring_levels=True))
    decoded, _ = stage(_deltas(n, seed=3, scale=0.2), torch.ones(n), [(i, 0) for i in range(n)])
    total, weight, count = summer(decoded, torch.ones(n))
    assert (weight, count) == (float(n), n)
    for name, d in decoded.items():
        assert torch.equal(total[name], d.double().sum(0).float())


@pytest.mark.parametrize(("bits", "n"), [(8, 4), (4, 7), (2, 8)])
def test_n_clients_at_the_extremes_do_not_overflow_the_narrow_ring(bits: int, n: int) -> None:
    summer = _grid_secure_sum(bits, n)
    step = 0.25 * 2.0 ** (1 - bits)
    top = {k: torch.full((n, *s), 0.25 - step) for k, s in SHAPES.items()}  # every j = 2^b − 1
    bottom = {k: torch.full((n, *s), -0.25) for k, s in SHAPES.items()}  # every j = 0
    for deltas, value in ((top, 0.25 - step), (bottom, -0.25)):
        total, weight, _ = summer(deltas, torch.ones(n))
        assert weight == n and all(bool((t == n * value).all()) for t in total.values())
    tight = SecAggConfig(
        modulus_bits=summer.config.modulus_bits - 1, grid_range=0.25, grid_bits=bits
    )
    with pytest.raises(ConfigError) as err:  # one bit fewer cannot hold n clients' top level
        tight.check_capacity(n)
    assert err.value.field == "secagg.modulus_bits" and "ceil(log2 n)" in str(err.value)


def test_narrow_ring_bytes_are_what_the_protocol_sends() -> None:
    cfg = config_from_dict(
        {
            "federated": {
                "weighting": "uniform",
                "concurrency": 5,
                "privacy": {"secure_aggregation": True},
                "compression": {"kind": "quantize", "bits": 4, "shared_range": 0.0625},
            }
        }
    ).federated
    assert cfg is not None
    from fedvox.experiment.compression import build_compression
    from fedvox.experiment.robust import build_robust

    privacy = build_privacy(cfg, 50, 0)
    summer = privacy.summer
    assert isinstance(summer, SecureSum)
    assert (summer.config.modulus_bits, summer.config.grid_bits) == (4 + 3, 4)
    stage = build_compression(cfg, privacy, build_robust(cfg), 0)
    assert stage is not None and stage.config.ring_levels
    agg = Aggregator([stage], summer=summer)
    assert agg.upload_bytes(SHAPES) == 4 + math.ceil(23 * 7 / 8) == 25  # vs 4 + 4·23 = 96
    # the MaskedInput the protocol actually sends has that size, and sums right
    n = 5
    decoded, _ = stage(_deltas(n, seed=2, scale=0.05), torch.ones(n), [(i, 0) for i in range(n)])
    flat = [
        torch.cat([decoded[k][i].reshape(-1) for k in SHAPES]).double().numpy() for i in range(n)
    ]
    vectors = [encode(v, 1.0, summer.config, np.random.default_rng(0)) for v in flat]
    params = summer.protocol_params(n, 23, 0)
    transcript: list = []
    entropies = [Entropy(bytes([i]) * 32) for i in range(n)]
    total, _, _ = run_protocol(params, lambda i: vectors[i], entropies, transcript=transcript)
    masked = [m for d, _, m in transcript if d == "up" and isinstance(m, MaskedInput)]
    assert {wire_size(m) for m in masked} == {25}
    assert np.array_equal(total, np.sum(vectors, axis=0))


@pytest.mark.parametrize(
    ("compression", "privacy", "reason"),
    [
        ({"kind": "quantize", "shared_range": 0.1}, {}, "power of two"),
        ({"kind": "float16", "shared_range": 0.25}, {}, "quantisation grid"),
        (
            {"kind": "quantize", "shared_range": 0.25},
            {"mechanism": "gaussian", "noise_multiplier": 1.0, "delta": 1e-3},
            "per-chunk quantisation composes",
        ),
    ],
)
def test_shared_grid_refusals_name_the_field(compression: dict, privacy: dict, reason: str) -> None:
    f = {
        "weighting": "uniform",
        "concurrency": 5,
        "privacy": {"secure_aggregation": True, **privacy},
        "compression": compression,
    }
    with pytest.raises(ConfigError) as err:
        config_from_dict({"federated": f})
    assert err.value.field == "federated.compression.shared_range"
    assert reason in str(err.value)


def test_packed_ring_elements_round_trip() -> None:
    rng = np.random.default_rng(4)
    for bits in (2, 7, 13, 31):
        v = rng.integers(0, 2**bits, size=37).astype(np.uint32)
        data = pack_ring(v, bits)
        assert len(data) == ring_bytes(37, bits, np.dtype(np.uint32)) == math.ceil(37 * bits / 8)
        assert np.array_equal(unpack_ring(data, bits, 37, np.dtype(np.uint32)), v)
    assert ring_bytes(37, 32, np.dtype(np.uint32)) == 4 * 37  # word rings as before


@pytest.mark.parametrize(
    ("privacy", "compression", "ring_bits"),
    [
        (  # DP + secure aggregation + per-chunk 8-bit quantisation: the 32-bit ring
            'mechanism = "gaussian"\nnoise_multiplier = 0.8\nclip_norm = 0.5\n'
            "secure_aggregation = true\ndelta = 1e-3\n",
            'kind = "quantize"\nbits = 8\n',
            32,
        ),
        (  # secure aggregation + a shared 4-bit grid: a ring of 4 + ⌈log2 4⌉ = 6 bits
            "secure_aggregation = true\n",
            'kind = "quantize"\nbits = 4\nshared_range = 0.015625\n',
            6,
        ),
    ],
)
def test_a_run_with_secure_aggregation_and_compression_counts_the_ring_it_sends(
    tmp_path, privacy: str, compression: str, ring_bits: int
) -> None:
    from test_federated_e2e import CFG
    from typer.testing import CliRunner

    from fedvox.cli import app
    from fedvox.records import EvalRecord, ServerStepRecord, read_run_log

    text = CFG.format(algorithm="fedavg", cache=tmp_path / "cache", steps=2, seed=0)
    text = text.replace("[federated]\n", '[federated]\nweighting = "uniform"\n')
    text += "[federated.privacy]\n" + privacy + "[federated.compression]\n" + compression
    (tmp_path / "c.toml").write_text(text)
    out = tmp_path / "r"
    res = CliRunner().invoke(app, ["train", str(tmp_path / "c.toml"), "--out", str(out), "-q"])
    assert res.exit_code == 0, res.output
    trips = [r for r in read_run_log(out / "trips.jsonl", (TripRecord,)) if r.bytes_up]
    server = read_run_log(out / "metrics.jsonl", (ServerStepRecord,))
    evals = read_run_log(out / "metrics.jsonl", (EvalRecord,))
    assert len(server) == 2 and all("compress_rel_error" in r.agg for r in server)
    assert all(r.agg["secagg_aborted"] == 0.0 for r in server)
    dims = {r.bytes_down // 4 for r in trips}  # the float32 model each device downloads
    assert len(dims) == 1 and trips
    dim = dims.pop()  # + 1 below: the weight rides along in the masked input
    assert {r.bytes_up for r in trips} == {4 + math.ceil((dim + 1) * ring_bits / 8)}
    if "mechanism" in privacy:
        assert evals[-1].epsilon is not None and evals[-1].epsilon > 0


def test_a_shared_grid_ring_refuses_values_off_the_grid_and_weights_other_than_one() -> None:
    cfg = SecAggConfig(modulus_bits=6, grid_range=0.25, grid_bits=4)  # step 1/32
    rng = np.random.default_rng(0)
    ok = encode(np.array([-0.25, 0.0, 0.25 - 1 / 32]), 1.0, cfg, rng)
    assert ok.tolist() == [0, 8, 15, 1]  # the levels, then the weight
    for bad in (np.array([0.01]), np.array([0.25]), np.array([-0.28125])):
        with pytest.raises(ValueError, match="off the grid"):
            encode(bad, 1.0, cfg, rng)
    with pytest.raises(ValueError, match="weight 1"):
        encode(np.array([0.0]), 0.5, cfg, rng)
