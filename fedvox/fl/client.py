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
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from fedvox.errors import ConfigError
from fedvox.fl.aggregation import stack
from fedvox.fl.population import Population
from fedvox.types import Batch, Params

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
    chunk_size: clients per vectorised call (None: as many as fit CHUNK_BYTES of params;
    1, chosen for clients of SOLO_BYTES or more, trains them one at a time without vmap).
    lowrank: the exact low-rank path for Sequential MLPs (see `_train_lowrank`): None uses it
    where the model allows and it saves work, True requires it, False never uses it.
    """

    epochs: int = 1
    batch_size: int = 10
    lr: float = 0.1
    mu: float = 0.0
    lr_normalise: bool = False
    vectorised: bool = True
    chunk_size: int | None = None
    lowrank: bool | None = None

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
    For a ModuleTask over a Sequential MLP the low-rank path (`ClientConfig.lowrank`) computes
    the same updates with one shared matmul per layer and step (see `_train_lowrank`).
    """
    batches = [population.batch_indices(c, t, cfg.batch_size, cfg.epochs) for c, t in jobs]
    n_examples = torch.tensor([cfg.epochs * population.num_examples(c) for c, _ in jobs])
    k = len(jobs)
    plan = _lowrank_plan(loss, population, cfg, max(len(bl) for bl in batches) * cfg.batch_size)
    chunk = cfg.chunk_size or (plan.auto_chunk if plan else _auto_chunk(starts[0], k))
    if not cfg.vectorised or (plan is None and chunk == 1):
        # one client per vmap call would only add overhead (and grouped convolutions)
        delta, loss_sum = _train_loop(loss, population, batches, starts, cfg)
        return ClientResults(delta, n_examples, loss_sum / n_examples.to(loss_sum.dtype))
    delta = {n: torch.empty((k, *t.shape), dtype=t.dtype) for n, t in starts[0].items()}
    loss_sum = torch.empty(k)
    if plan is None:
        for i in range(0, k, chunk):
            j = min(i + chunk, k)
            out = {n: t[i:j] for n, t in delta.items()}
            loss_sum[i:j] = _train_vectorised(loss, population, batches[i:j], starts[i:j], cfg, out)
        return ClientResults(delta, n_examples, loss_sum / n_examples.to(loss_sum.dtype))
    # The shared matmul needs one starting version: group clients by version.
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
            loss_sum[idx] = _train_lowrank(plan, population, part, starts[idx[0]], cfg, out)
            if not contiguous:
                for n, t in delta.items():
                    t[idx] = out[n]
    return ClientResults(delta, n_examples, loss_sum / n_examples.to(loss_sum.dtype))


# Stacked parameters of one vectorised chunk are kept near this size: past the cache, every
# local step streams k parameter copies through memory (W2: 100 stacked MLPs ran 2x slower
# than chunks of 25).
CHUNK_BYTES = 16 * 2**20
# A client this large is compute-bound on its own: stacking gains nothing, and vmap's batched
# convolutions (grouped) made W1's x-vector steps 30-40% slower than one client at a time.
SOLO_BYTES = 4 * 2**20


def _auto_chunk(params: Params, k: int) -> int:
    per_client = sum(t.numel() * t.element_size() for t in params.values())
    if per_client >= SOLO_BYTES:
        return 1
    return max(1, min(k, CHUNK_BYTES // max(per_client, 1)))


def _pad(batches: list[list[np.ndarray]], b: int) -> tuple[np.ndarray, Tensor, Tensor]:
    """Rows [k, steps, b] (padding points at a real example, so losses stay finite), the 0/1
    example mask [k, steps, b] and the active-step mask [k, steps]."""
    k, steps = len(batches), max(len(bl) for bl in batches)
    rows = np.empty((k, steps, b), dtype=np.int64)
    mask = np.zeros((k, steps, b), dtype=np.float32)
    for i, bl in enumerate(batches):
        rows[i] = bl[0][0]
        for s, r in enumerate(bl):
            rows[i, s, : len(r)] = r
            mask[i, s, : len(r)] = 1.0
    mask_t = torch.from_numpy(mask)
    return rows, mask_t, (mask_t.sum(2) > 0).to(torch.float32)


def _train_vectorised(
    loss: LossFn,
    population: Population,
    batches: list[list[np.ndarray]],
    starts: Sequence[Params],
    cfg: ClientConfig,
    out: Params,
) -> Tensor:
    """Writes the chunk's deltas into `out` (views of the full result); returns loss sums."""
    k = len(batches)
    rows, mask_t, active = _pad(batches, cfg.batch_size)
    steps = rows.shape[1]
    data = population.gather(rows)  # one gather for every client and step: [k, steps, b, ...]
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


# -- the low-rank path ------------------------------------------------------------------------

# Parameter-free modules that act on each example independently: the low-rank path applies
# them to every client's rows at once.
_ROWWISE = (
    nn.ReLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.GELU,
    nn.SiLU,
    nn.LeakyReLU,
    nn.ELU,
    nn.Softplus,
    nn.Identity,
)

# Budget for one low-rank chunk's per-client state (stored layer inputs and output
# gradients, dense parameters, activations); the shared matmul wants many rows.
LOWRANK_CHUNK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class _Plan:
    """How the low-rank path runs a model: its layers, which Linear weights stay low-rank."""

    task: ModuleTask
    layers: tuple[nn.Module, ...]
    lowrank: frozenset[int]
    auto_chunk: int


def _lowrank_plan(
    loss: LossFn, population: Population, cfg: ClientConfig, rank: int
) -> _Plan | None:
    """The plan when the low-rank path applies (see ClientConfig.lowrank), else None.

    It needs `loss` to be a ModuleTask's loss over an nn.Sequential of Linear, 1-D LayerNorm
    and row-wise activations, with 2-D inputs [example, features]. A Linear weight is kept
    low-rank when its `rank` (= local steps x batch) makes that cheaper than a per-client
    copy: rank·(in + out) < in·out (always, when lowrank=True).
    """
    if not cfg.vectorised or cfg.lowrank is False:
        return None
    task = getattr(loss, "__self__", None)
    eligible = (
        isinstance(task, ModuleTask)
        and getattr(loss, "__func__", None) is ModuleTask.loss
        and isinstance(task.module, nn.Sequential)
        and not list(task.module.buffers())
        and task.input_key in population.store
        and population.store[task.input_key].dim() == 2
        and all(
            isinstance(m, nn.Linear)
            or (isinstance(m, nn.LayerNorm) and len(m.normalized_shape) == 1)
            or type(m) in _ROWWISE
            for m in task.module
        )
    )
    if not eligible:
        if cfg.lowrank:
            raise ConfigError(
                "client.lowrank",
                "the low-rank path needs a ModuleTask over an nn.Sequential of Linear, "
                "LayerNorm and activation layers with 2-D inputs",
                "set client.lowrank to null (automatic) or false",
            )
        return None
    assert isinstance(task, ModuleTask)
    layers = tuple(task.module)
    lowrank = frozenset(
        i
        for i, m in enumerate(layers)
        if isinstance(m, nn.Linear)
        and (
            cfg.lowrank or rank * (m.in_features + m.out_features) < m.in_features * m.out_features
        )
    )
    if not lowrank:
        return None
    # per client: stored inputs/gradients and activations (rank rows each), dense parameters
    widths = sum(m.in_features + 2 * m.out_features for m in layers if isinstance(m, nn.Linear))
    dense = sum(p.numel() for n, p in task.module.named_parameters() if not _is_lowrank(n, lowrank))
    per_client = 4 * (rank * widths + 2 * dense)
    return _Plan(task, layers, lowrank, max(1, LOWRANK_CHUNK_BYTES // per_client))


def _is_lowrank(name: str, lowrank: frozenset[int]) -> bool:
    index, _, leaf = name.partition(".")
    return leaf == "weight" and int(index) in lowrank


def _train_lowrank(
    plan: _Plan,
    population: Population,
    batches: list[list[np.ndarray]],
    start: Params,
    cfg: ClientConfig,
    out: Params,
) -> Tensor:
    """Local SGD of k clients from ONE version, Linear weights kept as W0 + low-rank terms.

    After t steps a client's weight is W_t = W0 − Σ_{s<t} G̃_s^T X_s, with X_s the layer's
    input rows and G̃_s = lr·a_s·∂obj/∂y_s its output gradients at step s (a_s = 0 for a
    padding step). So y = x W_t^T = x W0^T − (x X^T) G̃: one matmul over all k clients' rows
    with the shared W0, plus a [b × rank] correction per client; autograd through the same
    expression gives ∂obj/∂x. FedProx: W_t − W0 = −Σ G̃^T X, so its term mu·(W_t − W0) turns
    the step into a (1 − lr·a·mu) decay of the stored G̃. The delta Σ G̃^T X is formed once at
    the end. Exact in real arithmetic; other parameters (biases, LayerNorm, Linears where a
    dense copy is cheaper) are per-client tensors trained as usual.
    """
    k, b = len(batches), cfg.batch_size
    rows, mask_t, active = _pad(batches, b)
    steps = rows.shape[1]
    rank = steps * b
    data = population.gather(rows)  # [k, steps, b, ...]
    x_all = data[plan.task.input_key]
    loss_fn = vmap(plan.task.loss_fn)
    p0: Params = {}
    p: Params = {}
    for n, t in start.items():
        if not _is_lowrank(n, plan.lowrank):
            p0[n] = t.unsqueeze(0).expand(k, *t.shape)
            p[n] = p0[n].clone().requires_grad_(True)
    xs: dict[int, Tensor] = {}
    gs: dict[int, Tensor] = {}
    for i in plan.lowrank:
        m = plan.layers[i]
        # the first layer's inputs are the data itself: no copy
        xs[i] = x_all.reshape(k, rank, -1) if i == 0 else torch.empty(k, rank, m.in_features)
        gs[i] = torch.empty(k, rank, m.out_features)  # step s writes rows s·b..(s+1)·b
    if 0 in plan.lowrank:  # the data is known up front: every step's x W0^T in one matmul
        first = (xs[0].reshape(k * rank, -1) @ start["0.weight"].T).view(k, steps, b, -1)
    loss_sum = torch.zeros(k)
    for s in range(steps):
        r0, r1 = s * b, (s + 1) * b
        h = x_all[:, s]
        outputs: list[tuple[int, Tensor]] = []
        for i, m in enumerate(plan.layers):
            if isinstance(m, nn.Linear):
                bias = p.get(f"{i}.bias")
                if i in plan.lowrank:
                    if i == 0:
                        y = first[:, s]
                    else:
                        xs[i][:, r0:r1] = h.detach()
                        y = (h.reshape(k * b, -1) @ start[f"{i}.weight"].T).view(k, b, -1)
                    if s > 0:
                        past = torch.bmm(h, xs[i][:, :r0].transpose(1, 2))
                        y = torch.baddbmm(y, past, gs[i][:, :r0], alpha=-1.0)
                    if bias is not None:
                        y = y + bias.unsqueeze(1)
                    elif not y.requires_grad:  # first layer without bias: y is a leaf
                        y.requires_grad_(True)
                    outputs.append((i, y))
                else:
                    w = p[f"{i}.weight"].transpose(1, 2)
                    y = torch.bmm(h, w) if bias is None else torch.baddbmm(bias.unsqueeze(1), h, w)
                h = y
            elif isinstance(m, nn.LayerNorm):
                h = F.layer_norm(h, m.normalized_shape, None, None, m.eps)
                if f"{i}.weight" in p:
                    h = h * p[f"{i}.weight"].unsqueeze(1)
                if f"{i}.bias" in p:
                    h = h + p[f"{i}.bias"].unsqueeze(1)
            else:
                # an in-place activation would overwrite y, whose gradient is still needed
                h = m(h.clone() if getattr(m, "inplace", False) else h)
        per_example = loss_fn(h, {n: t[:, s] for n, t in data.items()})  # [k, b]
        mask = mask_t[:, s]
        total = (per_example * mask).sum(1)
        denom = float(b) if cfg.lr_normalise else mask.sum(1).clamp_min(1.0)
        grads = torch.autograd.grad(
            (total / denom).sum(), [y for _, y in outputs] + list(p.values())
        )
        with torch.no_grad():
            scale = cfg.lr * active[:, s]
            for (i, _), g in zip(outputs, grads, strict=False):
                if cfg.mu > 0 and s > 0:
                    gs[i][:, :r0].mul_((1.0 - cfg.mu * scale).view(k, 1, 1))
                torch.mul(g, scale.view(k, 1, 1), out=gs[i][:, r0:r1])
            for (n, t), g in zip(p.items(), grads[len(outputs) :], strict=True):
                if cfg.mu > 0:
                    g = g + cfg.mu * (t - p0[n])
                t.addcmul_(scale.view(-1, *([1] * (t.dim() - 1))), g, value=-1.0)
            loss_sum += total
    with torch.no_grad():
        for i in plan.lowrank:
            torch.bmm(gs[i].transpose(1, 2), xs[i], out=out[f"{i}.weight"])
        for n, t in p.items():
            torch.sub(p0[n], t, out=out[n])
    return loss_sum


def sgd_step_(params: Params, objective: Tensor, lr: float) -> None:
    """One in-place SGD step on leaf tensors `params` (requires_grad) down `objective`.

    Shared by the one-client-at-a-time loops (here and fl.recon); a parameter the objective
    does not use gets a zero gradient.
    """
    grads = torch.autograd.grad(
        objective, list(params.values()), allow_unused=True, materialize_grads=True
    )
    with torch.no_grad():
        for t, g in zip(params.values(), grads, strict=True):
            t.sub_(g, alpha=lr)


def _train_loop(
    loss: LossFn,
    population: Population,
    batches: list[list[np.ndarray]],
    starts: Sequence[Params],
    cfg: ClientConfig,
) -> tuple[Params, Tensor]:
    """One client at a time with plain autograd (leaf params, in-place SGD steps).

    Not torch.func.grad: its per-op wrappers and out-of-place gradient sums cost a large
    client (W1's x-vector) about a fifth of its step time; vmap needs them, a loop does not.
    """
    objective = _objective(loss, cfg)
    deltas, sums = [], []
    for bl, start in zip(batches, starts, strict=True):
        p = {n: t.detach().clone().requires_grad_(True) for n, t in start.items()}
        total_loss = torch.zeros(())
        for r in bl:
            batch = population.gather(r)
            obj, total = objective(p, start, batch, torch.ones(len(r)))
            sgd_step_(p, obj, cfg.lr)
            total_loss = total_loss + total
        with torch.no_grad():
            deltas.append({n: start[n] - p[n] for n in p})
        sums.append(total_loss)
    return stack(deltas), torch.stack(sums)
