"""Client population: who holds which examples, and how a client's local batches are drawn.

Sits between the data store (one shared array per field) and the client update: clients are
index lists into that store, so memory grows with the data, never with a per-client object.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from fedvox.errors import ConfigError
from fedvox.rng import Purpose, derived_rng


class Population:
    """Clients as contiguous slices of one index array into a shared store of tensors.

    `store` maps a field name ("x", "y", ...) to a tensor whose first axis is the example;
    client c holds examples `order[offsets[c]:offsets[c+1]]`.

    Random crops: with `groups` (the group — recording — of every store row) and `take` (rows
    per group in one epoch), an epoch is not every row of the client but, for each of its
    groups, `take[g]` rows drawn without replacement, fresh per epoch and trip. With the
    store holding overlapping windows of each recording, that is a random crop per chunk.
    """

    def __init__(
        self,
        store: Mapping[str, Tensor],
        client_indices: Sequence[Sequence[int] | np.ndarray],
        seed: int = 0,
        groups: np.ndarray | None = None,
        take: np.ndarray | None = None,
    ) -> None:
        if not store:
            raise ConfigError("population.store", "no data fields", "pass e.g. {'x': X, 'y': Y}")
        lengths = {name: int(t.shape[0]) for name, t in store.items()}
        if len(set(lengths.values())) != 1:
            raise ConfigError(
                "population.store",
                f"fields have different numbers of examples {lengths}",
                "give every field one row per example",
            )
        n_store = next(iter(lengths.values()))
        if len(client_indices) == 0:
            raise ConfigError("population.clients", "no clients", "give at least one client")
        sizes = np.array([len(ix) for ix in client_indices], dtype=np.int64)
        empty = np.flatnonzero(sizes == 0)
        if empty.size:
            raise ConfigError(
                "population.clients",
                f"client {int(empty[0])} has no data ({empty.size} empty clients)",
                "drop clients without examples before building the population",
            )
        order = np.concatenate([np.asarray(ix, dtype=np.int64) for ix in client_indices])
        if order.min() < 0 or order.max() >= n_store:
            raise ConfigError(
                "population.clients",
                f"an example index is outside the store (0..{n_store - 1})",
                "index rows of the store",
            )
        self.store = {name: torch.as_tensor(t) for name, t in store.items()}
        self.order = order
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.seed = int(seed)
        self.groups: np.ndarray | None = None
        self.take: np.ndarray | None = None
        self._per_epoch = sizes
        if (groups is None) != (take is None):
            raise ConfigError("population.groups", "groups and take go together", "give both")
        if groups is not None and take is not None:
            self.groups = np.asarray(groups, dtype=np.int64)
            self.take = np.asarray(take, dtype=np.int64)
            if self.groups.shape != (n_store,) or self.groups.min() < 0:
                raise ConfigError(
                    "population.groups", f"need one group id >= 0 per store row ({n_store})"
                )
            if self.take.ndim != 1 or len(self.take) <= self.groups.max():
                raise ConfigError("population.take", "need one count per group id")
            members = np.bincount(self.groups, minlength=len(self.take))
            if np.any((self.take < 1) | (self.take > members)):
                raise ConfigError(
                    "population.take",
                    "every group needs 1 <= take <= its number of rows",
                    "draw at most as many rows per epoch as a group holds",
                )
            self._per_epoch = np.array(
                [
                    self.take[np.unique(self.groups[order[a:b]])].sum()
                    for a, b in itertools.pairwise(self.offsets)
                ],
                dtype=np.int64,
            )

    @property
    def num_clients(self) -> int:
        return len(self.offsets) - 1

    def num_examples(self, client_id: int) -> int:
        """Examples the client trains on in one epoch (its rows, or its draws per group)."""
        return int(self._per_epoch[client_id])

    def examples(self) -> np.ndarray:
        """Number of examples of every client (one array, for weighting and delay scaling; a
        copy, so a caller cannot change what the population draws)."""
        return self._per_epoch.copy()

    def rng(self, purpose: int, client_id: int, trip: int) -> np.random.Generator:
        return derived_rng(self.seed, purpose, client_id, trip)

    def batch_indices(
        self,
        client_id: int,
        trip: int,
        batch_size: int,
        epochs: int = 1,
        rng: np.random.Generator | None = None,
    ) -> list[np.ndarray]:
        """Store rows of each local batch: a fresh shuffle per epoch, last batch may be short."""
        if rng is None:
            rng = self.rng(Purpose.BATCHES, client_id, trip)
        rows = self.order[self.offsets[client_id] : self.offsets[client_id + 1]]
        out: list[np.ndarray] = []
        for _ in range(epochs):
            epoch = rows if self.groups is None else self._draw(rows, rng)
            perm = epoch[rng.permutation(len(epoch))]
            out.extend(perm[i : i + batch_size] for i in range(0, len(perm), batch_size))
        return out

    def _draw(self, rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One epoch's rows with groups: `take[g]` of each group's rows, without replacement."""
        assert self.groups is not None and self.take is not None
        g = self.groups[rows]
        picked = []
        for gid in np.unique(g):
            members = rows[g == gid]
            picked.append(rng.choice(members, size=int(self.take[gid]), replace=False))
        return np.sort(np.concatenate(picked))

    def num_batches(self, client_id: int, batch_size: int, epochs: int = 1) -> int:
        return epochs * math.ceil(self.num_examples(client_id) / batch_size)

    def gather(self, rows: np.ndarray | Tensor) -> dict[str, Tensor]:
        """The store's fields at `rows` (any shape of row indices)."""
        ix = torch.as_tensor(rows, dtype=torch.long)
        # a store moved to a GPU (fl.local.placement) is indexed there
        return {name: t[ix.to(t.device)] for name, t in self.store.items()}

    def client_batches(
        self,
        client_id: int,
        trip: int,
        batch_size: int,
        epochs: int = 1,
        rng: np.random.Generator | None = None,
    ) -> Iterator[dict[str, Tensor]]:
        """The client's local batches for this trip, deterministic in (seed, client, trip)."""
        for rows in self.batch_indices(client_id, trip, batch_size, epochs, rng):
            yield self.gather(rows)
