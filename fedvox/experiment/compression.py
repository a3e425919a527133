"""Compression wiring: the `[federated.compression]` section → the device's compression stage.

Beside experiment/privacy.py and robust.py, between the config and the simulator's
aggregation pipeline: aligns quantisation with the secure-aggregation ring, refuses what
cannot compose, and hands the stage the norm bounds (DP clip, robust bound) it must keep.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from fedvox.errors import ConfigError
from fedvox.fl.compression import Compress, CompressionConfig
from fedvox.fl.robust import NormBound
from fedvox.privacy.dp import FixedClip
from fedvox.privacy.secagg import SecureSum
from fedvox.rng import Purpose, derived_seed

if TYPE_CHECKING:  # config imports this module lazily (check_engine), so no cycle at run time
    from fedvox.experiment.config import FederatedSection
    from fedvox.experiment.privacy import PrivacyPipeline
    from fedvox.experiment.robust import RobustPipeline

COMPRESSION_PATHS = {
    "compression.kind": "federated.compression.kind",
    "compression.bits": "federated.compression.bits",
    "compression.chunk": "federated.compression.chunk",
    "compression.fraction": "federated.compression.fraction",
    "compression.shared_range": "federated.compression.shared_range",
    "secagg.scale_bits": "federated.privacy.secagg_scale_bits",
}
# float16 values are multiples of 2^-24: the ring needs that resolution to hold them exactly
FLOAT16_SCALE_BITS = 24
FLOAT16_MODULUS_BITS = 62


def check_compression(f: FederatedSection) -> None:
    """Refuse compression that cannot work with the rest of `f` (ConfigError naming it)."""
    from fedvox.experiment.config import toml_paths

    c = f.compression
    ring = None
    levels = shared_grid(f)
    if levels and f.privacy.mechanism != "none":
        raise ConfigError(
            "federated.compression.shared_range",
            "a shared grid is summed as levels in a narrow ring, so a decoded update cannot be "
            "scaled back to the DP clip norm after rounding (it would leave the grid), and "
            "rounding can raise its norm above the clip norm the noise is calibrated to",
            "leave shared_range unset with DP and secure aggregation (per-chunk quantisation "
            "composes with both, in the 32-bit ring), or turn secure_aggregation off",
        )
    if f.privacy.secure_aggregation and c.kind != "none":
        ring = None if levels else (f.privacy.secagg_scale_bits or FLOAT16_SCALE_BITS, 8.0)
        if f.algorithm == "fedbuff" and f.staleness != "constant":
            raise ConfigError(
                "federated.staleness",
                f"{c.kind} under secure aggregation is encoded exactly only for client weights "
                f"of 1, and FedBuff's {f.staleness!r} staleness weights are below 1 (the ring "
                "would round w·Δ again)",
                'use staleness = "constant" (or algorithm = "fedavg") with compression and '
                "secure aggregation",
            )
    with toml_paths(COMPRESSION_PATHS):
        compression_config(f, ring, seed=0)


def shared_grid(f: FederatedSection) -> bool:
    """Whether secure aggregation sums shared-grid levels (quantize with shared_range)."""
    c = f.compression
    return f.privacy.secure_aggregation and c.kind == "quantize" and c.shared_range is not None


def levels_ring_bits(bits: int, cohort: int) -> int:
    """The narrowest ring that holds the sum of `cohort` clients' `bits`-bit levels:
    bits + ⌈log2 n⌉ (n·(2^bits − 1) < 2^bits · 2^⌈log2 n⌉)."""
    return bits + max(1, math.ceil(math.log2(cohort)))


def compression_config(
    f: FederatedSection, ring: tuple[int, float] | None, seed: int
) -> CompressionConfig:
    """The engine's CompressionConfig; `ring` = (scale_bits, clip) under secure aggregation
    (None with a shared grid, whose ring holds its levels)."""
    c = f.compression
    return CompressionConfig(
        kind=c.kind,
        bits=c.bits,
        chunk=c.chunk,
        fraction=c.fraction,
        error_feedback=c.error_feedback,
        seed=seed,
        ring_scale_bits=None if ring is None else ring[0],
        ring_clip=None if ring is None else ring[1],
        shared_range=c.shared_range,
        ring_levels=shared_grid(f),
    )


def build_compression(
    f: FederatedSection, privacy: PrivacyPipeline, robust: RobustPipeline, seed: int
) -> Compress | None:
    """The compression stage of `f.compression` (None for "none"), placed after clipping."""
    from fedvox.experiment.config import toml_paths

    check_compression(f)
    if f.compression.kind == "none":
        return None
    ring = None
    if isinstance(privacy.summer, SecureSum) and not shared_grid(f):
        ring = (privacy.summer.config.scale_bits, privacy.summer.config.clip)
    bounds: list[Callable[[], float]] = []
    for stage in [*robust.stages, *privacy.stages]:
        if isinstance(stage, FixedClip):  # adaptive clipping moves it: read it on each call
            bounds.append(lambda s=stage: s.clip_norm)
        elif isinstance(stage, NormBound):
            bounds.append(lambda s=stage: s.bound)
    with toml_paths(COMPRESSION_PATHS):
        config = compression_config(f, ring, derived_seed(seed, Purpose.COMPRESS))
    return Compress(config, bounds)
