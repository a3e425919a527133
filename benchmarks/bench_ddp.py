"""Benchmark: centralised training step time with train.workers data-parallel processes (DDP).

Runs `fedvox train` on a small embedded corpus at two step counts per setting and prints
the difference per step — s/step with start-up, data preparation and evaluation cancelled —
for each (workers, threads) setting, and the ratio against the first setting.

    .venv/bin/python benchmarks/bench_ddp.py                          # 1×2, 1×1, 2×1 on xvector
    .venv/bin/python benchmarks/bench_ddp.py --settings 1x1,2x1 --model xvector-small
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = """name = "bench-ddp"
seed = 0
[data]
cache_dir = "{cache}"
workers = 1
[data.synthetic]
n_train_speakers = 16
n_test_speakers = 4
train_utts_per_speaker = 8
test_utts_per_speaker = 3
min_duration_s = 3.0
max_duration_s = 4.0
[model]
name = "{model}"
[train]
batch_size = {batch}
chunk_frames = [200, 300]
checkpoint_every = 100000
[eval]
asnorm_top_n = 4
lda_dim = 6
"""


def timed_run(cfg: Path, out: Path, steps: int, workers: int, threads: int) -> float:
    """Wall seconds of one `fedvox train` (start-up, data, training, evaluation)."""
    sets = [f"train.steps={steps}", f"train.workers={workers}", f"train.threads={threads}"]
    cmd = [sys.executable, "-m", "fedvox.cli", "train", str(cfg), "--out", str(out), "-q"]
    cmd += [a for s in sets for a in ("--set", s)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", default="1x2,1x1,2x1", help="workers x threads, comma-separated")
    p.add_argument("--model", default="xvector")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", default="5,25", help="the two step counts")
    args = p.parse_args()
    lo, hi = (int(s) for s in args.steps.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cfg = root / "bench.toml"
        cfg.write_text(CONFIG.format(cache=root / "cache", model=args.model, batch=args.batch))
        timed_run(cfg, root / "warm", 1, 1, 1)  # generate and cache the corpus once
        first = None
        for setting in args.settings.split(","):
            w, t = (int(x) for x in setting.split("x"))
            a = timed_run(cfg, root / f"{setting}-lo", lo, w, t)
            b = timed_run(cfg, root / f"{setting}-hi", hi, w, t)
            per = (b - a) / (hi - lo)
            first = first or per
            print(
                f"workers {w} × threads {t}: {per:.3f} s/step ({args.model}, batch "
                f"{args.batch}; runs {a:.1f} s / {b:.1f} s) — {first / per:.2f}× the first",
                flush=True,
            )


if __name__ == "__main__":
    main()
