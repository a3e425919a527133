"""Benchmark: population scaling — 100,000 clients, 1,000 trips in flight (FedBuff).

Checks design principle 6 (memory follows concurrency, not population): a tiny model
(logistic regression, 32 features x 10 classes, 8 examples per client), FedBuff K=100,
C=1000, half-normal delays. Prints time per 1,000 client trips, s/server step against its
FLOP floor, peak RSS (target <= 4 GiB) and the loss trend.

    .venv/bin/python benchmarks/bench_population.py            # threads 1 and 2
    .venv/bin/python benchmarks/bench_population.py --threads 1 --trips 20000
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floor import (
    forward_flops,
    keep_memory_if_asked,
    matmul_rate,
    median_rounds,
    peak_rss_mb,
    report,
    train_flops,
)

from fedvox.fl import (
    ClientConfig,
    DelayModel,
    FedBuff,
    ModuleTask,
    Population,
    ServerSGD,
    Simulator,
    SimulatorConfig,
)
from fedvox.fl.simulator import SimRecord
from fedvox.records import ServerStepRecord

CLIENTS, PER_CLIENT, DIM, CLASSES = 100_000, 8, 32, 10
CONCURRENCY, BUFFER, BATCH, LR = 1000, 100, 8, 0.1


def build() -> tuple[ModuleTask, Population]:
    """Gaussian classes x = 0.5·μ[y] + N(0,1); each client's labels from 2 classes."""
    rng = np.random.default_rng(0)
    mu = rng.normal(size=(CLASSES, DIM)).astype(np.float32)
    n = CLIENTS * PER_CLIENT
    pairs = rng.integers(CLASSES, size=(CLIENTS, 2))
    y = pairs[np.repeat(np.arange(CLIENTS), PER_CLIENT), rng.integers(2, size=n)]
    x = 0.5 * mu[y] + rng.standard_normal((n, DIM), dtype=np.float32)
    store = {"x": torch.from_numpy(x), "y": torch.from_numpy(y)}
    torch.manual_seed(0)
    task = ModuleTask(
        nn.Sequential(nn.Linear(DIM, CLASSES)),
        lambda out, b: F.cross_entropy(out, b["y"], reduction="none"),
    )
    return task, Population(store, np.arange(n).reshape(CLIENTS, PER_CLIENT), seed=0)


def run(threads: int, trips: int) -> None:
    torch.set_num_threads(threads)
    t_build = time.perf_counter()
    task, pop = build()
    t_build = time.perf_counter() - t_build
    rss_built = peak_rss_mb()
    fwd = forward_flops(lambda: task.loss(task.init_params(), pop.gather(np.arange(BATCH))))
    flops = train_flops(fwd / BATCH, BUFFER * PER_CLIENT)  # one server step
    rate = matmul_rate()
    stamps, losses, trip_marks = [time.perf_counter()], [], []

    def on_record(r: SimRecord) -> None:
        if isinstance(r, ServerStepRecord):
            stamps.append(time.perf_counter())
            losses.append(r.loss)
            trip_marks.append((r.trips, stamps[-1]))

    sim = Simulator(
        task,
        pop,
        FedBuff(BUFFER, ServerSGD(1.0)),
        ClientConfig(epochs=1, batch_size=BATCH, lr=LR),
        SimulatorConfig(concurrency=CONCURRENCY, delay=DelayModel("half_normal"), seed=0),
        callback=on_record,
    )
    sim.run(max_trips=trips)
    # time per 1,000 trips after the first 1,000 (warm-up: the initial fill of C trips)
    (n0, t0), (n1, t1) = next(m for m in trip_marks if m[0] >= 1000), trip_marks[-1]
    per_1000 = (t1 - t0) / (n1 - n0) * 1000
    report(
        f"population threads={threads} ({CLIENTS} clients, C={CONCURRENCY}, K={BUFFER})",
        median_rounds(stamps),
        flops,
        rate,
        [float(np.mean(losses[:5])), float(np.mean(losses[-5:]))],
        extra=(
            f"{per_1000:.3f} s per 1000 trips over {n1 - n0} trips, versions live "
            f"{len(sim.versions)}, data built in {t_build:.1f} s with RSS {rss_built:.0f} MB"
        ),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--trips", type=int, default=20_000, help="client trips to complete")
    ap.add_argument(
        "--keep-memory", action="store_true", help="malloc keeps freed pages (floor.py)"
    )
    args = ap.parse_args()
    if args.threads is not None:
        keep_memory_if_asked(args.keep_memory)
        run(args.threads, args.trips)
        return
    for threads in (1, 2):
        cmd = [sys.executable, __file__, "--threads", str(threads), "--trips", str(args.trips)]
        if args.keep_memory:
            cmd.append("--keep-memory")
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
