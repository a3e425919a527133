"""The local-training steps every client update is made of: vectorised over clients, or a loop.

Part of fedvox.fl.local: padding of clients' batches, the broadcast view of one start
version, the masked objective, one vmap(grad) SGD step sequence and the one-client loop.
Plain client training and Federated Reconstruction both run on these, step for step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.func import grad, vmap

from fedvox.fl.aggregation import stack
from fedvox.fl.local.config import ClientConfig
from fedvox.fl.local.task import LossFn
from fedvox.fl.population import Population
from fedvox.types import Batch, Params

# obj(p, anchor, fixed, batch, mask) -> (objective, masked loss sum): `p` trained, `anchor`
# FedProx's reference, `fixed` parameters the loss sees but SGD does not move.
Objective = Callable[[Params, Params, Params, Batch, Tensor], tuple[Tensor, Tensor]]

# Stacked parameters of one vectorised chunk are kept near this size: past the cache, every
# local step streams k parameter copies through memory (docs/federated.md, notes).
CHUNK_BYTES = 16 * 2**20
# A client this large is compute-bound on its own: stacking gains nothing, and vmap's batched
# convolutions (grouped) are slower than one client at a time (docs/federated.md, notes).
SOLO_BYTES = 4 * 2**20


def auto_chunk(params: Params, k: int) -> int:
    """Clients per vectorised call for `k` clients of `params`' size (1: one at a time)."""
    per_client = sum(t.numel() * t.element_size() for t in params.values())
    if per_client >= SOLO_BYTES:
        return 1
    return max(1, min(k, CHUNK_BYTES // max(per_client, 1)))


def device_of(params: Params) -> torch.device:
    """Where `params` live (the start version's device is where its clients train)."""
    return next(iter(params.values())).device


def pad(
    batches: list[list[np.ndarray]], b: int, device: torch.device | None = None
) -> tuple[np.ndarray, Tensor, Tensor]:
    """Rows [k, steps, b] (padding points at a real example, so losses stay finite), the 0/1
    example mask [k, steps, b] and the active-step mask [k, steps] (masks on `device`)."""
    k, steps = len(batches), max(len(bl) for bl in batches)
    rows = np.empty((k, steps, b), dtype=np.int64)
    mask = np.zeros((k, steps, b), dtype=np.float32)
    for i, bl in enumerate(batches):
        rows[i] = bl[0][0]
        for s, r in enumerate(bl):
            rows[i, s, : len(r)] = r
            mask[i, s, : len(r)] = 1.0
    mask_t = torch.from_numpy(mask).to(device or "cpu")
    return rows, mask_t, (mask_t.sum(2) > 0).to(torch.float32)


def broadcast_view(starts: Sequence[Params]) -> Params:
    """Stacked start params [k, ...]: a broadcast view, not k copies, when every client has
    the same version."""
    k = len(starts)
    if all(st is starts[0] for st in starts):
        return {n: t.unsqueeze(0).expand(k, *t.shape) for n, t in starts[0].items()}
    return stack(starts)


def objective(loss: LossFn, cfg: ClientConfig, prox: Sequence[str] | None = None) -> Objective:
    """Masked mean of per-example losses of `{**fixed, **p}` (+ FedProx's term over the names
    `prox`, default every name in `p`); aux = the masked loss sum."""

    def obj(p: Params, anchor: Params, fixed: Params, batch: Batch, mask: Tensor):
        per_example = loss({**fixed, **p} if fixed else p, batch)
        total = (per_example * mask).sum()
        denom = float(cfg.batch_size) if cfg.lr_normalise else mask.sum().clamp_min(1.0)
        obj = total / denom
        if cfg.mu > 0:
            # gradient mu·(w − w_start): a descent step moves w back TOWARDS the global model
            names = p if prox is None else prox
            obj = obj + 0.5 * cfg.mu * sum(((p[n] - anchor[n]) ** 2).sum() for n in names)
        return obj, total.detach()

    return obj


def sgd_vectorised(
    obj: Objective,
    p: Params,
    anchor: Params,
    fixed: Params,
    data: Batch,
    mask_t: Tensor,
    active: Tensor,
    lr: float,
    skip_idle: bool = False,
) -> Tensor:
    """SGD of k stacked clients in place on `p`: one vmap(grad) per step over every client's
    batch (data [k, steps, b, ...]); a padding step is multiplied by 0, or with `skip_idle`
    only the clients with a batch at that step are computed. Returns loss sums [k]."""
    step_grad = vmap(grad(obj, has_aux=True))
    loss_sum = torch.zeros(mask_t.shape[0], device=mask_t.device)
    for s in range(mask_t.shape[1]):
        on = active[:, s]
        everyone = bool(on.all())
        if skip_idle and not everyone:
            _idle_skipping_step(step_grad, p, anchor, fixed, data, mask_t, on, s, lr, loss_sum)
            continue
        g, total = step_grad(p, anchor, fixed, {n: t[:, s] for n, t in data.items()}, mask_t[:, s])
        scale = lr * on
        for n in p:
            # in place and fused: the stacked parameters are the memory traffic that matters
            if everyone:
                p[n].sub_(g[n], alpha=lr)
            else:
                p[n].addcmul_(scale.view(-1, *([1] * (p[n].dim() - 1))), g[n], value=-1.0)
        loss_sum += total
    return loss_sum


def _idle_skipping_step(
    step_grad: Callable,
    p: Params,
    anchor: Params,
    fixed: Params,
    data: Batch,
    mask_t: Tensor,
    on: Tensor,
    s: int,
    lr: float,
    loss_sum: Tensor,
) -> None:
    """Step s of sgd_vectorised for the active clients `on` only: views of a leading block
    (clients packed largest first), else gathered rows written back."""
    m = int(on.sum())
    if m == 0:
        return
    if bool(on[:m].all()):  # a prefix: views, updated in place
        pick = slice(0, m)
        g, total = step_grad(
            {n: t[pick] for n, t in p.items()},
            {n: t[pick] for n, t in anchor.items()},
            {n: t[pick] for n, t in fixed.items()},
            {n: t[pick, s] for n, t in data.items()},
            mask_t[pick, s],
        )
        for n in p:
            p[n][pick].sub_(g[n], alpha=lr)
        loss_sum[pick] += total
        return
    idx = on.nonzero().squeeze(1)
    g, total = step_grad(
        {n: t[idx] for n, t in p.items()},
        {n: t[idx] for n, t in anchor.items()},
        {n: t[idx] for n, t in fixed.items()},
        {n: t[idx, s] for n, t in data.items()},
        mask_t[idx, s],
    )
    for n in p:
        p[n].index_add_(0, idx, g[n], alpha=-lr)
    loss_sum.index_add_(0, idx, total)


def sgd_step_(params: Params, objective: Tensor, lr: float) -> None:
    """One in-place SGD step on leaf tensors `params` (requires_grad) down `objective`; a
    parameter the objective does not use gets a zero gradient."""
    grads = torch.autograd.grad(
        objective, list(params.values()), allow_unused=True, materialize_grads=True
    )
    with torch.no_grad():
        for t, g in zip(params.values(), grads, strict=True):
            t.sub_(g, alpha=lr)


def train_one(
    obj: Objective,
    population: Population,
    batches: Sequence[np.ndarray],
    start: Params,
    anchor: Params,
    fixed: Params,
    lr: float,
    names: Sequence[str],
) -> tuple[Params, Tensor]:
    """One client with plain autograd (leaf copies of `start`, in-place steps over `batches`
    of store rows): its Δ = anchor − w over `names`, and its loss sum.

    Not torch.func.grad: its per-op wrappers and out-of-place gradient sums cost a large
    client a noticeable share of its step time; vmap needs them, a loop does not.
    """
    p = {n: t.detach().clone().requires_grad_(True) for n, t in start.items()}
    device = device_of(start)
    total_loss = torch.zeros((), device=device)
    for r in batches:
        o, total = obj(p, anchor, fixed, population.gather(r), torch.ones(len(r), device=device))
        sgd_step_(p, o, lr)
        total_loss = total_loss + total
    with torch.no_grad():
        delta = {n: anchor[n] - p[n] for n in names}
    return delta, total_loss


# a unit is the job indices one computation trains together: a vectorised chunk, or one client
Unit = list[int]


def chunk_units(k: int, chunk: int) -> list[Unit]:
    """Consecutive chunks of `chunk` of k jobs (the last may be shorter)."""
    return [list(range(i, min(i + chunk, k))) for i in range(0, k, chunk)]


def packed_units(sizes: Sequence[int], chunk: int) -> list[Unit]:
    """Chunks of `chunk` job indices, largest `sizes` first (ties by job index): a vectorised
    call then pads its clients to a similar number of steps and rows."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    return [order[i : i + chunk] for i in range(0, len(order), chunk)]


def shard_units(units: list[Unit], shard: tuple[int, int] | None) -> list[Unit]:
    """The units a shard [start, stop) of job indices trains: those whose FIRST job lies in
    it. Every unit has one first job, so shards that tile 0..k train each unit exactly once,
    cut as the whole step would be: the same computations, so the same bits."""
    if shard is None:
        return units
    start, stop = shard
    return [u for u in units if start <= u[0] < stop]


def fill_units(
    units: list[Unit], template: Params, train_unit: Callable[[Unit, Params], Tensor]
) -> tuple[Params, Tensor, list[int]]:
    """Stacked Δ (names and device of `template`) and loss sums of the jobs in `units`, rows
    in job order, and those job indices: `train_unit(unit, out)` trains a unit, writes its Δ
    into `out` (views of the result where its rows are contiguous) and returns loss sums."""
    index = sorted(i for u in units for i in u)
    pos = {j: r for r, j in enumerate(index)}
    device = device_of(template)
    n = len(index)
    delta = {
        name: torch.empty((n, *t.shape), dtype=t.dtype, device=device)
        for name, t in template.items()
    }
    loss_sum = torch.empty(n, device=device)
    for u in units:
        rows = [pos[i] for i in u]
        if rows == list(range(rows[0], rows[-1] + 1)):  # write straight into the result
            r0, r1 = rows[0], rows[-1] + 1
            loss_sum[r0:r1] = train_unit(u, {name: t[r0:r1] for name, t in delta.items()})
        else:
            out = {name: t.new_empty((len(u), *t.shape[1:])) for name, t in delta.items()}
            loss_sum[rows] = train_unit(u, out)
            for name, t in delta.items():
                t[rows] = out[name]
    return delta, loss_sum, index


def train_stacked(
    obj: Objective,
    population: Population,
    batches: list[list[np.ndarray]],
    p0: Params,
    local: Params,
    cfg: ClientConfig,
    out: Params,
    joint: bool = False,
) -> Tensor:
    """k clients' SGD over their `batches` from stacked start params `p0`: writes Δ = p0 − w
    into `out` (names of p0), returns loss sums [k]. `local` params are fixed (Federated
    Reconstruction) or trained too but never returned (joint)."""
    rows, mask_t, active = pad(batches, cfg.batch_size, device_of(p0))
    data = population.gather(rows)
    p = {n: t.clone() for n, t in p0.items()}
    anchor, fixed = p0, local
    if joint:
        p.update(local)
        anchor, fixed = {**p0, **local}, {}
    loss_sum = sgd_vectorised(obj, p, anchor, fixed, data, mask_t, active, cfg.lr, cfg.pack)
    for n in p0:
        torch.sub(p0[n], p[n], out=out[n])
    return loss_sum
