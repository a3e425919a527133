"""Where the simulator's client training runs: in process, or on Ray actors (their settings).

Part of fedvox.scale; the config layer builds it from [federated.backend].
"""

from __future__ import annotations

from dataclasses import dataclass

from fedvox.errors import ConfigError

KINDS = ("inline", "ray")


@dataclass(frozen=True)
class BackendConfig:
    """`kind` "inline" (the in-process engine, default) or "ray": `workers` actors of
    `cpus_per_worker` CPUs (torch threads = that many, at least 1) and `gpus_per_worker` GPUs
    (fractions share one); a server step's jobs go out in shards of `shard_size` jobs (whole
    vectorised chunks: never cut by worker count, so the bits do not depend on it);
    `address` joins a running cluster (None: RAY_ADDRESS if set, else a local one)."""

    kind: str = "inline"
    workers: int = 2
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    shard_size: int = 8
    address: str | None = None
    # the local object store Ray starts with (None: Ray's default, 30 % of memory)
    object_store_bytes: int | None = None
    # recreated actors per server step before the step fails (a worker that keeps dying)
    max_restarts: int = 8

    def __post_init__(self) -> None:
        field = "federated.backend"
        if self.kind not in KINDS:
            raise ConfigError(
                f"{field}.kind", f"unknown backend {self.kind!r}", 'use "inline" or "ray"'
            )
        if self.workers < 1:
            raise ConfigError(f"{field}.workers", f"must be >= 1, got {self.workers}", "use e.g. 2")
        if not self.cpus_per_worker > 0:
            raise ConfigError(
                f"{field}.cpus_per_worker", f"must be > 0, got {self.cpus_per_worker}", "use 1"
            )
        if self.gpus_per_worker < 0:
            raise ConfigError(
                f"{field}.gpus_per_worker", f"must be >= 0, got {self.gpus_per_worker}", "use 0"
            )
        if self.shard_size < 1:
            raise ConfigError(
                f"{field}.shard_size", f"must be >= 1, got {self.shard_size}", "use e.g. 8"
            )
        if self.max_restarts < 0:
            raise ConfigError(f"{field}.max_restarts", f"must be >= 0, got {self.max_restarts}")

    @property
    def threads(self) -> int:
        """torch threads in each actor: its CPUs (at least one)."""
        return max(1, int(self.cpus_per_worker))
