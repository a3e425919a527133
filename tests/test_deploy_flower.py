"""Deployment on Flower's Message API, without a network: a fake Grid hands each message to
the ClientApp in-process and replays the simulator's arrival order, and the ServerApp then
ends on the simulator's weights bit for bit (synchronous FedAvg, and FedBuff)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable

import pytest
import torch

if os.environ.get("FEDVOX_REQUIRE_DEPLOY"):  # `make test` installs the deploy extra: no skip
    import flwr
else:  # a checkout without the `deploy` extra
    flwr = pytest.importorskip("flwr")

from flwr.app import Context, Error, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity
from test_fl_toys import class_population, mlp_task

from fedvox.deploy import ClientNode, DeployError, DeployServer, Envelope, ServerConfig
from fedvox.deploy.flower import client_app, from_message, server_app, to_content
from fedvox.fl import (
    ClientConfig,
    DelayModel,
    FedAvg,
    FedBuff,
    ServerAdam,
    ServerSGD,
    Simulator,
    SimulatorConfig,
)
from fedvox.fl.aggregation import Aggregator
from fedvox.records import TripRecord

SIZES = [6 + (c % 7) for c in range(24)]
# the one-client path: a deployed node trains alone, so the simulator must too to match bits
CLIENT = ClientConfig(batch_size=4, lr=0.2, vectorised=False)


@pytest.fixture(autouse=True)
def _task_identity():
    """Flower's runtime names the running task before a ServerApp builds messages."""
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 7, 1
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


class FakeGrid(Grid):
    """Flower's Grid in-process: a push runs the ClientApp of the destination node at once;
    a pull returns replies ordered by `arrival[(client, trip)]` (the simulator's virtual
    times; push order when empty), one at a time when `one_by_one` (asynchronous replay).
    Trips with no arrival time never reply; an `arrival` of None means the trip drops out."""

    def __init__(self, app, clients: int, arrival=None, one_by_one: bool = False) -> None:
        self.app = app
        self.contexts = {
            100 + c: Context(7, 100 + c, {"partition-id": c}, RecordDict(), {})
            for c in range(clients)
        }
        self.arrival = arrival
        self.one_by_one = one_by_one
        self.replies: dict[str, tuple[float, Message]] = {}
        self.ids = itertools.count()

    def set_run(self, run) -> None:
        raise NotImplementedError

    @property
    def run(self):
        raise NotImplementedError

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        raise NotImplementedError

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            mid = f"m{next(self.ids)}"
            msg.metadata.__dict__["_message_id"] = mid
            when = float(len(self.replies))
            if self.arrival is not None and msg.metadata.message_type == "train":
                values = msg.content.config_records["values"]
                when = self.arrival.get((values["client"], values["trip"]), float("inf"))
            if when is None:
                reply = Message(Error(1, "dropped out"), reply_to=msg)
                when = self.arrival.get(("drop", values["client"], values["trip"]))
            else:
                try:
                    reply = self.app(msg, self.contexts[msg.metadata.dst_node_id])
                except Exception as err:  # the runtime turns a failing ClientApp into an error
                    reply = Message(Error(2, repr(err)), reply_to=msg)
            self.replies[mid] = (when, reply)
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        ready = sorted(
            (self.replies[i][0], i) for i in message_ids if self.replies[i][0] != float("inf")
        )
        if self.one_by_one:
            assert ready, "the server waits on trips the simulator never completed"
            ready = ready[:1]
        return [self.replies.pop(i)[1] for _, i in ready]

    def send_and_receive(self, messages, *, timeout=None):
        return self.pull_messages(self.push_messages(messages))


def _simulate(algorithm, steps: int, **cfg) -> tuple[dict, dict]:
    """The simulator's weights after `steps`, and each trip's arrival time (None: dropped)."""
    trips: list[TripRecord] = []
    sim = Simulator(
        mlp_task(),
        class_population(SIZES, seed=1),
        algorithm,
        CLIENT,
        SimulatorConfig(**{"concurrency": 6, "seed": 3, **cfg}),
        callback=lambda r: trips.append(r) if isinstance(r, TripRecord) else None,
    )
    params = sim.run(max_server_steps=steps)
    arrival: dict = {}
    for r in trips:
        if r.status == "dropped_out":
            arrival[(r.client, r.trip)] = None
            arrival[("drop", r.client, r.trip)] = r.time
        elif r.status in ("aggregated", "stale"):
            arrival[(r.client, r.trip)] = r.time
    return params, arrival


def _deploy(algorithm, steps: int, arrival=None, one_by_one=False, **cfg) -> DeployServer:
    """The same run through a ServerApp and a ClientApp per node, over the fake grid."""
    task, population = mlp_task(), class_population(SIZES, seed=1)
    names = list(task.init_params())
    server = DeployServer(
        task.init_params(),
        algorithm,
        Aggregator([], names),
        ServerConfig(**{"concurrency": 6, "seed": 3, **cfg}),
    )
    clients = client_app(
        lambda node_config, run_config: ClientNode(
            task, population, int(node_config["partition-id"]), CLIENT
        )
    )
    grid = FakeGrid(clients, len(SIZES), arrival, one_by_one)
    app = server_app(lambda g, run_config: server.run(g, steps))
    app(grid, Context(7, 1, {}, RecordDict(), {}))
    return server


def _equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


def test_sync_fedavg_through_the_server_app_equals_the_simulator_bit_for_bit() -> None:
    # a constant delay: every trip of a round arrives together, in the order it was sent
    want, _ = _simulate(FedAvg(ServerAdam(0.05)), 3, delay=DelayModel("constant"))
    server = _deploy(FedAvg(ServerAdam(0.05)), 3)
    assert server.step == 3 and [s.updates for s in server.history] == [6, 6, 6]
    assert _equal(server.params, want)
    init = mlp_task().init_params()
    assert not _equal(server.params, init)


def test_sync_fedavg_with_replayed_arrivals_overselection_and_dropouts_equals_the_simulator() -> (
    None
):
    cfg = {"over_selection": 0.5, "dropout": 0.2}
    want, arrival = _simulate(FedAvg(ServerAdam(0.05)), 3, **cfg)
    assert None in arrival.values()  # some trip did drop out
    server = _deploy(FedAvg(ServerAdam(0.05)), 3, arrival, over_selection=0.5)
    assert _equal(server.params, want)


def test_fedbuff_with_the_simulators_arrival_order_equals_the_simulator_bit_for_bit() -> None:
    def algo():
        return FedBuff(3, ServerSGD(1.0, momentum=0.5), max_staleness=6)

    want, arrival = _simulate(algo(), 5)
    server = _deploy(algo(), 5, arrival, one_by_one=True)
    assert server.step == 5
    assert any(tau > 0 for s in server.history for tau in s.staleness)  # versions did mix
    assert _equal(server.params, want)
    # the order is what is replayed: the 3rd and 4th arrivals swapped, the first step ends elsewhere
    first = sorted((t, k) for k, t in arrival.items() if t is not None)
    (t3, k3), (t4, k4) = first[2], first[3]
    swapped = _deploy(algo(), 5, {**arrival, k3: t4, k4: t3}, True)
    assert swapped.history[0].jobs[2] == k4
    assert not _equal(swapped.params, want)


def test_messages_carry_float32_tensors_and_scalars_exactly() -> None:
    params = mlp_task().init_params()
    env = Envelope(5, "train", params, {"client": 3, "trip": 2, "loss": 0.1}, group="4")
    msg = Message(to_content(env), env.node, env.kind, group_id=env.group)
    back = from_message(msg)
    assert (back.node, back.kind, back.values, back.group) == (5, "train", env.values, "4")
    assert _equal(back.arrays, params)


def test_a_node_refuses_to_train_another_client() -> None:
    task, population = mlp_task(), class_population(SIZES, seed=1)
    node = ClientNode(task, population, 2, CLIENT)
    with pytest.raises(DeployError, match="holds 2"):
        node.handle(Envelope(0, "train", task.init_params(), {"client": 3, "trip": 0}))
