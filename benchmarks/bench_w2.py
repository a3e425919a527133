"""Benchmark W2 "mlp-overhead" (benchmarks.md) through fedvox's federated engine.

MLP 784-200-200-10, 1000 clients x 50 examples, 100 clients/round, 1 epoch, batch 10,
SGD 0.1, FedAvg. Prints s/round (median of rounds 2-6), the FLOP floor measured in the same
process, the ratio, peak RSS and the loss trend. Each thread count runs in its own process.

    .venv/bin/python benchmarks/bench_w2.py            # threads 1 and 2
    .venv/bin/python benchmarks/bench_w2.py --threads 1 [--loop] [--chunk 100]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fedvox.fl import (
    ClientConfig,
    DelayModel,
    FedAvg,
    ModuleTask,
    Population,
    ServerSGD,
    Simulator,
    SimulatorConfig,
)

CLIENTS, PER_CLIENT, COHORT, BATCH, LR, CLASSES, DIM = 1000, 50, 100, 10, 0.1, 10, 784
ROUNDS = 6


def matmul_rate(n: int = 2048, reps: int = 5) -> float:
    """Dense float32 matmul FLOP/s at the current thread count (median of `reps`)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


def build() -> tuple[ModuleTask, Population]:
    rng = np.random.default_rng(0)
    mu = rng.normal(size=(CLASSES, DIM)).astype(np.float32)
    n = CLIENTS * PER_CLIENT
    y = rng.integers(CLASSES, size=n)
    x = 0.3 * mu[y] + rng.standard_normal((n, DIM), dtype=np.float32)
    store = {"x": torch.from_numpy(x), "y": torch.from_numpy(y)}
    idx = np.arange(n).reshape(CLIENTS, PER_CLIENT)
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(DIM, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU(), nn.Linear(200, CLASSES)
    )
    task = ModuleTask(net, lambda out, b: F.cross_entropy(out, b["y"], reduction="none"))
    return task, Population(store, list(idx), seed=0)


def run(threads: int, vectorised: bool, chunk: int | None) -> None:
    torch.set_num_threads(threads)
    task, pop = build()
    with FlopCounterMode(display=False) as fc:
        task.loss(task.init_params(), pop.gather(np.arange(BATCH)))
    fwd_per_example = fc.get_total_flops() / BATCH
    round_flops = 3 * fwd_per_example * COHORT * PER_CLIENT
    rate = matmul_rate()
    floor = round_flops / rate

    stamps, losses = [time.perf_counter()], []

    def on_record(r: dict) -> None:
        if r["kind"] == "server_step":
            stamps.append(time.perf_counter())
            losses.append(r["loss"])

    sim = Simulator(
        task,
        pop,
        FedAvg(ServerSGD(1.0)),
        ClientConfig(epochs=1, batch_size=BATCH, lr=LR, vectorised=vectorised, chunk_size=chunk),
        SimulatorConfig(concurrency=COHORT, delay=DelayModel("constant"), seed=0),
        callback=on_record,
    )
    sim.run(max_server_steps=ROUNDS)
    per_round = np.diff(stamps)
    med = statistics.median(per_round[1:6])
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    mode = f"vectorised chunk={chunk or 'auto'}" if vectorised else "loop"
    print(
        f"threads={threads} {mode}: {med:.4f} s/round (rounds 2-6 median), "
        f"floor {floor:.4f} s ({round_flops / 1e9:.2f} GFLOP at {rate / 1e9:.1f} GFLOP/s), "
        f"ratio {med / floor:.2f}x, peak RSS {rss_mb:.0f} MB, "
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f} ({'down' if losses[-1] < losses[0] else 'NOT down'})"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--loop", action="store_true", help="reference per-client loop")
    ap.add_argument("--chunk", type=int, default=None, help="clients per vectorised call")
    args = ap.parse_args()
    if args.threads is not None:
        run(args.threads, not args.loop, args.chunk)
        return
    for threads in (1, 2):
        subprocess.run([sys.executable, __file__, "--threads", str(threads)], check=True)


if __name__ == "__main__":
    main()
