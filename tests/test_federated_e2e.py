"""Federated speaker training end to end: FedAvg and FedBuff runs, SIGKILL + resume, refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kill import train_until_killed
from tiny_corpus import TINY_DATA, TINY_EVAL
from typer.testing import CliRunner

from fedvox.cli import app
from fedvox.records import EvalRecord, ServerStepRecord, TripRecord, read_run_log

runner = CliRunner()

CFG = (
    '\nname = "fed-{algorithm}"\nseed = {seed}\n'
    + TINY_DATA
    + """[train]
threads = 1
"""
    + TINY_EVAL
    + """[federated]
algorithm = "{algorithm}"
concurrency = 4
buffer_size = 2
server_steps = {steps}
eval_every = 4
checkpoint_every = 2
chunk_frames = 60
local_batch_size = 4
local_lr = 0.02
delay_mean_s = 30
"""
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fedcache")


def cfg_file(folder: Path, cache: Path, algorithm: str, steps: int = 8, seed: int = 0) -> Path:
    p = folder / f"{algorithm}-{steps}-{seed}.toml"
    p.write_text(CFG.format(algorithm=algorithm, cache=cache, steps=steps, seed=seed))
    return p


@pytest.mark.parametrize("algorithm", ["fedavg", "fedbuff"])
def test_federated_run_folder(tmp_path: Path, cache: Path, algorithm: str) -> None:
    res = runner.invoke(
        app,
        ["train", str(cfg_file(tmp_path, cache, algorithm)), "--out", str(tmp_path / "r"), "-q"],
    )
    assert res.exit_code == 0, res.output
    run = tmp_path / "r"
    part = json.loads((run / "partition.json").read_text())
    clients = part["clients"]
    assert len(clients) == 8  # one speaker per device
    speakers = [{u.rsplit("-", 1)[0] for u in c} for c in clients]
    assert all(len(s) == 1 for s in speakers)
    assert not any(s.startswith("syn-test") for c in speakers for s in c)  # held out
    server = read_run_log(run / "metrics.jsonl", (ServerStepRecord,))
    evals = read_run_log(run / "metrics.jsonl", (EvalRecord,))
    assert [r.step for r in server] == list(range(1, 9))
    assert [r.step for r in evals] == [4, 8]
    assert all(None not in (r.trips, r.virtual_time_s, r.bytes_up, r.bytes_down) for r in evals)
    times = [r.virtual_time_s for r in server]
    assert times == sorted(times) and times[0] > 0
    trips = read_run_log(run / "trips.jsonl", (TripRecord,))
    assert sum(t.status == "aggregated" for t in trips) == sum(r.updates for r in server)
    # achieved concurrency: the cohort of a synchronous round, the trips in flight for async
    assert all(r.concurrency == 4 for r in server)
    if algorithm == "fedbuff":
        assert all(r.updates == 2 for r in server)
        assert max(t.staleness or 0 for t in trips) > 0
    report = (run / "report.md").read_text()
    assert report.count("| client trips |") == 1  # the learning-curve column
    assert "staleness.png" in report and (run / "staleness.png").stat().st_size > 1000
    hourly = (run / "hourly.csv").read_text().splitlines()
    head = hourly[0].split(",")
    rows = [dict(zip(head, line.split(","), strict=True)) for line in hourly[1:]]
    assert sum(int(r["trips_aggregated"]) for r in rows) == sum(r.updates for r in server)
    assert sum(int(r["server_steps"]) for r in rows) == len(server)


def test_federated_sigkill_resume_is_bit_identical(tmp_path: Path, cache: Path) -> None:
    cfg = cfg_file(tmp_path, cache, "fedbuff", steps=16)
    ref = runner.invoke(app, ["train", str(cfg), "--out", str(tmp_path / "ref"), "-q"])
    assert ref.exit_code == 0, ref.output
    run = tmp_path / "killed"
    train_until_killed(cfg, run, checkpoint=6)
    res = runner.invoke(app, ["resume", str(run), "-q"])
    assert res.exit_code == 0, res.output
    a = json.loads((tmp_path / "ref" / "metrics.json").read_text())
    b = json.loads((run / "metrics.json").read_text())
    assert a["weights_sha256"] == b["weights_sha256"]
    assert (tmp_path / "ref" / "metrics.jsonl").read_text() == (run / "metrics.jsonl").read_text()
    assert (tmp_path / "ref" / "trips.jsonl").read_text() == (run / "trips.jsonl").read_text()


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("federated.buffer_size=9", "field 'federated.buffer_size'"),
        ('federated.algorithm="fedsgd"', "federated.algorithm"),
        ("federated.local_lr=-0.1", "field 'federated.local_lr'"),
        ("federated.concurrency=50", "field 'federated.concurrency'"),
        ('federated.partition.scheme="dirichlet"', "federated.partition"),
    ],
)
def test_impossible_settings_refused_before_training(
    tmp_path: Path, cache: Path, override: str, field: str
) -> None:
    cfg = cfg_file(tmp_path, cache, "fedbuff")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedvox.cli",
            "train",
            str(cfg),
            "--out",
            str(tmp_path / "x"),
            "-q",
            "--set",
            override,
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stderr
    assert field in proc.stderr and "Traceback" not in proc.stderr
    assert not list((tmp_path / "x").glob("checkpoints/*.pt"))


@pytest.mark.parametrize(
    ("algorithm", "speakers"),
    [
        ("fedavg", "local"),
        ("fedbuff", "local"),
        ("fedavg", "fedaws"),
        ("fedbuff", "fedaws"),
        ("fedbuff", "codewords"),
        ("fedavg", "local+crops"),
    ],
)
def test_local_speakers_and_fedaws_runs(
    tmp_path: Path, cache: Path, algorithm: str, speakers: str
) -> None:
    """Federated Reconstruction (prototypes stay on the device) and FedAwS end to end."""
    cfg = cfg_file(tmp_path, cache, algorithm, steps=4)
    crops = speakers.endswith("+crops")  # random crops: windows every 20 frames
    speakers = speakers.removesuffix("+crops")
    extra = f'speakers = "{speakers}"\n' + ("chunk_hop = 20\n" if crops else "")
    text = cfg.read_text().replace("[federated]\n", "[federated]\n" + extra)
    text += "[federated.reconstruction]\npublic_speakers = 4\n"
    cfg.write_text(text)
    res = runner.invoke(app, ["train", str(cfg), "--out", str(tmp_path / "r"), "-q"])
    assert res.exit_code == 0, res.output
    evals = read_run_log(tmp_path / "r" / "metrics.jsonl", (EvalRecord,))
    assert [r.step for r in evals] == [4] and 0 <= evals[0].eer <= 1
    trips = read_run_log(tmp_path / "r" / "trips.jsonl", (TripRecord,))
    if speakers == "local":
        # downloads carry the public negatives as well as the model; uploads only the model
        assert all(t.bytes_down > t.bytes_up for t in trips if t.bytes_up)
    else:
        assert all(t.bytes_down == t.bytes_up for t in trips if t.bytes_up)


def test_codeword_rows_are_fixed_and_never_global() -> None:
    import torch

    from fedvox.experiment.config import ExperimentConfig
    from fedvox.experiment.federated import build_task

    cfg = ExperimentConfig.model_validate({"federated": {"speakers": "codewords"}})
    task = build_task(cfg, feat_dim=30, n_speakers=6)
    task.fix_head(7)
    rows = task.head.weight.detach().clone()
    assert torch.allclose(rows.norm(dim=1), torch.ones(6))
    params = task.init_params()
    assert "head.weight" not in params and all(n.startswith("extractor.") for n in params)
    batch = {"x": torch.randn(4, 60, 30), "y": torch.tensor([0, 1, 2, 3])}
    grads = torch.func.grad(lambda p: task.loss(p, batch).mean())(params)
    assert set(grads) == set(params)  # only the extractor is trained
    again = build_task(cfg, feat_dim=30, n_speakers=6)
    again.fix_head(7)
    assert torch.equal(again.head.weight, rows)  # any device can regenerate its row
