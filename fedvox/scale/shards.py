"""Cutting one server step's jobs into shards, and putting the shards' results back in order.

Part of fedvox.scale: a shard is a range [start, stop) of job indices; the trainer
(ClientConfig.shard) trains the units whose first job lies in it, so results are the ones
the whole step computes in process, whichever worker runs which shard.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fedvox.errors import FedvoxError
from fedvox.fl.local import ClientResults


def cut(k: int, shard_size: int) -> list[tuple[int, int]]:
    """Ranges of `shard_size` job indices tiling 0..k: a function of the step, never of the
    number of workers."""
    return [(i, min(i + shard_size, k)) for i in range(0, k, shard_size)]


def assemble(parts: Sequence[ClientResults], k: int) -> ClientResults:
    """The results of all k jobs, rows in job order, from shards' results (each with
    `index`); a job missing or trained twice is an error, not a silent gap."""
    index = torch.cat([p.index for p in parts if p.index is not None]).long()
    if len(index) != k or not torch.equal(torch.sort(index).values, torch.arange(k)):
        raise FedvoxError(
            f"the shards' results cover jobs {index.tolist()}, not each of 0..{k - 1} once"
        )
    order = torch.argsort(index)
    names = list(parts[0].delta)

    def rows(get) -> torch.Tensor:
        return torch.cat([get(p) for p in parts])[order]

    delta = {n: rows(lambda p, n=n: p.delta[n]) for n in names}
    malicious = None
    if any(p.malicious is not None for p in parts):
        malicious = rows(lambda p: p.malicious)
    return ClientResults(delta, rows(lambda p: p.num_examples), rows(lambda p: p.loss), malicious)
