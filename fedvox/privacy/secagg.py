"""Secure aggregation (Bonawitz et al. 2017) with SecAgg+ neighbourhoods (Bell et al. 2020).

A `Summer` for the aggregation pipeline (fl/aggregation.py): clients send quantised, masked
updates, and the server learns only Σ w_i Δ_i and Σ w_i of the survivors, even after dropouts.

Rounds: AdvertiseKeys → ShareKeys → MaskedInputCollection → (ConsistencyCheck) → Unmasking.
Parties exchange only the message dataclasses below (ints and bytes) through the server, so the
same classes can run over a network. Threat model: honest-but-curious server by default; with
registered Ed25519 identity keys (`ProtocolParams.verify_keys`) the advertised keys are signed
and the ConsistencyCheck round of the actively secure variant runs, so a server that forges
keys or equivocates about the surviving set is caught before any share is revealed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from torch import Tensor

from fedvox.errors import ConfigError, FedvoxError, StepSkipped
from fedvox.privacy import shamir
from fedvox.rng import Purpose, derived_rng
from fedvox.types import Params

KEY_BYTES = 32
SIGNATURE_BYTES = 64
SHARE_BYTES = shamir.share_size(KEY_BYTES)
# Up to this many clients "auto" uses the full graph (plain Bonawitz): it is cheap there and
# every client's secrets are spread over everyone.
AUTO_FULL_GRAPH_MAX = 20
# Stages a simulated client can stop after ("start": it never takes part).
STAGES = ("start", "advertise_keys", "share_keys", "masked_input", "consistency_check", "unmask")


class SecAggAbort(FedvoxError):
    """The protocol stopped cleanly: too few clients alive, or a party saw an invalid message.

    `alive` and `threshold` say how many clients were left against t, where that was the cause.
    """

    def __init__(
        self, message: str, alive: int | None = None, threshold: int | None = None
    ) -> None:
        self.alive = alive
        self.threshold = threshold
        super().__init__(message)


class SecAggViolation(SecAggAbort):
    """A client refused a message that would break privacy (both shares for one peer, a forged
    key, an equivocated surviving set): a bug or an attack, never a dropout."""


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class SecAggConfig:
    """Parameters of secure aggregation, validated on construction (errors name the field).

    threshold: a fraction of a share group (float in (0, 1], t = ⌈f·m⌉) or t itself (int).
    clip, scale_bits: each Δ coordinate is clipped to [−clip, clip] and scaled by 2^scale_bits.
    modulus_bits: the ring Z_{2^k} (k ≤ 32 runs in uint32, 32 < k ≤ 62 in uint64).
    max_weight: public bound on a client weight; the ring must hold n·max_weight·clip·2^s.
    neighbours: None = everyone (Bonawitz), int k = SecAgg+ with a k-regular Harary graph,
        "auto" = everyone up to 20 clients, else k = 2⌈log2 n⌉.
    dropout, dropout_after: simulated protocol-level dropouts (probability and stage).
    on_abort: "stop" raises SecAggAbort when too few clients are left; "skip" raises
        StepSkipped instead, so a simulator can skip the step. Violations always raise.
    consistency_check: signed advertised keys and the ConsistencyCheck round (malicious server).
    grid_range, grid_bits: inputs lie on the shared quantisation grid −c + j·c·2^(1−b) (c, b);
        each client then sends its levels j < 2^b and weight 1, so n clients need a ring of
        only b + ⌈log2 n⌉ bits (scale_bits and clip are not used).
    Rings narrower than 32 bits travel packed, modulus_bits bits an element.
    """

    threshold: float | int = 2 / 3
    clip: float = 8.0
    scale_bits: int = 22
    modulus_bits: int = 32
    max_weight: float = 1.0
    neighbours: int | Literal["auto"] | None = None
    dropout: float = 0.0
    dropout_after: Literal["share_keys", "masked_input"] = "share_keys"
    seed: int = 0
    on_abort: Literal["stop", "skip"] = "stop"
    consistency_check: bool = False
    grid_range: float | None = None
    grid_bits: int | None = None

    def __post_init__(self) -> None:
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, int | float):
            raise ConfigError("secagg.threshold", f"{t!r} is not a number", "use e.g. 2/3 or 5")
        if isinstance(t, float) and not 0.0 < t <= 1.0:
            raise ConfigError("secagg.threshold", f"fraction {t} outside (0, 1]", "use e.g. 2/3")
        if isinstance(t, int) and t < 1:
            raise ConfigError("secagg.threshold", f"t={t} < 1", "use t >= 1 (or a fraction)")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ConfigError("secagg.clip", f"{self.clip} is not a positive number", "use e.g. 8")
        if not 0 <= self.scale_bits <= 52:
            raise ConfigError("secagg.scale_bits", f"{self.scale_bits} outside 0..52", "use 22")
        if not 2 <= self.modulus_bits <= 62:
            raise ConfigError(
                "secagg.modulus_bits", f"{self.modulus_bits} outside 2..62", "use 32 (or up to 62)"
            )
        if (self.grid_range is None) != (self.grid_bits is None):
            raise ValueError("grid_range and grid_bits are set together (a shared grid)")
        if self.grid_bits is not None and not 1 <= self.grid_bits < self.modulus_bits:
            raise ConfigError(
                "secagg.modulus_bits",
                f"a ring of {self.modulus_bits} bits cannot hold {self.grid_bits}-bit levels",
                "use modulus_bits = grid_bits + ceil(log2 n) for n clients",
            )
        if not (math.isfinite(self.max_weight) and self.max_weight > 0):
            raise ConfigError("secagg.max_weight", f"{self.max_weight} is not positive", "use 1")
        k = self.neighbours
        if not (k is None or k == "auto" or (isinstance(k, int) and not isinstance(k, bool))):
            raise ConfigError("secagg.neighbours", f"{k!r}", "use None (all), 'auto' or an int")
        if isinstance(k, int) and k < 2:
            raise ConfigError("secagg.neighbours", f"k={k} < 2", "use k >= 2 or None (all)")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("secagg.dropout", f"{self.dropout} outside [0, 1)", "use e.g. 0.1")
        if self.dropout_after not in ("share_keys", "masked_input"):
            raise ConfigError(
                "secagg.dropout_after", f"{self.dropout_after!r}", "use share_keys or masked_input"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError("secagg.seed", f"{self.seed!r} is not an int >= 0", "use e.g. 0")
        if self.on_abort not in ("stop", "skip"):
            raise ConfigError("secagg.on_abort", f"{self.on_abort!r}", "use 'skip' or 'stop'")
        if not isinstance(self.consistency_check, bool):
            raise ConfigError(
                "secagg.consistency_check", f"{self.consistency_check!r}", "use true or false"
            )
        self.check_capacity(2)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint32 if self.modulus_bits <= 32 else np.uint64)

    @property
    def packed(self) -> bool:
        """Whether ring elements travel packed (modulus_bits bits each, rings below 32 bits)."""
        return self.modulus_bits < 32

    def client_range(self) -> int:
        """Largest |encoded coordinate| of one client (Δ and weight coordinates alike)."""
        if self.grid_bits is not None:
            return 2**self.grid_bits - 1
        scale = 2.0**self.scale_bits
        return math.ceil(self.max_weight * max(self.clip, 1.0) * scale)

    def max_clients(self) -> int:
        """How many clients' encodings can be summed without wrapping the ring (signed; a
        shared grid's levels are non-negative, so its sums use the whole unsigned ring)."""
        if self.grid_bits is not None:
            return (2**self.modulus_bits - 1) // self.client_range()
        return (2 ** (self.modulus_bits - 1) - 1) // self.client_range()

    def check_capacity(self, n: int) -> None:
        """Refuse n clients whose sum could overflow the ring (it would decode to garbage)."""
        if n > self.max_clients() and self.grid_bits is not None:
            need = self.grid_bits + math.ceil(math.log2(n))
            raise ConfigError(
                "secagg.modulus_bits",
                f"{n} clients x {self.grid_bits}-bit levels can overflow the ring "
                f"2^{self.modulus_bits} (at most {self.max_clients()} clients fit)",
                f"use modulus_bits >= {need} (grid_bits + ceil(log2 n))",
            )
        if n > self.max_clients():
            need = math.ceil(math.log2(n * self.client_range() + 1)) + 1
            raise ConfigError(
                "secagg.scale_bits",
                f"{n} clients x range ±{self.client_range()} (max_weight·clip·2^scale_bits) can "
                f"overflow the ring 2^{self.modulus_bits} (at most {self.max_clients()} clients fit)",
                f"lower scale_bits (or clip, max_weight), or set modulus_bits >= {need} (<= 62)",
            )

    def neighbour_count(self, n: int) -> int | None:
        """Neighbours per client for n clients; None when everyone shares with everyone."""
        k = self.neighbours
        if k == "auto":
            k = None if n <= AUTO_FULL_GRAPH_MAX else 2 * math.ceil(math.log2(n))
        if k is None:
            return None
        k += k % 2  # Harary graphs are built for even k
        return None if k >= n - 1 else k

    def group_threshold(self, group: int) -> int:
        """t for a share group of `group` clients (the client and its neighbours)."""
        if isinstance(self.threshold, int):
            if self.threshold > group:
                raise ConfigError(
                    "secagg.threshold",
                    f"t={self.threshold} exceeds the share group of {group} clients",
                    "lower t or use a fraction",
                )
            return self.threshold
        return max(1, math.ceil(self.threshold * group - 1e-9))


# --------------------------------------------------------------------------- encoding


def ring_mask(bits: int) -> int:
    return (1 << bits) - 1


def encode(
    vector: np.ndarray, weight: float, config: SecAggConfig, rng: np.random.Generator
) -> np.ndarray:
    """Ring encoding of (w·clip(Δ, ±c), w) with stochastic rounding: one client's input.

    The rounding noise comes from `rng` (public randomness, not a secret); E[decode] is exact.
    """
    if config.grid_bits is not None:
        return _encode_levels(vector, weight, config)
    if not 0.0 <= weight <= config.max_weight:
        raise ConfigError(
            "secagg.max_weight",
            f"client weight {weight} outside [0, {config.max_weight}]",
            "raise max_weight (and modulus_bits) or normalise the client weights",
        )
    v = np.empty(vector.size + 1, np.float64)
    np.clip(vector.reshape(-1), -config.clip, config.clip, out=v[:-1])
    v[:-1] *= weight
    v[-1] = weight
    v *= 2.0**config.scale_bits
    v += rng.random(v.size)
    np.floor(v, out=v)
    ints = v.astype(np.int64)
    ints &= ring_mask(config.modulus_bits)
    return ints.astype(config.dtype)


def _encode_levels(vector: np.ndarray, weight: float, config: SecAggConfig) -> np.ndarray:
    """A shared-grid input: each value's level j = (v + c)/step and the weight 1, exactly."""
    assert config.grid_range is not None and config.grid_bits is not None
    if weight != 1.0:
        raise ValueError(f"a shared grid sums levels of clients of weight 1, got {weight}")
    c, step = config.grid_range, config.grid_range * 2.0 ** (1 - config.grid_bits)
    j = (vector.reshape(-1).astype(np.float64) + c) / step
    levels = np.rint(j)
    on_grid = np.abs(j - levels) < 1e-6
    if not (on_grid.all() and levels.min() >= 0 and levels.max() < 2**config.grid_bits):
        raise ValueError("secure aggregation's shared grid got a value off the grid")
    out = np.empty(vector.size + 1, config.dtype)
    out[:-1] = levels.astype(config.dtype)
    out[-1] = 1
    return out


def decode(total: np.ndarray, config: SecAggConfig) -> tuple[np.ndarray, float]:
    """(Σ w·Δ, Σ w) in float64 from the ring sum of encodings (signed representatives; on a
    shared grid Σ j and the count n, so Σ Δ = step·Σ j − n·c)."""
    if config.grid_bits is not None:
        assert config.grid_range is not None
        sums = total.astype(np.float64)  # < 2^modulus_bits ≤ 2^62: exact integers in float64
        count = sums[-1]
        step = config.grid_range * 2.0 ** (1 - config.grid_bits)
        return sums[:-1] * step - count * config.grid_range, float(count)
    ints = total.astype(np.int64)
    ints[ints >= 1 << (config.modulus_bits - 1)] -= 1 << config.modulus_bits
    values = ints / 2.0**config.scale_bits
    return values[:-1], float(values[-1])


def pack_ring(vector: np.ndarray, bits: int) -> bytes:
    """Ring elements (< 2^bits) as a little-endian bit string of `bits` bits each."""
    shifts = np.arange(bits, dtype=vector.dtype)
    flags = ((vector[:, None] >> shifts) & 1).astype(np.uint8)
    return np.packbits(flags.reshape(-1), bitorder="little").tobytes()


def unpack_ring(data: bytes, bits: int, dim: int, dtype: np.dtype) -> np.ndarray:
    """The `dim` elements pack_ring wrote (padding bits of the last byte ignored)."""
    flags = np.unpackbits(np.frombuffer(data, np.uint8), count=dim * bits, bitorder="little")
    weights = np.left_shift(np.ones(bits, np.uint64), np.arange(bits, dtype=np.uint64))
    return (flags.reshape(dim, bits).astype(np.uint64) @ weights).astype(dtype)


def ring_bytes(dim: int, bits: int, dtype: np.dtype) -> int:
    """Bytes of `dim` ring elements on the wire: packed below 32 bits, else whole words."""
    return math.ceil(dim * bits / 8) if bits < 32 else dim * np.dtype(dtype).itemsize


# --------------------------------------------------------------------------- crypto helpers


class Entropy:
    """Secret randomness of one party: the OS, or (simulation) a ChaCha20 stream from a key.

    The keyed form makes a simulated run reproducible from its seed; a deployment uses None.
    """

    def __init__(self, key: bytes | None = None) -> None:
        self._stream = None
        if key is not None:
            cipher = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None)
            self._stream = cipher.encryptor()

    def __call__(self, n: int) -> bytes:
        if self._stream is None:
            return os.urandom(n)
        return self._stream.update(bytes(n))


def hkdf(secret: bytes, info: bytes, length: int = KEY_BYTES) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(secret)


class Keystream:
    """The PRG: AES-256-CTR keystream under a one-use key, read as ring elements.

    Buffers are reused across calls (allocating them dominated the cost); the returned
    array is valid until the next call. A zero nonce is safe because each key is used once.
    """

    def __init__(self, dim: int, dtype: np.dtype) -> None:
        self.dim = dim
        self.dtype = np.dtype(dtype)
        nbytes = dim * self.dtype.itemsize
        self._zero = bytes(nbytes)
        self._buf = bytearray(nbytes + 15)  # update_into wants block_size − 1 spare bytes
        self._view = np.frombuffer(self._buf, dtype=self.dtype, count=dim)

    def __call__(self, key: bytes) -> np.ndarray:
        enc = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
        enc.update_into(self._zero, self._buf)
        return self._view


def mask_key(private: X25519PrivateKey, peer_public: bytes, session: bytes) -> bytes:
    """Pairwise mask seed s_uv = HKDF(X25519(c_u, c_v)); both ends derive the same key."""
    shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    return hkdf(shared, b"fedvox/secagg/mask/" + session)


def _pair(sender: int, receiver: int) -> bytes:
    return struct.pack(">II", sender, receiver)


def advert_signed_bytes(session: bytes, sender: int, c_public: bytes, s_public: bytes) -> bytes:
    """What a client signs in AdvertiseKeys: its id and both public keys, bound to the session."""
    return b"fedvox/secagg/advertise/" + session + struct.pack(">I", sender) + c_public + s_public


def survivors_signed_bytes(session: bytes, survivors: Sequence[int]) -> bytes:
    """What a client signs in ConsistencyCheck: the surviving set U3, bound to the session."""
    ids = sorted(survivors)
    return b"fedvox/secagg/consistency/" + session + struct.pack(f">I{len(ids)}I", len(ids), *ids)


def signature_valid(public: bytes, signature: bytes, data: bytes) -> bool:
    """Whether `signature` is a valid Ed25519 signature of `data` under the raw `public` key."""
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class AdvertiseKeys:
    """Round 0, client → server: public keys for mask agreement (c) and share encryption (s).

    `signature`: Ed25519 over both keys under the client's registered identity (b"" unsigned).
    """

    sender: int
    c_public: bytes
    s_public: bytes
    signature: bytes = b""


@dataclass(frozen=True)
class KeyBroadcast:
    """Round 0, server → client: the public keys of the client's share group that arrived,
    with their senders' signatures when the protocol is signed."""

    keys: dict[int, tuple[bytes, bytes]]
    signatures: dict[int, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class EncryptedShare:
    """Round 1, client → server → client: AEAD(shares of b and c_sk) readable by `receiver`."""

    sender: int
    receiver: int
    ciphertext: bytes


@dataclass(frozen=True)
class MaskedInput:
    """Round 2, client → server: the masked ring vector, as little-endian bytes."""

    sender: int
    data: bytes


@dataclass(frozen=True)
class ConsistencyRequest:
    """ConsistencyCheck, server → client: the surviving set U3 (whose masked input arrived)."""

    survivors: tuple[int, ...]


@dataclass(frozen=True)
class ConsistencySignature:
    """ConsistencyCheck, client → server: Ed25519 over (session, U3) as this client saw it."""

    sender: int
    signature: bytes


@dataclass(frozen=True)
class UnmaskRequest:
    """Round 3, server → client: whose self-mask shares and whose key shares to reveal.

    `signatures`: with the consistency check, every signature over U3 the server received.
    """

    survivors: tuple[int, ...]
    dropped: tuple[int, ...]
    signatures: dict[int, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class UnmaskResponse:
    """Round 3, client → server: b-shares of survivors and c_sk-shares of dropped clients."""

    sender: int
    self_mask_shares: dict[int, bytes]
    key_shares: dict[int, bytes]


Message = (
    AdvertiseKeys
    | KeyBroadcast
    | EncryptedShare
    | MaskedInput
    | ConsistencyRequest
    | ConsistencySignature
    | UnmaskRequest
    | UnmaskResponse
)


def wire_size(obj: Any) -> int:
    """Bytes a message takes on the wire: 4 per id, raw bytes as they are (no framing)."""
    if isinstance(obj, bytes | bytearray):
        return len(obj)
    if isinstance(obj, int):
        return 4
    if isinstance(obj, dict):
        return sum(wire_size(k) + wire_size(v) for k, v in obj.items())
    if isinstance(obj, tuple | list):
        return sum(wire_size(v) for v in obj)
    if dataclasses.is_dataclass(obj):
        return sum(wire_size(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    raise TypeError(f"not a wire type: {type(obj).__name__}")


# --------------------------------------------------------------------------- parties


@dataclass(frozen=True)
class ProtocolParams:
    """What all parties agree on before round 0 (in a deployment the server announces it)."""

    n: int
    threshold: int
    dim: int
    modulus_bits: int
    neighbours: tuple[tuple[int, ...], ...]
    session: bytes
    # Ed25519 identity keys registered at setup, one per client; () = unsigned protocol
    verify_keys: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        if self.verify_keys and len(self.verify_keys) != self.n:
            raise ValueError(f"{len(self.verify_keys)} identity keys for {self.n} clients")
        for u, peers in enumerate(self.neighbours):
            if u in peers or any(u not in self.neighbours[v] for v in peers):
                raise ValueError("the neighbour graph must be symmetric without self-loops")
        smallest = min(len(p) for p in self.neighbours) + 1
        if not 1 <= self.threshold <= smallest:
            raise ValueError(f"threshold {self.threshold} outside 1..{smallest} (share group)")

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint32 if self.modulus_bits <= 32 else np.uint64)

    @property
    def signed(self) -> bool:
        """Whether keys are signed and the ConsistencyCheck round runs (malicious server)."""
        return bool(self.verify_keys)

    def group(self, u: int) -> tuple[int, ...]:
        """Who holds shares of u's secrets: u and its neighbours."""
        return tuple(sorted((*self.neighbours[u], u)))

    def finish(self, vector: np.ndarray) -> np.ndarray:
        """Reduce a uint32/uint64 accumulator to the ring Z_{2^k} (2^k divides 2^32 or 2^64)."""
        if self.modulus_bits not in (32, 64):
            vector &= self.dtype.type(ring_mask(self.modulus_bits))
        return vector


def neighbour_graph(n: int, k: int | None, rng: np.random.Generator) -> tuple[tuple[int, ...], ...]:
    """Everyone (k None) or a Harary graph H_{k,n} over a random ring order of the clients.

    H_{k,n} (k even) links each client to the k/2 nearest on each side of the ring: k-regular
    and k-connected, so removing a few dropped clients never isolates anyone.
    """
    if k is None or k >= n - 1:
        return tuple(tuple(v for v in range(n) if v != u) for u in range(n))
    if k % 2 or k < 2:
        raise ValueError(f"Harary graph needs an even k >= 2, got {k}")
    order = rng.permutation(n)
    pos = np.empty(n, np.int64)
    pos[order] = np.arange(n)
    graph = []
    for u in range(n):
        p = pos[u]
        peers = {int(order[(p + d) % n]) for d in range(-k // 2, k // 2 + 1) if d != 0}
        graph.append(tuple(sorted(peers)))
    return tuple(graph)


class SecAggClient:
    """One client of the protocol: keys, shares of its secrets, masking, and unmasking answers.

    `identity` is its long-term Ed25519 key, needed when the protocol is signed (its public
    half is `params.verify_keys[cid]`).
    """

    def __init__(
        self,
        cid: int,
        params: ProtocolParams,
        entropy: Callable[[int], bytes],
        identity: Ed25519PrivateKey | None = None,
    ) -> None:
        if params.signed:
            if identity is None:
                raise ValueError(f"client {cid}: a signed protocol needs its identity key")
            if identity.public_key().public_bytes_raw() != params.verify_keys[cid]:
                raise ValueError(f"client {cid}: identity key differs from the registered one")
        self.id = cid
        self.params = params
        self._rand = entropy
        self._identity = identity
        self._u3: frozenset[int] | None = None  # the surviving set this client signed
        self._c_sk: X25519PrivateKey | None = None
        self._s_sk: X25519PrivateKey | None = None
        self._peers: dict[int, tuple[bytes, bytes]] = {}
        self._aead: dict[int, ChaCha20Poly1305] = {}
        self._b: bytes | None = None
        self._held: dict[int, tuple[bytes, bytes]] = {}  # owner -> (b-share, c_sk-share)
        self._revealed: dict[int, str] = {}  # peer -> "self_mask" | "key"
        self._stage = "start"

    def state_dict(self) -> dict[str, bytes | int | str]:
        """Everything this client holds between rounds, as flat bytes/ints/strings (a deployed
        node whose runtime starts a fresh process per message keeps it there; it is secret)."""
        if self._identity is not None or self._u3 is not None:
            raise ValueError("the signed protocol's client state is not exported")
        out: dict[str, bytes | int | str] = {"id": self.id, "stage": self._stage}
        if self._c_sk is not None and self._s_sk is not None:
            out["c_sk"] = self._c_sk.private_bytes_raw()
            out["s_sk"] = self._s_sk.private_bytes_raw()
        if self._b is not None:
            out["b"] = self._b
        for v, (c, s_) in self._peers.items():
            out[f"peer_c.{v}"], out[f"peer_s.{v}"] = c, s_
        for v, (b, sk) in self._held.items():
            out[f"held_b.{v}"], out[f"held_sk.{v}"] = b, sk
        for v, what in self._revealed.items():
            out[f"revealed.{v}"] = what
        return out

    @classmethod
    def from_state(
        cls,
        params: ProtocolParams,
        state: Mapping[str, bytes | int | str],
        entropy: Callable[[int], bytes],
    ) -> SecAggClient:
        """The client `state_dict` described, in the protocol `params` (unsigned only)."""
        if params.signed:
            raise ValueError("the signed protocol's client state is not imported")
        client = cls(int(state["id"]), params, entropy)
        client._stage = str(state["stage"])
        if "c_sk" in state:
            client._c_sk = X25519PrivateKey.from_private_bytes(bytes(state["c_sk"]))  # type: ignore[arg-type]
            client._s_sk = X25519PrivateKey.from_private_bytes(bytes(state["s_sk"]))  # type: ignore[arg-type]
        if "b" in state:
            client._b = bytes(state["b"])  # type: ignore[arg-type]
        for key, value in state.items():
            kind, _, peer = key.partition(".")
            if kind == "peer_c":
                client._peers[int(peer)] = (bytes(value), bytes(state[f"peer_s.{peer}"]))  # type: ignore[arg-type]
            elif kind == "held_b":
                client._held[int(peer)] = (bytes(value), bytes(state[f"held_sk.{peer}"]))  # type: ignore[arg-type]
            elif kind == "revealed":
                client._revealed[int(peer)] = str(value)
        return client

    def _advance(self, expect: str, to: str) -> None:
        if self._stage != expect:
            raise SecAggViolation(f"client {self.id}: got a {to} message in stage {self._stage}")
        self._stage = to

    def _refuse(self, problem: str) -> SecAggViolation:
        return SecAggViolation(f"client {self.id} refuses: {problem}")

    def _enough(self, alive: int, stage: str) -> None:
        t = self.params.threshold
        if alive < t:
            raise SecAggAbort(
                f"client {self.id}: {alive} clients of its share group alive at {stage}, "
                f"below the threshold t={t}",
                alive,
                t,
            )

    def advertise_keys(self) -> AdvertiseKeys:
        """Round 0: fresh X25519 key pairs (c for masks, s for share encryption)."""
        self._advance("start", "advertise_keys")
        self._c_sk = X25519PrivateKey.from_private_bytes(self._rand(KEY_BYTES))
        self._s_sk = X25519PrivateKey.from_private_bytes(self._rand(KEY_BYTES))
        c_pk = self._c_sk.public_key().public_bytes_raw()
        s_pk = self._s_sk.public_key().public_bytes_raw()
        signature = b""
        if self._identity is not None and self.params.signed:
            data = advert_signed_bytes(self.params.session, self.id, c_pk, s_pk)
            signature = self._identity.sign(data)
        return AdvertiseKeys(self.id, c_pk, s_pk, signature)

    def _cipher(self, peer: int) -> ChaCha20Poly1305:
        if peer not in self._aead:
            assert self._s_sk is not None
            try:
                shared = self._s_sk.exchange(
                    X25519PublicKey.from_public_bytes(self._peers[peer][1])
                )
            except ValueError:  # not 32 bytes, or a low-order point (an all-zero secret)
                raise self._refuse(
                    f"client {peer}'s share-encryption key is not a usable X25519 public key"
                ) from None
            key = hkdf(shared, b"fedvox/secagg/share-encryption/" + self.params.session)
            self._aead[peer] = ChaCha20Poly1305(key)
        return self._aead[peer]

    def _associated(self, sender: int, receiver: int) -> tuple[bytes, bytes]:
        # Each (key, direction) seals exactly one message, so the id pair is a unique nonce.
        nonce = _pair(sender, receiver) + bytes(4)
        return nonce, self.params.session + _pair(sender, receiver)

    def share_keys(self, broadcast: KeyBroadcast) -> list[EncryptedShare]:
        """Round 1: Shamir-share b and c_sk over the share group, one AEAD message per peer."""
        self._advance("advertise_keys", "share_keys")
        assert self._c_sk is not None
        group = set(self.params.group(self.id))
        if not set(broadcast.keys) <= group:
            raise self._refuse(f"keys of non-neighbours {sorted(set(broadcast.keys) - group)}")
        own = broadcast.keys.get(self.id)
        mine = (
            self._c_sk.public_key().public_bytes_raw(),
            self._s_sk.public_key().public_bytes_raw() if self._s_sk else b"",
        )
        if own is not None and own != mine:
            raise self._refuse("the server relayed a different public key for this client")
        flat = [key for pair in broadcast.keys.values() for key in pair]
        if len(set(flat)) != len(flat):
            raise self._refuse("two advertised public keys are equal")
        if self.params.signed:
            session = self.params.session
            for v, (c_pk, s_pk) in sorted(broadcast.keys.items()):
                sig = broadcast.signatures.get(v, b"")
                data = advert_signed_bytes(session, v, c_pk, s_pk)
                if not signature_valid(self.params.verify_keys[v], sig, data):
                    raise self._refuse(
                        f"the advertised keys of client {v} carry no valid signature under its "
                        "registered identity key (forged or altered in transit)"
                    )
        self._peers = {v: keys for v, keys in broadcast.keys.items() if v != self.id}
        holders = sorted([*self._peers, self.id])
        self._enough(len(holders), "ShareKeys")
        t = self.params.threshold
        xs = [h + 1 for h in holders]  # x = 0 is the secret
        self._b = self._rand(KEY_BYTES)
        b_shares = shamir.split(self._b, t, xs, self._rand)
        sk_shares = shamir.split(self._c_sk.private_bytes_raw(), t, xs, self._rand)
        self._held[self.id] = (b_shares[self.id + 1], sk_shares[self.id + 1])
        out = []
        for v in sorted(self._peers):
            nonce, ad = self._associated(self.id, v)
            sealed = self._cipher(v).encrypt(nonce, b_shares[v + 1] + sk_shares[v + 1], ad)
            out.append(EncryptedShare(self.id, v, sealed))
        return out

    def masked_input(self, shares: Sequence[EncryptedShare], x: np.ndarray) -> MaskedInput:
        """Round 2: y = x + PRG(b) + Σ_v ±PRG(s_uv) over the peers v whose shares arrived."""
        self._advance("share_keys", "masked_input")
        assert self._c_sk is not None and self._b is not None
        for m in shares:
            if m.receiver != self.id or m.sender not in self._peers or m.sender in self._held:
                raise self._refuse(f"unexpected share message {m.sender} -> {m.receiver}")
            nonce, ad = self._associated(m.sender, self.id)
            try:
                plain = self._cipher(m.sender).decrypt(nonce, m.ciphertext, ad)
            except InvalidTag:
                raise self._refuse(f"share from client {m.sender} fails authentication") from None
            if len(plain) != 2 * SHARE_BYTES:
                raise self._refuse(f"share from client {m.sender} has the wrong size")
            self._held[m.sender] = (plain[:SHARE_BYTES], plain[SHARE_BYTES:])
        self._enough(len(self._held), "MaskedInputCollection")
        p = self.params
        if x.shape != (p.dim,) or x.dtype != p.dtype:
            raise ValueError(f"input must be a {p.dtype} vector of length {p.dim}")
        stream = Keystream(p.dim, p.dtype)
        y = x.copy()
        np.add(y, stream(self._b), out=y)
        for v in sorted(self._held):
            if v == self.id:
                continue
            try:
                pad = stream(mask_key(self._c_sk, self._peers[v][0], p.session))
            except ValueError:  # not 32 bytes, or a low-order point
                raise self._refuse(
                    f"client {v}'s mask key is not a usable X25519 public key"
                ) from None
            # The smaller id adds, the larger subtracts: the pair cancels in the sum.
            (np.add if self.id < v else np.subtract)(y, pad, out=y)
        y = p.finish(y)
        data = pack_ring(y, p.modulus_bits) if p.modulus_bits < 32 else y.tobytes()
        return MaskedInput(self.id, data)

    def consistency_check(self, request: ConsistencyRequest) -> ConsistencySignature:
        """ConsistencyCheck: sign (session, U3) with the identity key; later, before revealing
        anything, the client checks that t clients signed this same U3."""
        self._advance("masked_input", "consistency_check")
        if not self.params.signed or self._identity is None:
            raise self._refuse("a consistency check in an unsigned protocol")
        u3 = frozenset(request.survivors)
        if len(u3) != len(request.survivors) or self.id not in u3:
            raise self._refuse(f"the surviving set {sorted(u3)} repeats ids or omits this client")
        group = set(self.params.group(self.id))
        unknown = (u3 & group) - set(self._held)
        if unknown:
            raise self._refuse(f"survivors {sorted(unknown)} never sent it their shares")
        self._enough(len(u3 & group), "ConsistencyCheck")
        self._u3 = u3
        data = survivors_signed_bytes(self.params.session, sorted(u3))
        return ConsistencySignature(self.id, self._identity.sign(data))

    def _check_consistency(self, request: UnmaskRequest) -> None:
        """Refuse unless t clients signed the U3 this client signed and the request matches it."""
        if self._u3 is None:
            raise self._refuse("an unmask request before the consistency check")
        data = survivors_signed_bytes(self.params.session, sorted(self._u3))
        for v, sig in sorted(request.signatures.items()):
            if v not in self._u3:
                raise self._refuse(f"a consistency signature from client {v}, not a survivor")
            if not signature_valid(self.params.verify_keys[v], sig, data):
                raise self._refuse(
                    f"client {v}'s signature is not over the surviving set this client signed: "
                    "the server sent different surviving sets (equivocation) or forged one"
                )
        self._enough(len(request.signatures), "ConsistencyCheck (signatures)")
        held = set(self._held)
        if set(request.survivors) != held & self._u3 or set(request.dropped) != held - self._u3:
            raise self._refuse("the unmask request disagrees with the surviving set it signed")

    def unmask(self, request: UnmaskRequest) -> UnmaskResponse:
        """Round 3: b-shares of survivors, c_sk-shares of dropped peers; never both for one peer."""
        ready = (
            ("consistency_check", "unmask") if self.params.signed else ("masked_input", "unmask")
        )
        if self._stage not in ready:
            raise SecAggViolation(f"client {self.id}: unmask request in stage {self._stage}")
        if self.params.signed:
            self._check_consistency(request)
        self._stage = "unmask"
        surv, drop = set(request.survivors), set(request.dropped)
        both = surv & drop
        both |= {v for v in surv if self._revealed.get(v) == "key"}
        both |= {v for v in drop if self._revealed.get(v) == "self_mask"}
        if both:
            raise self._refuse(f"asked for both the self-mask and the key share of {sorted(both)}")
        if self.id in drop:
            raise self._refuse("asked for its own mask key although it sent its input")
        unknown = (surv | drop) - set(self._held)
        if unknown:
            raise self._refuse(f"holds no shares of clients {sorted(unknown)}")
        self._enough(len(surv), "Unmasking")
        for v in surv:
            self._revealed[v] = "self_mask"
        for v in drop:
            self._revealed[v] = "key"
        return UnmaskResponse(
            self.id,
            {v: self._held[v][0] for v in sorted(surv)},
            {v: self._held[v][1] for v in sorted(drop)},
        )


class SecAggServer:
    """The server: relays keys and shares, sums masked inputs, removes the masks at the end.

    It only ever receives public keys, ciphertexts, masked vectors and shares; it keeps a
    running sum of masked vectors, never an individual input.
    """

    def __init__(self, params: ProtocolParams) -> None:
        self.params = params
        self._keys: dict[int, tuple[bytes, bytes]] = {}
        self._key_sigs: dict[int, bytes] = {}
        self._shared: set[int] = set()  # U2: clients whose shares arrived
        self._masked: set[int] = set()  # U3: clients whose masked input arrived
        self._signed: dict[int, bytes] = {}  # U4: consistency signatures that arrived
        self._sum: np.ndarray | None = None

    def _enough(self, alive: int, stage: str) -> None:
        t = self.params.threshold
        if alive < t:
            raise SecAggAbort(
                f"{alive} clients alive at {stage}, below the threshold t={t}: "
                "secure aggregation aborted, nothing is revealed",
                alive,
                t,
            )

    def broadcast_keys(self, messages: Sequence[AdvertiseKeys]) -> dict[int, KeyBroadcast]:
        """After round 0: each client gets the keys (and signatures) of its share group's live
        members."""
        for m in messages:
            if not 0 <= m.sender < self.params.n or m.sender in self._keys:
                raise SecAggAbort(f"unexpected AdvertiseKeys from client {m.sender}")
            for key in (m.c_public, m.s_public):
                if not isinstance(key, bytes) or len(key) != KEY_BYTES:
                    raise SecAggAbort(
                        f"client {m.sender} advertised a public key that is not {KEY_BYTES} bytes"
                    )
            self._keys[m.sender] = (m.c_public, m.s_public)
            if self.params.signed:
                self._key_sigs[m.sender] = m.signature
        self._enough(len(self._keys), "AdvertiseKeys")
        out = {}
        for u in sorted(self._keys):
            live = [v for v in self.params.group(u) if v in self._keys]
            sigs = {v: self._key_sigs[v] for v in live} if self.params.signed else {}
            out[u] = KeyBroadcast({v: self._keys[v] for v in live}, sigs)
        return out

    def route_shares(
        self, batches: Mapping[int, Sequence[EncryptedShare]]
    ) -> dict[int, list[EncryptedShare]]:
        """After round 1: forward each ciphertext to its receiver (U2 = clients that shared)."""
        self._shared = set(batches) & set(self._keys)
        self._enough(len(self._shared), "ShareKeys")
        routed: dict[int, list[EncryptedShare]] = {u: [] for u in sorted(self._shared)}
        for sender, batch in batches.items():
            for m in batch:
                if m.sender != sender or m.receiver not in self.params.neighbours[sender]:
                    raise SecAggAbort(f"client {sender} sent a share addressed {m.receiver}")
                if m.receiver in routed:
                    routed[m.receiver].append(m)
        return routed

    def receive_masked(self, message: MaskedInput) -> None:
        """Round 2: add one masked vector to the running sum."""
        if message.sender not in self._shared or message.sender in self._masked:
            raise SecAggAbort(f"unexpected masked input from client {message.sender}")
        p = self.params
        size = ring_bytes(p.dim, p.modulus_bits, p.dtype)
        if len(message.data) != size:
            raise SecAggAbort(
                f"masked input of client {message.sender} has {len(message.data)} bytes, "
                f"not {size} ({p.dim} x {p.modulus_bits}-bit ring elements)"
            )
        if p.modulus_bits < 32:
            vec = unpack_ring(message.data, p.modulus_bits, p.dim, p.dtype)
        else:
            vec = np.frombuffer(message.data, dtype=p.dtype)
        if self._sum is None:
            self._sum = vec.copy()
        else:
            np.add(self._sum, vec, out=self._sum)
        self._masked.add(message.sender)

    def consistency_requests(self) -> dict[int, ConsistencyRequest]:
        """ConsistencyCheck: send U3 (clients whose masked input arrived) to each of them."""
        self._enough(len(self._masked), "MaskedInputCollection")
        u3 = tuple(sorted(self._masked))
        return {u: ConsistencyRequest(u3) for u in u3}

    def receive_signatures(self, messages: Sequence[ConsistencySignature]) -> None:
        """ConsistencyCheck: keep each survivor's signature over U3 (U4 = who answered)."""
        for m in messages:
            if m.sender not in self._masked or m.sender in self._signed:
                raise SecAggAbort(f"unexpected consistency signature from client {m.sender}")
            self._signed[m.sender] = m.signature
        self._enough(len(self._signed), "ConsistencyCheck")

    def unmask_requests(self) -> dict[int, UnmaskRequest]:
        """Round 3 requests: U3 = clients whose masked input arrived; U2 \\ U3 dropped.

        Signed: sent to U4 only, carrying every signature over U3 for the clients to check.
        """
        self._enough(len(self._masked), "MaskedInputCollection")
        dropped = self._shared - self._masked
        asked = sorted(self._signed) if self.params.signed else sorted(self._masked)
        out = {}
        for u in asked:
            group = set(self.params.group(u))
            out[u] = UnmaskRequest(
                tuple(sorted(group & self._masked)),
                tuple(sorted(group & dropped - {u})),
                dict(self._signed),
            )
        return out

    def _reconstruct(
        self,
        shares: dict[int, bytes],
        owner: int,
        what: str,
        cache: dict[tuple[int, ...], list[int]],
    ) -> bytes:
        t = self.params.threshold
        if len(shares) < t:
            raise SecAggAbort(
                f"{len(shares)} clients of client {owner}'s share group alive at Unmasking "
                f"(to recover its {what}), below the threshold t={t}",
                len(shares),
                t,
            )
        xs = tuple(sorted(shares)[:t])
        if xs not in cache:
            cache[xs] = shamir.lagrange_at_zero(xs)
        try:
            return shamir.combine({x: shares[x] for x in xs}, KEY_BYTES, cache[xs])
        except ValueError as err:
            raise SecAggAbort(f"client {owner}'s {what} shares are inconsistent: {err}") from None

    def unmask(self, responses: Sequence[UnmaskResponse]) -> tuple[np.ndarray, list[int]]:
        """Round 3: rebuild b of survivors and c_sk of dropped clients, strip every mask.

        Returns the ring sum of the survivors' inputs and the survivors (U3).
        """
        self._enough(len(responses), "Unmasking")
        p = self.params
        dropped = self._shared - self._masked
        b_shares: dict[int, dict[int, bytes]] = {}
        sk_shares: dict[int, dict[int, bytes]] = {}
        asked = set(self._signed) if p.signed else self._masked
        for r in responses:
            if r.sender not in asked:
                raise SecAggAbort(f"unmask response from client {r.sender}, not a survivor")
            if set(r.self_mask_shares) & set(r.key_shares):
                raise SecAggAbort(f"client {r.sender} revealed both shares of one peer")
            for v, s in r.self_mask_shares.items():
                b_shares.setdefault(v, {})[r.sender + 1] = s
            for v, s in r.key_shares.items():
                sk_shares.setdefault(v, {})[r.sender + 1] = s
        assert self._sum is not None
        total = self._sum
        stream = Keystream(p.dim, p.dtype)
        cache: dict[tuple[int, ...], list[int]] = {}
        for v in sorted(self._masked):
            b = self._reconstruct(b_shares.get(v, {}), v, "self-mask seed", cache)
            np.subtract(total, stream(b), out=total)
        for d in sorted(dropped):
            alive = [u for u in p.neighbours[d] if u in self._masked]
            if not alive:
                continue
            sk = self._reconstruct(sk_shares.get(d, {}), d, "mask key", cache)
            private = X25519PrivateKey.from_private_bytes(sk)
            if private.public_key().public_bytes_raw() != self._keys[d][0]:
                raise SecAggAbort(f"client {d}'s reconstructed mask key does not match its key")
            for u in alive:
                try:
                    pad = stream(mask_key(private, self._keys[u][0], p.session))
                except ValueError:  # a low-order point: u's own clients would have refused
                    raise SecAggAbort(f"client {u}'s mask key is not usable") from None
                # u added +pad when u < d, −pad otherwise: undo it.
                (np.subtract if u < d else np.add)(total, pad, out=total)
        self._sum = None
        return p.finish(total), sorted(self._masked)


# --------------------------------------------------------------------------- in-process run


@dataclass
class RunStats:
    """Seconds and bytes of one protocol run (per client lists cover clients that ran a stage)."""

    client_seconds: dict[str, list[float]] = field(default_factory=dict)
    server_seconds: dict[str, float] = field(default_factory=dict)
    bytes_up: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    bytes_down: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


class _Wire:
    """run_protocol's bookkeeping: who is still taking part, bytes and transcript of every
    message crossing the network, and client compute time per stage."""

    def __init__(
        self,
        stats: RunStats,
        drop_after: dict[int, str],
        transcript: list[tuple[str, int, Message]] | None,
    ) -> None:
        self.stats, self.drop_after, self.transcript = stats, drop_after, transcript

    def takes_part(self, i: int, stage: str) -> bool:
        return STAGES.index(self.drop_after.get(i, "unmask")) >= STAGES.index(stage)

    def up(self, i: int, m: Message) -> Message:
        self.stats.bytes_up[i] += wire_size(m)
        if self.transcript is not None:
            self.transcript.append(("up", i, m))
        return m

    def down(self, i: int, m: Message) -> Message:
        self.stats.bytes_down[i] += wire_size(m)
        if self.transcript is not None:
            self.transcript.append(("down", i, m))
        return m

    def timed(self, stage: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        out = fn()
        self.stats.client_seconds.setdefault(stage, []).append(time.perf_counter() - start)
        return out


def run_protocol(
    params: ProtocolParams,
    inputs: Callable[[int], np.ndarray],
    entropies: Sequence[Callable[[int], bytes]],
    drop_after: Mapping[int, str] | None = None,
    transcript: list[tuple[str, int, Message]] | None = None,
    identities: Sequence[Ed25519PrivateKey] | None = None,
    server: SecAggServer | None = None,
) -> tuple[np.ndarray, list[int], RunStats]:
    """Run all rounds in process; returns (ring sum of survivors' inputs, survivors, stats).

    `inputs(i)` gives client i's encoded vector (called only if i reaches round 2);
    `drop_after[i]` is the stage in STAGES after which client i goes silent. `transcript`
    collects ("up" | "down", client, message) for every message that crosses the network.
    A signed protocol (params.verify_keys) needs the clients' `identities` and runs the
    ConsistencyCheck round; `server` replaces the honest server (tests of a hostile one).
    """
    drop_after = dict(drop_after or {})
    bad = {s for s in drop_after.values() if s not in STAGES}
    if bad:
        raise ValueError(f"unknown dropout stages {sorted(bad)}; use one of {STAGES}")
    n = params.n
    stats = RunStats(bytes_up=np.zeros(n, np.int64), bytes_down=np.zeros(n, np.int64))
    wire = _Wire(stats, drop_after, transcript)
    takes_part, up, down, timed = wire.takes_part, wire.up, wire.down, wire.timed

    if params.signed and identities is None:
        raise ValueError("a signed protocol needs the clients' identity keys")
    ids = identities if params.signed else None
    clients = [
        SecAggClient(i, params, entropies[i], None if ids is None else ids[i]) for i in range(n)
    ]
    server = SecAggServer(params) if server is None else server
    clock = time.perf_counter()

    adverts = [
        up(i, timed("key_setup", clients[i].advertise_keys))
        for i in range(n)
        if takes_part(i, "advertise_keys")
    ]
    broadcasts = server.broadcast_keys(adverts)  # type: ignore[arg-type]
    batches = {}
    for i, msg in broadcasts.items():
        down(i, msg)
        if takes_part(i, "share_keys"):
            batch = timed("sharing", lambda c=clients[i], m=msg: c.share_keys(m))
            batches[i] = [up(i, s) for s in batch]
    routed = server.route_shares(batches)
    for i, shares in routed.items():
        for s in shares:
            down(i, s)
        if takes_part(i, "masked_input"):
            x = timed("encode", lambda i=i: inputs(i))
            masked = timed("masking", lambda c=clients[i], s=shares, x=x: c.masked_input(s, x))
            del x
            server.receive_masked(up(i, masked))  # type: ignore[arg-type]
    stats.server_seconds["relay_and_sum"] = (
        time.perf_counter() - clock - sum(sum(v) for v in stats.client_seconds.values())
    )
    if params.signed:
        signatures = []
        for i, creq in server.consistency_requests().items():
            down(i, creq)
            if takes_part(i, "consistency_check"):
                sig = timed("consistency", lambda c=clients[i], r=creq: c.consistency_check(r))
                signatures.append(up(i, sig))
        server.receive_signatures(signatures)  # type: ignore[arg-type]
    requests = server.unmask_requests()
    responses = []
    for i, req in requests.items():
        down(i, req)
        if takes_part(i, "unmask"):
            resp = timed("unmask_reply", lambda c=clients[i], r=req: c.unmask(r))
            responses.append(up(i, resp))
    clock = time.perf_counter()
    total, survivors = server.unmask(responses)  # type: ignore[arg-type]
    stats.server_seconds["unmasking"] = time.perf_counter() - clock
    return total, survivors, stats


# --------------------------------------------------------------------------- the Summer


def _session_secret(seed: int, call: int) -> bytes:
    """Secret root of one call's simulated randomness (keys, seeds, Shamir coefficients)."""
    material = seed.to_bytes(16, "big") + call.to_bytes(8, "big")
    return hkdf(material, b"fedvox/secagg/session-secret")


def identity_keys(seed: int, call: int, n: int) -> list[Ed25519PrivateKey]:
    """The n clients' Ed25519 identity keys of a simulated call (a deployment registers each
    device's own long-term key once, at enrolment)."""
    root = _session_secret(seed, call)
    return [
        Ed25519PrivateKey.from_private_bytes(hkdf(root, b"fedvox/secagg/identity/%d" % i))
        for i in range(n)
    ]


class SecureSum:
    """Summer running the protocol over the clients of each call (fl/aggregation.Summer).

    Every call has fresh keys: its secrets derive from (seed, call index), so a run is
    deterministic given the seed, repeated calls differ, and state_dict() makes a resumed run
    bit-identical. Returns (Σ w_i Δ_i as float32, Σ w_i, survivors) over the survivors only.
    An abort below the threshold raises SecAggAbort, or StepSkipped with on_abort = "skip"
    (counted in `aborted`); a SecAggViolation always propagates.
    A simulation: messages, costs and dropouts are the real protocol's, but its secrets are
    only as hidden as the seed; deployed clients draw theirs from `Entropy()` (the OS).
    """

    def __init__(self, config: SecAggConfig, seed: int | None = None) -> None:
        self.config = config
        self.seed = config.seed if seed is None else seed
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError("secagg.seed", f"{self.seed!r} is not an int >= 0", "use e.g. 0")
        self.calls = 0
        self.aborted = 0  # calls that aborted below the threshold and were skipped
        self.last_stats: RunStats | None = None
        self.last_survivors: list[int] = []
        self._last: dict[str, float] = {}

    def last_metrics(self) -> dict[str, float]:
        """The last call: aborted (1/0), survivors, threshold t, and the run's aborted total."""
        return dict(self._last)

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "seed": self.seed, "aborted": self.aborted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("seed", self.seed)) != self.seed:
            raise ConfigError(
                "secagg.seed",
                f"the checkpoint was written with seed {state['seed']}, this run has {self.seed}",
                "resume with the seed of the checkpointed run",
            )
        self.calls = int(state["calls"])
        self.aborted = int(state.get("aborted", 0))

    def _rng(self, purpose: int, *ids: int) -> np.random.Generator:
        return derived_rng(self.seed, purpose, *ids)

    def upload_bytes(self, shapes: Mapping[str, Sequence[int]]) -> int:
        """Bytes of one client's MaskedInput (the update's upload): its sender id and dim + 1
        ring elements (the weight rides along), packed below 32 bits, else whole words."""
        dim = sum(math.prod(s) for s in shapes.values()) + 1
        return wire_size(0) + ring_bytes(dim, self.config.modulus_bits, self.config.dtype)

    def protocol_params(self, n: int, dim: int, call: int) -> ProtocolParams:
        """The public parameters of call `call` over n clients with `dim` coordinates."""
        cfg = self.config
        k = cfg.neighbour_count(n)
        graph = neighbour_graph(n, k, self._rng(Purpose.SECAGG_GRAPH, call))
        t = cfg.group_threshold(min(len(g) for g in graph) + 1)
        session = hashlib.sha256(b"fedvox/secagg/session-id" + _session_secret(self.seed, call))
        return ProtocolParams(n, t, dim, cfg.modulus_bits, graph, session.digest()[:16])

    def __call__(self, deltas: Params, weights: Tensor) -> tuple[Params, float, int]:
        call = self.calls
        self.calls += 1  # counted even if it aborts, so a resumed run stays in step
        try:
            return self._run(deltas, weights, call)
        except SecAggViolation:
            raise
        except SecAggAbort as err:
            if self.config.on_abort == "stop":
                raise
            self.aborted += 1
            self.last_stats, self.last_survivors = None, []
            self._last = {
                "secagg_aborted": 1.0,
                "secagg_aborted_total": float(self.aborted),
                "secagg_survivors": float(err.alive if err.alive is not None else 0),
                "secagg_threshold": float(err.threshold if err.threshold is not None else 0),
            }
            alive = "?" if err.alive is None else err.alive
            t = "?" if err.threshold is None else err.threshold
            raise StepSkipped(
                f"secure aggregation aborted with {alive} survivors, below the threshold t={t} "
                f'(on_abort = "skip"): {err}',
                self._last,
            ) from err

    def _run(self, deltas: Params, weights: Tensor, call: int) -> tuple[Params, float, int]:
        cfg = self.config
        n = int(weights.shape[0])
        if n < 2:
            raise SecAggAbort(f"{n} client alive, below the 2 secure aggregation needs", n, 2)
        cfg.check_capacity(n)
        w = weights.detach().to(torch.float64).cpu().numpy()
        names = list(deltas)
        if any(deltas[name].shape[0] != n for name in names):
            raise ValueError(f"every delta needs a leading client axis of {n} (one per weight)")
        shapes = [deltas[name].shape[1:] for name in names]
        sizes = [math.prod(s) for s in shapes]
        params = self.protocol_params(n, sum(sizes) + 1, call)
        identities = None
        if cfg.consistency_check:
            identities = identity_keys(self.seed, call, n)
            registry = tuple(k.public_key().public_bytes_raw() for k in identities)
            params = dataclasses.replace(params, verify_keys=registry)

        drops: dict[int, str] = {}
        if cfg.dropout > 0:
            u = self._rng(Purpose.SECAGG_DROPOUT, call).random(n)
            drops = {i: cfg.dropout_after for i in range(n) if u[i] < cfg.dropout}

        def inputs(i: int) -> np.ndarray:
            flat = torch.cat([deltas[name][i].detach().reshape(-1) for name in names])
            rng = self._rng(Purpose.SECAGG_ROUNDING, call, i)
            return encode(flat.to(torch.float64).cpu().numpy(), float(w[i]), cfg, rng)

        root = _session_secret(self.seed, call)
        entropies = [Entropy(hkdf(root, b"fedvox/secagg/client/%d" % i)) for i in range(n)]
        total, survivors, stats = run_protocol(
            params, inputs, entropies, drops, identities=identities
        )
        self.last_stats, self.last_survivors = stats, survivors
        self._last = {
            "secagg_aborted": 0.0,
            "secagg_aborted_total": float(self.aborted),
            "secagg_survivors": float(len(survivors)),
            "secagg_threshold": float(params.threshold),
        }
        values, weight = decode(total, cfg)
        out, offset = {}, 0
        for name, shape, size in zip(names, shapes, sizes, strict=True):
            part = values[offset : offset + size].astype(np.float32).reshape(shape)
            out[name] = torch.from_numpy(part).to(deltas[name].device)
            offset += size
        return out, weight, len(survivors)
