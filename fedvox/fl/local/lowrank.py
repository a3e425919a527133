"""The exact low-rank path: local SGD of many MLP clients with one shared matmul per layer.

Part of fedvox.fl.local, for tasks that declare it (task.LowRankTask, e.g. a ModuleTask over
an nn.Sequential MLP): the same updates as the generic vectorised step, less work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import vmap

from fedvox.errors import ConfigError
from fedvox.fl.local.config import ClientConfig
from fedvox.fl.local.steps import device_of, pad
from fedvox.fl.local.task import LowRankTask
from fedvox.fl.population import Population
from fedvox.types import Params

# Budget for one low-rank chunk's per-client state (stored layer inputs and output
# gradients, dense parameters, activations); the shared matmul wants many rows.
LOWRANK_CHUNK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Plan:
    """How the low-rank path runs a model: its layers, which Linear weights stay low-rank."""

    task: LowRankTask
    layers: tuple[nn.Module, ...]
    lowrank: frozenset[int]
    auto_chunk: int


def lowrank_plan(task: object, population: Population, cfg: ClientConfig, rank: int) -> Plan | None:
    """The plan when the low-rank path applies (see ClientConfig.lowrank), else None.

    It needs a task that declares it (`lowrank_layers()` not None) and 2-D inputs [example,
    features]. A Linear weight is kept low-rank when its `rank` (= local steps x batch) makes
    that cheaper than a per-client copy: rank·(in + out) < in·out (always, when lowrank=True).
    """
    if not cfg.vectorised or cfg.lowrank is False:
        return None
    declare = getattr(task, "lowrank_layers", None)
    layers = declare() if callable(declare) else None
    key = getattr(task, "input_key", None)
    if layers is None or key not in population.store or population.store[key].dim() != 2:
        if cfg.lowrank:
            raise ConfigError(
                "client.lowrank",
                "the low-rank path needs a ModuleTask over an nn.Sequential of Linear, "
                "LayerNorm and activation layers with 2-D inputs",
                "set client.lowrank to null (automatic) or false",
            )
        return None
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
    dense = sum(
        p.numel()
        for i, m in enumerate(layers)
        for n, p in m.named_parameters()
        if not _is_lowrank(f"{i}.{n}", lowrank)
    )
    per_client = 4 * (rank * widths + 2 * dense)
    return Plan(task, layers, lowrank, max(1, LOWRANK_CHUNK_BYTES // per_client))  # type: ignore[arg-type]


def _is_lowrank(name: str, lowrank: frozenset[int]) -> bool:
    index, _, leaf = name.partition(".")
    return leaf == "weight" and int(index) in lowrank


@dataclass
class _State:
    """Per-chunk state: dense params (start p0, trained p), stored inputs xs and scaled
    output gradients gs of the low-rank layers, and the first layer's x W0^T if low-rank."""

    p0: Params
    p: Params
    xs: dict[int, Tensor]
    gs: dict[int, Tensor]
    first: Tensor | None


def _init_state(plan: Plan, start: Params, x_all: Tensor, k: int, steps: int, b: int) -> _State:
    rank = steps * b
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
        d = x_all.device
        xs[i] = (
            x_all.reshape(k, rank, -1) if i == 0 else torch.empty(k, rank, m.in_features, device=d)
        )
        gs[i] = torch.empty(k, rank, m.out_features, device=d)  # step s writes rows s·b..(s+1)·b
    first = None
    if 0 in plan.lowrank:  # the data is known up front: every step's x W0^T in one matmul
        first = (xs[0].reshape(k * rank, -1) @ start["0.weight"].T).view(k, steps, b, -1)
    return _State(p0, p, xs, gs, first)


def _forward(
    plan: Plan, st: _State, start: Params, h: Tensor, s: int, b: int
) -> tuple[Tensor, list[tuple[int, Tensor]]]:
    """Step s's outputs of k clients' batches h [k, b, in] and the low-rank layers' outputs."""
    k = h.shape[0]
    r0, r1 = s * b, (s + 1) * b
    p = st.p
    outputs: list[tuple[int, Tensor]] = []
    for i, m in enumerate(plan.layers):
        if isinstance(m, nn.Linear):
            bias = p.get(f"{i}.bias")
            if i in plan.lowrank:
                if i == 0:
                    assert st.first is not None
                    y = st.first[:, s]
                else:
                    st.xs[i][:, r0:r1] = h.detach()
                    y = (h.reshape(k * b, -1) @ start[f"{i}.weight"].T).view(k, b, -1)
                if s > 0:
                    past = torch.bmm(h, st.xs[i][:, :r0].transpose(1, 2))
                    y = torch.baddbmm(y, past, st.gs[i][:, :r0], alpha=-1.0)
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
    return h, outputs


def train_lowrank(
    plan: Plan,
    population: Population,
    batches: list[list[np.ndarray]],
    start: Params,
    cfg: ClientConfig,
    out: Params,
) -> Tensor:
    """Local SGD of k clients from ONE version, Linear weights kept as W0 + low-rank terms;
    writes the deltas into `out`, returns the loss sums [k].

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
    rows, mask_t, active = pad(batches, b, device_of(start))
    steps = rows.shape[1]
    data = population.gather(rows)  # [k, steps, b, ...]
    x_all = data[plan.task.input_key]
    loss_fn = vmap(plan.task.loss_fn)
    st = _init_state(plan, start, x_all, k, steps, b)
    p, p0 = st.p, st.p0
    loss_sum = torch.zeros(k, device=mask_t.device)
    for s in range(steps):
        r0, r1 = s * b, (s + 1) * b
        h, outputs = _forward(plan, st, start, x_all[:, s], s, b)
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
                    st.gs[i][:, :r0].mul_((1.0 - cfg.mu * scale).view(k, 1, 1))
                torch.mul(g, scale.view(k, 1, 1), out=st.gs[i][:, r0:r1])
            for (n, t), g in zip(p.items(), grads[len(outputs) :], strict=True):
                if cfg.mu > 0:
                    g = g + cfg.mu * (t - p0[n])
                t.addcmul_(scale.view(-1, *([1] * (t.dim() - 1))), g, value=-1.0)
            loss_sum += total
    with torch.no_grad():
        for i in plan.lowrank:
            torch.bmm(st.gs[i].transpose(1, 2), st.xs[i], out=out[f"{i}.weight"])
        for n, t in p.items():
            torch.sub(p0[n], t, out=out[n])
    return loss_sum
