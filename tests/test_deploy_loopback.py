"""A real federation on loopback: Flower's SuperLink and SuperNodes as processes, TLS and node
authentication on, the tiny corpus. Every process is started here and stopped by its PID.

One SuperLink and three registered SuperNodes serve two runs: FedBuff for 3 server steps,
then FedAvg in which a node is SIGKILLed mid-round (a dropout; the run completes) and
restarted (it rejoins and its updates are aggregated again). A fourth node whose key was
never registered is refused.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

if os.environ.get("FEDVOX_REQUIRE_DEPLOY"):  # `make test` installs the deploy extra: no skip
    import flwr  # noqa: F401
else:  # a checkout without the `deploy` extra
    pytest.importorskip("flwr", reason="Flower (the `deploy` extra) is not installed")

from tiny_corpus import TINY_DATA, TINY_EVAL
from typer.testing import CliRunner

from fedvox.cli import app
from fedvox.deploy.keys import write_keys
from fedvox.deploy.processes import _identify, _started, descendants
from fedvox.experiment.config import load_config
from fedvox.experiment.deployment import (
    ARRIVALS_FILE,
    LocalFederation,
    LocalSettings,
    app_folder,
    node_config,
    prepare_deployed_run,
)
from fedvox.experiment.runfolder import RunFolder
from fedvox.records import ServerStepRecord, TripRecord, read_run_log

pytestmark = pytest.mark.slow

NODES = 3
CFG = (
    'name = "loopback-{algorithm}"\nseed = 0\n'
    + TINY_DATA
    + "[train]\nthreads = 1\n"
    + TINY_EVAL
    + """[federated]
algorithm = "{algorithm}"
concurrency = 3
buffer_size = 1
server_steps = {steps}
eval_every = {steps}
checkpoint_every = {steps}
chunk_frames = 60
local_batch_size = 4
local_lr = 0.02
[federated.partition]
scheme = "dirichlet"
n_clients = 3
"""
)


def _prepare(tmp: Path, algorithm: str, steps: int, keys: Path, timeout: float | None):
    path = tmp / f"{algorithm}.toml"
    path.write_text(CFG.format(algorithm=algorithm, steps=steps, cache=tmp / "cache"))
    settings = LocalSettings(nodes=NODES, keys=keys, reply_timeout=timeout, wait_nodes_s=120)
    return prepare_deployed_run(load_config(path), tmp / f"run-{algorithm}", settings)


def _wait_for_line(log: Path, text: str, after: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.is_file() and text in log.read_bytes()[after:].decode(errors="replace"):
            return
        time.sleep(0.2)
    raise AssertionError(f"{log} did not log {text!r} within {timeout} s")


def _remember(fed: LocalFederation, seen: dict[int, int]) -> None:
    """Every process of the federation now, with its helpers (pid → start time)."""
    for pid in fed.procs.pids().values():
        seen.update(_identify([pid, *descendants(pid)]))


def test_a_federation_on_loopback_with_tls_node_auth_dropout_and_rejoin(tmp_path: Path) -> None:
    t0 = time.monotonic()
    keys = write_keys(tmp_path / "keys", ["localhost", "127.0.0.1"], NODES + 1)
    buff, shards, _ = _prepare(tmp_path, "fedbuff", 3, keys.root, None)
    # the round a node dies in ends when Flower reports the node gone (its heartbeat lapses,
    # about a minute) or at this deadline, whichever comes first
    avg, avg_shards, _ = _prepare(tmp_path, "fedavg", 3, keys.root, 150.0)
    assert [p.read_bytes() for p in shards] == [p.read_bytes() for p in avg_shards]
    seen: dict[int, int] = {}
    with LocalFederation(tmp_path / "fed", keys) as fed:
        fed.start_link()
        for i in range(NODES):  # node 3's key is never registered
            fed.register(i)
        for i in range(NODES):
            fed.start_node(i, node_config(shards[i]))
        fed.start_node(NODES, node_config(shards[0]), name="intruder")
        intruder = fed.procs.running["intruder"]
        assert intruder.proc.wait(timeout=120) != 0  # refused: it exits instead of serving
        assert "Failed to activate" in intruder.log.read_text(errors="replace")

        # FedBuff, K = 1, C = 3: three server steps from the first arrivals
        fed.submit(app_folder(buff))
        status = fed.wait(buff, 900, tick=lambda: _remember(fed, seen))
        assert status["status"] == "completed", status
        steps = read_run_log(buff.metrics_path, (ServerStepRecord,))
        assert [s.step for s in steps] == [1, 2, 3] and all(s.updates == 1 for s in steps)
        assert [s.staleness for s in steps] == [(0,), (1,), (2,)]  # the trips began together
        arrivals = [json.loads(line) for line in (buff.path / ARRIVALS_FILE).open()]
        order = [a["arrival"] for a in arrivals if a["status"] == "aggregated"]
        assert order == [1, 2, 3]  # recorded in the order the updates arrived
        assert (buff.path / "report.md").is_file() and (buff.path / "model.pt").is_file()

        # FedAvg, C = 3 of 3: node 1 is killed once it holds round 1's request
        log = fed.procs.running["node-1"].log
        mark = log.stat().st_size
        fed.submit(app_folder(avg))
        _wait_for_line(log, "Receiving: train message", mark, 300)
        fed.procs.kill("node-1")
        fed.restart_node(1)  # refused until the SuperLink counts it offline, then it rejoins
        status = fed.wait(avg, 900, tick=lambda: _remember(fed, seen))
        assert status["status"] == "completed", status
        _remember(fed, seen)
    trips = read_run_log(avg.path / "trips.jsonl", (TripRecord,))
    steps = read_run_log(avg.metrics_path, (ServerStepRecord,))
    assert [s.step for s in steps] == [1, 2, 3]
    first = [t for t in trips if t.start_version == 0]
    assert {(t.client, t.status) for t in first} == {
        (0, "aggregated"),
        (1, "dropped_out"),
        (2, "aggregated"),
    }
    assert steps[0].updates == 2 and steps[0].dropped_out == 1
    rejoined = [t for t in trips if t.client == 1 and t.status == "aggregated"]
    assert rejoined and rejoined[0].trip >= 1  # a later trip of the killed node's client
    assert steps[-1].updates == 3
    # every process the test started, and every helper they spawned, is gone
    assert len(seen) > NODES + 1  # the SuperLink, the nodes and their helpers were seen
    assert all(_started(pid) != started for pid, started in seen.items())
    assert time.monotonic() - t0 < 1500


def _processes_naming(text: str) -> list[int]:
    """PIDs whose command line mentions `text` (a check only: nothing is signalled)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_text(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_deploy_local_runs_secure_aggregation_through_supernodes_with_tls(tmp_path: Path) -> None:
    # `fedvox deploy local` end to end: one FedAvg round whose sum is formed by fedvox's
    # SecAgg over Flower messages. Every ClientApp call is a fresh process, so each node's
    # keys, shares and held update live in Flower's Context.state between the 4 rounds.
    path = tmp_path / "secagg.toml"
    text = CFG.format(algorithm="fedavg", steps=1, cache=tmp_path / "cache")
    text = text.replace("buffer_size = 1", 'weighting = "uniform"')
    path.write_text(text + "[federated.privacy]\nsecure_aggregation = true\n")
    out = tmp_path / "run"
    argv = ["deploy", "local", str(path), "--nodes", "3", "--out", str(out)]
    res = CliRunner().invoke(app, [*argv, "--reply-timeout", "300", "--timeout", "900"])
    assert res.exit_code == 0, res.output
    assert "TLS + node authentication" in res.output
    run = RunFolder.open(out)
    (step,) = read_run_log(run.metrics_path, (ServerStepRecord,))
    assert step.updates == NODES and step.agg["secagg_survivors"] == NODES
    deployed = run.manifest()["deploy_local"]
    assert deployed["tls"] and deployed["node_authentication"]
    assert deployed["flower"]["status"] == "finished:completed"
    assert (
        deployed["flower"]["inbound-bytes"]
        >= NODES * run.manifest()["deployed"]["bytes_up_per_trip"]
    )
    for i in range(NODES):  # each node answered discovery and the 4 protocol rounds
        log = (out / "deploy" / "logs" / f"node-{i}.log").read_text(errors="replace")
        assert log.count("Receiving: query message") == 1 + 4
    assert (out / "model.pt").is_file() and (out / "report.md").is_file()
    # the command stopped everything it started (their command lines name the run folder)
    assert _processes_naming(str(out.resolve())) == []


def test_ctrl_c_stops_every_process_deploy_local_started(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(CFG.format(algorithm="fedavg", steps=50, cache=tmp_path / "cache"))
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    code = "from fedvox.cli import main; main()"
    argv = [sys.executable, "-c", code, "deploy", "local", str(path), "--nodes", "3"]
    proc = subprocess.Popen([*argv, "--out", str(out)], env=env, stdout=subprocess.PIPE)
    try:
        _wait_for_line(out / "deploy" / "logs" / "node-2.log", "SuperNode ID", 0, 300)
        assert len(_processes_naming(str(out.resolve()))) >= 4  # the SuperLink and 3 nodes
        os.kill(proc.pid, signal.SIGINT)  # what Ctrl-C sends
        assert proc.wait(timeout=120) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _processes_naming(str(out.resolve())) == []


def test_federated_reconstruction_with_a_node_on_its_own_kaldi_dir(tmp_path: Path) -> None:
    # speakers = "local" through real SuperNodes: the public negatives ride in every TRAIN
    # message; nodes 0 and 1 hold shards, node 2 its own Kaldi dir (features extracted there,
    # its three speakers local); the server learns node 2's examples from its QUERY reply.
    from tiny_corpus import write_kaldi_dir

    from fedvox.data.corpus import load_kaldi_dir
    from fedvox.experiment.node_data import own_population

    keys = write_keys(tmp_path / "keys", ["localhost", "127.0.0.1"], NODES)
    path = tmp_path / "recon.toml"
    text = CFG.format(algorithm="fedavg", steps=1, cache=tmp_path / "cache")
    text = text.replace("buffer_size = 1", 'speakers = "local"')
    path.write_text(text + "[federated.reconstruction]\npublic_speakers = 4\n")
    settings = LocalSettings(nodes=NODES, keys=keys.root, reply_timeout=300.0)
    run, shards, _ = prepare_deployed_run(load_config(path), tmp_path / "run", settings)
    own = write_kaldi_dir(tmp_path / "node-2" / "data", {"ann": 2, "ben": 2, "cat": 2})
    own_config = {"kaldi-dir": str(own), "client": 2, "cache-dir": str(own.parent / "cache")}
    with LocalFederation(tmp_path / "fed", keys) as fed:
        fed.start_link()
        for i in range(NODES):
            fed.register(i)
        for i in range(NODES):
            fed.start_node(i, node_config(shards[i]) if i < 2 else own_config)
        fed.submit(app_folder(run))
        status = fed.wait(run, 900)
    assert status["status"] == "completed", status
    (step,) = read_run_log(run.metrics_path, (ServerStepRecord,))
    assert step.updates == NODES
    deployed = run.manifest()["deployed"]
    assert deployed["bytes_down_per_trip"] == deployed["bytes_up_per_trip"] + 4 * 4 * 256
    population, speakers = own_population(
        run.config(), load_kaldi_dir(own), 2, NODES, own.parent / "cache"
    )
    assert speakers == 3
    assert deployed["examples_per_client"][2] == population.num_examples(2)
    assert any((own.parent / "cache" / "features").rglob("*.fvx"))
    log = (tmp_path / "fed" / "logs" / "node-2.log").read_text(errors="replace")
    assert "Receiving: train message" in log


def test_deploy_local_stopped_after_a_checkpoint_resumes_with_deploy_resume(
    tmp_path: Path,
) -> None:
    path = tmp_path / "r.toml"
    text = CFG.format(algorithm="fedavg", steps=2, cache=tmp_path / "cache")
    path.write_text(text.replace("checkpoint_every = 2", "checkpoint_every = 1"))
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    fedvox = [sys.executable, "-c", "from fedvox.cli import main; main()"]
    argv = [*fedvox, "deploy", "local", str(path), "--nodes", "3", "--out", str(out)]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE)
    try:  # Ctrl-C once the first checkpoint is written: everything stops, no status
        deadline = time.monotonic() + 420
        while not (out / "checkpoints" / "ckpt-000000001.sha256").is_file():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.5)
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _processes_naming(str(out.resolve())) == []
    res = subprocess.run([*fedvox, "deploy", "resume", str(out)], env=env, capture_output=True)
    assert res.returncode == 0, res.stdout.decode()[-2000:] + res.stderr.decode()[-2000:]
    assert "resumed from server step 1, now at step 2" in " ".join(res.stdout.decode().split())
    run = RunFolder.open(out)
    manifest = run.manifest()
    assert manifest["deployed"]["resumed_from_step"] == 1
    assert manifest["deploy_resumes"][0]["from_step"] == 1
    assert manifest["deploy_local"]["tls"] and manifest["deploy_local"]["status"] == "completed"
    steps = read_run_log(run.metrics_path, (ServerStepRecord,))
    assert [s.step for s in steps] == [1, 2]  # each step logged once
    trips = read_run_log(out / "trips.jsonl", (TripRecord,))
    assert sorted(t.server_step for t in trips if t.status == "aggregated") == [1] * 3 + [2] * 3
    assert len({(t.client, t.trip) for t in trips}) == len(trips)
    assert (out / "model.pt").is_file() and (out / "report.md").is_file()
    assert _processes_naming(str(out.resolve())) == []
