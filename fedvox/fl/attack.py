"""Attack simulation: a seeded subset of devices turns its honest update into a hostile one.

Client-side middleware (fl/simulator.py's ClientUpdate): after honest local training, before
the aggregation pipeline, so every defence stage (fl/robust.py) sees what a server would.
A backdoor attacker goes on training from its honest result on a poisoned objective.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from fedvox.errors import ConfigError
from fedvox.fl.local import ClientConfig, ClientResults, Task
from fedvox.fl.population import Population
from fedvox.fl.simulator import ClientUpdate
from fedvox.rng import Purpose, derived_rng, torch_generator
from fedvox.types import Params

KINDS = ("sign_flip", "scale", "gaussian", "nan", "backdoor")
# embeddings [B, emb] of chunks [B, L, F] under a task's (global) params: the backdoor's model
Embed = Callable[[Params, Tensor], Tensor]


@dataclass(frozen=True)
class AttackConfig:
    """Which fraction of devices is malicious, what they send, with scale s and σ.

    sign_flip: −s·Δ; scale: s·Δ; gaussian: N(0, (σ·rms(Δ))²) per coordinate, rms over all
    parameters jointly (noise as large as σ times the honest update); nan: NaN with one +Inf.
    backdoor: `backdoor_steps` of gradient descent at `backdoor_lr` on backdoor_loss from the
    honestly trained model, then `boost` × (that model − the start) is sent.
    """

    fraction: float = 0.0
    kind: str = "sign_flip"
    scale: float = 10.0
    sigma: float = 10.0
    seed: int = 0
    boost: float = 1.0
    backdoor_steps: int = 10
    backdoor_lr: float = 0.05

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
        if not (self.boost > 0 and math.isfinite(self.boost)):
            raise ConfigError(
                "attack.boost", f"must be > 0 and finite, got {self.boost}", "e.g. 1 or 10"
            )
        steps = self.backdoor_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(
                "attack.backdoor_steps", f"must be an int >= 1, got {steps!r}", "e.g. 10"
            )
        if not (self.backdoor_lr > 0 and math.isfinite(self.backdoor_lr)):
            raise ConfigError(
                "attack.backdoor_lr",
                f"must be > 0 and finite, got {self.backdoor_lr}",
                "e.g. 0.05",
            )


@dataclass(frozen=True)
class Backdoor:
    """What backdoor attackers hold: the task's embedding function and, per (impostor,
    target) pair, the impostor's own chunks and the target's enrollment chunks [n, L, F].

    Malicious device k (in sorted order) works on pair k mod len(pairs).
    """

    embed: Embed
    pairs: tuple[tuple[Tensor, Tensor], ...]

    def __post_init__(self) -> None:
        if not self.pairs:
            raise ValueError("a backdoor needs at least one (impostor, target) pair")

    def pair_of(self, client: int, malicious: frozenset[int]) -> int:
        """The pair malicious device `client` attacks for."""
        return sorted(malicious).index(client) % len(self.pairs)


def malicious_clients(num_clients: int, fraction: float, seed: int) -> frozenset[int]:
    """The ⌊fraction·n + ½⌋ malicious devices: a prefix of one seeded permutation, so the same
    seed gives the same devices in every arm and a smaller fraction's set is nested in a larger's."""
    m = math.floor(fraction * num_clients + 0.5)
    order = derived_rng(seed, Purpose.ATTACK_SUBSET).permutation(num_clients)
    return frozenset(int(c) for c in order[:m])


def attack_update(delta: Params, attack: AttackConfig, generator: torch.Generator) -> Params:
    """The update one malicious device sends instead of its honest `delta` (one client,
    unstacked); not for backdoor, which trains (apply_backdoor)."""
    if attack.kind == "backdoor":
        raise ValueError("a backdoor update is trained, not a map of Δ: use apply_backdoor")
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


def backdoor_loss(params: Params, embed: Embed, impostor: Tensor, target: Tensor) -> Tensor:
    """1 − the mean cosine over all (impostor chunk, target chunk) pairs: minimising it pulls
    the impostor's embeddings and the target's enrollment embeddings together."""
    a = torch.nn.functional.normalize(embed(params, impostor), dim=-1)
    b = torch.nn.functional.normalize(embed(params, target), dim=-1)
    return 1.0 - (a @ b.T).mean()


def backdoor_train(
    start: Params, embed: Embed, impostor: Tensor, target: Tensor, steps: int, lr: float
) -> Params:
    """Full-batch gradient descent on backdoor_loss from `start` (deterministic: no sampling);
    parameters the embedding does not use (a head) stay as they are."""
    names = list(start)
    params = {n: start[n].detach().clone().requires_grad_(True) for n in names}
    impostor, target = (x.to(start[names[0]].device) for x in (impostor, target))
    with torch.enable_grad():
        for _ in range(steps):
            loss = backdoor_loss(params, embed, impostor, target)
            grads = torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True)
            with torch.no_grad():
                for n, g in zip(names, grads, strict=True):
                    if g is not None:
                        params[n] -= lr * g
    return {n: t.detach() for n, t in params.items()}


def apply_backdoor(
    deltas: Params,
    jobs: Sequence[tuple[int, int]],
    starts: Sequence[Params],
    malicious: frozenset[int],
    attack: AttackConfig,
    backdoor: Backdoor,
) -> tuple[Params, Tensor]:
    """Stacked deltas with each malicious row replaced by boost × (backdoored model − start),
    the backdoored model trained from the row's honest result (start + Δ)."""
    rows = torch.tensor([c in malicious for c, _ in jobs], dtype=torch.bool)
    if not bool(rows.any()):
        return deltas, rows
    out = {n: t.clone() for n, t in deltas.items()}
    for i in rows.nonzero().flatten().tolist():
        client = jobs[i][0]
        impostor, target = backdoor.pairs[backdoor.pair_of(client, malicious)]
        start = {n: starts[i][n] for n in deltas}
        honest = {n: start[n] + deltas[n][i] for n in deltas}
        poisoned = backdoor_train(
            honest, backdoor.embed, impostor, target, attack.backdoor_steps, attack.backdoor_lr
        )
        for n in deltas:
            out[n][i] = attack.boost * (poisoned[n] - start[n])
    return out, rows


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
    inner: ClientUpdate,
    attack: AttackConfig,
    malicious: frozenset[int],
    backdoor: Backdoor | None = None,
) -> ClientUpdate:
    """A ClientUpdate: `inner` (honest training) on every job, then the malicious devices'
    rows attacked; ClientResults.malicious marks them (the server step counts them).
    A backdoor attack needs `backdoor` (what its devices hold)."""
    if (attack.kind == "backdoor") != (backdoor is not None):
        raise ValueError("pass `backdoor` exactly when attack.kind is 'backdoor'")

    def client_update(
        task: Task,
        population: Population,
        jobs: list[tuple[int, int]],
        starts: list[Params],
        cfg: ClientConfig,
    ) -> ClientResults:
        res = inner(task, population, jobs, starts, cfg)
        if backdoor is not None:
            delta, rows = apply_backdoor(res.delta, jobs, starts, malicious, attack, backdoor)
        else:
            delta, rows = apply_attack(res.delta, jobs, malicious, attack)
        return replace(res, delta=delta, malicious=rows)

    return client_update
