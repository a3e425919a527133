"""Deployed Federated Reconstruction through the experiment wiring, without a network: nodes
holding shards of the prepared corpus, and nodes on their own Kaldi dirs (features extracted
on the node, speakers local, the server told only how many examples each node has). Bad
node data gives an error naming the file or field and the fix."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

if os.environ.get("FEDVOX_REQUIRE_DEPLOY"):  # `make test` installs the deploy extra: no skip
    import flwr  # noqa: F401
else:  # a checkout without the `deploy` extra
    pytest.importorskip("flwr")

from flwr.app import Context, RecordDict
from test_deploy_flower import _task_identity  # noqa: F401
from test_deploy_serve import NodeGrid
from tiny_corpus import TINY_DATA, TINY_EVAL, write_kaldi_dir
from typer.testing import CliRunner

from fedvox.cli import app
from fedvox.deploy import QUERY, TRAIN, Envelope
from fedvox.errors import ConfigError, DataError
from fedvox.experiment.deployment import (
    CONFIG_KEY,
    STATUS_FILE,
    load_node,
    run_app_config,
    shards_of,
)
from fedvox.experiment.node_data import FEAT_DIM_KEY, FEATURES_KEY
from fedvox.experiment.runfolder import RunFolder
from fedvox.models.io import load_model
from fedvox.records import TripRecord, read_run_log
from fedvox.tasks.speakers import NEGATIVES

CFG = (
    'name = "recon-deployed"\nseed = 0\n'
    + TINY_DATA
    + "[train]\nthreads = 1\n"
    + TINY_EVAL
    + """[federated]
algorithm = "fedavg"
speakers = "local"
concurrency = 2
server_steps = 2
eval_every = 2
checkpoint_every = 2
chunk_frames = 60
local_batch_size = 4
local_lr = 0.02
[federated.reconstruction]
public_speakers = 4
[federated.partition]
scheme = "dirichlet"
n_clients = 2
"""
)


RUN_IDS = itertools.count(100)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One data cache (the tiny corpus, its features, the public speakers) for the module."""
    return tmp_path_factory.mktemp("cache")


def _config(tmp_path: Path, cache: Path, extra: str = "") -> Path:
    path = tmp_path / "recon.toml"
    path.write_text(CFG.format(cache=cache) + extra)
    return path


def _prepare(config: Path, out: Path, *args: str) -> tuple[RunFolder, dict]:
    res = CliRunner().invoke(app, ["deploy", "prepare", str(config), "--out", str(out), *args])
    assert res.exit_code == 0, res.output
    run = RunFolder.open(out)
    return run, run_app_config(run)


def _serve(run: RunFolder, node_configs: list[dict], run_config: dict) -> NodeGrid:
    from fedvox.experiment.flower_app import client, server

    run_id = next(RUN_IDS)  # fedvox's ClientApp keeps its nodes per (node, run) id
    grid = NodeGrid(client, [Path("unused")] * len(node_configs), run_config, run_id)
    for node, node_config in zip(list(grid.contexts), node_configs, strict=True):
        grid.contexts[node] = Context(run_id, node, node_config, RecordDict(), run_config)
    server(grid, Context(run_id, 1, {}, RecordDict(), run_config))
    status = json.loads((run.path / STATUS_FILE).read_text())
    assert status["status"] == "completed", status
    return grid


def _bytes_down(run: RunFolder) -> set[int]:
    return {t.bytes_down for t in read_run_log(run.path / "trips.jsonl", (TripRecord,))}


def test_shard_nodes_train_local_speakers_and_count_the_negatives_down(
    tmp_path: Path, cache: Path
) -> None:
    run, run_config = _prepare(_config(tmp_path, cache), tmp_path / "run")
    shards = shards_of(run)
    _serve(run, [{"shard": str(p)} for p in shards], run_config)
    manifest = run.manifest()["deployed"]
    assert manifest["steps"] == 2
    # the public negatives [4, 256] (float32) ride down with every trip, never up
    assert manifest["bytes_down_per_trip"] == manifest["bytes_up_per_trip"] + 4 * 4 * 256
    assert _bytes_down(run) == {manifest["bytes_down_per_trip"]}
    # the server learnt each node's examples from its QUERY reply
    sizes = [len(torch.load(p, weights_only=True)["order"]) for p in shards]
    assert manifest["examples_per_client"] == sizes


def _own_dirs(root: Path) -> list[Path]:
    """Two nodes' own Kaldi dirs: one speaker on node 0, three on node 1."""
    return [
        write_kaldi_dir(root / "node-0" / "data", {"alice": 3}),
        write_kaldi_dir(root / "node-1" / "data", {"bob": 2, "carol": 2, "dave": 2}),
    ]


def test_nodes_on_their_own_kaldi_dirs_train_through_the_fake_grid(
    tmp_path: Path, cache: Path
) -> None:
    config = _config(tmp_path, cache)
    dirs = _own_dirs(tmp_path)
    nodes = [
        {"kaldi-dir": str(d), "client": i, "cache-dir": str(d.parent / "cache")}
        for i, d in enumerate(dirs)
    ]
    finals = []
    for k in range(2):  # twice: same config, seed and data give the same bits
        run, run_config = _prepare(config, tmp_path / f"own-{k}", "--own-data", "--nodes", "2")
        assert not (run.path / "deploy" / "nodes").exists()  # no shard was written
        assert run_config["node-data"] == "own" and "partition-sha256" not in run_config
        _serve(run, nodes, run_config)
        manifest = run.manifest()["deployed"]
        assert manifest["steps"] == 2 and manifest["nodes"] == 2
        finals.append(load_model(run.path / "model.pt").state_dict())
    # the nodes' features are cached in their own folders
    assert all(any((d.parent / "cache" / "features").rglob("*.fvx")) for d in dirs)
    # the server knows each node's examples only from its QUERY reply
    want = [int(load_node(n, run_config).population.num_examples(i)) for i, n in enumerate(nodes)]
    assert manifest["examples_per_client"] == want
    a, b = finals
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


def test_a_node_on_its_own_data_answers_with_its_examples_and_trains(
    tmp_path: Path, cache: Path
) -> None:
    from fedvox.experiment.federated import recon_task

    config = _config(tmp_path, cache)
    (d,) = _own_dirs(tmp_path)[1:]
    run_config = {CONFIG_KEY: config.read_text(), "nodes": 2}
    node = load_node({"kaldi-dir": str(d), "client": 1}, run_config)
    assert node.task.max_local == 3  # its three speakers are its local speakers
    reply = node.handle(Envelope(5, QUERY))
    assert reply.values == {"client": 1, "num_examples": node.population.num_examples(1)}
    assert (d / ".fedvox-cache" / "features").is_dir()  # default cache: in its data folder
    params = recon_task(node.cfg, 30, 1).init_params()
    start = {**params, NEGATIVES: torch.nn.functional.normalize(torch.randn(4, 256), dim=-1)}
    values = {"client": 1, "trip": 0, "version": 0}
    out = node.handle(Envelope(5, TRAIN, start, values))
    assert set(out.arrays) == set(params)  # the extractor's delta only: no prototype, no negatives
    assert out.values["num_examples"] > 0 and np.isfinite(out.values["loss"])


def _node(tmp_path: Path, cache: Path, node_config: dict, extra: str = "", **run) -> None:
    config = _config(tmp_path, cache, extra)
    load_node(node_config, {CONFIG_KEY: config.read_text(), "nodes": 2, **run})


def test_bad_node_data_names_the_file_or_field_and_the_fix(tmp_path: Path, cache: Path) -> None:
    from fedvox.data.audio import write_audio

    (good,) = _own_dirs(tmp_path)[:1]
    ok = {"kaldi-dir": str(good), "client": 0}
    with pytest.raises(DataError, match=r"no such folder.*Fix"):
        _node(tmp_path, cache, {**ok, "kaldi-dir": str(tmp_path / "missing")})
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match=r"wav\.scp"):
        _node(tmp_path, cache, {**ok, "kaldi-dir": str(empty)})
    (empty / "wav.scp").write_text("")
    (empty / "utt2spk").write_text("")
    with pytest.raises(DataError, match=r"wav\.scp.*Fix"):  # zero utterances
        _node(tmp_path, cache, {**ok, "kaldi-dir": str(empty)})
    broken = write_kaldi_dir(tmp_path / "broken", {"eve": 2})
    (broken / "wav" / "eve-01.wav").write_bytes(b"not audio at all")
    with pytest.raises(DataError, match=r"eve-01\.wav"):
        _node(tmp_path, cache, {**ok, "kaldi-dir": str(broken)})
    slow = write_kaldi_dir(tmp_path / "slow", {"eve": 1})
    write_audio(slow / "wav" / "eve-00.wav", np.zeros(8000, np.float32), 8000)
    with pytest.raises(DataError, match="8000 Hz, expected 16000 Hz"):
        _node(tmp_path, cache, {**ok, "kaldi-dir": str(slow)})
    with pytest.raises(ConfigError, match=r"features-sha256.*fedvox commit"):
        _node(tmp_path, cache, ok, **{FEATURES_KEY: "0" * 64})
    with pytest.raises(ConfigError, match=r"'features'.*30.*40"):
        _node(tmp_path, cache, ok, **{FEAT_DIM_KEY: 40})
    with pytest.raises(ConfigError, match=r"node-config\.client"):
        _node(tmp_path, cache, {"kaldi-dir": str(good)})
    with pytest.raises(ConfigError, match="relative"):
        _node(tmp_path, cache, {**ok, "kaldi-dir": "data"})
    with pytest.raises(ConfigError, match=r"node-config\.kaldi-dir.*one source"):
        _node(tmp_path, cache, {**ok, "shard": "/x/node-0.pt"})
    with pytest.raises(DataError, match="VoxCeleb"):
        _node(tmp_path, cache, {"voxceleb-dir": str(good), "client": 0})


PREPARE = ["deploy", "prepare", "--own-data", "--overwrite"]
VOXCELEB = ["--node-layout", "voxceleb"]


def test_own_data_needs_local_speakers_and_no_device_panel(tmp_path: Path, cache: Path) -> None:
    (good,) = _own_dirs(tmp_path)[:1]
    ok = {"kaldi-dir": str(good), "client": 0}
    text = CFG.format(cache=cache)
    cases = {
        "federated.speakers": text.replace('speakers = "local"', 'speakers = "global_head"'),
        "federated.reconstruction.centre": text.replace(
            "public_speakers = 4", 'public_speakers = 4\ncentre = "domain"'
        ),
        "federated.reconstruction.device_clusters": text.replace(
            "public_speakers = 4", "public_speakers = 4\ndevice_clusters = 2"
        ),
    }
    for field, cfg in cases.items():
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_node(ok, {CONFIG_KEY: cfg})
        config = tmp_path / "bad.toml"
        config.write_text(cfg)
        res = CliRunner().invoke(
            app,
            [*PREPARE, str(config), "--out", str(tmp_path / "r"), "--nodes", "2"],
        )
        assert res.exit_code != 0 and field in str(res.exception), res.output
    res = CliRunner().invoke(
        app,
        [*PREPARE, str(_config(tmp_path, cache)), "--out", str(tmp_path / "r")],
    )
    assert res.exit_code != 0 and "--nodes" in str(res.exception)


def test_print_commands_for_nodes_on_their_own_data(tmp_path: Path, cache: Path) -> None:
    run, _ = _prepare(_config(tmp_path, cache), tmp_path / "run", "--own-data", "--nodes", "2")
    res = CliRunner().invoke(
        app, ["deploy", "print-commands", str(run.path), "--host", "link.lan", "--insecure"]
    )
    assert res.exit_code == 0, res.output
    text = res.output
    for i in range(2):
        want = f'kaldi-dir="/opt/fedvox-node/data" client={i} cache-dir="/opt/fedvox-node/cache"'
        assert want in text
    assert "never leaves the node" in text and ".pt" not in text
    res = CliRunner().invoke(
        app,
        ["deploy", "print-commands", str(run.path), "--host", "h", "--insecure", *VOXCELEB],
    )
    assert res.exit_code == 0 and 'voxceleb-dir="/opt/fedvox-node/data"' in res.output
