"""Federated Reconstruction (`speakers = "local"`) deployed, without a network: the server
computes each version's public negatives (and domain centre, device clusters) once and ships
them inside the TRAIN messages; nodes enrol their speakers locally and reply with the
extractor's delta only. Over the fake Grid the run equals the simulator bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("FEDVOX_REQUIRE_DEPLOY"):  # `make test` installs the deploy extra: no skip
    import flwr  # noqa: F401
else:  # a checkout without the `deploy` extra
    pytest.importorskip("flwr")

from flwr.app import Context, RecordDict
from test_deploy_flower import FakeGrid, _equal, _task_identity  # noqa: F401
from test_speaker_recon import CHUNKS, RECON, make_task, one_speaker_population, public_store

from fedvox.deploy import ClientNode, DeployServer, ServerConfig
from fedvox.deploy.flower import ARRAYS, client_app, server_app
from fedvox.deploy.secagg import SecAggNode
from fedvox.fl import (
    ClientConfig,
    DelayModel,
    FedAvg,
    ServerAdam,
    ServerSGD,
    Simulator,
    SimulatorConfig,
)
from fedvox.fl.aggregation import Aggregator
from fedvox.privacy.secagg import SecAggConfig
from fedvox.records import TripRecord
from fedvox.tasks.speakers import (
    DOMAIN_CENTRE,
    NEGATIVES,
    PROTOTYPES,
    DomainClusters,
    make_speaker_recon_update,
    make_version_broadcast,
    received_broadcast_update,
)

N_CLIENTS, STEPS = 12, 3
CLIENT = ClientConfig(batch_size=2, lr=0.03, vectorised=False)  # a node trains alone


class RecordingGrid(FakeGrid):
    """The fake grid, keeping the array names of every TRAIN request and every reply."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.sent: list[dict[str, torch.Tensor]] = []
        self.replied: list[set[str]] = []

    def push_messages(self, messages):
        messages = list(messages)
        for m in messages:
            if m.metadata.message_type == "train":
                self.sent.append(m.content.array_records[ARRAYS].to_torch_state_dict())
        return super().push_messages(messages)

    def pull_messages(self, message_ids):
        got = list(super().pull_messages(message_ids))
        for m in got:
            if not m.has_error() and m.metadata.message_type == "train":
                self.replied.append(set(m.content.array_records[ARRAYS].keys()))
        return got


def _extras(pop, sub: str) -> dict:
    """The server's optional broadcasts: nothing, the domain centre, or device clusters."""
    panel = pop.store["x"][::CHUNKS]  # the first chunk of every device
    if sub == "centre":
        return {"centre_panel": panel}
    if sub == "clusters":
        return {"clusters": DomainClusters(panel, k=2, min_size=1)}
    return {}


def _simulate(sub: str) -> tuple[dict, int]:
    pop, public, task = one_speaker_population(N_CLIENTS), public_store(), make_task()
    trips: list[TripRecord] = []
    sim = Simulator(
        task,
        pop,
        FedAvg(ServerAdam(0.05)),
        CLIENT,
        SimulatorConfig(concurrency=6, seed=3, delay=DelayModel("constant")),
        client_update=make_speaker_recon_update(public, RECON, **_extras(pop, sub)),
        extra_bytes_down=public.broadcast_bytes(task.emb_dim),
        callback=lambda r: trips.append(r) if isinstance(r, TripRecord) else None,
    )
    return sim.run(max_server_steps=STEPS), trips[0].bytes_down


def _deploy(sub: str, algorithm=None, secure=None) -> tuple[DeployServer, RecordingGrid]:
    pop, public, task = one_speaker_population(N_CLIENTS), public_store(), make_task()
    computed: list[int] = []

    def broadcast(params):
        computed.append(server.step)
        return make_version_broadcast(task, public, **_extras(pop, sub))(params)

    server = DeployServer(
        task.init_params(),
        algorithm or FedAvg(ServerAdam(0.05)),
        Aggregator([], list(task.init_params())),
        ServerConfig(concurrency=6, seed=3),
        broadcast=broadcast,
        secure=secure,
    )
    update = received_broadcast_update(RECON)
    nodes = client_app(
        lambda node_config, run_config: ClientNode(
            task,
            pop,
            int(node_config["partition-id"]),
            CLIENT,
            update=update,
            secure=None if secure is None else SecAggNode(secure),
        )
    )
    grid = RecordingGrid(nodes, N_CLIENTS)
    server_app(lambda g, run_config: server.run(g, STEPS))(
        grid, Context(7, 1, {}, RecordDict(), {})
    )
    assert computed == list(range(STEPS))  # once per model version, not per request
    return server, grid


@pytest.mark.parametrize("sub", ["plain", "centre", "clusters"])
def test_deployed_federated_reconstruction_equals_the_simulator_bit_for_bit(sub: str) -> None:
    want, _ = _simulate(sub)
    server, grid = _deploy(sub)
    assert server.step == STEPS and [s.updates for s in server.history] == [6] * STEPS
    assert _equal(server.params, want)
    assert not _equal(server.params, make_task().init_params())
    names = set(make_task().init_params())
    # every request carried the version's negatives (and centre) beside the params ...
    extra = {NEGATIVES} | ({DOMAIN_CENTRE} if sub == "centre" else set())
    assert all(set(s) == names | extra for s in grid.sent)
    rows = public_store().n_speakers + (2 if sub == "clusters" else 0)
    assert all(s[NEGATIVES].shape == (rows, 16) for s in grid.sent)
    # ... and every reply only the extractor's delta: no prototype, no negatives
    assert len(grid.replied) == 6 * STEPS
    assert all(r == names and PROTOTYPES not in r for r in grid.replied)


def test_the_broadcast_is_counted_in_bytes_down_and_refused_when_missing() -> None:
    from fedvox.errors import ConfigError

    task, public = make_task(), public_store()
    _, down = _simulate("plain")
    params = sum(4 * t.numel() for t in task.init_params().values())
    assert down == params + 4 * public.n_speakers * task.emb_dim
    pop = one_speaker_population(N_CLIENTS)
    update = received_broadcast_update(RECON)
    with pytest.raises(ConfigError, match="public_negatives"):
        update(task, pop, [(0, 0)], [task.init_params()], CLIENT)


def test_secure_aggregation_of_local_speaker_updates_matches_the_plaintext_sum() -> None:
    def algo():
        return FedAvg(ServerSGD(1.0), weighting="uniform")

    plain, _ = _deploy("plain", algo())
    secure, grid = _deploy("plain", algo(), SecAggConfig(threshold=2 / 3))
    assert [s.updates for s in secure.history] == [6] * STEPS
    assert all(r == set() for r in grid.replied)  # the nodes held their updates back
    for n, t in plain.params.items():
        assert torch.allclose(secure.params[n], t, atol=1e-5), n
