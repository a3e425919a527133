"""Start `train.workers` data-parallel processes through torchrun (torch.distributed.run).

`fedvox train` / `fedvox resume` call this when a config asks for more than one worker and
the process was not itself started by torchrun: the resolved config goes to a temporary TOML,
and torchrun starts that many copies of `python -m fedvox.cli` on this machine (rendezvous
on a free loopback port). Rank 0 owns the run folder; the others only train.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from fedvox.experiment.config import ExperimentConfig, dump_toml


def under_launcher() -> bool:
    """Whether torchrun (or another DDP launcher) started this process."""
    return "WORLD_SIZE" in os.environ


def worker_rank() -> int:
    """This process's rank among the workers (0 without a launcher)."""
    return int(os.environ.get("RANK", "0"))


def launch_workers(cfg: ExperimentConfig, command: list[str]) -> int:
    """Run `fedvox <command>` in cfg.train.workers processes; returns the exit status.

    `command` may name `{config}`: the resolved config's temporary TOML goes there.
    """
    with tempfile.TemporaryDirectory(prefix="fedvox-workers-") as tmp:
        path = Path(tmp) / f"{cfg.name}.toml"
        path.write_text(dump_toml(cfg))
        args = [a.replace("{config}", str(path)) for a in command]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={cfg.train.workers}",
            "-m",
            "fedvox.cli",
            *args,
        ]
        # each worker sets its own torch threads (train.threads); torchrun's OMP default of 1
        # would otherwise be printed as a warning
        env = {**os.environ, "OMP_NUM_THREADS": str(cfg.train.threads)}
        return subprocess.run(cmd, env=env, check=False).returncode
