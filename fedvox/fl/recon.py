"""Federated Reconstruction (Singhal et al. 2021): local parameters rebuilt on every trip, never sent.

A Simulator `client_update` (make_recon_update) and RECONEVAL (recon_eval): the client splits its
data into support/query, reconstructs its local parameters on support with the global ones
frozen, trains the global ones on query, and uploads Δ over GLOBAL names only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor
from torch.func import grad, vmap

from fedvox.errors import ConfigError
from fedvox.fl.aggregation import stack
from fedvox.fl.client import (
    ClientConfig,
    ClientResults,
    _auto_chunk,
    _objective,
    _pad,
    sgd_step_,
)
from fedvox.fl.population import Population
from fedvox.rng import Purpose, derived_rng, torch_generator
from fedvox.types import Batch, MetricFn, Params

SPLITS = ("even_odd", "all", "fraction", "groups")
GROUP_FIELD = "group"  # store field naming each example's group (e.g. its recording)


@runtime_checkable
class ReconTask(Protocol):
    """A model with global parameters (on the server) and local ones (on the device only).

    - `init_params()`: the GLOBAL parameters only; the server and aggregator know no others.
    - `init_local(client_ids, generator)`: fresh local parameters for those clients, stacked
      along a leading client axis (clients are stateless: called on every participation; the
      engine calls it once per job with a generator derived from (seed, client, trip)).
    - `loss(params, batch)`: PER-EXAMPLE losses [B]; `params` = global ∪ local of ONE client
      (unstacked); must be vmappable (torch.func) for the vectorised path.
    - optional `closed_form_local(global_params, batch, mask) -> local params` of one client
      from all its support examples (`mask` [n] marks real rows; padded rows repeat a real
      one), used when ReconConfig.closed_form is set (e.g. ridge regression, or a speaker
      prototype = mean embedding of the enrollment utterances).
    """

    def init_params(self) -> Params: ...

    def init_local(self, client_ids: Sequence[int], generator: torch.Generator) -> Params: ...

    def loss(self, params: Params, batch: Batch) -> Tensor: ...


@dataclass(frozen=True)
class ReconConfig:
    """Reconstruction on the client (and in RECONEVAL).

    steps: reconstruction EPOCHS over the support batches (one SGD step at `lr` per support
      batch of ClientConfig.batch_size; TFF's "reconstruction epochs"). 0 without closed_form
      is the paper's "no reconstruction": local parameters stay at their initialisation.
    closed_form: set the local parameters with task.closed_form_local on all support
      examples first (then `steps` epochs of SGD refine them; usually steps = 0).
    split: "even_odd" (support = even-indexed local batches, query = odd ones; the paper's
      default), "fraction" (the first `support_fraction` of a shuffled client is support),
      "groups" (a `support_fraction` of the client's groups — store field "group", e.g. its
      recordings — is support, the other groups query; one group: all data for both), or
      "all" (support = query = all data; with no local parameters and steps = 0 this is
      exactly FedAvg's client update). A client with fewer than `min_examples_to_split`
      examples, or (even_odd) a single batch, uses all its data for both.
    joint: train local parameters together with the global ones on query (still never sent).
    """

    steps: int = 1
    lr: float = 0.1
    split: str = "even_odd"
    support_fraction: float = 0.5
    min_examples_to_split: int = 2
    joint: bool = False
    closed_form: bool = False

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ConfigError(
                "reconstruction.steps", f"must be >= 0, got {self.steps}", "use e.g. 1"
            )
        if not self.lr > 0:
            raise ConfigError("reconstruction.lr", f"must be > 0, got {self.lr}", "use e.g. 0.1")
        if self.split not in SPLITS:
            raise ConfigError(
                "reconstruction.split",
                f"unknown split {self.split!r}",
                f"use one of {', '.join(SPLITS)}",
            )
        if not 0 < self.support_fraction < 1:
            raise ConfigError(
                "reconstruction.support_fraction",
                f"must be in (0, 1), got {self.support_fraction}",
                "use e.g. 0.5",
            )
        if self.min_examples_to_split < 2:
            raise ConfigError(
                "reconstruction.min_examples_to_split",
                f"must be >= 2, got {self.min_examples_to_split}",
                "use 2 (one example cannot be split)",
            )


def _check_task(task: ReconTask, recon: ReconConfig) -> None:
    for attr in ("init_params", "init_local", "loss"):
        if not callable(getattr(task, attr, None)):
            raise ConfigError(
                "task", f"{type(task).__name__} has no {attr}()", "implement fl.recon.ReconTask"
            )
    if recon.closed_form and not callable(getattr(task, "closed_form_local", None)):
        raise ConfigError(
            "reconstruction.closed_form",
            f"{type(task).__name__} has no closed_form_local()",
            "set closed_form false (and steps >= 1), or implement closed_form_local",
        )


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


def _init_locals(
    task: ReconTask, clients: Sequence[int], gens: Sequence[torch.Generator]
) -> Params:
    """Fresh local parameters, one task.init_local call per client (so a client's values never
    depend on who else is in the chunk), stacked along the client axis."""
    parts = [task.init_local([c], g) for c, g in zip(clients, gens, strict=True)]
    return {n: torch.cat([p[n] for p in parts]) for n in parts[0]}


def _starting(starts: Sequence[Params]) -> Params:
    """Stacked global params [k, ...]: a broadcast view when every client has one version."""
    k = len(starts)
    if all(st is starts[0] for st in starts):
        return {n: t.unsqueeze(0).expand(k, *t.shape) for n, t in starts[0].items()}
    return stack(starts)


def _sgd(
    obj: Callable,
    p: Params,
    anchor: Params,
    extra: Params,
    data: Batch,
    mask_t: Tensor,
    active: Tensor,
    lr: float,
) -> Tensor:
    """Vectorised SGD on the stacked `p` in place (as client._train_vectorised does, step for
    step); `extra` is a per-client argument held fixed. Returns the masked loss sums [k]."""
    step_grad = vmap(grad(obj, has_aux=True))
    loss_sum = torch.zeros(mask_t.shape[0])
    for s in range(mask_t.shape[1]):
        g, total = step_grad(p, anchor, extra, {n: t[:, s] for n, t in data.items()}, mask_t[:, s])
        everyone = bool(active[:, s].all())
        scale = lr * active[:, s]
        for n in p:
            if everyone:
                p[n].sub_(g[n], alpha=lr)
            else:
                p[n].addcmul_(scale.view(-1, *([1] * (p[n].dim() - 1))), g[n], value=-1.0)
        loss_sum += total
    return loss_sum


def _local_objective(task: ReconTask, cfg: ClientConfig) -> Callable:
    """Objective of the local params `l` with the global ones `g` frozen (no proximal term)."""
    rcfg = replace(cfg, mu=0.0)

    def obj(loc: Params, anchor: Params, g: Params, batch: Batch, mask: Tensor):
        return _objective(lambda q, b: task.loss({**g, **q}, b), rcfg)(loc, anchor, batch, mask)

    return obj


def _query_objective(task: ReconTask, cfg: ClientConfig, joint: bool, names: Sequence[str]):
    """Objective on query: global params `p` (plus local ones when joint) with `extra` fixed;
    FedProx's pull acts on global names only."""
    if not joint:

        def obj(p: Params, anchor: Params, loc: Params, batch: Batch, mask: Tensor):
            return _objective(lambda q, b: task.loss({**q, **loc}, b), cfg)(p, anchor, batch, mask)

        return obj
    plain = _objective(task.loss, replace(cfg, mu=0.0))

    def obj_joint(p: Params, anchor: Params, _: Params, batch: Batch, mask: Tensor):
        value, total = plain(p, anchor, batch, mask)
        if cfg.mu > 0:
            value = value + 0.5 * cfg.mu * sum(((p[n] - anchor[n]) ** 2).sum() for n in names)
        return value, total

    return obj_joint


def _reconstruct_vec(
    task: ReconTask,
    population: Population,
    support: list[list[np.ndarray]],
    g: Params,
    local: Params,
    cfg: ClientConfig,
    recon: ReconConfig,
) -> Params:
    """Local params of k clients after reconstruction on `support` (global `g` untouched)."""
    if recon.closed_form:
        m = max(sum(len(r) for r in bl) for bl in support)
        rows, mask_t, _ = _pad([[np.concatenate(bl)] for bl in support], m)
        data = population.gather(rows[:, 0])
        local = vmap(task.closed_form_local)(g, data, mask_t[:, 0])  # type: ignore[attr-defined]
    local = {n: t.detach().clone() for n, t in local.items()}
    if recon.steps == 0 or not local:
        return local
    rows, mask_t, active = _pad([bl * recon.steps for bl in support], cfg.batch_size)
    data = population.gather(rows)
    obj = _local_objective(task, cfg)
    _sgd(obj, local, local, g, data, mask_t, active, recon.lr)
    return local


def _reconstruct_one(
    task: ReconTask,
    population: Population,
    support: list[np.ndarray],
    g: Params,
    local: Params,
    cfg: ClientConfig,
    recon: ReconConfig,
) -> Params:
    """The loop reference for one client (no vmap)."""
    if recon.closed_form:
        rows = np.concatenate(support)
        local = task.closed_form_local(g, population.gather(rows), torch.ones(len(rows)))  # type: ignore[attr-defined]
    if recon.steps == 0 or not local:
        return dict(local)
    step_grad = grad(_local_objective(task, cfg), has_aux=True)
    for _ in range(recon.steps):
        for r in support:
            gl, _ = step_grad(local, local, g, population.gather(r), torch.ones(len(r)))
            local = {n: local[n] - recon.lr * gl[n] for n in local}
    return local


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
    examples (train_clients' convention); a non-finite Δ is zeroed with num_examples 0.
    """
    _check_task(task, recon)
    names = list(starts[0])
    clients = [c for c, _ in jobs]
    gens = [torch_generator(population.seed, Purpose.RECON_INIT, c, t) for c, t in jobs]
    local0 = _init_locals(task, clients, gens)
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
    merged0 = {**starts[0], **{n: t[0] for n, t in local0.items()}}
    chunk = cfg.chunk_size or _auto_chunk(merged0, k)
    if not cfg.vectorised or chunk == 1:
        delta, loss_sum = _train_loop(task, population, splits, starts, local0, cfg, recon)
    else:
        delta = {n: torch.empty((k, *t.shape), dtype=t.dtype) for n, t in starts[0].items()}
        loss_sum = torch.empty(k)
        for i in range(0, k, chunk):
            j = min(i + chunk, k)
            out = {n: t[i:j] for n, t in delta.items()}
            part = {n: t[i:j] for n, t in local0.items()}
            loss_sum[i:j] = _train_vectorised(
                task, population, splits[i:j], starts[i:j], part, cfg, recon, out
            )
    finite = torch.ones(k, dtype=torch.bool)
    for t in delta.values():
        finite &= torch.isfinite(t.reshape(k, -1)).all(1)
    if not bool(finite.all()):
        # a diverged client must not poison the sum: zero update, zero weight
        for t in delta.values():
            t[~finite] = 0.0
    loss = loss_sum / n_examples.clamp_min(1).to(loss_sum.dtype)
    return ClientResults(delta, torch.where(finite, n_examples, 0), loss)


def _train_vectorised(
    task: ReconTask,
    population: Population,
    splits: list[Split],
    starts: Sequence[Params],
    local0: Params,
    cfg: ClientConfig,
    recon: ReconConfig,
    out: Params,
) -> Tensor:
    """One chunk: writes the global deltas into `out`; returns the query loss sums."""
    p0 = _starting(starts)
    local = _reconstruct_vec(task, population, [s.support for s in splits], p0, local0, cfg, recon)
    names = list(p0)
    rows, mask_t, active = _pad([s.query for s in splits], cfg.batch_size)
    data = population.gather(rows)
    p = {n: t.clone() for n, t in p0.items()}
    if recon.joint:
        p.update(local)
        anchor = {**p0, **local}
        local = {}
    else:
        anchor = p0
    obj = _query_objective(task, cfg, recon.joint, names)
    loss_sum = _sgd(obj, p, anchor, local, data, mask_t, active, cfg.lr)
    for n in names:
        torch.sub(p0[n], p[n], out=out[n])
    return loss_sum


def _train_loop(
    task: ReconTask,
    population: Population,
    splits: list[Split],
    starts: Sequence[Params],
    local0: Params,
    cfg: ClientConfig,
    recon: ReconConfig,
) -> tuple[Params, Tensor]:
    """The reference, one client at a time (as client._train_loop)."""
    deltas, sums = [], []
    for i, (sp, start) in enumerate(zip(splits, starts, strict=True)):
        local = {n: t[i] for n, t in local0.items()}
        local = _reconstruct_one(task, population, sp.support, start, local, cfg, recon)
        names = list(start)
        obj = _query_objective(task, cfg, recon.joint, names)
        p = dict(start)
        anchor = start
        if recon.joint:
            p.update(local)
            anchor = {**start, **local}
            local = {}
        # plain autograd on leaf copies with in-place steps, as client._train_loop
        p = {n: t.detach().clone().requires_grad_(True) for n, t in p.items()}
        total_loss = torch.zeros(())
        for r in sp.query:
            o, total = obj(p, anchor, local, population.gather(r), torch.ones(len(r)))
            sgd_step_(p, o, cfg.lr)
            total_loss = total_loss + total.detach()
        with torch.no_grad():
            deltas.append({n: start[n] - p[n] for n in names})
        sums.append(total_loss)
    return stack(deltas), torch.stack(sums)


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


# -- evaluation -------------------------------------------------------------------------------


def _eval_splits(
    population: Population,
    clients: Sequence[int],
    cfg: ClientConfig,
    recon: ReconConfig,
    seed: int,
) -> list[Split]:
    return [
        split_client(
            population, c, derived_rng(seed, Purpose.RECON_EVAL, c), cfg.batch_size, 1, recon
        )
        for c in clients
    ]


def reconstruct(
    task: ReconTask,
    population: Population,
    params: Params,
    recon: ReconConfig,
    clients: Sequence[int] | None = None,
    client: ClientConfig | None = None,
    seed: int = 0,
    part: str = "support",
) -> Params:
    """Local params of `clients` (stacked) reconstructed from `params` (global, unchanged) on
    their RECONEVAL support half (`part="support"`) or on all their data (`part="all"`, e.g.
    enrollment). Deterministic in (seed, client)."""
    _check_task(task, recon)
    cfg = client or ClientConfig()
    clients = list(range(population.num_clients)) if clients is None else list(clients)
    if part not in ("support", "all"):
        raise ConfigError("part", f"unknown part {part!r}", "use 'support' or 'all'")
    use = recon if part == "support" else replace(recon, split="all")
    splits = _eval_splits(population, clients, cfg, use, seed)
    return _reconstruct_many(task, population, params, clients, splits, cfg, recon, seed)


def _reconstruct_many(
    task: ReconTask,
    population: Population,
    params: Params,
    clients: Sequence[int],
    splits: list[Split],
    cfg: ClientConfig,
    recon: ReconConfig,
    seed: int,
) -> Params:
    gens = [torch_generator(seed, Purpose.RECON_EVAL_INIT, c) for c in clients]
    local0 = _init_locals(task, clients, gens)
    k = len(clients)
    if not local0:
        return {}
    merged0 = {**params, **{n: t[0] for n, t in local0.items()}}
    chunk = cfg.chunk_size or _auto_chunk(merged0, k)
    parts: list[Params] = []
    params = {n: t.detach() for n, t in params.items()}
    if not cfg.vectorised:
        for i, sp in enumerate(splits):
            one = {n: t[i] for n, t in local0.items()}
            parts.append(_reconstruct_one(task, population, sp.support, params, one, cfg, recon))
        return stack(parts)
    for i in range(0, k, chunk):
        j = min(i + chunk, k)
        g = _starting([params] * (j - i))
        part = {n: t[i:j] for n, t in local0.items()}
        support = [s.support for s in splits[i:j]]
        parts.append(_reconstruct_vec(task, population, support, g, part, cfg, recon))
    return {n: torch.cat([p[n] for p in parts]) for n in parts[0]}


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
    splits = _eval_splits(population, clients, cfg, recon, seed)
    params = {n: t.detach() for n, t in params.items()}
    local = _reconstruct_many(task, population, params, clients, splits, cfg, recon, seed)
    sums: dict[str, float] = {}
    n_total = 0
    k = len(clients)
    chunk = cfg.chunk_size or _auto_chunk({**params, **{n: t[0] for n, t in local.items()}}, k)
    with torch.no_grad():
        for i in range(0, k, chunk):
            j = min(i + chunk, k)
            q = [[np.concatenate(s.query)] for s in splits[i:j]]
            m = max(len(b[0]) for b in q)
            rows, mask_t, _ = _pad(q, m)
            data = population.gather(rows[:, 0])
            merged = {**_starting([params] * (j - i)), **{n: t[i:j] for n, t in local.items()}}
            values = vmap(metric_fn)(merged, data)
            for name, v in values.items():
                sums[name] = sums.get(name, 0.0) + float((v * mask_t[:, 0]).sum())
            n_total += int(mask_t.sum())
    out = {name: s / n_total for name, s in sums.items()}
    out.update(examples=float(n_total), clients=float(k))
    return out
