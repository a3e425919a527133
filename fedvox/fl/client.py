"""Client update: local SGD from a downloaded model, many clients as one vectorised computation.

Called by the simulator when clients' completion events are processed; returns the stacked
deltas Δ = w_start − w_local that the aggregator (fl/aggregation.py) sums.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from fedvox.errors import ConfigError
from fedvox.fl.aggregation import stack
from fedvox.fl.population import Population

Params = dict[str, Tensor]
Batch = dict[str, Tensor]
LossFn = Callable[[Params, Batch], Tensor]


class Task(Protocol):
    """What the engine needs from a model: initial parameters and a functional loss.

    `loss(params, batch)` returns PER-EXAMPLE losses, shape [B]; the engine reduces them with
    a 0/1 mask so padded examples (short final batches under vmap) contribute nothing.
    """

    def init_params(self) -> Params: ...

    def loss(self, params: Params, batch: Batch) -> Tensor: ...


class ModuleTask:
    """A Task over an nn.Module via torch.func.functional_call.

    `loss_fn(outputs, batch)` gives per-example losses; `input_key` names the model input.
    Use LayerNorm/GroupNorm, not BatchNorm: running statistics are buffers mutated in place,
    which vmap over clients cannot carry (see docs/federated.md).
    """

    def __init__(
        self,
        module: nn.Module,
        loss_fn: Callable[[Tensor, Batch], Tensor],
        input_key: str = "x",
    ) -> None:
        self.module = module
        self.loss_fn = loss_fn
        self.input_key = input_key

    def init_params(self) -> Params:
        return {n: p.detach().clone() for n, p in self.module.named_parameters()}

    def loss(self, params: Params, batch: Batch) -> Tensor:
        out = functional_call(self.module, params, (batch[self.input_key],))
        return self.loss_fn(out, batch)


@dataclass(frozen=True)
class ClientConfig:
    """Local training: `epochs` of SGD at `lr` with batch `batch_size`.

    mu > 0 adds FedProx's (mu/2)·||w − w_start||². lr_normalise scales a short batch's step
    by n_batch/B (FedBuff paper) by dividing its loss sum by B instead of n_batch.
    chunk_size: clients per vectorised call (None: as many as fit CHUNK_BYTES of params).
    """

    epochs: int = 1
    batch_size: int = 10
    lr: float = 0.1
    mu: float = 0.0
    lr_normalise: bool = False
    vectorised: bool = True
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ConfigError("client.epochs", f"must be >= 1, got {self.epochs}", "use 1")
        if self.batch_size < 1:
            raise ConfigError("client.batch_size", f"must be >= 1, got {self.batch_size}")
        if not self.lr > 0:
            raise ConfigError("client.lr", f"must be > 0, got {self.lr}", "use e.g. 0.1")
        if self.mu < 0:
            raise ConfigError("client.mu", f"must be >= 0, got {self.mu}", "use 0 for FedAvg")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ConfigError("client.chunk_size", f"must be >= 1, got {self.chunk_size}")


@dataclass
class ClientResults:
    """Results of k clients, stacked along the leading axis."""

    delta: Params
    num_examples: Tensor
    loss: Tensor


def _objective(loss: LossFn, cfg: ClientConfig) -> Callable:
    """Masked mean of per-example losses (+ FedProx term); aux = masked loss sum."""

    def objective(p: Params, anchor: Params, batch: Batch, mask: Tensor) -> tuple[Tensor, Tensor]:
        per_example = loss(p, batch)
        total = (per_example * mask).sum()
        denom = float(cfg.batch_size) if cfg.lr_normalise else mask.sum().clamp_min(1.0)
        obj = total / denom
        if cfg.mu > 0:
            # gradient mu·(w − w_start): a descent step moves w back TOWARDS the global model
            prox = sum(((p[n] - anchor[n]) ** 2).sum() for n in p)
            obj = obj + 0.5 * cfg.mu * prox
        return obj, total.detach()

    return objective


def train_clients(
    loss: LossFn,
    population: Population,
    jobs: Sequence[tuple[int, int]],
    starts: Sequence[Params],
    cfg: ClientConfig,
) -> ClientResults:
    """Train clients `jobs` = [(client_id, trip), ...] from their starting params `starts`.

    Vectorised: one vmap(grad) over the stacked clients per local step; a client with fewer
    batches is padded and its step multiplied by 0. Loop: the reference, one client at a time.
    """
    batches = [population.batch_indices(c, t, cfg.batch_size, cfg.epochs) for c, t in jobs]
    n_examples = torch.tensor([cfg.epochs * population.num_examples(c) for c, _ in jobs])
    if cfg.vectorised:
        k = len(jobs)
        chunk = cfg.chunk_size or _auto_chunk(starts[0], k)
        delta = {n: torch.empty((k, *t.shape), dtype=t.dtype) for n, t in starts[0].items()}
        loss_sum = torch.empty(k)
        for i in range(0, k, chunk):
            j = min(i + chunk, k)
            out = {n: t[i:j] for n, t in delta.items()}
            loss_sum[i:j] = _train_vectorised(loss, population, batches[i:j], starts[i:j], cfg, out)
    else:
        delta, loss_sum = _train_loop(loss, population, batches, starts, cfg)
    return ClientResults(delta, n_examples, loss_sum / n_examples.to(loss_sum.dtype))


# Stacked parameters of one vectorised chunk are kept near this size: past the cache, every
# local step streams k parameter copies through memory (W2: 100 stacked MLPs ran 2x slower
# than chunks of 25).
CHUNK_BYTES = 16 * 2**20


def _auto_chunk(params: Params, k: int) -> int:
    per_client = sum(t.numel() * t.element_size() for t in params.values())
    return max(1, min(k, CHUNK_BYTES // max(per_client, 1)))


def _train_vectorised(
    loss: LossFn,
    population: Population,
    batches: list[list[np.ndarray]],
    starts: Sequence[Params],
    cfg: ClientConfig,
    out: Params,
) -> Tensor:
    """Writes the chunk's deltas into `out` (views of the full result); returns loss sums."""
    k, b = len(batches), cfg.batch_size
    steps = max(len(bl) for bl in batches)
    rows = np.empty((k, steps, b), dtype=np.int64)
    mask = np.zeros((k, steps, b), dtype=np.float32)
    for i, bl in enumerate(batches):
        rows[i] = bl[0][0]  # padding points at a real example, so the loss stays finite
        for s, r in enumerate(bl):
            rows[i, s, : len(r)] = r
            mask[i, s, : len(r)] = 1.0
    data = population.gather(rows)  # one gather for every client and step: [k, steps, b, ...]
    mask_t = torch.from_numpy(mask)
    active = (mask_t.sum(2) > 0).to(torch.float32)  # [k, steps]
    if all(st is starts[0] for st in starts):  # one version: a view, not k copies
        p0 = {n: t.unsqueeze(0).expand(k, *t.shape) for n, t in starts[0].items()}
    else:
        p0 = stack(starts)
    p = {n: t.clone() for n, t in p0.items()}
    step_grad = vmap(grad(_objective(loss, cfg), has_aux=True))
    loss_sum = torch.zeros(k)
    for s in range(steps):
        g, total = step_grad(p, p0, {n: t[:, s] for n, t in data.items()}, mask_t[:, s])
        everyone = bool(active[:, s].all())
        scale = cfg.lr * active[:, s]
        for n in p:
            # in place and fused: the stacked parameters are the memory traffic that matters
            if everyone:
                p[n].sub_(g[n], alpha=cfg.lr)
            else:
                p[n].addcmul_(scale.view(-1, *([1] * (p[n].dim() - 1))), g[n], value=-1.0)
        loss_sum += total
    for n in p:
        torch.sub(p0[n], p[n], out=out[n])
    return loss_sum


def _train_loop(
    loss: LossFn,
    population: Population,
    batches: list[list[np.ndarray]],
    starts: Sequence[Params],
    cfg: ClientConfig,
) -> tuple[Params, Tensor]:
    step_grad = grad(_objective(loss, cfg), has_aux=True)
    deltas, sums = [], []
    for bl, start in zip(batches, starts, strict=True):
        p = dict(start)
        total_loss = torch.zeros(())
        for r in bl:
            batch = population.gather(r)
            g, total = step_grad(p, start, batch, torch.ones(len(r)))
            p = {n: p[n] - cfg.lr * g[n] for n in p}
            total_loss = total_loss + total
        deltas.append({n: start[n] - p[n] for n in p})
        sums.append(total_loss)
    return stack(deltas), torch.stack(sums)
