"""Client training on Ray actors: the simulator's client update, run as shards on a pool.

Part of fedvox.scale and the only module that imports Ray (extra `fedvox[ray]`). Actors hold
the client update and the population (put in the object store once, as NumPy, so same-node
reads are zero-copy), the task (put again only when its settings change) and the start
versions (one put per version). A server step's jobs are cut by fedvox.scale.shards, sent
through a small ray.wait dispatcher and reassembled in job order; a dead actor is recreated
and its shard sent again (a shard is a pure function of its inputs).
"""

from __future__ import annotations

import copy
import logging
import os
import warnings
import weakref
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import RayActorError, RayTaskError, WorkerCrashedError

from fedvox.device import set_determinism
from fedvox.errors import ConfigError, FedvoxError
from fedvox.fl.local import ClientConfig, ClientResults
from fedvox.fl.local.placement import Update, on_device, task_settings
from fedvox.fl.population import Population
from fedvox.scale.config import BackendConfig
from fedvox.scale.shards import assemble, cut
from fedvox.types import Params

log = logging.getLogger(__name__)

# what a dead or unreachable actor raises: recreate it and send its shard again
DEAD = (RayActorError, WorkerCrashedError)
VERSIONS_HELD = 64  # start versions an actor keeps deserialised (FedBuff: ~C/K in flight)


def connect(config: BackendConfig) -> None:
    """Join Ray: `config.address`, else RAY_ADDRESS, else start a local Ray on this machine;
    nothing when this process is already connected."""
    if ray.is_initialized():
        return
    common: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
    address = config.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, **common)
    else:
        # "local": a new Ray even where `ray start` left a cluster behind; an embedded Ray
        # that nobody joins talks over loopback only
        ray.init(
            address="local",
            object_store_memory=config.object_store_bytes,
            _node_ip_address="127.0.0.1",
            **common,
        )


def _tensor(a: np.ndarray) -> torch.Tensor:
    """A tensor over `a` without a copy; Ray's zero-copy arrays are read-only, and nothing in
    client training writes into the store or a start version."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(a)


def _numpy_params(params: Params) -> dict[str, np.ndarray]:
    return {n: t.detach().cpu().numpy() for n, t in params.items()}


def _population_payload(population: Population) -> Population:
    """A shallow copy of `population` whose store is NumPy (zero-copy in the object store)."""
    payload = copy.copy(population)
    payload.store = {n: t.numpy() for n, t in population.store.items()}  # type: ignore[misc]
    return payload


def _results_payload(res: ClientResults) -> dict[str, Any]:
    def arr(t: torch.Tensor | None) -> np.ndarray | None:
        return None if t is None else t.detach().cpu().numpy()

    return {
        "delta": _numpy_params(res.delta),
        "num_examples": arr(res.num_examples),
        "loss": arr(res.loss),
        "malicious": arr(res.malicious),
        "index": arr(res.index),
    }


def _results(payload: dict[str, Any]) -> ClientResults:
    def ten(a: np.ndarray | None) -> torch.Tensor | None:
        return None if a is None else _tensor(a)

    return ClientResults(
        {n: _tensor(a) for n, a in payload["delta"].items()},
        _tensor(payload["num_examples"]),
        _tensor(payload["loss"]),
        ten(payload["malicious"]),
        ten(payload["index"]),
    )


class Worker:
    """One actor: trains shards with the update and population it was given at start."""

    def __init__(self, shared: list, threads: int, device: str) -> None:
        set_determinism(threads, device)
        population: Population = ray.get(shared[0])
        population.store = {n: _tensor(a) for n, a in population.store.items()}
        self.population = population
        update: Update = ray.get(shared[1])
        self.update = update if device == "cpu" else on_device(update, device)
        self.task: Any = None
        self.task_key: str | None = None
        self.versions: OrderedDict[str, Params] = OrderedDict()

    def node(self) -> str:
        """The Ray node this actor runs on."""
        return ray.get_runtime_context().get_node_id()

    def _version(self, ref: ray.ObjectRef) -> Params:
        key = ref.hex()
        if key not in self.versions:
            self.versions[key] = {n: _tensor(a) for n, a in ray.get(ref).items()}
            while len(self.versions) > VERSIONS_HELD:
                self.versions.popitem(last=False)
        self.versions.move_to_end(key)
        return self.versions[key]

    def train(
        self,
        refs: list,
        jobs: list[tuple[int, int]],
        version_of: list[int],
        cfg: ClientConfig,
    ) -> dict[str, Any]:
        """The shard `cfg.shard` of a step: refs = [task, version 0, version 1, ...] (nested
        in a list so Ray passes them unresolved), version_of[i] = job i's version."""
        task_ref, version_refs = refs[0], refs[1:]
        if task_ref.hex() != self.task_key:
            self.task, self.task_key = ray.get(task_ref), task_ref.hex()
        versions = [self._version(r) for r in version_refs]  # one dict per version: shared
        starts = [versions[v] for v in version_of]
        res = self.update(self.task, self.population, jobs, starts, cfg)
        return _results_payload(res)


def _check_resources(config: BackendConfig) -> None:
    """Refuse workers the cluster can never place (they would wait forever)."""
    have = ray.cluster_resources()
    for key, per, name in (
        ("CPU", config.cpus_per_worker, "cpus_per_worker"),
        ("GPU", config.gpus_per_worker, "gpus_per_worker"),
    ):
        need = per * config.workers
        if need > have.get(key, 0.0) + 1e-9:
            raise ConfigError(
                "federated.backend.workers",
                f"{config.workers} workers x {per} {name} need {need:g} {key}s; the Ray cluster "
                f"has {have.get(key, 0.0):g}",
                f"use fewer workers or a smaller {name}, or add nodes",
            )


_REMOTE: dict[str, Any] = {}


def _remote_worker() -> Any:
    """Worker as a Ray actor class, made once per process."""
    if "worker" not in _REMOTE:
        _REMOTE["worker"] = ray.remote(Worker)
    return _REMOTE["worker"]


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor)
    except Exception as err:  # already gone with its node: nothing left to stop
        log.debug("ray.kill: %s", err)


class RayBackend:
    """A Simulator `client_update` that trains each server step's jobs on Ray actors; the
    weights are the in-process ones bit for bit (same thread count per worker)."""

    def __init__(
        self,
        update: Update,
        population: Population,
        config: BackendConfig,
        device: str = "cpu",
    ) -> None:
        if device != "cpu" and config.gpus_per_worker <= 0:
            raise ConfigError(
                "federated.backend.gpus_per_worker",
                f"train.device is {device!r} but the Ray workers get no GPU",
                'set gpus_per_worker > 0 (e.g. 0.5: two workers per GPU), or train.device = "cpu"',
            )
        connect(config)
        _check_resources(config)
        self.config = config
        self.device = device
        self.population = population
        self.shared = [ray.put(_population_payload(population)), ray.put(update)]
        self.task_ref: ray.ObjectRef | None = None
        self.task_key: tuple | None = None
        self.task_of: Any = None
        self.version_refs: dict[int, tuple[weakref.ref, ray.ObjectRef]] = {}
        self.puts = {"task": 0, "versions": 0}
        self.restarts = 0
        self.actors = [self._spawn() for _ in range(config.workers)]

    def _spawn(self) -> Any:
        c = self.config
        # max_restarts=0: recreating is ours to do, so every shard of a dead actor is resent
        options: dict[str, Any] = {"num_cpus": c.cpus_per_worker, "max_restarts": 0}
        if c.gpus_per_worker > 0:
            options["num_gpus"] = c.gpus_per_worker
        device = "cuda" if self.device != "cpu" else "cpu"  # Ray sets the visible GPU
        return _remote_worker().options(**options).remote(self.shared, c.threads, device)

    def nodes(self) -> list[str]:
        """The Ray node of each actor (for tests and logs)."""
        return ray.get([a.node.remote() for a in self.actors])

    def close(self) -> None:
        """Stop the actors (the object store frees what they held)."""
        for a in self.actors:
            _kill(a)
        self.actors = []

    # -- the client update ---------------------------------------------------------------

    def __call__(
        self,
        task: Any,
        population: Population,
        jobs: list[tuple[int, int]],
        starts: list[Params],
        cfg: ClientConfig,
    ) -> ClientResults:
        if population is not self.population:
            raise FedvoxError("a RayBackend trains the population it was built with only")
        if not self.actors:
            raise FedvoxError("this RayBackend was closed")
        refs, version_of = self._version_refs(starts)
        refs.insert(0, self._task_ref(task))
        calls = [
            (refs, jobs, version_of, replace(cfg, shard=s))
            for s in cut(len(jobs), self.config.shard_size)
        ]
        return assemble(self._dispatch(calls), len(jobs))

    def _task_ref(self, task: Any) -> ray.ObjectRef:
        """The task in the object store, put again when its plain settings changed (the
        margin schedule sets the AAM margin between server steps)."""
        key = task_settings(task)
        if self.task_ref is None or task is not self.task_of or key != self.task_key:
            self.task_ref, self.task_of, self.task_key = ray.put(task), task, key
            self.puts["task"] += 1
        return self.task_ref

    def _version_refs(self, starts: Sequence[Params]) -> tuple[list, list[int]]:
        """One object-store entry per start version (by identity, checked with a weak
        reference so a reused id is never mistaken); dead versions are dropped."""
        for key in [k for k, (alive, _) in self.version_refs.items() if alive() is None]:
            del self.version_refs[key]
        refs: list = []
        slot: dict[int, int] = {}
        version_of = []
        for st in starts:
            key = id(st)
            if key not in slot:
                first = next(iter(st.values()))
                hit = self.version_refs.get(key)
                if hit is None or hit[0]() is not first:
                    hit = (weakref.ref(first), ray.put(_numpy_params(st)))
                    self.version_refs[key] = hit
                    self.puts["versions"] += 1
                slot[key] = len(refs)
                refs.append(hit[1])
            version_of.append(slot[key])
        return refs, version_of

    def _dispatch(self, calls: list[tuple]) -> list[ClientResults]:
        """Each call on a free actor, as actors free up (ray.wait); results in call order.
        A dead actor is recreated and its call queued again, up to max_restarts a step."""
        queue = deque(range(len(calls)))
        idle = deque(range(len(self.actors)))
        running: dict[ray.ObjectRef, tuple[int, int]] = {}
        results: list[ClientResults | None] = [None] * len(calls)
        restarts = 0
        while queue or running:
            while queue and idle:
                a, c = idle.popleft(), queue.popleft()
                running[self.actors[a].train.remote(*calls[c])] = (c, a)
            ready, _ = ray.wait(list(running), num_returns=1)
            for ref in ready:
                c, a = running.pop(ref)
                try:
                    results[c] = _results(ray.get(ref))
                except RayTaskError as err:  # training itself raised: the driver raises it
                    raise err.as_instanceof_cause() from None
                except DEAD as err:
                    restarts += 1
                    self.restarts += 1
                    if restarts > self.config.max_restarts:
                        raise FedvoxError(
                            f"Ray workers died {restarts} times in one server step (last: "
                            f"{type(err).__name__}: {err}). Fix: give each worker more memory "
                            "(fewer workers or a smaller federated.backend.shard_size), or "
                            "check the nodes' logs"
                        ) from err
                    log.warning(
                        "Ray worker %d died (%s): recreated, shard %d sent again",
                        a,
                        type(err).__name__,
                        c,
                    )
                    _kill(self.actors[a])
                    self.actors[a] = self._spawn()
                    queue.appendleft(c)
                idle.append(a)
        return [r for r in results if r is not None]
