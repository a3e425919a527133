"""A deployed node's side: answer the server's requests with the local-training core.

Runtime-free (fedvox.deploy.flower wraps it in a ClientApp). A node trains exactly what the
simulator trains for the same (client, trip) and start params, so a deployment can equal it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedvox.deploy.grid import QUERY, TRAIN, DeployError, Envelope, Value
from fedvox.deploy.secagg import STAGE, SecAggNode
from fedvox.fl.local import ClientConfig, Task
from fedvox.fl.population import Population
from fedvox.fl.simulator import ClientUpdate, plain_client_update
from fedvox.types import Params


@dataclass
class ClientNode:
    """What one node holds: the task, the data of its client `client` (keyed in `population`
    by that federation-wide id, so its batches are the simulator's), local-training settings."""

    task: Task
    population: Population
    client: int
    config: ClientConfig
    update: ClientUpdate = plain_client_update
    secure: SecAggNode | None = None  # secure aggregation: updates leave only masked

    def handle(self, request: Envelope) -> Envelope:
        """The reply to one request: the node's identity (QUERY), its update (TRAIN; with
        secure aggregation it is held back), or a secure-aggregation round (QUERY)."""
        if request.kind == QUERY and STAGE in request.values:
            if self.secure is None:
                raise DeployError("a secure aggregation round, but this node has no SecAggNode")
            return self.secure.handle(request)
        if request.kind == QUERY:
            n = int(self.population.num_examples(self.client))
            return self._reply(request, values={"client": self.client, "num_examples": n})
        if request.kind != TRAIN:
            raise DeployError(f"unknown request kind {request.kind!r}")
        client, trip = int(request.values["client"]), int(request.values["trip"])
        if client != self.client:  # the server's node map is stale: refuse, never train others
            raise DeployError(f"asked to train client {client}; this node holds {self.client}")
        start = dict(request.arrays)
        res = self.update(self.task, self.population, [(client, trip)], [start], self.config)
        values = {
            "client": client,
            "trip": trip,
            "num_examples": int(res.num_examples[0]),
            "loss": float(res.loss[0]),
        }
        delta = {n: d[0] for n, d in res.delta.items()}
        if request.values.get("secure"):
            if self.secure is None:
                raise DeployError("asked to hold an update for secure aggregation without one")
            # in request order; a broadcast beside the params (e.g. negatives) is not an update
            held = {n: delta[n] for n in request.arrays if n in delta}
            self.secure.hold(request.group, held)
            return self._reply(request, {}, values)
        return self._reply(request, delta, values)

    def state(self) -> tuple[dict[str, Value], Params]:
        """What must survive until the next message (secure aggregation's secrets and held
        updates); empty without secure aggregation."""
        return ({}, {}) if self.secure is None else self.secure.state()

    def restore(self, values: dict[str, Value], arrays: Params) -> None:
        """Take back what `state` returned after the previous message."""
        if self.secure is not None:
            self.secure.restore(values, arrays)

    def _reply(
        self,
        request: Envelope,
        arrays: Params | None = None,
        values: dict[str, Value] | None = None,
    ) -> Envelope:
        return Envelope(request.node, request.kind, arrays or {}, values or {}, request.group)
