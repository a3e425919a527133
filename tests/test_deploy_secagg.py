"""Secure aggregation over Flower messages, without a network: the fake Grid of
test_deploy_flower hands each round's QUERY to the ClientApp in-process and can make a node
stop answering at any round. Keys and shares cross as ConfigRecord bytes, masked inputs as
an ArrayRecord; the ServerApp never receives an update."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("FEDVOX_REQUIRE_DEPLOY"):  # `make test` installs the deploy extra: no skip
    import flwr  # noqa: F401
else:  # a checkout without the `deploy` extra
    pytest.importorskip("flwr")

from flwr.app import Context, Error, Message, RecordDict
from test_deploy_flower import CLIENT, SIZES, FakeGrid, _task_identity  # noqa: F401
from test_fl_toys import class_population, mlp_task

from fedvox.deploy import ClientNode, DeployServer, ServerConfig
from fedvox.deploy.flower import client_app, server_app
from fedvox.deploy.secagg import ADVERTISE, MASKED, SHARE, SecAggNode
from fedvox.fl import FedAvg, ServerSGD
from fedvox.fl.aggregation import Aggregator
from fedvox.privacy.secagg import SecAggConfig

SECAGG = SecAggConfig(threshold=2 / 3, on_abort="skip")


class DroppingGrid(FakeGrid):
    """The fake grid, where node `n` stops answering at round `stage` of server step `group`
    for each (n, stage, group) in `drops` (a TRAIN drop uses the stage "train"). It keeps
    every reply the ServerApp received."""

    def __init__(self, app, clients: int, drops: set[tuple[int, str, str]]) -> None:
        super().__init__(app, clients)
        self.drops = drops
        self.seen: list[Message] = []
        self.fresh = None  # a ClientApp factory: a new app (no memory) for every message

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            values = msg.content.config_records["values"]
            stage = values.get("secagg", msg.metadata.message_type)
            key = (msg.metadata.dst_node_id, str(stage), msg.metadata.group_id)
            if key in self.drops:
                mid = f"m{next(self.ids)}"
                msg.metadata.__dict__["_message_id"] = mid
                self.replies[mid] = (
                    float(len(self.replies)),
                    Message(Error(1, "gone"), reply_to=msg),
                )
                ids.append(mid)
            else:
                if self.fresh is not None:  # as Flower's runtime: a new process per message
                    self.app = self.fresh()
                ids.extend(super().push_messages([msg]))
        return ids

    def pull_messages(self, message_ids):
        got = list(super().pull_messages(message_ids))
        self.seen.extend(got)
        return got


def _run(
    steps: int, drops: set, secure: SecAggConfig | None, fresh: bool = False
) -> tuple[DeployServer, DroppingGrid]:
    task, population = mlp_task(), class_population(SIZES, seed=1)
    server = DeployServer(
        task.init_params(),
        FedAvg(ServerSGD(1.0), weighting="uniform"),
        Aggregator([], list(task.init_params())),
        ServerConfig(concurrency=6, seed=3),
        secure=secure,
    )

    def load(node_config, run_config):
        holder = None if secure is None else SecAggNode(secure)
        c = int(node_config["partition-id"])
        return ClientNode(task, population, c, CLIENT, secure=holder)

    grid = DroppingGrid(client_app(load), len(SIZES), drops)
    if fresh:  # the node's secrets and held update must survive in Context.state
        grid.fresh = lambda: client_app(load)
    app = server_app(lambda g, run_config: server.run(g, steps))
    app(grid, Context(7, 1, {}, RecordDict(), {}))
    return server, grid


def _first_cohort() -> list[tuple[int, int]]:
    server, _ = _run(1, set(), None)
    return server.history[0].jobs


@pytest.mark.parametrize("fresh", [False, True], ids=["one-process", "process-per-message"])
def test_secure_sum_over_messages_equals_the_plaintext_sum_with_dropouts(fresh: bool) -> None:
    cohort = [c for c, _ in _first_cohort()]
    gone, late = 100 + cohort[1], 100 + cohort[4]  # node id = 100 + client
    # one node never sends its masked input, one never answers the key advertisement
    secure, grid = _run(1, {(gone, MASKED, "1"), (late, ADVERTISE, "1")}, SECAGG, fresh)
    # the same survivors in plaintext: those two trips dropped out at training instead
    plain, _ = _run(1, {(gone, "train", "1"), (late, "train", "1")}, None)
    assert secure.history[0].updates == 4 == plain.history[0].updates
    assert secure.history[0].agg["secagg_survivors"] == 4.0
    init = mlp_task().init_params()
    for name, want in plain.params.items():
        got = secure.params[name]
        assert not torch.equal(want, init[name])  # the step moved the model
        # within the quantisation of 2^-22 per coordinate (and float32 rounding)
        assert torch.allclose(got, want, rtol=0, atol=1e-5), name
    # the server never held a plaintext update: TRAIN replies carry only scalars, and the
    # only arrays it received are the masked ring vectors (bytes)
    for reply in grid.seen:
        arrays = reply.content.array_records.get("arrays") if not reply.has_error() else None
        if reply.metadata.message_type == "train" and not reply.has_error():
            assert arrays is None or len(arrays) == 0
        elif arrays is not None and len(arrays):
            assert list(arrays) == ["masked"]
            assert arrays["masked"].dtype == "uint8"


def test_below_the_threshold_the_step_is_skipped_logged_and_the_run_goes_on() -> None:
    cohort = [c for c, _ in _first_cohort()]
    # step 1: three of six nodes stop after advertising keys, t = 4 of 6 cannot be met
    drops = {(100 + c, SHARE, "1") for c in cohort[:3]}
    server, _ = _run(2, drops, SECAGG)
    first, second = server.history
    assert first.updates == 0 and first.agg.get("secagg_aborted") == 1.0
    assert server.rounds is not None and "below the threshold" in server.rounds.log[0].aborted
    assert second.updates == 6
    init = mlp_task().init_params()
    assert any(not torch.equal(server.params[n], init[n]) for n in init)  # step 2 applied
