"""Benchmark W1 "xvector-small" (docs/benchmarks.md) through fedvox's federated engine.

The compute-bound workload: 1000 clients x 32 utterances (200 frames x 30), 50 clients/round,
1 epoch, batch 16, SGD 0.05, FedAvg by examples. Prints s/round against the FLOP floor.

Model: build_extractor("xvector-small", 30, norm="layer", embedding_layer="a") then
LinearHead(256, 500) on `head_input`, cross-entropy: W1's layer shapes and FLOPs, but
ChannelLayerNorm replaces BatchNorm, because vmap over clients cannot carry BN's running
statistics (docs/federated.md). Each thread count runs in its own process. A client of this
size (5 MB of parameters) is trained one at a time (fl/local/steps.py SOLO_BYTES): vmap over clients
turns the convolutions into grouped ones and ran 30-40% slower (--chunk 3 shows it).

    .venv/bin/python benchmarks/bench_w1.py            # threads 1 and 2
    .venv/bin/python benchmarks/bench_w1.py --threads 2 --plain   # plain PyTorch loop reference
    .venv/bin/python benchmarks/bench_w1.py --threads 1 [--loop] [--chunk 3] [--cohort 10]
    .venv/bin/python benchmarks/bench_w1.py --norm none   # no norm layers: same FLOPs, but at
                                                          # lr 0.05 its loss does not go down
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
from torch import Tensor, nn

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
from fedvox.fl.local.steps import auto_chunk
from fedvox.fl.simulator import SimRecord
from fedvox.models import build_extractor
from fedvox.models.heads import LinearHead
from fedvox.records import ServerStepRecord

CLIENTS, PER_CLIENT, COHORT, BATCH, LR = 1000, 32, 50, 16, 0.05
FRAMES, FEAT, SPEAKERS, ROUNDS = 200, 30, 500, 6


class W1Net(nn.Module):
    """x-vector (embedding at segment a) -> ReLU/LN -> segment b -> ReLU/LN -> Linear 500."""

    def __init__(self, norm: str = "layer") -> None:
        super().__init__()
        self.extractor = build_extractor("xvector-small", FEAT, norm=norm, embedding_layer="a")
        self.head = LinearHead(256, SPEAKERS)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.extractor.head_input(x))


def build(norm: str = "layer") -> tuple[ModuleTask, Population]:
    """Synthetic W1 data: x = 0.5·μ[speaker] + N(0,1) per frame; 2 speakers per client."""
    rng = np.random.default_rng(0)
    mu = rng.normal(size=(SPEAKERS, FEAT)).astype(np.float32)
    n = CLIENTS * PER_CLIENT
    pairs = rng.integers(SPEAKERS, size=(CLIENTS, 2))
    y = pairs[np.repeat(np.arange(CLIENTS), PER_CLIENT), rng.integers(2, size=n)]
    x = torch.from_numpy(rng.standard_normal((n, FRAMES, FEAT), dtype=np.float32))
    x += 0.5 * torch.from_numpy(mu[y]).unsqueeze(1)
    store = {"x": x, "y": torch.from_numpy(y)}
    torch.manual_seed(0)
    task = ModuleTask(W1Net(norm), lambda out, b: F.cross_entropy(out, b["y"], reduction="none"))
    return task, Population(store, list(np.arange(n).reshape(CLIENTS, PER_CLIENT)), seed=0)


def run_plain(threads: int, cohort: int, norm: str) -> None:
    """The reference: a plain PyTorch loop over clients (load weights, torch.optim.SGD steps on
    the module, average the deltas by examples), no engine; same data, FLOPs and floor."""
    torch.set_num_threads(threads)
    task, pop = build(norm)
    net = task.module
    flops = train_flops(
        forward_flops(lambda: task.loss(task.init_params(), pop.gather(np.arange(BATCH)))) / BATCH,
        cohort * PER_CLIENT,
    )
    rate = matmul_rate()
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    rng = np.random.default_rng(0)
    stamps, losses = [time.perf_counter()], []
    for _ in range(ROUNDS):
        total = {n: torch.zeros_like(t) for n, t in glob.items()}
        round_loss = 0.0
        for c in rng.choice(CLIENTS, size=cohort, replace=False):
            with torch.no_grad():
                for n, p in net.named_parameters():
                    p.copy_(glob[n])
            opt = torch.optim.SGD(net.parameters(), lr=LR)
            rows = pop.order[pop.offsets[c] : pop.offsets[c + 1]][rng.permutation(PER_CLIENT)]
            for i in range(0, PER_CLIENT, BATCH):
                batch = pop.gather(rows[i : i + BATCH])
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(net(batch["x"]), batch["y"])
                loss.backward()
                opt.step()
                round_loss += float(loss.detach()) / (cohort * PER_CLIENT // BATCH)
            with torch.no_grad():
                for n, p in net.named_parameters():
                    total[n] += glob[n] - p  # equal example counts: a plain mean
        for n in glob:
            glob[n] -= total[n] / cohort
        stamps.append(time.perf_counter())
        losses.append(round_loss)
    report(
        f"W1 threads={threads} cohort={cohort} plain PyTorch loop norm={norm}",
        median_rounds(stamps),
        flops,
        rate,
        losses,
    )


def run(
    threads: int, vectorised: bool, chunk: int | None, cohort: int, norm: str, ray: int = 0
) -> None:
    torch.set_num_threads(threads)
    task, pop = build(norm)
    flops = train_flops(
        forward_flops(lambda: task.loss(task.init_params(), pop.gather(np.arange(BATCH)))) / BATCH,
        cohort * PER_CLIENT,
    )
    rate = matmul_rate()
    stamps, losses = [time.perf_counter()], []

    def on_record(r: SimRecord) -> None:
        if isinstance(r, ServerStepRecord):
            stamps.append(time.perf_counter())
            losses.append(r.loss)

    sim = Simulator(
        task,
        pop,
        FedAvg(ServerSGD(1.0)),
        ClientConfig(
            epochs=1,
            batch_size=BATCH,
            lr=LR,
            vectorised=vectorised,
            chunk_size=chunk,
        ),
        SimulatorConfig(concurrency=cohort, delay=DelayModel("constant"), seed=0),
        callback=on_record,
        client_update=ray_update(pop, ray),
    )
    sim.run(max_server_steps=ROUNDS)
    auto = auto_chunk(task.init_params(), cohort)  # 1: big clients run one at a time
    mode = f"vectorised chunk={chunk or f'auto={auto}'}" if vectorised else "loop"
    mode += f" norm={norm}" + (f" on {ray} Ray workers x 1 thread" if ray else "")
    report(
        f"W1 threads={threads} cohort={cohort} {mode}", median_rounds(stamps), flops, rate, losses
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--ray", type=int, default=0, help="train clients on N Ray workers x 1 thread (0: here)"
    )
    ap.add_argument("--loop", action="store_true", help="the engine's per-client loop")
    ap.add_argument(
        "--plain", action="store_true", help="reference: a plain PyTorch loop, no engine"
    )
    ap.add_argument("--chunk", type=int, default=None, help="clients per vectorised call")
    ap.add_argument(
        "--cohort", type=int, default=COHORT, help="clients per round (smaller: a quick check)"
    )
    ap.add_argument(
        "--norm",
        choices=("layer", "none"),
        default="layer",
        help="frame/segment normalisation (W1 allows it to differ; 'none' keeps the FLOPs)",
    )
    ap.add_argument(
        "--keep-memory", action="store_true", help="malloc keeps freed pages (floor.py)"
    )
    args = ap.parse_args()
    if args.threads is not None:
        keep_memory_if_asked(args.keep_memory)
        if args.plain:
            run_plain(args.threads, args.cohort, args.norm)
        else:
            run(args.threads, not args.loop, args.chunk, args.cohort, args.norm, args.ray)
        return
    for threads in (1, 2):
        cmd = [sys.executable, __file__, "--threads", str(threads), "--cohort", str(args.cohort)]
        cmd += ["--norm", args.norm]
        if args.keep_memory:
            cmd.append("--keep-memory")
        for flag in ("loop", "plain"):
            if getattr(args, flag):
                cmd.append(f"--{flag}")
        if args.chunk:
            cmd += ["--chunk", str(args.chunk)]
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
