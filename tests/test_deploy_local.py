"""`fedvox deploy` without a network: keys, node shards, process supervision by PID, Flower's
command lines, refusals and the printed commands for separate machines."""

from __future__ import annotations

import os
import stat
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_pem_private_key, load_ssh_private_key
from typer.testing import CliRunner

from fedvox.cli import app
from fedvox.deploy import flower_commands as fc
from fedvox.deploy.keys import KeyLayout, write_keys
from fedvox.deploy.processes import Processes, _started, descendants
from fedvox.deploy.shard import load_shard, node_shard, save_shard, shard_population
from fedvox.errors import ConfigError, DataError, FedvoxError
from fedvox.experiment.config import config_from_dict
from fedvox.experiment.deployment import check_deployable, margin_at
from fedvox.fl.population import Population

runner = CliRunner()


def test_keys_make_a_ca_a_server_certificate_for_the_hosts_and_private_node_keys(
    tmp_path: Path,
) -> None:
    k = write_keys(tmp_path / "k", ["server.lan", "10.0.0.5"], 3)
    assert k.nodes() == [0, 1, 2]
    for private in [k.ca_key, k.server_key, *(k.node_key(i) for i in range(3))]:
        assert stat.S_IMODE(private.stat().st_mode) == 0o600, private
    ca = x509.load_pem_x509_certificate(k.ca_cert.read_bytes())
    cert = x509.load_pem_x509_certificate(k.server_cert.read_bytes())
    assert cert.issuer == ca.subject
    cert.verify_directly_issued_by(ca)  # raises if the CA did not sign it
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["server.lan"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"]
    load_pem_private_key(k.server_key.read_bytes(), None)
    # node keys: OpenSSH, a NIST curve, the .pub is the private key's public half
    node = load_ssh_private_key(k.node_key(1).read_bytes(), None)
    assert node.curve.name == "secp384r1"
    assert k.node_pub(1).read_text().startswith("ecdsa-sha2-nistp384 ")
    with pytest.raises(FedvoxError, match="already"):
        write_keys(tmp_path / "k", ["localhost"], 1)
    with pytest.raises(FedvoxError, match=r"node-3\.key"):
        KeyLayout(tmp_path / "k").check(4)


def test_keys_refuse_a_host_that_is_no_name() -> None:
    with pytest.raises(ConfigError, match="--host"):
        write_keys(Path("/nonexistent"), ["bad host"], 1)


@pytest.mark.parametrize("crops", [False, True])
def test_a_node_shard_draws_the_full_populations_batches(tmp_path: Path, crops: bool) -> None:
    rng = np.random.default_rng(0)
    n = 60
    store = {"x": torch.randn(n, 3), "y": torch.as_tensor(rng.integers(0, 5, n))}
    rows = rng.permutation(n)
    clients = [rows[:20], rows[20:45], rows[45:]]
    kw = {}
    if crops:  # windows of recordings: 12 groups of 5 rows, 2 drawn per epoch
        kw = {"groups": np.arange(n) // 5, "take": np.full(12, 2)}
        clients = [np.arange(0, 20), np.arange(20, 45), np.arange(45, 60)]
    full = Population(store, clients, seed=7, **kw)
    path = save_shard(tmp_path / "node-1.pt", node_shard(full, 1))
    shard = load_shard(path)
    assert shard["store"]["x"].shape[0] == len(clients[1])  # only this client's rows
    mine = shard_population(shard)
    assert mine.num_examples(1) == full.num_examples(1)
    for trip in range(3):
        a = list(full.client_batches(1, trip, 4, epochs=2))
        b = list(mine.client_batches(1, trip, 4, epochs=2))
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x["x"], y["x"]) and torch.equal(x["y"], y["y"])


def test_a_torn_shard_names_its_file(tmp_path: Path) -> None:
    bad = tmp_path / "node-0.pt"
    bad.write_bytes(b"not a shard")
    with pytest.raises(DataError, match=r"node-0\.pt"):
        load_shard(bad)
    with pytest.raises(DataError, match="no such shard"):
        load_shard(tmp_path / "missing.pt")


def _tree_script() -> list[str]:
    # a parent that starts a child in a session of its own (as Flower's SuperExec is started)
    code = (
        "import subprocess, sys, time;"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],"
        " start_new_session=True);"
        "time.sleep(120)"
    )
    return [sys.executable, "-c", code]


def test_processes_stop_each_process_and_its_detached_helpers_by_pid(tmp_path: Path) -> None:
    with Processes(tmp_path / "logs") as procs:
        m = procs.start("parent", _tree_script())
        deadline = time.monotonic() + 30
        while not descendants(m.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        helpers = descendants(m.pid)
        assert helpers
        started = {p: _started(p) for p in [m.pid, *helpers]}
        procs.watch()
    # leaving the block stopped the parent and the helper it spawned, each by its PID
    assert all(_started(p) != t for p, t in started.items())
    assert m.proc.returncode is not None


def test_processes_kill_is_a_crash_and_a_name_can_be_started_again(tmp_path: Path) -> None:
    with Processes(tmp_path / "logs") as procs:
        procs.start("n", [sys.executable, "-c", "import time; time.sleep(60)"])
        procs.kill("n")
        assert procs.running["n"].proc.returncode == -9
        again = procs.start("n", [sys.executable, "-c", "import time; time.sleep(60)"])
        assert procs.pids() == {"n": again.pid}
    assert again.proc.returncode is not None


def test_flower_command_lines_turn_tls_and_node_authentication_on(tmp_path: Path) -> None:
    keys = write_keys(tmp_path / "k", ["localhost"], 1)
    link = fc.Link("127.0.0.1", 9123, keys)
    argv = fc.superlink_argv(link)
    assert "--enable-supernode-auth" in argv and "--insecure" not in argv
    assert argv[argv.index("--ssl-certfile") + 1] == str(keys.server_cert)
    node = fc.supernode_argv(link, keys.node_key(0), {"shard": "/a b/n.pt", "k": 2}, 9200)
    assert node[node.index("--root-certificates") + 1] == str(keys.ca_cert)
    assert node[node.index("--auth-supernode-private-key") + 1] == str(keys.node_key(0))
    assert node[node.index("--node-config") + 1] == 'shard="/a b/n.pt" k=2'
    insecure = fc.Link("127.0.0.1", 9123, None)
    assert "--insecure" in fc.superlink_argv(insecure)
    assert "--enable-supernode-auth" not in fc.superlink_argv(insecure)
    assert "--insecure" in fc.supernode_argv(insecure, None, {}, 9200)
    conn = fc.write_connection(tmp_path / "home", link).read_text()
    assert 'address = "127.0.0.1:9123"' in conn and str(keys.ca_cert) in conn
    env = fc.runtime_env(tmp_path / "home")
    assert env["FLWR_TELEMETRY_ENABLED"] == "0" and env["FLWR_DISABLE_UPDATE_CHECK"] == "1"


def _cfg(**federated: object):
    base = {"federated": {"algorithm": "fedavg", "weighting": "uniform", **federated}}
    return config_from_dict(base, source="test")


@pytest.mark.parametrize(
    ("federated", "field"),
    [
        (
            {"algorithm": "fedbuff", "privacy": {"secure_aggregation": True}},
            "federated.privacy.secure_aggregation",
        ),
        (
            {"privacy": {"secure_aggregation": True, "secagg_consistency_check": True}},
            "federated.privacy.secagg_consistency_check",
        ),
        ({"privacy": {"mechanism": "dp_ftrl"}}, "federated.privacy.mechanism"),
        ({"attack": {"fraction": 0.1}}, "federated.attack.fraction"),
        ({"compression": {"kind": "float16"}}, "federated.compression.kind"),
        (
            {"speakers": "local", "reconstruction": {"broadcast_every": 10}},
            "federated.reconstruction.broadcast_every",
        ),
    ],
)
def test_what_a_deployed_run_cannot_do_yet_is_refused_by_field(federated, field) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        check_deployable(_cfg(**federated))
    check_deployable(_cfg())
    check_deployable(_cfg(privacy={"secure_aggregation": True}))  # synchronous, no DP: fine
    check_deployable(_cfg(speakers="local"))  # Federated Reconstruction: negatives shipped


def test_the_margin_schedule_steps_at_evaluation_and_checkpoint_boundaries() -> None:
    cfg = _cfg(server_steps=20, eval_every=10, checkpoint_every=4)
    cfg = cfg.model_copy(
        update={"model": cfg.model.model_copy(update={"margin": 0.2, "margin_ramp": (0.0, 0.5)})}
    )
    values = [margin_at(cfg, v) for v in range(20)]
    assert values[0] == values[3] and values[4] == values[7]  # constant within a chunk
    assert values[4] > values[0] and values[-1] == pytest.approx(0.2)


def test_deploy_keys_and_print_commands_from_the_command_line(tmp_path: Path) -> None:
    res = runner.invoke(
        app, ["deploy", "keys", str(tmp_path / "k"), "--host", "link.lan", "--nodes", "2"]
    )
    assert res.exit_code == 0, res.output
    run = tmp_path / "run"
    (run / "deploy" / "nodes").mkdir(parents=True)
    (run / "config.toml").write_text("")
    for i in range(2):
        (run / "deploy" / "nodes" / f"node-{i}.pt").write_bytes(b"")
    res = runner.invoke(
        app,
        ["deploy", "print-commands", str(run), "--host", "link.lan", "--keys", str(tmp_path / "k")],
    )
    assert res.exit_code == 0, res.output
    text = res.output
    assert "flower-superlink --host 0.0.0.0 --port 9092" in text
    assert "--enable-supernode-auth" in text and "--insecure" not in text
    assert text.count("flwr supernode register") == 2
    assert "--superlink link.lan:9092 --root-certificates /opt/fedvox-node/ca.pem" in text
    assert "--auth-supernode-private-key /opt/fedvox-node/node-1.key" in text
    assert "FLWR_TELEMETRY_ENABLED=0" in text and "flwr run" in text
    assert "fedvox deploy resume" in text and "--command-only" in text  # after a crash
    assert "/work/" not in text.split("copy")[0]  # programs by name, not this machine's paths
    res = runner.invoke(app, ["deploy", "print-commands", str(run), "--host", "link.lan"])
    assert res.exit_code != 0 and "--keys" in str(res.exception or res.output)
    res = runner.invoke(app, ["deploy", "print-commands", str(run), "--host", "h", "--insecure"])
    assert res.exit_code == 0 and "WARNING" in res.output and "--insecure" in res.output


def test_files_are_private_from_the_first_byte(tmp_path: Path) -> None:
    from fedvox.atomic import atomic_write_bytes

    path = atomic_write_bytes(tmp_path / "secret", b"x", 0o600)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    path = atomic_write_bytes(tmp_path / "open", b"x")
    assert stat.S_IMODE(os.stat(path).st_mode) != 0o600
