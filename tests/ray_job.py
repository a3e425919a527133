"""A small federated job on Ray for the multi-node test: run as a script against the cluster
in RAY_ADDRESS, it prints the weights' digest and the nodes its actors ran on (JSON)."""

from __future__ import annotations

import hashlib
import json
import sys

import torch
from test_fl_toys import class_population, mlp_task

from fedvox.fl import ClientConfig, FedBuff, ServerSGD, Simulator, SimulatorConfig
from fedvox.fl.simulator import ClientUpdate


def job(update: ClientUpdate | None = None, population=None, steps: int = 3) -> dict:
    """FedBuff on the toy MLP task; `update` None trains in process."""
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    pop = population if population is not None else toy_population()
    sim = Simulator(
        mlp_task(d=6, h=40),
        pop,
        FedBuff(4, ServerSGD(1.0)),
        ClientConfig(batch_size=4, lr=0.2, chunk_size=2),
        SimulatorConfig(concurrency=8, seed=2),
        client_update=update,
    )
    return sim.run(max_server_steps=steps)


def toy_population():
    return class_population([6 + (c % 7) for c in range(20)], seed=1)


def digest(params: dict) -> str:
    h = hashlib.sha256()
    for n in sorted(params):
        h.update(n.encode())
        h.update(params[n].contiguous().numpy().tobytes())
    return h.hexdigest()


if __name__ == "__main__":
    from fedvox.fl.simulator import plain_client_update
    from fedvox.scale import BackendConfig
    from fedvox.scale.actors import RayBackend

    pop = toy_population()
    backend = RayBackend(
        plain_client_update, pop, BackendConfig(kind="ray", workers=2, shard_size=3)
    )
    try:
        nodes = backend.nodes()
        params = job(backend, pop)
    finally:
        backend.close()
    json.dump({"digest": digest(params), "nodes": nodes}, sys.stdout)
