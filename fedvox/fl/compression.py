"""Upload compression: float16, stochastic uniform quantisation, top-k with error feedback.

A per-client stage of the aggregation pipeline (fl/aggregation.py), after clipping and before
the sum: it returns the decoded update the server aggregates and knows the bytes it sends.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from fedvox.errors import ConfigError
from fedvox.rng import Purpose, derived_rng
from fedvox.types import Params

KINDS = ("none", "float16", "quantize", "topk")
FLOAT16_MAX = 65504.0
SCALE_BYTES = 8  # a quantisation chunk's (low, step) as two float32
VALUE_BYTES = 4  # a float32 value (uncompressed, or a top-k value)


@dataclass(frozen=True)
class CompressionConfig:
    """What a client does to its update before upload (errors name `compression.<field>`).

    quantize: `bits` per coordinate, per-chunk min/max scaling over `chunk` coordinates of a
    tensor, unbiased stochastic rounding from a (seed, client, trip) generator.
    topk: the ceil(fraction·n) largest-magnitude coordinates of each tensor, the rest carried
    to the client's next trip when `error_feedback` (a residual held on the device).
    ring_scale_bits/ring_clip: secure aggregation's fixed-point ring; when set, values are
    clipped to ±ring_clip and quantisation steps are powers of two ≥ 2^−ring_scale_bits, so
    the ring holds every decoded value exactly.
    shared_range: quantize on one public grid shared by every client instead of per-chunk
    scales: c (a power of two), levels −c + j·c·2^(1−bits), j < 2^bits, values clipped to
    [−c, c − step]; no scales are sent, and secure aggregation can sum the levels j in a ring
    of bits + ⌈log2 n⌉ bits (`ring_levels`: the stage then never rescales off the grid).
    """

    kind: Literal["none", "float16", "quantize", "topk"] = "none"
    bits: int = 8
    chunk: int = 512
    fraction: float = 0.01
    error_feedback: bool = True
    seed: int = 0
    ring_scale_bits: int | None = None
    ring_clip: float | None = None
    shared_range: float | None = None
    ring_levels: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError("compression.kind", f"{self.kind!r}", f"use one of {KINDS}")
        if self.bits not in (2, 4, 8):
            raise ConfigError("compression.bits", f"{self.bits!r}", "use 8, 4 or 2")
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise ConfigError("compression.chunk", f"{self.chunk!r} is not an int >= 1", "use 512")
        if not 0.0 < self.fraction <= 1.0:
            raise ConfigError("compression.fraction", f"{self.fraction} outside (0, 1]", "use 0.01")
        c = self.shared_range
        if c is not None:
            if self.kind != "quantize":
                raise ConfigError(
                    "compression.shared_range",
                    f"a shared grid is a quantisation grid, and kind is {self.kind!r}",
                    'use kind = "quantize" with shared_range, or leave shared_range unset',
                )
            if not (c > 0 and math.isfinite(c) and math.log2(c).is_integer()):
                raise ConfigError(
                    "compression.shared_range",
                    f"{c} is not a power of two (the grid's levels must be exact in float32)",
                    "use e.g. 0.015625 (2^-6): about the largest |coordinate| of an update",
                )
        if self.ring_levels and (c is None or self.ring_clip is not None):
            raise ValueError("ring_levels is the shared grid's ring (shared_range, no ring_clip)")
        if (self.ring_scale_bits is None) != (self.ring_clip is None):
            raise ValueError("ring_scale_bits and ring_clip are set together (secure aggregation)")
        if self.ring_clip is not None:
            if self.kind == "topk":
                raise ConfigError(
                    "federated.compression.kind",
                    "top-k under secure aggregation would reveal which coordinates each client "
                    "sends (the masks hide values, not positions), unless every client shared "
                    "one mask of positions",
                    'use kind = "quantize" or "float16" with secure aggregation (they compose), '
                    "or turn secure_aggregation off for top-k",
                )
            c = float(self.ring_clip)
            if not (c > 0 and math.log2(c).is_integer()):
                raise ConfigError(
                    "secagg.clip", f"{c} is not a power of two", "use e.g. 8 with compression"
                )
            if self.kind == "float16" and self.ring_scale_bits < 24:  # type: ignore[operator]
                raise ConfigError(
                    "secagg.scale_bits",
                    f"{self.ring_scale_bits} bits cannot hold float16 values exactly (their "
                    "finest step is 2^-24)",
                    "use scale_bits >= 24 (and a ring of modulus_bits > 32) with float16",
                )


# --------------------------------------------------------------------------- wire sizes


def index_bits(n: int) -> int:
    """Bits of one coordinate index into a tensor of n coordinates (0 when n = 1)."""
    return (n - 1).bit_length()


def topk_count(n: int, fraction: float) -> int:
    """Coordinates top-k sends of a tensor of n: ceil(fraction·n), at least 1."""
    return min(n, max(1, math.ceil(fraction * n - 1e-9)))


def tensor_bytes(n: int, config: CompressionConfig) -> int:
    """Bytes one tensor of n coordinates takes on the wire, packed on its own.

    float16: 2n. quantize: ⌈n·bits/8⌉ codes + 8 per chunk (low, step as float32), without
    the scales on a shared grid. topk: 4k values + the cheaper of k packed ⌈log2 n⌉-bit
    indices or an n-bit mask.
    """
    if config.kind == "none":
        return VALUE_BYTES * n
    if config.kind == "float16":
        return 2 * n
    if config.kind == "quantize":
        scales = 0 if config.shared_range is not None else SCALE_BYTES * math.ceil(n / config.chunk)
        return math.ceil(n * config.bits / 8) + scales
    k = topk_count(n, config.fraction)
    return VALUE_BYTES * k + math.ceil(min(k * index_bits(n), n) / 8)


def upload_bytes(shapes: Mapping[str, Sequence[int]], config: CompressionConfig) -> int:
    """Bytes of one compressed update: the sum over its tensors."""
    return sum(tensor_bytes(math.prod(s), config) for s in shapes.values())


# --------------------------------------------------------------------------- the maps


def to_float16(x: Tensor) -> Tensor:
    """Round to float16 (saturating at ±65504, so no update overflows to Inf) and back."""
    return x.clamp(-FLOAT16_MAX, FLOAT16_MAX).to(torch.float16).to(x.dtype)


def quantize(
    x: Tensor,
    bits: int,
    chunk: int,
    u: Tensor,
    min_step: float | None = None,
) -> Tensor:
    """Decoded stochastic uniform quantisation of a flat tensor, per chunk of `chunk` values.

    Levels low + j·step, j < 2^bits, low/high the chunk's min/max; x rounds up with
    probability (x − lower level)/step using `u` ~ U[0, 1), so E[decoded] = x and
    |decoded − x| < step. With `min_step` (a ring's resolution) steps are powers of two
    ≥ min_step and ≥ the float32 spacing of the chunk's values, lows are multiples of the
    step, so every decoded value is exact in float32 and in the ring.
    """
    n = x.numel()
    levels = 2**bits
    pad = (-n) % chunk
    v = x.reshape(-1).to(torch.float64)
    lo = torch.cat([v, v.new_full((pad,), math.inf)]).view(-1, chunk).amin(1)
    hi = torch.cat([v, v.new_full((pad,), -math.inf)]).view(-1, chunk).amax(1)
    span = hi - lo
    if min_step is None:
        step = span / (levels - 1)
    else:
        # a power-of-two step ≥ span/(L−2): low moves down by < step, the top still fits
        step = torch.exp2(torch.ceil(torch.log2(span / (levels - 2))))  # span 0: step 0
        big = torch.maximum(lo.abs(), hi.abs())
        ulp = torch.exp2(torch.floor(torch.log2(big.clamp(min=2.0**-126))) - 23)
        step = torch.maximum(torch.maximum(step, ulp), step.new_tensor(min_step))
        lo = torch.floor(lo / step) * step
    lo_e = lo.repeat_interleave(chunk)[:n]
    step_e = step.repeat_interleave(chunk)[:n]
    safe = torch.where(step_e > 0, step_e, torch.ones_like(step_e))
    j = torch.floor((v - lo_e) / safe + u.reshape(-1).to(torch.float64))
    j = j.clamp(0, levels - 1) * (step_e > 0)
    return (lo_e + j * step_e).to(x.dtype).reshape(x.shape)


def shared_step(bits: int, c: float) -> float:
    """The step of the shared grid [−c, c − step] of 2^bits levels: c·2^(1−bits)."""
    return c * 2.0 ** (1 - bits)


def quantize_shared(x: Tensor, bits: int, c: float, u: Tensor) -> tuple[Tensor, Tensor]:
    """Stochastic rounding onto the shared grid −c + j·step (step = shared_step), after
    clipping to [−c, c − step]; returns (decoded, levels j as int64). Unbiased inside the
    range; with c a power of two every level is exact in float32."""
    step = shared_step(bits, c)
    v = x.reshape(-1).to(torch.float64).clamp(-c, c - step)
    j = torch.floor((v + c) / step + u.reshape(-1).to(torch.float64)).clamp(0, 2**bits - 1)
    return (j * step - c).to(x.dtype).reshape(x.shape), j.to(torch.int64).reshape(x.shape)


def top_k(x: Tensor, k: int) -> Tensor:
    """x with all but its k largest-magnitude coordinates set to zero (flat order ties)."""
    flat = x.reshape(-1)
    out = torch.zeros_like(flat)
    idx = torch.topk(flat.abs(), k, sorted=False).indices
    out[idx] = flat[idx]
    return out.reshape(x.shape)


def scale_to_bound(update: Params, bound: float) -> tuple[Params, float]:
    """Scale an update (all tensors jointly) to L2 norm ≤ bound; returns it and its norm."""
    sq = sum(float(t.to(torch.float64).pow(2).sum()) for t in update.values())
    norm = math.sqrt(sq)
    if norm <= bound:
        return update, norm
    f = bound / norm
    return {n: t * f for n, t in update.items()}, norm


# --------------------------------------------------------------------------- the stage


class Compress:
    """SumStage compressing each client's update as its device would; needs (client, trip).

    Returns the decoded updates. `bounds` give the norm bounds in force (DP clip norm, robust
    norm bound): a decoded update above the smallest is scaled back to it on the device (the
    sent scales or values shrink; the bytes do not change), except on a shared grid summed
    as levels (`ring_levels`), which only bounds the input. Top-k residuals are device state,
    one per client that has sent, saved with the simulator.
    """

    needs_jobs = True

    def __init__(
        self, config: CompressionConfig, bounds: Sequence[Callable[[], float]] = ()
    ) -> None:
        self.config = config
        self.bounds = list(bounds)
        self.residuals: dict[int, Params] = {}
        self._errors: list[float] = []
        self._rescaled = 0
        self._last: dict[str, float] = {}

    def upload_bytes(self, shapes: Mapping[str, Sequence[int]]) -> int:
        """Bytes one client sends per trip (payload + scales or indices)."""
        return upload_bytes(shapes, self.config)

    def residual_bytes(self) -> int:
        """Memory the top-k residuals hold: 4 bytes a coordinate per client that has sent."""
        return sum(
            t.numel() * t.element_size() for r in self.residuals.values() for t in r.values()
        )

    def compress(self, update: Params, client: int, trip: int) -> Params:
        """One client's decoded upload for trip `trip` (updates its residual under top-k)."""
        cfg = self.config
        if cfg.ring_clip is not None:
            update = {n: t.clamp(-cfg.ring_clip, cfg.ring_clip) for n, t in update.items()}
        if cfg.kind == "none":
            out = dict(update)
        elif cfg.kind == "float16":
            out = {n: to_float16(t) for n, t in update.items()}
        elif cfg.kind == "quantize" and cfg.shared_range is not None:
            rng = derived_rng(cfg.seed, Purpose.COMPRESS, client, trip)
            out = {}
            for n, t in update.items():
                u = torch.from_numpy(rng.random(t.numel())).to(t.device)
                out[n] = quantize_shared(t, cfg.bits, cfg.shared_range, u)[0]
        elif cfg.kind == "quantize":
            rng = derived_rng(cfg.seed, Purpose.COMPRESS, client, trip)
            min_step = None if cfg.ring_scale_bits is None else 2.0**-cfg.ring_scale_bits
            out = {}
            for n, t in update.items():
                u = torch.from_numpy(rng.random(t.numel())).to(t.device)
                out[n] = quantize(t, cfg.bits, cfg.chunk, u, min_step)
        else:
            if cfg.error_feedback and client in self.residuals:
                update = {n: t + self.residuals[client][n] for n, t in update.items()}
            out = {n: top_k(t, topk_count(t.numel(), cfg.fraction)) for n, t in update.items()}
        if self.bounds and not cfg.ring_levels:  # a ring of levels holds only the grid
            bound = min(b() for b in self.bounds)
            out, norm = scale_to_bound(out, bound)
            self._rescaled += int(norm > bound)
        if cfg.kind == "topk" and cfg.error_feedback:
            self.residuals[client] = {n: (update[n] - out[n]).detach().clone() for n in update}
        sq_in = sum(float(t.to(torch.float64).pow(2).sum()) for t in update.values())
        sq_err = sum(float((out[n] - t).to(torch.float64).pow(2).sum()) for n, t in update.items())
        self._errors.append(math.sqrt(sq_err / sq_in) if sq_in > 0 else 0.0)
        return out

    def __call__(
        self, deltas: Params, weights: Tensor, jobs: Sequence[tuple[int, int]]
    ) -> tuple[Params, Tensor]:
        if len(jobs) != weights.shape[0]:
            raise ValueError(f"{len(jobs)} (client, trip) pairs for {weights.shape[0]} updates")
        out = {n: torch.empty_like(d) for n, d in deltas.items()}
        # rows in arrival order: a client twice in one batch uses its first trip's residual
        for i, (client, trip) in enumerate(jobs):
            dec = self.compress({n: d[i] for n, d in deltas.items()}, int(client), int(trip))
            for n in out:
                out[n][i] = dec[n]
        return out, weights

    def end_step(self, count: int) -> None:
        errs = np.asarray(self._errors, dtype=np.float64)
        self._last = {
            "compress_rel_error": float(errs.mean()) if errs.size else 0.0,
            "compress_rescaled": float(self._rescaled),
            "compress_residual_clients": float(len(self.residuals)),
            "compress_residual_mb": self.residual_bytes() / 1e6,
        }
        self._errors, self._rescaled = [], 0

    def discard_step(self) -> None:
        """A skipped step: its clients did send (residuals stay), its metrics are dropped."""
        self._errors, self._rescaled = [], 0

    def last_metrics(self) -> dict[str, float]:
        """The last step: mean relative error ‖dec − x‖/‖x‖, updates rescaled, residual memory."""
        return dict(self._last)

    def state_dict(self) -> dict[str, Any]:
        residuals = {c: {n: t.clone() for n, t in r.items()} for c, r in self.residuals.items()}
        return {"kind": self.config.kind, "residuals": residuals}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind", self.config.kind) != self.config.kind:
            raise ConfigError(
                "federated.compression.kind",
                f"the checkpoint was written with {state['kind']!r}, this run has "
                f"{self.config.kind!r}",
                "resume with the compression of the checkpointed run",
            )
        self.residuals = {
            int(c): {n: t.clone() for n, t in r.items()} for c, r in state["residuals"].items()
        }
