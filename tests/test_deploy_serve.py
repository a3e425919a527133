"""A deployed run's wiring to the experiment config, without a network: `fedvox deploy
prepare`'s run folder, shards and app folder, then fedvox's own ServerApp and ClientApp
(experiment.flower_app) over the fake Grid. The run folder ends like `fedvox train`'s."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest

if os.environ.get("FEDVOX_REQUIRE_DEPLOY"):  # `make test` installs the deploy extra: no skip
    import flwr  # noqa: F401
else:  # a checkout without the `deploy` extra
    pytest.importorskip("flwr")

from flwr.app import Context, RecordDict
from test_deploy_flower import FakeGrid, _task_identity  # noqa: F401
from tiny_corpus import TINY_DATA, TINY_EVAL
from typer.testing import CliRunner

from fedvox.cli import app
from fedvox.deploy import DeployError
from fedvox.experiment.deployment import ARRIVALS_FILE, STATUS_FILE, app_folder, shards_of
from fedvox.experiment.runfolder import RunFolder
from fedvox.records import EvalRecord, ServerStepRecord, TripRecord, read_run_log

CFG = (
    'name = "served"\nseed = 0\n'
    + TINY_DATA
    + "[train]\nthreads = 1\n"
    + TINY_EVAL
    + """[federated]
algorithm = "fedbuff"
concurrency = 3
buffer_size = 2
server_steps = 2
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


class NodeGrid(FakeGrid):
    """The fake grid with SuperNodes as `deploy prepare` describes them: node i holds shard i
    and sees the run's config."""

    def __init__(self, client, shards: list[Path], run_config: dict, run_id: int = 7) -> None:
        super().__init__(client, len(shards))
        self.contexts = {
            100 + i: Context(run_id, 100 + i, {"shard": str(p)}, RecordDict(), run_config)
            for i, p in enumerate(shards)
        }


def test_a_prepared_run_served_over_the_fake_grid_writes_a_run_folder(tmp_path: Path) -> None:
    from fedvox.experiment.flower_app import client, server

    config = tmp_path / "served.toml"
    config.write_text(CFG.format(cache=tmp_path / "cache"))
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["deploy", "prepare", str(config), "--out", str(out)])
    assert res.exit_code == 0, res.output
    run = RunFolder.open(out)
    shards = shards_of(run)
    assert len(shards) == 3
    pyproject = tomllib.loads((app_folder(run) / "pyproject.toml").read_text())
    run_config = pyproject["tool"]["flwr"]["app"]["config"]
    assert pyproject["tool"]["flwr"]["app"]["components"]["serverapp"].endswith(":server")
    grid = NodeGrid(client, shards, run_config)
    server(grid, Context(7, 1, {}, RecordDict(), run_config))
    status = json.loads((out / STATUS_FILE).read_text())
    assert status["status"] == "completed" and status["steps"] == 2
    steps = read_run_log(run.metrics_path, (ServerStepRecord,))
    assert [s.step for s in steps] == [1, 2] and all(s.updates == 2 for s in steps)
    assert [e.step for e in read_run_log(run.metrics_path, (EvalRecord,))] == [2]
    trips = read_run_log(out / "trips.jsonl", (TripRecord,))
    assert sum(t.status == "aggregated" for t in trips) == 4
    arrivals = [json.loads(line) for line in (out / ARRIVALS_FILE).open()]
    assert [a["arrival"] for a in arrivals if a["status"] == "aggregated"] == [1, 2, 3, 4]
    for name in ("model.pt", "report.md", "metrics.json", "partition.json"):
        assert (out / name).is_file(), name
    assert run.manifest()["deployed"]["steps"] == 2
    # a shard of another partition is refused by the node, naming the fix
    other = dict(run_config, **{"partition-sha256": "0" * 64})
    grid = NodeGrid(client, shards, other, run_id=8)
    with pytest.raises(DeployError, match="another partition"):
        server(grid, Context(8, 1, {}, RecordDict(), other))
    assert "another partition" in json.loads((out / STATUS_FILE).read_text())["error"]
