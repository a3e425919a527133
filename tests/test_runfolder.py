"""Run folders: manifest contents, metric logs, and checkpoints that survive corruption."""

from pathlib import Path

import pytest
import torch

from fedvox.errors import FedvoxError
from fedvox.experiment.config import ExperimentConfig
from fedvox.experiment.runfolder import RunFolder
from fedvox.records import TrainRecord


def test_create_writes_config_and_manifest(tmp_path: Path) -> None:
    cfg = ExperimentConfig(seed=7)
    run = RunFolder.create(tmp_path / "r", cfg)
    m = run.manifest()
    assert m["seed"] == 7
    assert m["config_hash"] == cfg.hash()
    assert m["packages"]["torch"].startswith("2.13")
    assert {"platform", "python", "git", "command"} <= set(m)
    # bits are promised per vector ISA: the manifest says which one ran
    assert m["cpu_isa"] == torch.backends.cpu.get_cpu_capability()
    assert m["cpu_model"] and m["cpu_model"] != "unknown"
    assert run.config() == cfg
    with pytest.raises(FedvoxError, match="already exists"):
        RunFolder.create(tmp_path / "r", cfg)


def test_metrics_log_ignores_torn_last_line(tmp_path: Path) -> None:
    run = RunFolder.create(tmp_path / "r", ExperimentConfig())
    run.log_metrics(TrainRecord(step=1, loss=2.0, lr=0.1, margin=0.2, frames=200))
    run.log_metrics(TrainRecord(step=2, loss=1.5, lr=0.1, margin=0.2, frames=300))
    with open(run.metrics_path, "a") as f:
        f.write('{"kind": "train", "step": 3, "lo')  # a crash mid-write
    assert [r.step for r in run.read_metrics()] == [1, 2]
    first = run.metrics_path.read_text().splitlines()[0]
    run.truncate_metrics(1)
    assert [r.step for r in run.read_metrics()] == [1]
    assert run.metrics_path.read_text() == first + "\n"  # kept lines are kept as they were


def test_corrupt_checkpoint_falls_back_with_warning(tmp_path: Path) -> None:
    run = RunFolder.create(tmp_path / "r", ExperimentConfig())
    run.save_checkpoint(10, {"w": torch.ones(3)})
    p20 = run.save_checkpoint(20, {"w": torch.full((3,), 2.0)})
    step, state = run.load_latest_checkpoint()
    assert step == 20 and float(state["w"][0]) == 2.0
    data = p20.read_bytes()
    p20.write_bytes(data[: len(data) // 2])  # torn write
    with pytest.warns(UserWarning, match="torn or corrupt"):
        step, state = run.load_latest_checkpoint()
    assert step == 10 and float(state["w"][0]) == 1.0


def test_keeps_only_newest_checkpoints(tmp_path: Path) -> None:
    run = RunFolder.create(tmp_path / "r", ExperimentConfig())
    for s in range(1, 6):
        run.save_checkpoint(s, {"s": s}, keep=2)
    assert sorted(p.name for p in run.checkpoint_dir.glob("*.pt")) == [
        "ckpt-000000004.pt",
        "ckpt-000000005.pt",
    ]
    assert not list(run.checkpoint_dir.glob("*.tmp"))
