"""The support/query split: the one function that divides a client's data for reconstruction.

Part of fedvox.fl.local: training (keyed by (seed, client, trip)) and evaluation (RECONEVAL,
keyed by (seed, client)) both call `split_client`, so they split alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedvox.fl.local.config import GROUP_FIELD, ReconConfig
from fedvox.fl.population import Population
from fedvox.rng import Purpose, derived_rng


@dataclass(frozen=True)
class Split:
    """One client's store rows: support batches (one epoch), query batches (every epoch)."""

    support: list[np.ndarray]
    query: list[np.ndarray]
    num_query: int  # distinct query examples


def _batches(rows: np.ndarray, b: int) -> list[np.ndarray]:
    return [rows[i : i + b] for i in range(0, len(rows), b)]


def split_client(
    population: Population,
    client: int,
    rng: np.random.Generator,
    batch_size: int,
    epochs: int,
    recon: ReconConfig,
) -> Split:
    """The support/query split of one client for one trip (all randomness from `rng`).

    Query epochs after the first reshuffle the query examples; "all" (and the small-client
    fallback) uses population.batch_indices, so its query batches are FedAvg's exactly.
    """
    n = population.num_examples(client)
    small = n < recon.min_examples_to_split
    if recon.split == "even_odd" and n <= batch_size:
        small = True  # a single batch: nothing to put on the odd side
    if recon.split == "all" or small:
        query = population.batch_indices(client, 0, batch_size, epochs, rng)
        return Split(query[: len(query) // epochs], query, n)
    if recon.split == "even_odd":
        first = population.batch_indices(client, 0, batch_size, 1, rng)
        support, query = first[0::2], first[1::2]
    elif recon.split == "groups":
        # whole groups (recordings) on each side: a prototype enrolled on some sessions is
        # trained against others, so the query cannot be matched by a shared channel
        rows = population.order[population.offsets[client] : population.offsets[client + 1]]
        groups = population.store[GROUP_FIELD][torch.from_numpy(rows)].numpy()
        uniq = np.unique(groups)
        if len(uniq) < 2:  # one recording: nothing to hold out
            query = population.batch_indices(client, 0, batch_size, epochs, rng)
            return Split(query[: len(query) // epochs], query, n)
        chosen = rng.permutation(uniq)[
            : min(max(round(recon.support_fraction * len(uniq)), 1), len(uniq) - 1)
        ]
        in_support = np.isin(groups, chosen)
        support = _batches(rows[in_support][rng.permutation(int(in_support.sum()))], batch_size)
        q = rows[~in_support]
        query = _batches(q[rng.permutation(len(q))], batch_size)
    else:
        rows = population.order[population.offsets[client] : population.offsets[client + 1]]
        perm = rows[rng.permutation(n)]
        cut = min(max(round(recon.support_fraction * n), 1), n - 1)
        support, query = _batches(perm[:cut], batch_size), _batches(perm[cut:], batch_size)
    q_rows = np.concatenate(query)
    query = list(query)
    for _ in range(epochs - 1):
        query.extend(_batches(q_rows[rng.permutation(len(q_rows))], batch_size))
    return Split(support, query, len(q_rows))


def eval_splits(
    population: Population,
    clients: Sequence[int],
    batch_size: int,
    recon: ReconConfig,
    seed: int,
) -> list[Split]:
    """The RECONEVAL splits of `clients` (one epoch), each from its own (seed, client) stream."""
    return [
        split_client(population, c, derived_rng(seed, Purpose.RECON_EVAL, c), batch_size, 1, recon)
        for c in clients
    ]
