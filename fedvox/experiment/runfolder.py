"""A run is a folder: resolved config, manifest, metrics log, checkpoints and report.

Checkpoints are written atomically with a sha256 sidecar; a torn or corrupt one is detected
on load and the previous one is used, with a warning.
"""

from __future__ import annotations

import io
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedvox.atomic import atomic_write, atomic_write_text, sha256_file
from fedvox.device import determinism_settings
from fedvox.errors import FedvoxError
from fedvox.experiment.config import ExperimentConfig, dump_toml, load_config
from fedvox.models.io import MODEL_FILE, load_model
from fedvox.records import (
    EpochRecord,
    EvalRecord,
    Record,
    RunRecord,
    ServerStepRecord,
    TrainRecord,
    append_run_log,
    read_run_log,
    read_run_log_lines,
)

# the record kinds metrics.jsonl holds (client trips go to their own log)
METRICS_KINDS = (TrainRecord, EvalRecord, ServerStepRecord, EpochRecord)

_PACKAGES = ("fedvox", "torch", "numpy", "scipy", "soundfile", "pydantic", "matplotlib")


def git_commit() -> dict[str, Any]:
    """Commit of the fedvox source tree (and whether it had uncommitted changes), if in git."""
    src = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        )
        return {"commit": commit, "dirty": dirty}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo; else what platform reports)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def build_manifest(cfg: ExperimentConfig, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """What is needed to rerun and trust a result: versions, platform, commit, config hash, seed."""
    versions = {}
    for pkg in _PACKAGES:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "config_hash": cfg.hash(),
        "seed": cfg.seed,
        "git": git_commit(),
        "packages": versions,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        # float kernels differ between vector ISAs: same bits are promised on the same ISA
        "cpu_model": cpu_model(),
        "cpu_isa": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "torch_threads": cfg.train.threads,
        # where training ran and the PyTorch switches set for it (fedvox.device)
        "device": cfg.train.device,
        "determinism": determinism_settings(cfg.train.device),
        "command": sys.argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **(extra or {}),
    }


def count_lines(path: Path) -> int:
    """Number of lines in a text file (0 if it does not exist)."""
    if not path.exists():
        return 0
    with open(path) as f:
        return sum(1 for _ in f)


def truncate_lines(path: Path, n: int) -> None:
    """Keep the first n lines of a log (what a checkpoint had seen), atomically."""
    lines = path.read_text().splitlines(keepends=True)[:n] if path.exists() else []
    atomic_write_text(path, "".join(lines))


class RunFolder:
    """The folder of one run and the files in it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    # --- layout -----------------------------------------------------------------------
    @property
    def config_path(self) -> Path:
        return self.path / "config.toml"

    @property
    def manifest_path(self) -> Path:
        return self.path / "manifest.json"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / "checkpoints"

    @property
    def report_path(self) -> Path:
        return self.path / "report.md"

    @property
    def model_path(self) -> Path:
        return self.path / MODEL_FILE

    # --- creation ---------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | Path, cfg: ExperimentConfig, overwrite: bool = False) -> RunFolder:
        """Make a fresh run folder with the resolved config and manifest."""
        path = Path(path)
        if path.exists() and any(path.iterdir()) and not overwrite:
            raise FedvoxError(
                f"run folder {path} already exists. Fix: choose another --out, pass --overwrite, "
                f"or continue it with `fedvox resume {path}`"
            )
        path.mkdir(parents=True, exist_ok=True)
        run = cls(path)
        for old in (run.metrics_path,):
            old.unlink(missing_ok=True)
        atomic_write_text(run.config_path, dump_toml(cfg))
        atomic_write_text(run.manifest_path, json.dumps(build_manifest(cfg), indent=2) + "\n")
        return run

    @classmethod
    def open(cls, path: str | Path) -> RunFolder:
        """Open an existing run folder (for eval, resume, enroll)."""
        run = cls(path)
        if not run.config_path.is_file():
            raise FedvoxError(
                f"{path} is not a fedvox run folder (no config.toml). "
                "Fix: give the folder a `fedvox train` or `fedvox demo` run wrote"
            )
        return run

    def config(self) -> ExperimentConfig:
        return load_config(self.config_path)

    def manifest(self) -> dict[str, Any]:
        return json.loads(self.manifest_path.read_text())

    def update_manifest(self, **fields: Any) -> None:
        m = self.manifest()
        m.update(fields)
        atomic_write_text(self.manifest_path, json.dumps(m, indent=2) + "\n")

    # --- metrics ----------------------------------------------------------------------
    def log_metrics(self, record: Record) -> None:
        """Append one record; flushed and fsynced so a crash loses at most that line."""
        append_run_log(self.metrics_path, [record])

    def read_metrics(self) -> list[RunRecord]:
        """Every record of metrics.jsonl, typed (a torn last line from a crash is skipped)."""
        return read_run_log(self.metrics_path)

    def truncate_metrics(self, after_step: int) -> None:
        """Drop metric lines past a checkpoint so a resumed run does not log them twice.

        The kept lines are kept byte for byte; a torn last line goes.
        """
        path = self.metrics_path
        lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
        records = read_run_log_lines(path, METRICS_KINDS)
        keep = [lines[i - 1] + "\n" for i, r in records if r.step <= after_step]
        atomic_write_text(path, "".join(keep))

    # --- checkpoints ------------------------------------------------------------------
    def save_checkpoint(self, step: int, state: dict[str, Any], keep: int = 3) -> Path:
        """Atomically write checkpoint `step` plus its sha256; keep the newest `keep`."""
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        path = self.checkpoint_dir / f"ckpt-{step:09d}.pt"
        atomic_write(path, lambda f: f.write(data))
        atomic_write_text(path.with_suffix(".sha256"), sha256_file(path) + "\n")
        for old in self._checkpoints()[:-keep]:
            old.unlink(missing_ok=True)
            old.with_suffix(".sha256").unlink(missing_ok=True)
        return path

    def _checkpoints(self) -> list[Path]:
        return sorted(self.checkpoint_dir.glob("ckpt-*.pt"))

    def load_latest_checkpoint(self) -> tuple[int, dict[str, Any]] | None:
        """The newest checkpoint whose hash verifies; corrupt ones are skipped with a warning."""
        for path in reversed(self._checkpoints()):
            side = path.with_suffix(".sha256")
            # Compared as bytes: a torn sidecar need not be text.
            ok = side.is_file() and side.read_bytes().strip() == sha256_file(path).encode()
            if ok:
                try:
                    state = torch.load(path, map_location="cpu", weights_only=False)
                    return int(path.stem.split("-")[1]), state
                except Exception as exc:  # a verified file that still fails to load
                    warnings.warn(
                        f"checkpoint {path} failed to load ({exc}); trying an older one",
                        stacklevel=2,
                    )
                    continue
            warnings.warn(
                f"checkpoint {path} is torn or corrupt (hash mismatch); using an older one",
                stacklevel=2,
            )
        return None


def load_run_model(run: RunFolder) -> tuple[nn.Module, ExperimentConfig]:
    """A run's trained extractor (eval mode) and its config; a run without a model file
    says how to finish training."""
    cfg = run.config()
    if not run.model_path.is_file():
        raise FedvoxError(
            f"{run.path} has no trained model ({MODEL_FILE}). "
            f"Fix: let training finish, or continue it with `fedvox resume {run.path}`"
        )
    return load_model(run.model_path), cfg
