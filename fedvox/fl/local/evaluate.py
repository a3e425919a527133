"""RECONEVAL: reconstruct each client's local parameters on its support, score its query.

Part of fedvox.fl.local: the same split (split_client) and reconstruction as training, keyed
by (seed, client) instead of (seed, client, trip).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.func import vmap

from fedvox.fl.local.config import ClientConfig, ReconConfig
from fedvox.fl.local.reconstruct import reconstruct_clients
from fedvox.fl.local.split import eval_splits
from fedvox.fl.local.steps import auto_chunk, broadcast_view, pad
from fedvox.fl.local.task import ReconTask
from fedvox.fl.population import Population
from fedvox.types import MetricFn, Params


def recon_eval(
    task: ReconTask,
    population: Population,
    params: Params,
    recon: ReconConfig,
    metric_fn: MetricFn,
    clients: Sequence[int] | None = None,
    seed: int = 0,
    client: ClientConfig | None = None,
) -> dict[str, float]:
    """RECONEVAL: per client, reconstruct local params on its support half, then average
    `metric_fn(global ∪ local, batch)` (per-example values [B], vmappable) over its query half.

    Returns every metric's mean over all query examples of all clients, plus "examples" and
    "clients". Splits (even_odd etc., batches of client.batch_size) derive from (seed, client).
    """
    cfg = client or ClientConfig()
    clients = list(range(population.num_clients)) if clients is None else list(clients)
    splits = eval_splits(population, clients, cfg.batch_size, recon, seed)
    params = {n: t.detach() for n, t in params.items()}
    local = reconstruct_clients(task, population, params, clients, splits, cfg, recon, seed)
    sums: dict[str, float] = {}
    n_total = 0
    k = len(clients)
    chunk = cfg.chunk_size or auto_chunk({**params, **{n: t[0] for n, t in local.items()}}, k)
    with torch.no_grad():
        for i in range(0, k, chunk):
            j = min(i + chunk, k)
            q = [[np.concatenate(s.query)] for s in splits[i:j]]
            m = max(len(b[0]) for b in q)
            rows, mask_t, _ = pad(q, m)
            data = population.gather(rows[:, 0])
            merged = {**broadcast_view([params] * (j - i)), **{n: t[i:j] for n, t in local.items()}}
            values = vmap(metric_fn)(merged, data)
            for name, v in values.items():
                sums[name] = sums.get(name, 0.0) + float((v * mask_t[:, 0]).sum())
            n_total += int(mask_t.sum())
    out = {name: s / n_total for name, s in sums.items()}
    out.update(examples=float(n_total), clients=float(k))
    return out
