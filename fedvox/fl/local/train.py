"""Client updates: plain local SGD, and Federated Reconstruction (split → reconstruct → train).

Part of fedvox.fl.local: what the simulator (and next a Ray worker or a Flower client) calls
for a list of jobs [(client, trip)]; returns the stacked deltas the aggregator sums.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from fedvox.errors import ConfigError
from fedvox.fl.aggregation import finite_rows
from fedvox.fl.local.config import ClientConfig, ClientResults, ReconConfig
from fedvox.fl.local.lowrank import lowrank_plan, train_lowrank
from fedvox.fl.local.reconstruct import init_locals, reconstruct_one, reconstruct_stacked
from fedvox.fl.local.split import Split, split_client
from fedvox.fl.local.steps import (
    Objective,
    Unit,
    auto_chunk,
    broadcast_view,
    chunk_units,
    device_of,
    fill_units,
    objective,
    packed_units,
    shard_units,
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
    train_unit: Callable[[Unit, Params], Tensor]
    if not cfg.vectorised or (plan is None and chunk == 1):
        # one client per vmap call would only add overhead (and grouped convolutions)
        units = chunk_units(len(jobs), 1)

        def train_unit(u: Unit, out: Params) -> Tensor:
            st = starts[u[0]]
            delta, total = train_one(obj, population, batches[u[0]], st, st, {}, cfg.lr, list(st))
            for n, t in out.items():
                t[0] = delta[n]
            return total.reshape(1)

    elif plan is None:
        sizes = [len(bl) for bl in batches]
        units = packed_units(sizes, chunk) if cfg.pack else chunk_units(len(jobs), chunk)

        def train_unit(u: Unit, out: Params) -> Tensor:
            p0 = broadcast_view([starts[i] for i in u])
            return train_stacked(obj, population, [batches[i] for i in u], p0, {}, cfg, out)

    else:
        lowrank = plan
        units = _version_units(starts, chunk)

        def train_unit(u: Unit, out: Params) -> Tensor:
            part = [batches[i] for i in u]
            return train_lowrank(lowrank, population, part, starts[u[0]], cfg, out)

    units = shard_units(units, cfg.shard)
    delta, loss_sum, index = fill_units(units, starts[0], train_unit)
    kept = n_examples[index]
    return ClientResults(delta, kept, loss_sum / kept.to(loss_sum), index=_index(cfg, index))


def _version_units(starts: Sequence[Params], chunk: int) -> list[Unit]:
    """The low-rank path's units: the shared matmul needs one starting version, so clients
    are grouped by version (in order of first appearance) and cut in chunks of each group."""
    groups: dict[int, list[int]] = {}
    for i, st in enumerate(starts):
        groups.setdefault(id(st), []).append(i)
    return [m[c0 : c0 + chunk] for m in groups.values() for c0 in range(0, len(m), chunk)]


def _index(cfg: ClientConfig, index: list[int]) -> Tensor | None:
    """ClientResults.index: the job indices of a shard's rows (None: every job, in order)."""
    return None if cfg.shard is None else torch.tensor(index, dtype=torch.long)


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
    train_unit: Callable[[Unit, Params], Tensor]
    if not cfg.vectorised or chunk == 1:
        units = chunk_units(k, 1)

        def train_unit(u: Unit, out: Params) -> Tensor:
            i = u[0]
            delta, total = _recon_one(
                task, population, splits[i], starts[i], local0, i, cfg, recon, obj
            )
            for n, t in out.items():
                t[0] = delta[n]
            return total.reshape(1)

    else:
        if cfg.pack:
            units = packed_units([len(s.query) for s in splits], chunk)
        else:
            units = chunk_units(k, chunk)

        def train_unit(u: Unit, out: Params) -> Tensor:
            p0 = broadcast_view([starts[i] for i in u])
            if u == list(range(u[0], u[-1] + 1)):
                part = {n: t[u[0] : u[-1] + 1] for n, t in local0.items()}
            else:
                part = {n: t[u] for n, t in local0.items()}
            sup = [splits[i].support for i in u]
            local = reconstruct_stacked(task, population, sup, p0, part, cfg, recon)
            qry = [splits[i].query for i in u]
            return train_stacked(obj, population, qry, p0, local, cfg, out, joint=recon.joint)

    delta, loss_sum, index = fill_units(shard_units(units, cfg.shard), starts[0], train_unit)
    n = len(index)
    # per row, without a temporary the size of the stacked deltas
    finite = finite_rows(delta, torch.ones(n, device=device)).cpu()
    kept = n_examples[index]
    loss = loss_sum / kept.clamp_min(1).to(loss_sum)
    return ClientResults(delta, torch.where(finite, kept, 0), loss, index=_index(cfg, index))


def _recon_one(
    task: ReconTask,
    population: Population,
    sp: Split,
    start: Params,
    local0: Params,
    i: int,
    cfg: ClientConfig,
    recon: ReconConfig,
    obj: Objective,
) -> tuple[Params, Tensor]:
    """The reference for job i, without vmap: reconstruct, then train_one on its query."""
    local = {n: t[i] for n, t in local0.items()}
    local = reconstruct_one(task, population, sp.support, start, local, cfg, recon)
    p, anchor = dict(start), start
    if recon.joint:
        p.update(local)
        anchor, local = {**start, **local}, {}
    return train_one(obj, population, sp.query, p, anchor, local, cfg.lr, list(start))


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
