"""A node's own data: one client's rows cut out of the federation's population.

Between the experiment's population (built where the data is prepared) and a deployed node,
which holds only its shard. A shard draws the same batches, in the same order, as the full
population does for that client and trip, so a node trains what the simulator trains.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedvox.atomic import atomic_write
from fedvox.errors import DataError
from fedvox.fl.population import Population

SHARD_VERSION = 1


def node_shard(population: Population, client: int) -> dict[str, Any]:
    """Client `client`'s rows (in store order), its index list and crop groups, renumbered
    monotonically so every draw maps one to one onto the full population's."""
    rows = population.order[population.offsets[client] : population.offsets[client + 1]]
    kept = np.unique(rows)  # sorted: a monotone renumbering keeps every sort and choice
    local = np.searchsorted(kept, rows)
    shard: dict[str, Any] = {
        "version": SHARD_VERSION,
        "client": int(client),
        "num_clients": population.num_clients,
        "seed": population.seed,
        "store": {n: t[torch.as_tensor(kept)].clone() for n, t in population.store.items()},
        "order": torch.as_tensor(local),
    }
    if population.groups is not None and population.take is not None:
        gids = np.unique(population.groups[kept])
        shard["groups"] = torch.as_tensor(np.searchsorted(gids, population.groups[kept]))
        shard["take"] = torch.as_tensor(population.take[gids])
    return shard


def shard_population(shard: dict[str, Any]) -> Population:
    """A population in which the shard's client holds its rows under its federation-wide id;
    every other client holds a placeholder row (a node never trains them)."""
    n, client = int(shard["num_clients"]), int(shard["client"])
    order = np.asarray(shard["order"], dtype=np.int64)
    clients = [order if c == client else np.zeros(1, dtype=np.int64) for c in range(n)]
    crops = {}
    if "groups" in shard:
        crops = {"groups": np.asarray(shard["groups"]), "take": np.asarray(shard["take"])}
    return Population(shard["store"], clients, seed=int(shard["seed"]), **crops)


def save_shard(path: Path, shard: dict[str, Any]) -> Path:
    """Write a shard atomically (torch format, tensors and plain values only)."""
    return atomic_write(path, lambda f: torch.save(shard, f))


def load_shard(path: Path) -> dict[str, Any]:
    """Read a shard a node was given; a missing, foreign or torn file names itself."""
    try:
        shard = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise DataError(
            path, "no such shard", "give the node the shard its federation wrote"
        ) from None
    except Exception as err:
        raise DataError(path, f"not a fedvox node shard ({err})", "write it again") from None
    if not isinstance(shard, dict) or shard.get("version") != SHARD_VERSION:
        raise DataError(path, "not a fedvox node shard of this version", "write it again")
    return shard
