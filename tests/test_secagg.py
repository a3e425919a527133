"""Secure aggregation: Shamir sharing, the four-round protocol, dropouts, and SecureSum."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from fedvox.errors import ConfigError, FedvoxError
from fedvox.fl.aggregation import Aggregator, weighted_sum
from fedvox.privacy import shamir
from fedvox.privacy.secagg import (
    EncryptedShare,
    Entropy,
    MaskedInput,
    ProtocolParams,
    SecAggAbort,
    SecAggClient,
    SecAggConfig,
    SecAggServer,
    SecAggViolation,
    SecureSum,
    UnmaskRequest,
    UnmaskResponse,
    decode,
    encode,
    neighbour_graph,
    run_protocol,
)


def _params(n: int, t: int, dim: int, k: int | None = None, bits: int = 32) -> ProtocolParams:
    graph = neighbour_graph(n, k, np.random.default_rng(7))
    return ProtocolParams(n, t, dim, bits, graph, b"test-session-id!")


def _entropies(n: int, seed: int = 0) -> list[Entropy]:
    return [Entropy(bytes([seed % 256, i % 256]) * 16) for i in range(n)]


def _ring_inputs(n: int, dim: int, bits: int = 32, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    dtype = np.uint32 if bits <= 32 else np.uint64
    return [rng.integers(0, 2**bits, dim, dtype=np.uint64).astype(dtype) for _ in range(n)]


def _ring_sum(vectors: list[np.ndarray], bits: int) -> np.ndarray:
    total = np.zeros_like(vectors[0])
    for v in vectors:
        total += v  # wraps mod 2^32 / 2^64
    return total & total.dtype.type((1 << bits) - 1)


# ------------------------------------------------------------------ Shamir


def test_shamir_any_t_shares_reconstruct_and_t_minus_1_do_not() -> None:
    rand = Entropy(b"k" * 32)
    secret = int.from_bytes(b"\x17" * 32, "big")
    t, xs = 3, [1, 2, 3, 4, 5, 6]
    shares = shamir.split_int(secret, t, xs, rand)
    for subset in itertools.combinations(xs, t):
        assert shamir.combine_int({x: shares[x] for x in subset}) == secret
    for subset in itertools.combinations(xs, t - 1):
        assert shamir.combine_int({x: shares[x] for x in subset}) != secret


def test_shamir_bytes_roundtrip_and_too_few_shares() -> None:
    rand = Entropy(b"q" * 32)
    secret = bytes(range(32))
    shares = shamir.split(secret, 4, [3, 9, 11, 20, 21], rand)
    assert all(len(s) == shamir.share_size(32) for s in shares.values())
    assert shamir.combine({x: shares[x] for x in (9, 11, 20, 21)}, 32) == secret
    assert shamir.combine({x: shares[x] for x in (3, 9, 20, 21)}, 32) == secret
    # Three shares of a degree-3 polynomial interpolate a wrong element, almost surely not
    # even a 32-byte value: refused, never silently returned as the secret.
    with pytest.raises(ValueError):
        shamir.combine({x: shares[x] for x in (3, 9, 11)}, 32)
    long = bytes(range(100))  # two field elements
    shares = shamir.split(long, 2, [1, 2, 3], rand)
    assert shamir.combine({1: shares[1], 3: shares[3]}, 100) == long


# ------------------------------------------------------------------ encoding


def test_encode_decode_quantisation_error_and_clipping() -> None:
    cfg = SecAggConfig(clip=2.0, scale_bits=16)
    x = np.array([0.3, -1.7, 5.0, -9.0, 1e-6])
    enc = encode(x, 0.5, cfg, np.random.default_rng(0))
    values, weight = decode(enc, cfg)
    expected = 0.5 * np.clip(x, -2, 2)
    assert np.all(np.abs(values - expected) < 2.0**-16)  # stochastic rounding: < 1 ulp
    assert weight == 0.5  # 0.5 * 2^16 is an integer: exact
    # Unbiased: the mean of many roundings converges to the value, not to floor or nearest.
    rng = np.random.default_rng(1)
    x = np.full(20000, 0.3 * 2.0**-16)
    means = decode(encode(x, 1.0, cfg, rng), cfg)[0].mean()
    assert abs(means * 2**16 - 0.3) < 0.02


def test_config_refuses_ring_overflow_naming_the_field() -> None:
    cfg = SecAggConfig()  # c = 8, 2^22, 2^32: 2^25 per client, 63 clients fit
    assert cfg.max_clients() == 63
    with pytest.raises(ConfigError, match=r"secagg\.scale_bits"):
        cfg.check_capacity(64)
    with pytest.raises(ConfigError, match=r"secagg\.scale_bits"):
        SecAggConfig(scale_bits=30)
    with pytest.raises(ConfigError, match=r"secagg\.modulus_bits"):
        SecAggConfig(modulus_bits=64)
    with pytest.raises(ConfigError, match=r"secagg\.threshold"):
        SecAggConfig(threshold=1.5)
    d = {"a": torch.zeros(64, 3)}
    with pytest.raises(ConfigError, match=r"secagg\.scale_bits"):
        SecureSum(cfg, 0)(d, torch.ones(64))
    with pytest.raises(ConfigError, match=r"secagg\.max_weight"):
        SecureSum(cfg, 0)({"a": torch.zeros(3, 2)}, torch.tensor([1.0, 2.0, 1.0]))


# ------------------------------------------------------------------ protocol


def test_sum_equals_plaintext_weighted_sum_within_quantisation_error() -> None:
    n, scale_bits = 8, 22
    cfg = SecAggConfig(scale_bits=scale_bits)
    g = torch.Generator().manual_seed(0)
    deltas = {
        "w": torch.randn(n, 4, 5, generator=g),
        "b": (torch.rand(n, 7, generator=g) * 2 - 1) * 7.9,
    }
    weights = torch.rand(n, generator=g)
    total, weight, count = SecureSum(cfg, 3)(deltas, weights)
    plain = weighted_sum(deltas, weights)
    assert count == n
    for name in deltas:
        assert total[name].dtype == torch.float32 and total[name].shape == plain[name].shape
        # Each client's rounding error is < 2^-s per coordinate, so the sum's is < n·2^-s;
        # plus float32 rounding of the result (values here are < 64: < 2^-18). Inputs stay
        # inside the clip range [-8, 8], so clipping adds no error.
        bound = n * 2.0**-scale_bits + 2.0**-18
        assert float((total[name] - plain[name]).abs().max()) < bound
    assert abs(weight - float(weights.sum())) < n * 2.0**-scale_bits


@pytest.mark.parametrize("k", [None, 4])
def test_dropouts_after_sharekeys_and_maskedinput_recover_survivors_sum(k: int | None) -> None:
    n, dim = 10, 50
    params = _params(n, t=3 if k else 6, dim=dim, k=k)
    xs = _ring_inputs(n, dim)
    # Chosen so that every share group of the k=4 graph keeps t=3 live members.
    drops = {1: "share_keys", 5: "share_keys", 3: "masked_input", 9: "masked_input"}
    total, survivors, _ = run_protocol(params, lambda i: xs[i], _entropies(n), drops)
    # Clients that sent a masked input count even if they vanish before unmasking.
    assert survivors == [0, 2, 3, 4, 6, 7, 8, 9]
    assert np.array_equal(total, _ring_sum([xs[i] for i in survivors], 32))


def test_uint64_ring_and_early_dropouts() -> None:
    n, dim, bits = 6, 40, 40
    params = _params(n, t=3, dim=dim, bits=bits)
    xs = _ring_inputs(n, dim, bits)
    drops = {0: "start", 1: "advertise_keys", 3: "share_keys"}
    total, survivors, _ = run_protocol(params, lambda i: xs[i], _entropies(n), drops)
    assert survivors == [2, 4, 5]
    assert total.dtype == np.uint64
    assert np.array_equal(total, _ring_sum([xs[i] for i in survivors], bits))


def test_secagg_plus_thirty_clients_with_dropouts() -> None:
    n, dim = 30, 20
    cfg = SecAggConfig(neighbours=6, dropout=0.15, threshold=0.5)
    summer = SecureSum(cfg, 11)
    params = summer.protocol_params(n, dim + 1, 0)
    assert all(len(p) == 6 for p in params.neighbours) and params.threshold == 4
    g = torch.Generator().manual_seed(1)
    deltas = {"v": torch.rand(n, dim, generator=g) - 0.5}
    weights = torch.rand(n, generator=g)
    total, weight, count = summer(deltas, weights)
    surv = summer.last_survivors
    assert 0 < n - count < n  # some dropped, deterministically from the seed
    plain = weighted_sum({"v": deltas["v"][surv]}, weights[surv])
    assert float((total["v"] - plain["v"]).abs().max()) < n * 2.0**-22 + 1e-6
    assert abs(weight - float(weights[surv].sum())) < n * 2.0**-22


@pytest.mark.parametrize(
    ("drops", "stage"),
    [
        ({i: "start" for i in range(4)}, "AdvertiseKeys"),
        ({i: "advertise_keys" for i in range(4)}, "ShareKeys"),
        ({i: "share_keys" for i in range(4)}, "MaskedInputCollection"),
        ({i: "masked_input" for i in range(4)}, "Unmasking"),
    ],
)
def test_fewer_than_t_alive_aborts_cleanly(drops: dict[int, str], stage: str) -> None:
    n, t = 8, 5
    params = _params(n, t=t, dim=10)
    xs = _ring_inputs(n, 10)
    with pytest.raises(SecAggAbort, match=rf"4 clients .*alive at {stage}.*t=5") as err:
        run_protocol(params, lambda i: xs[i], _entropies(n), drops)
    assert isinstance(err.value, FedvoxError)


def test_per_group_shortfall_in_secagg_plus_aborts() -> None:
    # Neighbourhood of 5 (k=4), t=4: client 0's two neighbours on one side vanish with it.
    n = 12
    params = _params(n, t=4, dim=8, k=4)
    peers = params.neighbours[0]
    xs = _ring_inputs(n, 8)
    drops = {0: "masked_input", peers[0]: "masked_input", peers[1]: "masked_input"}
    with pytest.raises(SecAggAbort, match=r"below the threshold t=4"):
        run_protocol(params, lambda i: xs[i], _entropies(n), drops)


def _run_to_unmask(n: int = 5, t: int = 3, dim: int = 6):
    params = _params(n, t=t, dim=dim)
    clients = [SecAggClient(i, params, e) for i, e in enumerate(_entropies(n))]
    server = SecAggServer(params)
    broadcasts = server.broadcast_keys([c.advertise_keys() for c in clients])
    batches = {i: clients[i].share_keys(b) for i, b in broadcasts.items() if i != 4}
    routed = server.route_shares(batches)
    xs = _ring_inputs(n, dim)
    for i, shares in routed.items():
        server.receive_masked(clients[i].masked_input(shares, xs[i]))
    return clients, server, xs


def test_client_refuses_to_reveal_both_shares_of_one_peer() -> None:
    clients, _, _ = _run_to_unmask()
    c = clients[0]
    with pytest.raises(SecAggViolation, match=r"both .* \[2\]"):
        c.unmask(UnmaskRequest(survivors=(0, 1, 2, 3), dropped=(2,)))
    # Split over two requests: still refused, the client remembers what it revealed.
    c.unmask(UnmaskRequest(survivors=(0, 1, 2, 3), dropped=()))
    with pytest.raises(SecAggViolation, match="both"):
        c.unmask(UnmaskRequest(survivors=(0, 1, 3), dropped=(2,)))
    d = clients[3]  # the other order: key share first, then the self-mask share
    d.unmask(UnmaskRequest(survivors=(0, 1, 3), dropped=(2,)))
    with pytest.raises(SecAggViolation, match="both"):
        d.unmask(UnmaskRequest(survivors=(0, 1, 2, 3), dropped=()))
    with pytest.raises(SecAggViolation, match="own mask key"):
        clients[1].unmask(UnmaskRequest(survivors=(0, 2, 3), dropped=(1,)))
    with pytest.raises(SecAggViolation, match="no shares"):
        clients[1].unmask(UnmaskRequest(survivors=(0, 1, 2, 4), dropped=()))


def test_honest_transcript_never_reveals_both_kinds_for_a_peer() -> None:
    n = 9
    params = _params(n, t=5, dim=16)
    xs = _ring_inputs(n, 16)
    transcript: list = []
    drops = {1: "share_keys", 4: "share_keys", 6: "masked_input"}
    run_protocol(params, lambda i: xs[i], _entropies(n), drops, transcript)
    responses = [m for d, _, m in transcript if isinstance(m, UnmaskResponse)]
    assert len(responses) == n - 3
    self_mask = {v for r in responses for v in r.self_mask_shares}
    keys = {v for r in responses for v in r.key_shares}
    assert keys == {1, 4} and self_mask == {0, 2, 3, 5, 6, 7, 8}
    assert not self_mask & keys


def test_server_only_ever_holds_masked_vectors() -> None:
    n, dim = 6, 3000
    params = _params(n, t=4, dim=dim)
    xs = _ring_inputs(n, dim)
    transcript: list = []
    server_holds: list[np.ndarray] = []
    original = SecAggServer.receive_masked

    def spy(self: SecAggServer, message: MaskedInput) -> None:
        original(self, message)
        server_holds.extend(v for v in vars(self).values() if isinstance(v, np.ndarray))

    SecAggServer.receive_masked = spy  # type: ignore[method-assign]
    try:
        run_protocol(params, lambda i: xs[i], _entropies(n), {3: "share_keys"}, transcript)
    finally:
        SecAggServer.receive_masked = original  # type: ignore[method-assign]
    to_server = [m for d, _, m in transcript if d == "up"]
    kinds = {type(m).__name__ for m in to_server}
    assert kinds == {"AdvertiseKeys", "EncryptedShare", "MaskedInput", "UnmaskResponse"}
    masked = [m for m in to_server if isinstance(m, MaskedInput)]
    assert len(masked) == n - 1
    for m in masked:
        y = np.frombuffer(m.data, np.uint32)
        assert np.mean(y == xs[m.sender]) < 0.01  # a plaintext would match everywhere
    plaintexts = [*xs, *(xs[i] + xs[j] for i in range(n) for j in range(i + 1, n))]
    for held in server_holds:
        assert all(np.mean(held == x) < 0.01 for x in plaintexts)
    # Shares travel encrypted: no ciphertext contains the (secret) share bytes in clear.
    shares = [m for m in to_server if isinstance(m, EncryptedShare)]
    assert shares and all(len(m.ciphertext) == 2 * shamir.share_size(32) + 16 for m in shares)


def test_masked_zero_input_is_uniform() -> None:
    n, dim = 5, 40000
    params = _params(n, t=3, dim=dim)
    zeros = [np.zeros(dim, np.uint32)] * n
    transcript: list = []
    run_protocol(params, lambda i: zeros[i], _entropies(n, seed=3), {}, transcript)
    y = next(
        np.frombuffer(m.data, np.uint32)
        for d, _, m in transcript
        if d == "up" and isinstance(m, MaskedInput)
    )
    assert np.mean(y == 0) < 1e-3  # far from the plaintext
    for values in (y >> np.uint32(26), y & np.uint32(63)):  # top and bottom 6 bits
        counts = np.bincount(values.astype(np.int64), minlength=64)
        assert stats.chisquare(counts).pvalue > 0.001
    assert stats.kstest(y / 2.0**32, "uniform").pvalue > 0.001


def test_tampered_share_is_rejected() -> None:
    params = _params(4, t=2, dim=4)
    clients = [SecAggClient(i, params, e) for i, e in enumerate(_entropies(4))]
    server = SecAggServer(params)
    broadcasts = server.broadcast_keys([c.advertise_keys() for c in clients])
    batches = {i: clients[i].share_keys(b) for i, b in broadcasts.items()}
    routed = server.route_shares(batches)
    # The server redirects a share meant for client 2 to client 1: authentication fails.
    stolen = next(m for m in batches[0] if m.receiver == 2)
    forged = [EncryptedShare(0, 1, stolen.ciphertext)] + [m for m in routed[1] if m.sender != 0]
    with pytest.raises(SecAggViolation, match="authentication"):
        clients[1].masked_input(forged, np.zeros(4, np.uint32))


def test_server_rejects_double_reveal_in_a_response() -> None:
    clients, server, _ = _run_to_unmask()
    requests = server.unmask_requests()
    responses = [clients[i].unmask(r) for i, r in requests.items()]
    bad = UnmaskResponse(0, {**responses[0].self_mask_shares}, {2: b"x" * 66})
    with pytest.raises(SecAggAbort, match="both"):
        server.unmask([bad, *responses[1:]])


# ------------------------------------------------------------------ SecureSum


def _deltas(n: int = 6, seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    deltas = {"a": torch.randn(n, 3, 2, generator=g), "b": torch.randn(n, 4, generator=g)}
    return deltas, torch.rand(n, generator=g)


def test_securesum_deterministic_per_seed_and_fresh_per_call() -> None:
    deltas, weights = _deltas()
    cfg = SecAggConfig(dropout=0.2)
    first = [SecureSum(cfg, 5)(deltas, weights) for _ in range(2)]
    for name in deltas:
        assert torch.equal(first[0][0][name], first[1][0][name])
    assert first[0][1:] == first[1][1:]
    summer = SecureSum(cfg, 5)
    p0, p1 = summer.protocol_params(6, 9, 0), summer.protocol_params(6, 9, 1)
    assert p0.session != p1.session  # fresh keys and masks every call
    other = SecureSum(cfg, 6).protocol_params(6, 9, 0)
    assert other.session != p0.session


def test_securesum_state_dict_resumes_bit_identically() -> None:
    deltas, weights = _deltas()
    cfg = SecAggConfig(dropout=0.3, dropout_after="masked_input")
    a = SecureSum(cfg, 3)
    a(deltas, weights)
    state = a.state_dict()
    expected = a(deltas, weights)
    assert a.last_stats is not None and len(a.last_stats.client_seconds["unmask_reply"]) == 5
    b = SecureSum(cfg, 3)
    b.load_state_dict(state)
    got = b(deltas, weights)
    assert got[1:] == expected[1:]
    assert all(torch.equal(got[0][n], expected[0][n]) for n in deltas)
    with pytest.raises(ConfigError, match=r"secagg\.seed"):
        SecureSum(cfg, 4).load_state_dict(state)
    fresh = SecureSum(cfg, 3)(deltas, weights)  # call 0: different rounding and masks
    assert not all(torch.equal(fresh[0][n], expected[0][n]) for n in deltas)


def test_securesum_as_the_aggregators_summer() -> None:
    d1, w1 = _deltas(5, seed=1)
    d2, w2 = _deltas(4, seed=2)
    agg = Aggregator(summer=SecureSum(SecAggConfig(), 0))
    agg.accumulate(d1, w1)
    agg.accumulate(d2, w2)
    total, weight, count = agg.result()
    plain = Aggregator()
    plain.accumulate(d1, w1)
    plain.accumulate(d2, w2)
    ref, ref_weight, ref_count = plain.result()
    assert count == ref_count == 9
    assert abs(weight - ref_weight) < 9 * 2.0**-22
    for name in ref:
        assert float((total[name] - ref[name]).abs().max()) < 9 * 2.0**-22 + 1e-6
    state = agg.state_dict()
    assert state["stages"] == [{"calls": 2, "seed": 0, "aborted": 0}]


def test_securesum_refuses_a_single_client() -> None:
    with pytest.raises(SecAggAbort, match="1 client alive"):
        SecureSum(SecAggConfig(), 0)({"a": torch.zeros(1, 3)}, torch.ones(1))


def test_neighbour_graph_is_regular_and_symmetric() -> None:
    graph = neighbour_graph(30, 6, np.random.default_rng(0))
    assert all(len(p) == 6 and u not in p for u, p in enumerate(graph))
    assert all(u in graph[v] for u, p in enumerate(graph) for v in p)
    assert SecAggConfig(neighbours="auto").neighbour_count(20) is None
    assert SecAggConfig(neighbours="auto").neighbour_count(100) == 14
    assert SecAggConfig(neighbours=5).neighbour_count(100) == 6
