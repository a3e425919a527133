"""Where client training runs: copies of the task, the data store and each start version.

Part of fedvox.fl.local: wraps a client update so it trains on a device (a GPU) while the
server — versions, aggregation, privacy, checkpoints — stays on the CPU; a Ray worker holds
its copies the same way. `task_settings` tells when a copy must follow its original.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fedvox.fl.local.config import ClientConfig, ClientResults
from fedvox.fl.population import Population
from fedvox.types import Params

# (task, population, jobs, starts, client config) -> results: the simulator's client update
Update = Callable[[Any, Population, list[tuple[int, int]], list[Params], ClientConfig], Any]
_PLAIN = (bool, int, float, str, type(None))


def task_settings(task: object) -> tuple:
    """The task's plain settings (numbers, strings, flags of it and its modules — e.g. the
    AAM margin the schedule sets between server steps), in a fixed order: a copy of the task
    trains like its original while these are equal. Parameters and buffers are not included:
    training reads the start version's values, not the module's."""
    out: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def walk(obj: object, path: str) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        items = vars(obj).items() if hasattr(obj, "__dict__") else ()
        for name, value in sorted(items, key=lambda kv: kv[0]):
            if name in ("_parameters", "_buffers", "training") or name.endswith("hooks"):
                continue
            if name == "_modules":
                for sub, m in value.items():
                    if m is not None:
                        walk(m, f"{path}.{sub}")
            elif isinstance(value, _PLAIN):
                out.append((f"{path}.{name}", value))
            elif isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value):
                out.append((f"{path}.{name}", value))
            elif isinstance(value, nn.Module):
                walk(value, f"{path}.{name}")

    walk(task, "task")
    return tuple(out)


def move_population(population: Population, device: torch.device) -> Population:
    """A shallow copy of `population` whose store lives on `device` (index arrays shared)."""
    moved = copy.copy(population)
    moved.store = {n: t.to(device) for n, t in population.store.items()}
    return moved


def move_task(task: object, device: torch.device) -> object:
    """A deep copy of `task` on `device` (an nn.Module, or a task holding one as `module`)."""
    moved = copy.deepcopy(task)
    if isinstance(moved, nn.Module):
        moved.to(device)
    elif isinstance(getattr(moved, "module", None), nn.Module):
        moved.module.to(device)  # type: ignore[attr-defined]
    return moved


def results_to_cpu(res: ClientResults) -> ClientResults:
    """`res` with every tensor on the CPU (where the server aggregates)."""
    return ClientResults(
        {n: t.cpu() for n, t in res.delta.items()},
        res.num_examples.cpu(),
        res.loss.cpu(),
        None if res.malicious is None else res.malicious.cpu(),
        None if res.index is None else res.index.cpu(),
    )


def on_device(update: Update, device: torch.device | str) -> Update:
    """`update` run on `device`: the task and the population's store are copied there once
    (the task again when its task_settings change), each start version once per call (so
    clients of one version still share it), and the results come back to the CPU."""
    device = torch.device(device)
    held: dict[str, Any] = {}

    def client_update(
        task: Any,
        population: Population,
        jobs: list[tuple[int, int]],
        starts: list[Params],
        cfg: ClientConfig,
    ) -> ClientResults:
        settings = task_settings(task)
        if held.get("task_of") is not task or held.get("settings") != settings:
            held.update(task_of=task, settings=settings, task=move_task(task, device))
        if held.get("population_of") is not population:
            held.update(population_of=population, population=move_population(population, device))
        moved: dict[int, Params] = {}
        for st in starts:
            if id(st) not in moved:
                moved[id(st)] = {n: t.to(device) for n, t in st.items()}
        res = update(held["task"], held["population"], jobs, [moved[id(st)] for st in starts], cfg)
        return results_to_cpu(res)

    return client_update
