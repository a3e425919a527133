"""Benchmark W2 "mlp-overhead" (docs/benchmarks.md) through fedvox's federated engine.

MLP 784-200-200-10, 1000 clients x 50 examples, 100 clients/round, 1 epoch, batch 10,
SGD 0.1, FedAvg. Prints s/round (median of rounds 2-6), the FLOP floor measured in the same
process, the ratio, peak RSS and the loss trend. Each thread count runs in its own process.

    .venv/bin/python benchmarks/bench_w2.py            # threads 1 and 2
    .venv/bin/python benchmarks/bench_w2.py --threads 1 [--loop] [--chunk 100] [--lowrank off]

The MLP takes the exact low-rank client path (fedvox/fl/local/lowrank.py `train_lowrank`) unless
--lowrank off selects the generic vmap path.
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
    ray_update,
    report,
    train_flops,
)

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
from fedvox.fl.simulator import SimRecord
from fedvox.records import ServerStepRecord

CLIENTS, PER_CLIENT, COHORT, BATCH, LR, CLASSES, DIM = 1000, 50, 100, 10, 0.1, 10, 784
ROUNDS = 6


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


def run(
    threads: int, vectorised: bool, chunk: int | None, lowrank: bool | None, ray: int = 0
) -> None:
    torch.set_num_threads(threads)
    task, pop = build()
    fwd = forward_flops(lambda: task.loss(task.init_params(), pop.gather(np.arange(BATCH))))
    flops = train_flops(fwd / BATCH, COHORT * PER_CLIENT)
    rate = matmul_rate()
    stamps, losses = [time.perf_counter()], []

    def on_record(r: SimRecord) -> None:
        if isinstance(r, ServerStepRecord):
            stamps.append(time.perf_counter())
            losses.append(r.loss)

    client = ClientConfig(
        epochs=1,
        batch_size=BATCH,
        lr=LR,
        vectorised=vectorised,
        chunk_size=chunk,
        lowrank=lowrank,
    )
    sim = Simulator(
        task,
        pop,
        FedAvg(ServerSGD(1.0)),
        client,
        SimulatorConfig(concurrency=COHORT, delay=DelayModel("constant"), seed=0),
        callback=on_record,
        client_update=ray_update(pop, ray),
    )
    sim.run(max_server_steps=ROUNDS)
    path = {None: "auto", True: "on", False: "off"}[lowrank]
    mode = f"vectorised chunk={chunk or 'auto'} lowrank={path}" if vectorised else "loop"
    mode += f" on {ray} Ray workers x 1 thread" if ray else ""
    report(f"W2 threads={threads} {mode}", median_rounds(stamps), flops, rate, losses)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--ray", type=int, default=0, help="train clients on N Ray workers x 1 thread (0: here)"
    )
    ap.add_argument("--loop", action="store_true", help="reference per-client loop")
    ap.add_argument("--chunk", type=int, default=None, help="clients per vectorised call")
    ap.add_argument("--lowrank", choices=("auto", "on", "off"), default="auto")
    ap.add_argument(
        "--keep-memory", action="store_true", help="malloc keeps freed pages (floor.py)"
    )
    args = ap.parse_args()
    if args.threads is not None:
        keep_memory_if_asked(args.keep_memory)
        lowrank = {"auto": None, "on": True, "off": False}[args.lowrank]
        run(args.threads, not args.loop, args.chunk, lowrank, args.ray)
        return
    for threads in (1, 2):
        cmd = [sys.executable, __file__, "--threads", str(threads), "--lowrank", args.lowrank]
        if args.keep_memory:
            cmd.append("--keep-memory")
        if args.loop:
            cmd.append("--loop")
        if args.chunk:
            cmd += ["--chunk", str(args.chunk)]
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
