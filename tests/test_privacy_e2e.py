"""Privacy composed with the engine: once-per-epoch selection, DP and SecAgg runs, refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_federated_e2e import CFG
from torch import nn
from typer.testing import CliRunner

from fedvox.cli import app
from fedvox.errors import ConfigError
from fedvox.fl import (
    ClientConfig,
    FedAvg,
    FedBuff,
    ModuleTask,
    Population,
    ServerSGD,
    Simulator,
    SimulatorConfig,
)
from fedvox.fl.simulator import SimRecord
from fedvox.privacy.dp import FixedClip
from fedvox.privacy.secagg import SecAggConfig, SecureSum
from fedvox.privacy.tree import TreeNoise
from fedvox.records import EpochRecord, EvalRecord, ServerStepRecord, TripRecord, read_run_log

runner = CliRunner()


def _toy(n_clients: int = 12, per_client: int = 6, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.normal(size=(n_clients * per_client, 5)).astype(np.float32))
    y = torch.from_numpy(rng.integers(3, size=n_clients * per_client))
    torch.manual_seed(seed)
    task = ModuleTask(
        nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)),
        lambda out, b: F.cross_entropy(out, b["y"], reduction="none"),
    )
    clients = list(np.arange(n_clients * per_client).reshape(n_clients, per_client))
    return task, Population({"x": x, "y": y}, clients, seed=seed)


@pytest.mark.parametrize("barrier", [False, True])
def test_once_per_epoch_no_client_twice_in_a_tree(barrier: bool) -> None:
    task, pop = _toy()
    records: list[SimRecord] = []
    tree = TreeNoise(0.1, seed=1)
    algo = FedAvg(ServerSGD(1.0), weighting="uniform") if barrier else FedBuff(2, ServerSGD(1.0))
    sim = Simulator(
        task,
        pop,
        algo,
        ClientConfig(batch_size=3, lr=0.1),
        SimulatorConfig(concurrency=5, seed=3, once_per_epoch=True),
        callback=records.append,
        stages=[FixedClip(1.0)],
        noise=[tree],
    )
    sim.run(max_server_steps=30)
    epochs = 0
    seen: set[tuple[int, int]] = set()
    for r in records:
        if isinstance(r, EpochRecord):
            epochs += 1
            assert r.epoch == epochs
        elif isinstance(r, TripRecord) and r.status == "aggregated":
            key = (epochs, r.client)
            assert key not in seen, f"client {r.client} twice in tree {epochs}"
            seen.add(key)
    assert epochs >= 3  # 12 clients, 5 at a time: many epochs in 30 steps
    steps = [r for r in records if isinstance(r, ServerStepRecord)]
    assert len(steps) == 30 and all(r.agg["clip_norm"] == 1.0 for r in steps)
    assert all(ServerStepRecord.from_json(r.to_json()) == r for r in steps)  # as logged
    assert tree.restarts == epochs  # every epoch restarted the tree
    # without the constraint a client does repeat within such a window
    records.clear()
    sim2 = Simulator(
        task,
        pop,
        FedBuff(2, ServerSGD(1.0)),
        ClientConfig(batch_size=3, lr=0.1),
        SimulatorConfig(concurrency=5, seed=3),
        callback=records.append,
    )
    sim2.run(max_server_steps=30)
    clients = [r.client for r in records if isinstance(r, TripRecord)][:12]
    assert len(set(clients)) < len(clients)


def test_once_per_epoch_resume_is_bit_identical() -> None:
    def make():
        task, pop = _toy()
        return Simulator(
            task,
            pop,
            FedBuff(2, ServerSGD(1.0)),
            ClientConfig(batch_size=3, lr=0.1),
            SimulatorConfig(concurrency=5, seed=3, once_per_epoch=True),
            stages=[FixedClip(0.5)],
            noise=[TreeNoise(0.05, seed=2)],
        )

    full = make()
    full.run(max_server_steps=20)
    part = make()
    part.run(max_server_steps=9)
    state = part.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    resumed.run(max_server_steps=20)
    for n in full.params:
        assert torch.equal(full.params[n], resumed.params[n])


def test_secure_sum_in_simulator_matches_plain_within_quantisation() -> None:
    task, pop = _toy()
    plain = Simulator(
        task,
        pop,
        FedAvg(ServerSGD(1.0), weighting="uniform"),
        ClientConfig(batch_size=3, lr=0.1),
        SimulatorConfig(concurrency=4, seed=1),
    )
    secure = Simulator(
        task,
        pop,
        FedAvg(ServerSGD(1.0), weighting="uniform"),
        ClientConfig(batch_size=3, lr=0.1),
        SimulatorConfig(concurrency=4, seed=1),
        summer=SecureSum(SecAggConfig(seed=5), seed=5),
    )
    a, b = plain.run(max_server_steps=3), secure.run(max_server_steps=3)
    for n in a:
        assert torch.allclose(a[n], b[n], atol=1e-4), n


def _write(tmp: Path, cache: Path, algorithm: str, privacy: str, extra: str = "") -> Path:
    text = CFG.format(algorithm=algorithm, cache=cache, steps=4, seed=0) + extra
    text += "[federated.privacy]\n" + privacy
    p = tmp / f"{algorithm}.toml"
    p.write_text(text)
    return p


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("privcache")


@pytest.mark.parametrize(
    ("algorithm", "privacy", "extra"),
    [
        (
            "fedavg",
            'mechanism = "gaussian"\nnoise_multiplier = 0.8\nclip_norm = 0.5\n'
            "secure_aggregation = true\ndelta = 1e-3\n",
            'weighting = "uniform"\n',
        ),
        (
            "fedbuff",
            'mechanism = "dp_ftrl"\nnoise_multiplier = 0.8\nclip_norm = 0.5\n'
            "secure_aggregation = true\ndelta = 1e-3\n",
            "",
        ),
        # Federated Reconstruction (prototypes stay local) under DP-FTRL / Gaussian DP + SecAgg
        (
            "fedbuff",
            'mechanism = "dp_ftrl"\nnoise_multiplier = 0.8\nclip_norm = 0.5\n'
            "secure_aggregation = true\ndelta = 1e-3\n",
            'speakers = "local"\n[federated.reconstruction]\npublic_speakers = 4\n',
        ),
        (
            "fedavg",
            'mechanism = "gaussian"\nnoise_multiplier = 0.8\nclip_norm = 0.5\n'
            "secure_aggregation = true\ndelta = 1e-3\n",
            'weighting = "uniform"\nspeakers = "local"\n'
            "[federated.reconstruction]\npublic_speakers = 4\n",
        ),
    ],
)
def test_dp_and_secagg_runs_end_to_end(
    tmp_path: Path, cache: Path, algorithm: str, privacy: str, extra: str
) -> None:
    out = tmp_path / "r"
    res = runner.invoke(
        app,
        ["train", str(_write(tmp_path, cache, algorithm, privacy, extra)), "--out", str(out), "-q"],
    )
    assert res.exit_code == 0, res.output
    evals = read_run_log(out / "metrics.jsonl", (EvalRecord,))
    eps = [r.epsilon for r in evals]
    assert all(e is not None and e > 0 for e in eps)
    assert eps == sorted(eps)  # ε only grows as training goes
    assert all(r.delta == 1e-3 for r in evals)
    server = read_run_log(out / "metrics.jsonl", (ServerStepRecord,))
    assert server and all(r.agg["clip_norm"] == 0.5 for r in server)
    report = (out / "report.md").read_text()
    assert "ε" in report


@pytest.mark.parametrize(
    ("algorithm", "privacy", "extra", "field"),
    [
        ("fedbuff", 'mechanism = "gaussian"\ndelta = 1e-3\n', "", "privacy.mechanism"),
        ("fedavg", 'mechanism = "gaussian"\ndelta = 1e-3\n', "", "federated.weighting"),
        (
            "fedavg",
            'mechanism = "gaussian"\ndelta = 0.5\n',
            'weighting = "uniform"\n',
            "privacy.delta",
        ),
        ("fedavg", "secure_aggregation = true\n", "", "federated.weighting"),
    ],
)
def test_dp_claims_without_valid_accounting_are_refused(
    tmp_path: Path, cache: Path, algorithm: str, privacy: str, extra: str, field: str
) -> None:
    res = runner.invoke(
        app,
        [
            "train",
            str(_write(tmp_path, cache, algorithm, privacy, extra)),
            "--out",
            str(tmp_path / "r"),
            "-q",
        ],
    )
    # main() turns a FedvoxError into one line and exit status 2 (test_federated_e2e checks it)
    assert isinstance(res.exception, ConfigError), res.output
    assert field in str(res.exception)
    assert not list((tmp_path / "r").glob("checkpoints/*.pt"))  # refused before training
