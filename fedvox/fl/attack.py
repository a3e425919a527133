"""Attack simulation: a seeded subset of devices turns its honest update into a hostile one.

Client-side middleware (fl/simulator.py's ClientUpdate): after honest local training, before
the aggregation pipeline, so every defence stage (fl/robust.py) sees what a server would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from fedvox.errors import ConfigError
from fedvox.fl.local import ClientConfig, ClientResults, Task
from fedvox.fl.population import Population
from fedvox.fl.simulator import ClientUpdate
from fedvox.rng import Purpose, derived_rng, torch_generator
from fedvox.types import Params

KINDS = ("sign_flip", "scale", "gaussian", "nan")


@dataclass(frozen=True)
class AttackConfig:
    """Which fraction of devices is malicious, what they send, with scale s and σ.

    sign_flip: −s·Δ; scale: s·Δ; gaussian: N(0, (σ·rms(Δ))²) per coordinate, rms over all
    parameters jointly (noise as large as σ times the honest update); nan: NaN with one +Inf.
    """

    fraction: float = 0.0
    kind: str = "sign_flip"
    scale: float = 10.0
    sigma: float = 10.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (0 <= self.fraction < 1):
            raise ConfigError(
                "attack.fraction",
                f"must be in [0, 1), got {self.fraction}",
                "e.g. 0.05 or 0.2 (0 = no attack)",
            )
        if self.kind not in KINDS:
            raise ConfigError("attack.kind", f"unknown kind {self.kind!r}", f"use one of {KINDS}")
        if not (self.scale > 0 and math.isfinite(self.scale)):
            raise ConfigError(
                "attack.scale", f"must be > 0 and finite, got {self.scale}", "e.g. 10"
            )
        if not (self.sigma > 0 and math.isfinite(self.sigma)):
            raise ConfigError(
                "attack.sigma", f"must be > 0 and finite, got {self.sigma}", "e.g. 10"
            )


def malicious_clients(num_clients: int, fraction: float, seed: int) -> frozenset[int]:
    """The ⌊fraction·n + ½⌋ malicious devices: a prefix of one seeded permutation, so the same
    seed gives the same devices in every arm and a smaller fraction's set is nested in a larger's."""
    m = math.floor(fraction * num_clients + 0.5)
    order = derived_rng(seed, Purpose.ATTACK_SUBSET).permutation(num_clients)
    return frozenset(int(c) for c in order[:m])


def attack_update(delta: Params, attack: AttackConfig, generator: torch.Generator) -> Params:
    """The update one malicious device sends instead of its honest `delta` (one client, unstacked)."""
    if attack.kind == "sign_flip":
        return {n: -attack.scale * t for n, t in delta.items()}
    if attack.kind == "scale":
        return {n: attack.scale * t for n, t in delta.items()}
    if attack.kind == "nan":
        out = {n: torch.full_like(t, math.nan) for n, t in delta.items()}
        out[next(iter(out))].view(-1)[0] = math.inf
        return out
    sq = sum(float(t.double().pow(2).sum()) for t in delta.values())
    numel = sum(t.numel() for t in delta.values())
    std = attack.sigma * math.sqrt(sq / max(numel, 1))
    return {
        n: std * torch.randn(t.shape, generator=generator, dtype=t.dtype) for n, t in delta.items()
    }


def apply_attack(
    deltas: Params,
    jobs: Sequence[tuple[int, int]],
    malicious: frozenset[int],
    attack: AttackConfig,
) -> tuple[Params, Tensor]:
    """Stacked deltas with each malicious job's row replaced by its attack (a copy when any
    is); returns (deltas, a bool per row: malicious). Noise keys on (seed, client, trip)."""
    rows = torch.tensor([c in malicious for c, _ in jobs], dtype=torch.bool)
    if not bool(rows.any()):
        return deltas, rows
    out = {n: t.clone() for n, t in deltas.items()}
    for i in rows.nonzero().flatten().tolist():
        client, trip = jobs[i]
        gen = torch_generator(attack.seed, Purpose.ATTACK_NOISE, client, trip)
        bad = attack_update({n: t[i] for n, t in deltas.items()}, attack, gen)
        for n, t in bad.items():
            out[n][i] = t
    return out, rows


def make_attack_update(
    inner: ClientUpdate, attack: AttackConfig, malicious: frozenset[int]
) -> ClientUpdate:
    """A ClientUpdate: `inner` (honest training) on every job, then the malicious devices'
    rows attacked; ClientResults.malicious marks them (the server step counts them)."""

    def client_update(
        task: Task,
        population: Population,
        jobs: list[tuple[int, int]],
        starts: list[Params],
        cfg: ClientConfig,
    ) -> ClientResults:
        res = inner(task, population, jobs, starts, cfg)
        delta, rows = apply_attack(res.delta, jobs, malicious, attack)
        return replace(res, delta=delta, malicious=rows)

    return client_update
