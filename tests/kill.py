"""Start `fedvox train` in a subprocess and SIGKILL it once a given checkpoint exists: the
crash that the resume tests recover from."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def train_until_killed(cfg: Path, run: Path, checkpoint: int, timeout_s: float = 120) -> None:
    """Train `cfg` into `run`, killed (SIGKILL) as soon as checkpoint `checkpoint` is on disk."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedvox.cli", "train", str(cfg), "--out", str(run), "-q"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + timeout_s
    name = f"ckpt-{checkpoint:09d}.pt"
    while time.time() < deadline and not list((run / "checkpoints").glob(name)):
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
