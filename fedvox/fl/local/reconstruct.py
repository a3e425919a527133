"""Reconstruction: a client's local parameters rebuilt from its support data, globals frozen.

Part of fedvox.fl.local: closed form (task.closed_form_local) and/or `steps` SGD epochs;
used by Federated Reconstruction's client update and by RECONEVAL alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch
from torch.func import grad, vmap

from fedvox.errors import ConfigError
from fedvox.fl.aggregation import stack
from fedvox.fl.local.config import ClientConfig, ReconConfig
from fedvox.fl.local.split import Split, eval_splits
from fedvox.fl.local.steps import (
    auto_chunk,
    broadcast_view,
    device_of,
    objective,
    pad,
    sgd_vectorised,
)
from fedvox.fl.local.task import ReconTask, check_recon_task
from fedvox.fl.population import Population
from fedvox.rng import Purpose, torch_generator
from fedvox.types import Params


def init_locals(task: ReconTask, clients: Sequence[int], gens: Sequence[torch.Generator]) -> Params:
    """Fresh local parameters, one task.init_local call per client (so a client's values never
    depend on who else is in the chunk), stacked along the client axis."""
    parts = [task.init_local([c], g) for c, g in zip(clients, gens, strict=True)]
    return {n: torch.cat([p[n] for p in parts]) for n in parts[0]}


def reconstruct_stacked(
    task: ReconTask,
    population: Population,
    support: list[list[np.ndarray]],
    g: Params,
    local: Params,
    cfg: ClientConfig,
    recon: ReconConfig,
) -> Params:
    """Local params of k clients (stacked) after reconstruction on their `support` batches
    from stacked global `g` (untouched) and initial `local`."""
    if recon.closed_form and cfg.pack:
        # one client at a time, unpadded: a stacked call over k clients of up to m rows each
        # streams k·m activations through memory (slower than k small calls) and pads them
        local = _closed_form_each(task, population, support, g)
    elif recon.closed_form:
        m = max(sum(len(r) for r in bl) for bl in support)
        rows, mask_t, _ = pad([[np.concatenate(bl)] for bl in support], m, device_of(g))
        data = population.gather(rows[:, 0])
        local = vmap(task.closed_form_local)(g, data, mask_t[:, 0])  # type: ignore[attr-defined]
    local = {n: t.detach().clone() for n, t in local.items()}
    if recon.steps == 0 or not local:
        return local
    rows, mask_t, active = pad([bl * recon.steps for bl in support], cfg.batch_size, device_of(g))
    data = population.gather(rows)
    obj = objective(task.loss, replace(cfg, mu=0.0))
    sgd_vectorised(obj, local, local, g, data, mask_t, active, recon.lr)
    return local


def _closed_form_each(
    task: ReconTask, population: Population, support: list[list[np.ndarray]], g: Params
) -> Params:
    """Closed-form local params of k clients computed one by one (as reconstruct_one does),
    stacked: g is stacked [k, ...] (a broadcast view when the clients share a version)."""
    parts = []
    for i, bl in enumerate(support):
        rows = np.concatenate(bl)
        ones = torch.ones(len(rows), device=device_of(g))
        gi = {n: t[i] for n, t in g.items()}
        with torch.no_grad():
            parts.append(task.closed_form_local(gi, population.gather(rows), ones))  # type: ignore[attr-defined]
    return {n: torch.stack([p[n] for p in parts]) for n in parts[0]}


def reconstruct_one(
    task: ReconTask,
    population: Population,
    support: list[np.ndarray],
    g: Params,
    local: Params,
    cfg: ClientConfig,
    recon: ReconConfig,
) -> Params:
    """The loop reference of reconstruct_stacked for one client (no vmap)."""
    if recon.closed_form:
        rows = np.concatenate(support)
        ones = torch.ones(len(rows), device=device_of(g))
        local = task.closed_form_local(g, population.gather(rows), ones)  # type: ignore[attr-defined]
    if recon.steps == 0 or not local:
        return dict(local)
    step_grad = grad(objective(task.loss, replace(cfg, mu=0.0)), has_aux=True)
    for _ in range(recon.steps):
        for r in support:
            ones = torch.ones(len(r), device=device_of(g))
            gl, _ = step_grad(local, local, g, population.gather(r), ones)
            local = {n: local[n] - recon.lr * gl[n] for n in local}
    return local


def reconstruct(
    task: ReconTask,
    population: Population,
    params: Params,
    recon: ReconConfig,
    clients: Sequence[int] | None = None,
    client: ClientConfig | None = None,
    seed: int = 0,
    part: str = "support",
) -> Params:
    """Local params of `clients` (stacked) reconstructed from `params` (global, unchanged) on
    their RECONEVAL support half (`part="support"`) or on all their data (`part="all"`, e.g.
    enrollment). Deterministic in (seed, client)."""
    check_recon_task(task, recon)
    cfg = client or ClientConfig()
    clients = list(range(population.num_clients)) if clients is None else list(clients)
    if part not in ("support", "all"):
        raise ConfigError("part", f"unknown part {part!r}", "use 'support' or 'all'")
    use = recon if part == "support" else replace(recon, split="all")
    splits = eval_splits(population, clients, cfg.batch_size, use, seed)
    return reconstruct_clients(task, population, params, clients, splits, cfg, recon, seed)


def reconstruct_clients(
    task: ReconTask,
    population: Population,
    params: Params,
    clients: Sequence[int],
    splits: list[Split],
    cfg: ClientConfig,
    recon: ReconConfig,
    seed: int,
) -> Params:
    """Evaluation's reconstruction of `clients` on their `splits`' support, local params
    initialised from (seed, client): stacked local params, chunked as in training."""
    gens = [torch_generator(seed, Purpose.RECON_EVAL_INIT, c) for c in clients]
    local0 = init_locals(task, clients, gens)
    k = len(clients)
    if not local0:
        return {}
    merged0 = {**params, **{n: t[0] for n, t in local0.items()}}
    chunk = cfg.chunk_size or auto_chunk(merged0, k)
    parts: list[Params] = []
    params = {n: t.detach() for n, t in params.items()}
    if not cfg.vectorised:
        for i, sp in enumerate(splits):
            one = {n: t[i] for n, t in local0.items()}
            parts.append(reconstruct_one(task, population, sp.support, params, one, cfg, recon))
        return stack(parts)
    for i in range(0, k, chunk):
        j = min(i + chunk, k)
        g = broadcast_view([params] * (j - i))
        part = {n: t[i:j] for n, t in local0.items()}
        support = [s.support for s in splits[i:j]]
        parts.append(reconstruct_stacked(task, population, support, g, part, cfg, recon))
    return {n: torch.cat([p[n] for p in parts]) for n in parts[0]}
