"""Data-parallel centralised training (train.workers, DDP through torchrun): two workers
follow one worker's trajectory to float tolerance (layer norm: the mean gradient is the
same sum, split), repeat their own bits, resume to the same bits, and bad settings are
refused naming the field."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_corpus import TINY_DATA, TINY_EVAL

from fedvox.errors import ConfigError
from fedvox.experiment.config import config_from_dict
from fedvox.training.distributed import Workers, batch_slice, init_workers

CONFIG = (
    'name = "ddp"\nseed = 0\n'
    + TINY_DATA
    + """[model]
name = "xvector-tiny"
norm = "layer"
[train]
steps = 6
batch_size = 8
chunk_frames = [50, 60]
threads = 1
checkpoint_every = 3
warmup_steps = 0
"""
    + TINY_EVAL
)


def _train(cfg: Path, out: Path, *sets: str) -> None:
    args = [a for s in sets for a in ("--set", s)]
    cmd = [sys.executable, "-m", "fedvox.cli", "train", str(cfg), "--out", str(out), "-q", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "model.pt", weights_only=False)["extractor"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ddp")
    cfg = root / "ddp.toml"
    cfg.write_text(CONFIG.format(cache=root / "cache"))
    _train(cfg, root / "one")
    _train(cfg, root / "two", "train.workers=2")
    return root, cfg


def test_two_workers_follow_one_to_float_tolerance_and_record_it(runs) -> None:
    root, _ = runs
    one, two = _weights(root / "one"), _weights(root / "two")
    assert one.keys() == two.keys()
    for k in one:  # the same mean gradient, summed in another order: close, not equal
        torch.testing.assert_close(two[k], one[k], atol=1e-4, rtol=1e-4)
    assert any(not torch.equal(one[k], two[k]) for k in one), "two workers changed nothing"
    import json

    manifest = json.loads((root / "two" / "manifest.json").read_text())
    assert manifest["train_workers"] == 2
    assert "train_workers" not in json.loads((root / "one" / "manifest.json").read_text())


def test_two_workers_repeat_their_bits_and_resume_to_them(runs) -> None:
    root, cfg = runs
    _train(cfg, root / "again", "train.workers=2")
    two = _weights(root / "two")
    again = _weights(root / "again")
    assert all(torch.equal(two[k], again[k]) for k in two)
    # an interrupted run: the newest checkpoint (step 6) gone, resume from step 3
    cut = root / "cut"
    shutil.copytree(root / "two", cut)
    for f in (cut / "checkpoints").glob("ckpt-000000006.*"):
        f.unlink()
    (cut / "model.pt").unlink()
    proc = subprocess.run(
        [sys.executable, "-m", "fedvox.cli", "resume", str(cut), "-q"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed = _weights(cut)
    assert all(torch.equal(two[k], resumed[k]) for k in two)


def test_batch_slices_partition_the_batch() -> None:
    parts = [batch_slice(12, Workers(r, 3)) for r in range(3)]
    assert [list(range(12))[p] for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    with pytest.raises(ConfigError, match=r"train\.batch_size"):
        batch_slice(10, Workers(0, 3))


def test_bad_worker_settings_are_refused_naming_the_field(monkeypatch) -> None:
    with pytest.raises(ConfigError, match=r"train"):
        config_from_dict({"train": {"workers": 3, "batch_size": 64}})
    with pytest.raises(ConfigError, match=r"train\.workers"):
        config_from_dict({"train": {"workers": 2}, "federated": {}})
    with pytest.raises(ConfigError, match=r"train\.workers"):
        config_from_dict({"train": {"workers": 0}})
    # launched among 3 processes for a config of 2 (no process group is joined)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match=r"train\.workers"):
        init_workers(2, "cpu")
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ConfigError, match=r"train\.workers"):  # 2 asked, started alone
        init_workers(2, "cpu")
