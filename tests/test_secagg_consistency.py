"""Secure aggregation against a malicious server: signed keys and the ConsistencyCheck round.

A server that forges an advertised key or equivocates about the surviving set U3 is caught
(SecAggViolation) before any share is revealed; an honest run sums to the same bits as the
unsigned protocol, and the extra messages are counted on the wire.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedvox.privacy.secagg import (
    SIGNATURE_BYTES,
    ConsistencyRequest,
    Entropy,
    KeyBroadcast,
    ProtocolParams,
    SecAggClient,
    SecAggConfig,
    SecAggServer,
    SecAggViolation,
    SecureSum,
    UnmaskRequest,
    neighbour_graph,
    run_protocol,
    wire_size,
)

N, T, DIM = 6, 4, 5


def _identities(n: int = N) -> list[Ed25519PrivateKey]:
    return [Ed25519PrivateKey.from_private_bytes(bytes([i + 1]) * 32) for i in range(n)]


def _params(signed: bool) -> ProtocolParams:
    graph = neighbour_graph(N, None, np.random.default_rng(7))
    keys = tuple(k.public_key().public_bytes_raw() for k in _identities()) if signed else ()
    return ProtocolParams(N, T, DIM, 32, graph, b"test-session-id!", keys)


def _run(signed: bool, server: SecAggServer | None = None, drops: dict | None = None):
    rng = np.random.default_rng(1)
    inputs = [rng.integers(0, 2**32, DIM, dtype=np.uint64).astype(np.uint32) for _ in range(N)]
    entropies = [Entropy(bytes([0, i]) * 16) for i in range(N)]
    transcript: list = []
    total, survivors, stats = run_protocol(
        _params(signed),
        lambda i: inputs[i],
        entropies,
        drops,
        transcript,
        identities=_identities() if signed else None,
        server=server,
    )
    return total, survivors, stats, transcript


@pytest.mark.parametrize(
    "drops", [None, {5: "share_keys"}, {4: "masked_input"}, {3: "consistency_check"}]
)
def test_honest_signed_run_sums_to_the_same_bits(drops: dict | None) -> None:
    plain_total, plain_surv, plain_stats, _ = _run(False, drops=drops)
    total, surv, stats, transcript = _run(True, drops=drops)
    assert np.array_equal(total, plain_total) and surv == plain_surv
    # every byte is accounted: the stats are the transcript's wire sizes
    for direction, counted in (("up", stats.bytes_up), ("down", stats.bytes_down)):
        per = np.zeros(N, np.int64)
        for d, i, m in transcript:
            if d == direction:
                per[i] += wire_size(m)
        assert np.array_equal(per, counted)
    # the extra cost of a client that took part throughout: two signatures up; down, each
    # group member's key signature, U3, and every survivor's signature over U3
    kinds = {type(m).__name__ for _, _, m in transcript}
    assert {"ConsistencyRequest", "ConsistencySignature"} <= kinds
    if drops is None:
        extra_up = stats.bytes_up - plain_stats.bytes_up
        extra_down = stats.bytes_down - plain_stats.bytes_down
        assert (extra_up == 2 * SIGNATURE_BYTES + 4).all()  # advert sig, ConsistencySignature
        assert (extra_down == N * (4 + SIGNATURE_BYTES) + 4 * N + N * (4 + SIGNATURE_BYTES)).all()


def test_securesum_with_consistency_check_gives_the_same_sum() -> None:
    g = torch.Generator().manual_seed(0)
    deltas, weights = {"a": torch.randn(6, 3, 2, generator=g)}, torch.rand(6, generator=g)
    for dropout in (0.0, 0.3):
        plain = SecureSum(SecAggConfig(dropout=dropout), 3)(deltas, weights)
        signed = SecureSum(SecAggConfig(dropout=dropout, consistency_check=True), 3)
        got = signed(deltas, weights)
        assert torch.equal(got[0]["a"], plain[0]["a"]) and got[1:] == plain[1:]
        assert signed.last_stats is not None and "consistency" in signed.last_stats.client_seconds


class Equivocating(SecAggServer):
    """Tells client 0 that client 4 dropped, and everyone else that it survived."""

    def consistency_requests(self) -> dict[int, ConsistencyRequest]:
        out = super().consistency_requests()
        out[0] = ConsistencyRequest(tuple(u for u in out[0].survivors if u != 4))
        return out


def test_equivocation_about_the_surviving_set_is_detected() -> None:
    with pytest.raises(SecAggViolation, match=r"equivocation"):
        _run(True, server=Equivocating(_params(True)))


class Lying(SecAggServer):
    """Signs off U3 honestly, then asks client 1 for client 4's mask key as if 4 had dropped."""

    def unmask_requests(self) -> dict[int, UnmaskRequest]:
        out = super().unmask_requests()
        r = out[1]
        out[1] = UnmaskRequest(
            tuple(u for u in r.survivors if u != 4), (*r.dropped, 4), r.signatures
        )
        return out


def test_unmask_request_against_the_signed_set_is_refused() -> None:
    with pytest.raises(SecAggViolation, match=r"disagrees with the surviving set"):
        _run(True, server=Lying(_params(True)))


class Substituting(SecAggServer):
    """Replaces client 2's mask-agreement key (a man in the middle) in what client 0 gets."""

    def broadcast_keys(self, messages):  # type: ignore[no-untyped-def]
        out = super().broadcast_keys(messages)
        keys = dict(out[0].keys)
        forged = Ed25519PrivateKey.from_private_bytes(bytes(32))  # any other key will do
        keys[2] = (forged.public_key().public_bytes_raw(), keys[2][1])
        out[0] = KeyBroadcast(keys, out[0].signatures)
        return out


def test_forged_advertised_key_is_detected() -> None:
    with pytest.raises(SecAggViolation, match=r"client 2 carry no valid signature"):
        _run(True, server=Substituting(_params(True)))
    # unsigned, the same substitution goes unnoticed in ShareKeys: that is the threat
    params = _params(False)
    clients = [SecAggClient(i, params, Entropy(bytes([0, i]) * 16)) for i in range(N)]
    server = Substituting(params)
    broadcasts = server.broadcast_keys([c.advertise_keys() for c in clients])
    assert len(clients[0].share_keys(broadcasts[0])) == N - 1


def test_altered_signature_or_missing_identity_is_refused() -> None:
    params = _params(True)
    ids = _identities()
    clients = [SecAggClient(i, params, Entropy(bytes([0, i]) * 16), ids[i]) for i in range(N)]
    adverts = [c.advertise_keys() for c in clients]
    sig = bytearray(adverts[3].signature)
    sig[0] ^= 1
    adverts[3] = dataclasses.replace(adverts[3], signature=bytes(sig))
    broadcasts = SecAggServer(params).broadcast_keys(adverts)
    with pytest.raises(SecAggViolation, match=r"client 3 carry no valid signature"):
        clients[0].share_keys(broadcasts[0])
    with pytest.raises(ValueError, match="identity key"):
        SecAggClient(0, params, Entropy(bytes(32)))
    with pytest.raises(ValueError, match="differs from the registered"):
        SecAggClient(0, params, Entropy(bytes(32)), ids[1])
