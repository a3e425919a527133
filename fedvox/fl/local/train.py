"""Client updates: plain local SGD, and Federated Reconstruction (split → reconstruct → train).

Part of fedvox.fl.local: what the simulator (and next a Ray worker or a Flower client) calls
for a list of jobs [(client, trip)]; returns the stacked deltas the aggregator sums.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from fedvox.errors import ConfigError
from fedvox.fl.aggregation import stack
from fedvox.fl.local.config import ClientConfig, ClientResults, ReconConfig
from fedvox.fl.local.lowrank import Plan, lowrank_plan, train_lowrank
from fedvox.fl.local.reconstruct import init_locals, reconstruct_one, reconstruct_stacked
from fedvox.fl.local.split import Split, split_client
from fedvox.fl.local.steps import (
    Objective,
    auto_chunk,
    broadcast_view,
    device_of,
    in_chunks,
    objective,
    train_one,
    train_stacked,
)
from fedvox.fl.local.task import ReconTask, Task, check_recon_task
from fedvox.fl.population import Population
from fedvox.rng import Purpose, torch_generator
from fedvox.types import Params


def train_clients(
    task: Task,
    population: Population,
    jobs: Sequence[tuple[int, int]],
    starts: Sequence[Params],
    cfg: ClientConfig,
) -> ClientResults:
    """Train clients `jobs` = [(client_id, trip), ...] from their starting params `starts`.

    Vectorised: one vmap(grad) over the stacked clients per local step; a client with fewer
    batches is padded and its step multiplied by 0. Loop: the reference, one client at a time.
    A task that declares the low-rank path (task.LowRankTask) computes the same updates with
    one shared matmul per layer and step (fl.local.lowrank).
    """
    batches = [population.batch_indices(c, t, cfg.batch_size, cfg.epochs) for c, t in jobs]
    n_examples = torch.tensor([cfg.epochs * population.num_examples(c) for c, _ in jobs])
    plan = lowrank_plan(task, population, cfg, max(len(bl) for bl in batches) * cfg.batch_size)
    chunk = cfg.chunk_size or (plan.auto_chunk if plan else auto_chunk(starts[0], len(jobs)))
    obj = objective(task.loss, cfg)
    if not cfg.vectorised or (plan is None and chunk == 1):
        # one client per vmap call would only add overhead (and grouped convolutions)
        parts = [
            train_one(obj, population, bl, st, st, {}, cfg.lr, list(st))
            for bl, st in zip(batches, starts, strict=True)
        ]
        delta, loss_sum = stack([d for d, _ in parts]), torch.stack([s for _, s in parts])
    elif plan is None:

        def chunk_fn(i: int, j: int, out: Params) -> Tensor:
            p0 = broadcast_view(starts[i:j])
            return train_stacked(obj, population, batches[i:j], p0, {}, cfg, out)

        delta, loss_sum = in_chunks(starts, chunk, chunk_fn)
    else:
        delta, loss_sum = _train_lowrank_versions(plan, population, batches, starts, cfg, chunk)
    return ClientResults(delta, n_examples, loss_sum / n_examples.to(loss_sum))


def _train_lowrank_versions(
    plan: Plan,
    population: Population,
    batches: list[list[np.ndarray]],
    starts: Sequence[Params],
    cfg: ClientConfig,
    chunk: int,
) -> tuple[Params, Tensor]:
    """The low-rank path: the shared matmul needs one starting version, so clients are
    grouped by version and trained in chunks of each group."""
    k = len(starts)
    device = device_of(starts[0])
    delta = {
        n: torch.empty((k, *t.shape), dtype=t.dtype, device=device) for n, t in starts[0].items()
    }
    loss_sum = torch.empty(k, device=device)
    groups: dict[int, list[int]] = {}
    for i, st in enumerate(starts):
        groups.setdefault(id(st), []).append(i)
    for members in groups.values():
        for c0 in range(0, len(members), chunk):
            idx = members[c0 : c0 + chunk]
            contiguous = idx == list(range(idx[0], idx[-1] + 1))
            if contiguous:  # write straight into the result (the usual case)
                out = {n: t[idx[0] : idx[-1] + 1] for n, t in delta.items()}
            else:
                out = {n: t.new_empty((len(idx), *t.shape[1:])) for n, t in delta.items()}
            part = [batches[i] for i in idx]
            loss_sum[idx] = train_lowrank(plan, population, part, starts[idx[0]], cfg, out)
            if not contiguous:
                for n, t in delta.items():
                    t[idx] = out[n]
    return delta, loss_sum


def train_clients_recon(
    task: ReconTask,
    population: Population,
    jobs: Sequence[tuple[int, int]],
    starts: Sequence[Params],
    cfg: ClientConfig,
    recon: ReconConfig,
) -> ClientResults:
    """The FedRecon client update of jobs [(client, trip)] from their global params `starts`.

    Per client: split (split_client, keyed by the population's (seed, client, trip)), fresh
    local params (init_local), reconstruction on support with the global params frozen, then
    ClientConfig's epochs of SGD on query over the global params with the local ones frozen
    (unless joint). Δ = w_start − w_local over GLOBAL names only; num_examples = epochs × query
    examples (train_clients' convention); a non-finite Δ gets num_examples 0 and is left as it
    is, for the aggregator to drop and count (fl/aggregation.py) whatever the weighting.
    """
    check_recon_task(task, recon)
    names = list(starts[0])
    gens = [torch_generator(population.seed, Purpose.RECON_INIT, c, t) for c, t in jobs]
    device = device_of(starts[0])
    local0 = {n: t.to(device) for n, t in init_locals(task, [c for c, _ in jobs], gens).items()}
    clash = sorted(set(local0) & set(names))
    if clash:
        raise ConfigError(
            "task", f"parameters {clash} are both global and local", "give local params own names"
        )
    splits = [
        split_client(
            population, c, population.rng(Purpose.BATCHES, c, t), cfg.batch_size, cfg.epochs, recon
        )
        for c, t in jobs
    ]
    n_examples = torch.tensor([cfg.epochs * sp.num_query for sp in splits])
    k = len(jobs)
    chunk = cfg.chunk_size or auto_chunk({**starts[0], **{n: t[0] for n, t in local0.items()}}, k)
    # on query; with joint local training FedProx still pulls the global names only
    obj = objective(task.loss, cfg, prox=names if recon.joint else None)
    if not cfg.vectorised or chunk == 1:
        delta, loss_sum = _recon_loop(task, population, splits, starts, local0, cfg, recon, obj)
    else:

        def chunk_fn(i: int, j: int, out: Params) -> Tensor:
            p0 = broadcast_view(starts[i:j])
            part = {n: t[i:j] for n, t in local0.items()}
            sup = [s.support for s in splits[i:j]]
            local = reconstruct_stacked(task, population, sup, p0, part, cfg, recon)
            qry = [s.query for s in splits[i:j]]
            return train_stacked(obj, population, qry, p0, local, cfg, out, joint=recon.joint)

        delta, loss_sum = in_chunks(starts, chunk, chunk_fn)
    finite = torch.ones(k, dtype=torch.bool)
    for t in delta.values():
        finite &= torch.isfinite(t.reshape(k, -1)).all(1).cpu()
    loss = loss_sum / n_examples.clamp_min(1).to(loss_sum)
    return ClientResults(delta, torch.where(finite, n_examples, 0), loss)


def _recon_loop(
    task: ReconTask,
    population: Population,
    splits: list[Split],
    starts: Sequence[Params],
    local0: Params,
    cfg: ClientConfig,
    recon: ReconConfig,
    obj: Objective,
) -> tuple[Params, Tensor]:
    """The reference, one client at a time: reconstruct, then train_one on its query."""
    deltas, sums = [], []
    for i, (sp, start) in enumerate(zip(splits, starts, strict=True)):
        local = {n: t[i] for n, t in local0.items()}
        local = reconstruct_one(task, population, sp.support, start, local, cfg, recon)
        p, anchor = dict(start), start
        if recon.joint:
            p.update(local)
            anchor, local = {**start, **local}, {}
        delta, total = train_one(obj, population, sp.query, p, anchor, local, cfg.lr, list(start))
        deltas.append(delta)
        sums.append(total)
    return stack(deltas), torch.stack(sums)


def make_recon_update(recon: ReconConfig) -> Callable:
    """A Simulator `client_update`: (task, population, jobs, starts, cfg) -> ClientResults."""

    def client_update(
        task: ReconTask,
        population: Population,
        jobs: list[tuple[int, int]],
        starts: list[Params],
        cfg: ClientConfig,
    ) -> ClientResults:
        return train_clients_recon(task, population, jobs, starts, cfg, recon)

    return client_update
