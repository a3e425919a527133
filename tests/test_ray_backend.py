"""The Ray backend (fedvox.scale.actors): the weights are the in-process ones bit for bit on
1 and 2 actors and two shard sizes, after a killed actor, after a killed driver resumed, and
on a two-node cluster on loopback. Ray starts once per session (about 10 s)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# conftest.py sets RAY_AUTH_MODE/RAY_AUTH_TOKEN before Ray is imported: the session's Ray,
# its subprocess drivers and the two-node cluster share that token.
if os.environ.get("FEDVOX_REQUIRE_RAY"):  # `make test` installs the ray extra: no skip
    import ray
else:  # a checkout without the `ray` extra
    ray = pytest.importorskip(
        "ray", reason="Ray is not installed: pip install -e '.[ray]' (make test does)"
    )

from kill import train_until_killed
from ray_job import digest, job, toy_population
from test_fl_toys import mlp_task
from tiny_corpus import TINY_DATA, TINY_EVAL
from typer.testing import CliRunner

from fedvox.cli import app
from fedvox.fl import ClientConfig, FedAvg, FedBuff, ServerSGD, Simulator, SimulatorConfig
from fedvox.fl.simulator import plain_client_update
from fedvox.scale import BackendConfig
from fedvox.scale.actors import RayBackend

TESTS = Path(__file__).parent
# the session's Ray node: on loopback, at an address Ray does not rewrite to the machine's
# outward one (it does so for 127.0.0.1), so a subprocess driver can join it
SESSION_IP = "127.0.0.2"
ALGOS = {"fedavg": lambda: FedAvg(ServerSGD(1.0)), "fedbuff": lambda: FedBuff(4, ServerSGD(1.0))}


@pytest.fixture(scope="session")
def ray_cluster() -> str:
    """A local Ray of 2 CPUs for the whole session: its GCS address."""
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=200_000_000,
        logging_level="warning",
        _node_ip_address=SESSION_IP,
    )
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def _sim(algo: str, pop, update=None) -> Simulator:
    torch.set_num_threads(1)  # the actors' thread count (cpus_per_worker = 1)
    return Simulator(
        mlp_task(d=6, h=40),
        pop,
        ALGOS[algo](),
        ClientConfig(batch_size=4, lr=0.2, chunk_size=2),
        SimulatorConfig(concurrency=8, seed=2),
        client_update=update,
    )


def _backend(pop, workers: int, shard_size: int) -> RayBackend:
    config = BackendConfig(kind="ray", workers=workers, shard_size=shard_size)
    return RayBackend(plain_client_update, pop, config)


def _equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_weights_are_the_same_bits_inline_and_on_one_or_two_actors_and_two_shard_sizes(
    ray_cluster: str,
) -> None:
    pop = toy_population()
    want = {a: _sim(a, pop).run(max_server_steps=3) for a in ALGOS}
    # chunks of 2 clients: shards of 3 and 5 jobs own different chunks, some none
    for workers, shard_size in [(2, 3), (1, 5)]:
        backend = _backend(pop, workers, shard_size)
        try:
            for algo in ALGOS:
                got = _sim(algo, pop, backend).run(max_server_steps=3)
                assert _equal(got, want[algo]), (algo, workers, shard_size)
                if algo == "fedavg":  # versions 0, 1, 2: one put each, however many shards
                    assert backend.puts["versions"] == 3
            # one put per task object (each simulator here has its own), none per step
            assert backend.puts["task"] == len(ALGOS) and backend.restarts == 0
        finally:
            backend.close()
    assert not _equal(want["fedavg"], want["fedbuff"])  # the comparison can fail


def test_a_killed_actor_is_recreated_and_the_weights_do_not_change(ray_cluster: str) -> None:
    pop = toy_population()
    want = _sim("fedbuff", pop).run(max_server_steps=4)
    backend = _backend(pop, 2, 3)
    try:
        sim = _sim("fedbuff", pop, backend)
        sim.run(max_server_steps=2)
        ray.kill(backend.actors[0])  # mid-run: its next shard meets a dead actor
        got = sim.run(max_server_steps=4)
        assert backend.restarts >= 1
        assert _equal(got, want)
    finally:
        backend.close()


def test_the_task_is_sent_again_when_its_settings_change(ray_cluster: str) -> None:
    from fedvox.models import AAMSoftmax

    pop = toy_population()
    backend = _backend(pop, 1, 8)
    try:
        head = AAMSoftmax(4, 3, scale=10.0, margin=0.1)
        first = backend._task_ref(head)
        assert backend._task_ref(head) is first  # unchanged: no new put
        head.set_margin(0.2)  # what the margin schedule does between server steps
        assert backend._task_ref(head) is not first and backend.puts["task"] == 2
    finally:
        backend.close()


def test_more_workers_than_the_cluster_can_place_are_refused(ray_cluster: str) -> None:
    from fedvox.errors import ConfigError

    config = BackendConfig(kind="ray", workers=3, cpus_per_worker=1.0)  # the session has 2 CPUs
    with pytest.raises(ConfigError, match=r"federated\.backend\.workers.*need 3 CPUs"):
        RayBackend(plain_client_update, toy_population(), config)
    with pytest.raises(ConfigError, match=r"gpus_per_worker"):  # cuda asked, no GPU given
        RayBackend(plain_client_update, toy_population(), BackendConfig(kind="ray"), "cuda")


CFG = (
    '\nname = "fed-ray"\nseed = 0\n'
    + TINY_DATA
    + "[train]\nthreads = 1\n"
    + TINY_EVAL
    + """[federated]
algorithm = "fedbuff"
concurrency = 4
buffer_size = 2
server_steps = 6
eval_every = 3
checkpoint_every = 2
chunk_frames = 60
local_batch_size = 4
local_lr = 0.02
delay_mean_s = 30
[federated.backend]
kind = "{kind}"
workers = 2
shard_size = 1
"""
)


def test_driver_sigkill_and_resume_under_ray_give_the_inline_weights(
    ray_cluster: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = CliRunner()
    cache = tmp_path / "cache"
    cfgs = {}
    for kind in ("inline", "ray"):
        cfgs[kind] = tmp_path / f"{kind}.toml"
        cfgs[kind].write_text(CFG.format(cache=cache, kind=kind))
    ref = runner.invoke(app, ["train", str(cfgs["inline"]), "--out", str(tmp_path / "ref"), "-q"])
    assert ref.exit_code == 0, ref.output
    run = tmp_path / "killed"
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)  # the subprocess driver joins this Ray
    # killed once checkpoint 4 appears: checkpoint 2 is whole (4 may be torn)
    train_until_killed(cfgs["ray"], run, checkpoint=4, timeout_s=300)
    assert not (run / "metrics.json").exists()  # killed before the end
    assert (run / "checkpoints" / "ckpt-000000002.pt").exists()  # resumed from step 2 or 4
    res = runner.invoke(app, ["resume", str(run), "-q"])  # this process's Ray
    assert res.exit_code == 0, res.output
    a = json.loads((tmp_path / "ref" / "metrics.json").read_text())
    b = json.loads((run / "metrics.json").read_text())
    assert a["weights_sha256"] == b["weights_sha256"]
    assert (tmp_path / "ref" / "trips.jsonl").read_text() == (run / "trips.jsonl").read_text()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """`ray start ... --block` (stopped by SIGTERM, which stops its Ray processes), once it
    says the runtime started."""
    ray_cli = str(Path(sys.executable).parent / "ray")
    out = open(log, "w")
    proc = subprocess.Popen(
        [ray_cli, "start", *args, "--disable-usage-stats", "--block"],
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.time() + 90
    while "Ray runtime started" not in log.read_text():
        if proc.poll() is not None or time.time() > deadline:
            raise AssertionError(f"ray start failed:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_federated_job_runs_across_a_two_node_cluster_on_loopback(
    ray_cluster: str, tmp_path: Path
) -> None:
    ip, port = "127.0.0.3", _free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    node = ["--node-ip-address", ip, "--num-cpus", "1", "--object-store-memory", "80000000"]
    procs = []
    try:
        procs.append(
            _ray_start(
                ["--head", "--port", str(port), "--include-dashboard", "false", *node],
                env,
                tmp_path / "head.log",
            )
        )
        procs.append(_ray_start(["--address", f"{ip}:{port}", *node], env, tmp_path / "node.log"))
        done = subprocess.run(
            [sys.executable, str(TESTS / "ray_job.py")],
            env={**env, "RAY_ADDRESS": f"{ip}:{port}", "OMP_NUM_THREADS": "1"},
            cwd=TESTS,
            capture_output=True,
            text=True,
            timeout=180,
        )
    finally:
        for proc in reversed(procs):
            _stop(proc)
        # `ray start --head` records its address for later `ray.init()`s: not a dead one
        current = Path("/tmp/ray/ray_current_cluster")
        if current.exists() and current.read_text().strip() == f"{ip}:{port}":
            current.unlink()
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(set(got["nodes"])) == 2  # one actor on each node (1 CPU each)
    assert got["digest"] == digest(job())
