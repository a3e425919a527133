"""Shamir t-of-n secret sharing over the prime field GF(2^521 − 1), for 32-byte keys and seeds.

Used by secure aggregation (privacy/secagg.py) to share each client's self-mask seed and
mask-agreement private key with its neighbours, so the server can recover either after dropouts.
"""

# Hand-written on Python ints: no maintained Python library does Shamir over a prime field
# with a vetted API (the ones on PyPI are unmaintained or GF(256)-only), and the math is a
# polynomial evaluation and a Lagrange interpolation.

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

# The Mersenne prime 2^521 − 1: one field element holds a 64-byte chunk, so a 32-byte secret
# is a single element and a share is one 66-byte number.
PRIME = 2**521 - 1
ELEMENT_BYTES = 66
CHUNK_BYTES = 64

RandomBytes = Callable[[int], bytes]


def random_element(random_bytes: RandomBytes) -> int:
    """A uniform element of GF(PRIME) by rejection sampling 521-bit numbers."""
    while True:
        value = int.from_bytes(random_bytes(ELEMENT_BYTES), "big") & PRIME
        if value < PRIME:
            return value


def _check_points(t: int, xs: Sequence[int]) -> None:
    if not 1 <= t <= len(xs):
        raise ValueError(f"threshold t={t} must be in 1..{len(xs)} (the number of shares)")
    if len(set(xs)) != len(xs) or any(not 0 < x < PRIME for x in xs):
        raise ValueError("share points must be distinct and non-zero (x = 0 is the secret)")


def split_int(secret: int, t: int, xs: Sequence[int], random_bytes: RandomBytes) -> dict[int, int]:
    """Shares f(x) for x in xs of a random degree-(t−1) polynomial with f(0) = secret."""
    if not 0 <= secret < PRIME:
        raise ValueError("secret must be a field element")
    _check_points(t, xs)
    coeffs = [secret] + [random_element(random_bytes) for _ in range(t - 1)]
    shares = {}
    for x in xs:
        acc = 0
        for c in reversed(coeffs):  # Horner
            acc = (acc * x + c) % PRIME
        shares[x] = acc
    return shares


def lagrange_at_zero(xs: Sequence[int]) -> list[int]:
    """Coefficients λ_i with f(0) = Σ λ_i f(x_i) for any polynomial of degree < len(xs)."""
    coeffs = []
    for i, xi in enumerate(xs):
        num, den = 1, 1
        for j, xj in enumerate(xs):
            if j != i:
                num = num * xj % PRIME
                den = den * (xj - xi) % PRIME
        coeffs.append(num * pow(den, -1, PRIME) % PRIME)
    return coeffs


def combine_int(shares: Mapping[int, int], lagrange: list[int] | None = None) -> int:
    """Interpolate f(0) through all given points (x -> f(x)).

    With fewer than t shares this silently yields a wrong value (a polynomial of lower
    degree through the points): the caller must know t and pass at least t shares.
    """
    xs = list(shares)
    _check_points(len(xs), xs)
    lam = lagrange if lagrange is not None else lagrange_at_zero(xs)
    return sum(lam_i * shares[x] for lam_i, x in zip(lam, xs, strict=True)) % PRIME


def split(secret: bytes, t: int, xs: Sequence[int], random_bytes: RandomBytes) -> dict[int, bytes]:
    """Share a byte string: each 64-byte chunk is one field element, shared independently.

    A share is the concatenation of its 66-byte elements; its x is the holder's point.
    """
    chunks = [secret[i : i + CHUNK_BYTES] for i in range(0, len(secret), CHUNK_BYTES)] or [b""]
    per_chunk = [split_int(int.from_bytes(c, "big"), t, xs, random_bytes) for c in chunks]
    return {x: b"".join(s[x].to_bytes(ELEMENT_BYTES, "big") for s in per_chunk) for x in xs}


def share_size(secret_size: int) -> int:
    """Bytes of one share of a `secret_size`-byte secret."""
    return max(1, -(-secret_size // CHUNK_BYTES)) * ELEMENT_BYTES


def combine(shares: Mapping[int, bytes], size: int, lagrange: list[int] | None = None) -> bytes:
    """Reconstruct a `size`-byte secret from shares (x -> share bytes); needs ≥ t of them.

    Raises ValueError when the interpolated value cannot be such a secret (too few or
    corrupted shares usually give a field element that does not fit in its chunk).
    """
    n_chunks = max(1, -(-size // CHUNK_BYTES))
    if any(len(s) != n_chunks * ELEMENT_BYTES for s in shares.values()):
        raise ValueError(f"a share of a {size}-byte secret has {n_chunks * ELEMENT_BYTES} bytes")
    xs = list(shares)
    lam = lagrange if lagrange is not None else lagrange_at_zero(xs)
    out = []
    for k in range(n_chunks):
        lo = k * ELEMENT_BYTES
        pts = {x: int.from_bytes(shares[x][lo : lo + ELEMENT_BYTES], "big") for x in xs}
        value = combine_int(pts, lam)
        width = min(CHUNK_BYTES, size - k * CHUNK_BYTES)
        if value >= 1 << (8 * width):
            raise ValueError("shares do not reconstruct a secret of this size (too few or corrupt)")
        out.append(value.to_bytes(width, "big"))
    return b"".join(out)
