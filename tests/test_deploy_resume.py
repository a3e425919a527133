"""Checkpoint and resume of a deployed run, without a network (the fake Grid of
test_deploy_flower): a server stopped after a checkpoint and resumed ends on the weights, the
trips and the logs of an uninterrupted run, bit for bit; bad folders are refused by name."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import tomllib
from pathlib import Path

import pytest
import torch

if os.environ.get("FEDVOX_REQUIRE_DEPLOY"):  # `make test` installs the deploy extra: no skip
    import flwr  # noqa: F401
else:  # a checkout without the `deploy` extra
    pytest.importorskip("flwr")

from flwr.app import Context, RecordDict
from test_deploy_flower import CLIENT, SIZES, FakeGrid, _equal, _simulate, _task_identity  # noqa: F401
from test_deploy_serve import NodeGrid
from test_fl_toys import class_population, mlp_task
from tiny_corpus import TINY_DATA, TINY_EVAL
from typer.testing import CliRunner

from fedvox.cli import app
from fedvox.deploy import ClientNode, DeployServer, ServerConfig
from fedvox.deploy.flower import client_app, server_app
from fedvox.errors import ConfigError, DataError
from fedvox.experiment.deployment import (
    ARRIVALS_FILE,
    CONFIG_KEY,
    STATUS_FILE,
    app_folder,
    begin_resume,
    load_resume_state,
    shards_of,
)
from fedvox.experiment.runfolder import RunFolder
from fedvox.fl import FedAvg, FedBuff, ServerAdam, ServerSGD
from fedvox.fl.aggregation import Aggregator
from fedvox.records import EvalRecord, ServerStepRecord, TripRecord, read_run_log


class Crash(RuntimeError):
    """The server process dying (raised from a hook once a checkpoint exists)."""


def _server(algorithm, aggregator: Aggregator | None = None, **cfg) -> DeployServer:
    task = mlp_task()
    return DeployServer(
        task.init_params(),
        algorithm,
        aggregator or Aggregator([], list(task.init_params())),
        ServerConfig(**{"concurrency": 6, "seed": 3, **cfg}),
    )


def _run(server: DeployServer, steps: int, arrival, one_by_one: bool) -> None:
    """`server` to `steps` through a ServerApp, a fresh ClientApp per node, the fake grid."""
    task, population = mlp_task(), class_population(SIZES, seed=1)
    clients = client_app(
        lambda node_config, run_config: ClientNode(
            task, population, int(node_config["partition-id"]), CLIENT
        )
    )
    grid = FakeGrid(clients, len(SIZES), arrival, one_by_one)
    app = server_app(lambda g, run_config: server.run(g, steps))
    app(grid, Context(7, 1, {}, RecordDict(), {}))


def _stopped_and_resumed(
    algo, steps: int, save_at: int, crash_at: int, arrival, one_by_one, agg=lambda: None, **cfg
):
    """A server checkpointed at step `save_at` (state_dict through torch.save), killed at
    `crash_at`, then a new server (new algorithm and aggregator `agg()`) resumed from the bytes."""
    saved: dict[str, bytes] = {}

    def hook(server: DeployServer) -> None:
        if server.step == save_at:
            buf = io.BytesIO()
            torch.save(server.state_dict(), buf)
            saved["ckpt"] = buf.getvalue()
        if server.step == crash_at:
            raise Crash(f"killed after step {crash_at}")

    first = _server(algo(), agg(), **cfg)
    first.on_checkpoint = hook
    with pytest.raises(Crash):
        _run(first, steps, arrival, one_by_one)
    state = torch.load(io.BytesIO(saved["ckpt"]), weights_only=False)
    resumed = _server(algo(), agg(), **cfg)
    resumed.load_state_dict(state)
    _run(resumed, steps, arrival, one_by_one)
    return state, resumed


def _trips(server: DeployServer) -> list[dict]:
    """The trip log without wall-clock times."""
    return [
        {k: v for k, v in dataclasses.asdict(t).items() if k not in ("sent", "ended")}
        for t in server.trip_log
    ]


def _steps(server: DeployServer) -> list[tuple]:
    return [(s.step, s.jobs, s.staleness, s.updates, s.loss) for s in server.history]


def test_sync_fedavg_stopped_after_a_checkpoint_resumes_to_the_simulators_bits() -> None:
    cfg = {"over_selection": 0.5, "dropout": 0.2}
    want, arrival = _simulate(FedAvg(ServerAdam(0.05)), 5, **cfg)
    assert None in arrival.values()  # some trip did drop out
    whole = _server(FedAvg(ServerAdam(0.05)), over_selection=0.5)
    _run(whole, 5, arrival, False)
    assert _equal(whole.params, want)
    state, resumed = _stopped_and_resumed(
        lambda: FedAvg(ServerAdam(0.05)), 5, 2, 4, arrival, False, over_selection=0.5
    )
    assert state["step"] == 2 and state["in_flight"] == [] and state["pending"] == []
    assert state["algorithm"]["server_opt"]["step"] == 2  # Adam's moments travel too
    assert resumed.step == 5 and _equal(resumed.params, want)
    assert _trips(resumed) == _trips(whole) and _steps(resumed) == _steps(whole)


def test_dp_on_the_server_resumes_with_its_noise_stream_and_adaptive_clip() -> None:
    from fedvox.privacy.dp import AdaptiveClip, GaussianNoise

    def agg() -> Aggregator:
        clip = AdaptiveClip(0.05, 0.5, count_noise_std=1.0, seed=2)
        return Aggregator([clip], noise=[GaussianNoise(0.5, clip, seed=9)])

    whole = _server(FedAvg(ServerSGD(1.0), weighting="uniform"), agg())
    _run(whole, 4, None, False)
    state, resumed = _stopped_and_resumed(
        lambda: FedAvg(ServerSGD(1.0), weighting="uniform"), 4, 2, 3, None, False, agg=agg
    )
    assert state["aggregator"]["stages"]  # the clip's and the noise's state travel
    assert _equal(resumed.params, whole.params)
    clips = [s.agg["clip_norm"] for s in resumed.history]
    assert clips == [s.agg["clip_norm"] for s in whole.history] and len(set(clips)) > 1


def test_fedbuff_resumed_with_its_trips_in_flight_reissued_equals_the_simulator() -> None:
    def algo():
        return FedBuff(3, ServerSGD(1.0, momentum=0.5), max_staleness=6)

    want, arrival = _simulate(algo(), 6)
    whole = _server(algo())
    _run(whole, 6, arrival, True)
    assert _equal(whole.params, want)
    state, resumed = _stopped_and_resumed(algo, 6, 2, 4, arrival, True)
    # at the checkpoint C - 1 trips were still training (the step's slot not yet refilled),
    # each from the version it started on; the resumed server sends them again
    assert len(state["in_flight"]) == 5 and state["pending"] == []
    assert {t["version"] for t in state["in_flight"]} == set(state["versions"])
    assert any(t["version"] < 2 for t in state["in_flight"])  # older versions kept
    assert resumed.step == 6 and _equal(resumed.params, want)
    assert any(tau > 0 for s in resumed.history for tau in s.staleness)
    assert _trips(resumed) == _trips(whole) and _steps(resumed) == _steps(whole)


# -- the ServerApp's body over a prepared run folder ------------------------------------

CFG = (
    'name = "resumed"\nseed = 0\n'
    + TINY_DATA
    + "[train]\nthreads = 1\n"
    + TINY_EVAL
    + """[federated]
algorithm = "fedavg"
server_optimizer = "adam"
server_lr = 0.01
concurrency = 3
server_steps = 4
eval_every = 2
checkpoint_every = 2
chunk_frames = 60
local_batch_size = 4
local_lr = 0.02
[federated.partition]
scheme = "dirichlet"
n_clients = 3
"""
)


class CrashGrid(NodeGrid):
    """NodeGrid whose SuperLink goes away when the server pushes more than `trains` TRAIN
    requests (None: never)."""

    def __init__(self, client, shards, run_config, run_id, trains: int | None = None) -> None:
        super().__init__(client, shards, run_config, run_id)
        self.trains = trains

    def push_messages(self, messages):
        messages = list(messages)
        if self.trains is not None:
            self.trains -= sum(m.metadata.message_type == "train" for m in messages)
            if self.trains < 0:
                raise Crash("the SuperLink went away")
        return super().push_messages(messages)


def _prepare(tmp: Path, name: str, text: str = CFG) -> tuple[RunFolder, dict]:
    config = tmp / f"{name}.toml"
    config.write_text(text.format(cache=tmp / "cache"))
    res = CliRunner().invoke(app, ["deploy", "prepare", str(config), "--out", str(tmp / name)])
    assert res.exit_code == 0, res.output
    run = RunFolder.open(tmp / name)
    return run, _app_config(run)


def _app_config(run: RunFolder) -> dict:
    """The run config `flwr run` submits (the app folder's)."""
    pyproject = tomllib.loads((app_folder(run) / "pyproject.toml").read_text())
    return pyproject["tool"]["flwr"]["app"]["config"]


class Order(dict):
    """Replies in a fixed order of (client, trip), whatever was in flight when (FakeGrid's
    `arrival`, replayed one at a time)."""

    def get(self, key, default=None):
        client, trip = key
        return trip + 0.37 * ((2 * client + trip) % 3)


def _serve(
    run: RunFolder, run_config: dict, run_id: int, trains: int | None = None, order=None
) -> None:
    from fedvox.experiment.flower_app import client, server

    grid = CrashGrid(client, shards_of(run), run_config, run_id, trains)
    grid.arrival, grid.one_by_one = order, order is not None
    server(grid, Context(run_id, 1, {}, RecordDict(), run_config))


def _logs(run: RunFolder) -> dict[str, list]:
    """Every log line of a run without its wall-clock times."""
    clock = {"virtual_time_s", "time", "start_time", "sent", "ended"}

    def strip(d: dict) -> dict:
        return {k: v for k, v in d.items() if k not in clock}

    return {
        "steps": [strip(vars(r)) for r in read_run_log(run.metrics_path, (ServerStepRecord,))],
        "evals": [strip(vars(r)) for r in read_run_log(run.metrics_path, (EvalRecord,))],
        "trips": [strip(vars(r)) for r in read_run_log(run.path / "trips.jsonl", (TripRecord,))],
        "arrivals": [strip(json.loads(x)) for x in (run.path / ARRIVALS_FILE).open()],
    }


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    """One uninterrupted deployed run, and one killed in round 4 (after step 2's checkpoint,
    step 3 logged); the tests resume copies of it."""
    from flwr.supercore.task_identity import TaskIdentity

    tmp = tmp_path_factory.mktemp("resume")
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 7, 1  # as the runtime
    try:
        whole, run_config = _prepare(tmp, "whole")
        _serve(whole, run_config, 31)
        stopped, run_config = _prepare(tmp, "stopped")
        with pytest.raises(Crash):
            _serve(stopped, run_config, 32, trains=9)  # 3 rounds of 3 trips, then the crash
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved
    assert "Crash" in json.loads((stopped.path / STATUS_FILE).read_text())["error"]
    assert [s.step for s in read_run_log(stopped.metrics_path, (ServerStepRecord,))] == [1, 2, 3]
    assert sorted(p.name for p in stopped.checkpoint_dir.glob("*.pt")) == ["ckpt-000000002.pt"]
    return {"whole": whole, "stopped": stopped, "tmp": tmp}


def test_a_deployed_fedavg_run_killed_after_a_checkpoint_resumes_to_the_same_bits(served) -> None:
    whole, stopped = served["whole"], served["stopped"]
    resumed = tmp_copy(stopped, served["tmp"] / "resumed")
    assert begin_resume(resumed) == 2  # notes the crash, clears the status
    assert not (resumed.path / STATUS_FILE).exists()
    assert resumed.manifest()["deploy_resumes"][0]["before"]["status"] == "failed"
    # two rounds of 3 trips are left: a server that started over would be killed in round 3
    _serve(resumed, dict(_app_config(resumed), resume=True), 33, trains=6)
    status = json.loads((resumed.path / STATUS_FILE).read_text())
    assert status == {**status, "status": "completed", "steps": 4}
    assert resumed.manifest()["deployed"]["resumed_from_step"] == 2
    summary = [json.loads((r.path / "metrics.json").read_text()) for r in (whole, resumed)]
    assert summary[0]["weights_sha256"] == summary[1]["weights_sha256"]
    assert summary[0]["backends"] == summary[1]["backends"]
    got, want = _logs(resumed), _logs(whole)
    assert [s["step"] for s in got["steps"]] == [1, 2, 3, 4]  # step 3 not logged twice
    assert got == want
    assert sorted(p.name for p in resumed.checkpoint_dir.glob("*.pt")) == [
        "ckpt-000000002.pt",
        "ckpt-000000004.pt",
    ]
    a, b = (
        torch.load(r.checkpoint_dir / "ckpt-000000004.pt", weights_only=False)
        for r in (whole, resumed)
    )
    assert _equal(a["deployed"]["params"], b["deployed"]["params"])
    assert a["log_lines"] == b["log_lines"] and a["counts"] == b["counts"]


def tmp_copy(run: RunFolder, to: Path) -> RunFolder:
    """A copy of a run folder (the app folder's run-dir pointing at the copy)."""
    import shutil

    shutil.copytree(run.path, to)
    app_toml = app_folder(RunFolder(to)) / "pyproject.toml"
    app_toml.write_text(app_toml.read_text().replace(str(run.path.resolve()), str(to.resolve())))
    return RunFolder(to)


def _resume_cli(*args: str):
    """`fedvox deploy resume ARGS`; the error it raised (None if it succeeded)."""
    res = CliRunner().invoke(app, ["deploy", "resume", *args])
    return res.exception, res.output


def test_resuming_a_folder_that_cannot_resume_names_the_file_or_field(served, tmp_path) -> None:
    stopped, whole = served["stopped"], served["whole"]
    # a `fedvox train` folder: no Flower app folder; and `fedvox resume` of a deployed one
    plain = RunFolder.create(tmp_path / "plain", stopped.config())
    err, _ = _resume_cli(str(plain.path))
    assert isinstance(err, DataError) and "pyproject.toml" in str(err)
    assert "not a deployed run" in str(err) and "fedvox resume" in str(err)
    res = CliRunner().invoke(app, ["resume", str(stopped.path)])
    assert "fedvox deploy resume" in str(res.exception)
    # no checkpoint (a torn one does not count)
    none = tmp_copy(stopped, tmp_path / "none")
    (none.checkpoint_dir / "ckpt-000000002.pt").write_bytes(b"torn")
    with pytest.warns(UserWarning, match="torn or corrupt"):
        err, _ = _resume_cli("--command-only", str(none.path))
    assert isinstance(err, DataError) and str(none.checkpoint_dir) in str(err)
    assert "checkpoint_every = 2" in str(err) and "--overwrite" in str(err)
    # the config changed since the checkpoint: config.toml, or what the nodes would get
    edited = tmp_copy(stopped, tmp_path / "edited")
    edited.config_path.write_text(edited.config_path.read_text().replace("0.02", "0.03"))
    err, _ = _resume_cli("--command-only", str(edited.path))
    assert isinstance(err, ConfigError) and err.field == "federated.local_lr"
    assert err.source == str(edited.config_path) and "0.03" in str(err) and "0.02" in str(err)
    nodes = tmp_copy(stopped, tmp_path / "nodes")
    app_toml = app_folder(nodes) / "pyproject.toml"
    app_toml.write_text(app_toml.read_text().replace("local_lr = 0.02", "local_lr = 0.03"))
    err, _ = _resume_cli("--command-only", str(nodes.path))
    assert isinstance(err, ConfigError) and err.field == "federated.local_lr"
    assert err.source == str(app_toml)
    # the ServerApp checks the run config it is handed too, before preparing any data
    run_config = dict(_app_config(nodes), resume=True)
    with pytest.raises(ConfigError, match="local_lr"):
        _serve(nodes, run_config, 34)
    assert f"run-config.{CONFIG_KEY}" in json.loads((nodes.path / STATUS_FILE).read_text())["error"]
    # a completed run has nothing to resume
    err, _ = _resume_cli(str(whole.path))
    assert "nothing to resume" in str(err) and "report.md" in str(err)
    # nothing above touched the run it refused
    assert not (stopped.path / "model.pt").exists()
    assert load_resume_state(stopped)[0] == 2


def test_resume_command_only_prints_the_flwr_run_with_resume_true(served, tmp_path) -> None:
    copy = tmp_copy(served["stopped"], tmp_path / "copy")
    err, output = _resume_cli("--command-only", str(copy.path))
    assert err is None, output
    assert "from its checkpoint of server step 2" in output
    assert "flwr run" in output and "--run-config resume=true" in output
    assert not (copy.path / STATUS_FILE).exists()  # cleared, so a waiting `local` sees the new one


def test_a_secure_aggregation_step_in_progress_is_abandoned_and_redone() -> None:
    from test_deploy_secagg import SECAGG, DroppingGrid

    from fedvox.deploy.secagg import MASKED, SecAggNode

    task, population = mlp_task(), class_population(SIZES, seed=1)

    class CrashingGrid(DroppingGrid):
        """Dies when step 3's masked inputs are requested (keys and shares already sent)."""

        def push_messages(self, messages):
            messages = list(messages)
            for m in messages:
                values = m.content.config_records["values"]
                if (values.get("secagg"), m.metadata.group_id) == (MASKED, "3") and self.crash:
                    raise Crash("the server died mid-protocol")
            return super().push_messages(messages)

    def run(server: DeployServer, crash: bool) -> None:
        def load(node_config, run_config):  # fresh secrets from the OS for every run
            c = int(node_config["partition-id"])
            return ClientNode(task, population, c, CLIENT, secure=SecAggNode(SECAGG))

        grid = CrashingGrid(client_app(load), len(SIZES), set())
        grid.crash = crash
        app = server_app(lambda g, run_config: server.run(g, 4))
        app(grid, Context(7, 1, {}, RecordDict(), {}))

    def make() -> DeployServer:
        s = _server(FedAvg(ServerSGD(1.0), weighting="uniform"))
        return DeployServer(s.params, s.algorithm, s.aggregator, s.config, secure=SECAGG)

    whole = make()
    run(whole, crash=False)
    saved = {}
    first = make()
    first.on_checkpoint = lambda s: saved.update(state=s.state_dict()) if s.step == 2 else None
    with pytest.raises(Crash):
        run(first, crash=True)
    assert first.step == 2 and len(first.rounds.log) == 3  # step 3's protocol had begun
    resumed = make()
    resumed.load_state_dict(saved["state"])
    assert resumed.rounds.sums.calls == 2  # the protocol's next session is step 3's again
    run(resumed, crash=False)
    assert resumed.step == 4 and [s.updates for s in resumed.history] == [6, 6, 6, 6]
    # masks cancel: the same sums of the same updates, up to the quantisation (2^-22), whose
    # stochastic rounding a node draws from the OS (so not even two whole runs share bits)
    init = mlp_task().init_params()
    for name, want in whole.params.items():
        assert not torch.equal(want, init[name])
        assert torch.allclose(resumed.params[name], want, rtol=0, atol=1e-5), name


LOCAL = 'speakers = "local"\n[federated.reconstruction]\npublic_speakers = 4\n'


@pytest.mark.parametrize("local", [False, True], ids=["global-head", "local-speakers"])
def test_a_deployed_fedbuff_run_resumes_with_its_trips_in_flight_sent_again(
    tmp_path, local
) -> None:
    # with local speakers a re-sent trip carries the public negatives of its own (older)
    # version, not the current one's: else the resumed run would train other updates
    text = CFG.replace('algorithm = "fedavg"', 'algorithm = "fedbuff"\nbuffer_size = 2')
    base = 100 if local else 0  # own run ids: the ClientApp keeps one node per run
    if local:
        text = text.replace("[federated.partition]", LOCAL + "[federated.partition]")
    whole, run_config = _prepare(tmp_path, "whole", text)
    whole.save_checkpoint(9, {"deployed": {}})  # of an earlier attempt in this folder
    _serve(whole, run_config, 41 + base, order=Order())
    assert not (whole.checkpoint_dir / "ckpt-000000009.pt").exists()  # a fresh run drops it
    stopped, run_config = _prepare(tmp_path, "stopped", text)
    with pytest.raises(Crash):  # 3 trips, then one per arrival: killed at the 7th arrival
        _serve(stopped, run_config, 42 + base, trains=9, order=Order())
    assert [s.step for s in read_run_log(stopped.metrics_path, (ServerStepRecord,))] == [1, 2, 3]
    ckpt = load_resume_state(stopped)[1]
    in_flight = ckpt["deployed"]["in_flight"]
    assert len(in_flight) == 2 and ckpt["counts"]["trips"] == 4  # the step's slot not refilled
    # every trip started is counted once: re-sent trips keep their number (and bytes down)
    begin_resume(stopped)
    _serve(stopped, dict(run_config, resume=True), 43 + base, order=Order())
    got, want = _logs(stopped), _logs(whole)
    assert [s["step"] for s in got["steps"]] == [1, 2, 3, 4]
    assert any(tau > 0 for s in got["steps"] for tau in s["staleness"])
    assert got == want
    summary = [json.loads((r.path / "metrics.json").read_text()) for r in (whole, stopped)]
    assert summary[0]["weights_sha256"] == summary[1]["weights_sha256"]
    resent = {(t["client"], t["trip"]) for t in in_flight}
    arrivals = [(a["client"], a["trip"]) for a in got["arrivals"]]
    assert resent <= set(arrivals) and len(arrivals) == len(set(arrivals))  # each trip ends once
