"""Benchmark: xvector-small training step and embedding extraction at 1 vs 2 torch threads.

Prints ms/step, utterances/s, and the step's FLOP floor (docs/benchmarks.md) at each thread count.
Usage: python benchmarks/bench_threads.py [--steps 10] [--threads 1,2] [--repeats 2] [--norm batch]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floor import matmul_rate

from fedvox.models import AAMSoftmax, build_extractor, train_step

BATCH, FRAMES, FEAT_DIM, SPEAKERS = 64, 200, 30, 200


def median_ms(fn, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--norm", default="batch", choices=["batch", "layer", "none"])
    parser.add_argument("--repeats", type=int, default=2, help="interleaved passes over --threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    extractor = build_extractor("xvector-small", FEAT_DIM, norm=args.norm)
    head = AAMSoftmax(extractor.emb_dim, SPEAKERS, margin=0.2)
    optimizer = torch.optim.SGD([*extractor.parameters(), *head.parameters()], lr=0.01)
    feats = torch.randn(BATCH, FRAMES, FEAT_DIM, generator=gen)
    labels = torch.randint(0, SPEAKERS, (BATCH,), generator=gen)

    with FlopCounterMode(display=False) as counter:
        head(extractor.head_input(feats), labels)
    forward_flops = counter.get_total_flops()
    step_flops = 3 * forward_flops  # forward + backward ~ 3x forward (docs/benchmarks.md)

    def step() -> None:
        extractor.train()
        train_step(extractor, head, optimizer, feats, labels)

    def extract() -> None:
        extractor.eval()
        with torch.no_grad():
            extractor(feats)

    print(
        f"xvector-small norm={args.norm}: batch {BATCH} x {FRAMES} frames x {FEAT_DIM}, "
        f"AAM over {SPEAKERS} speakers; forward {forward_flops / 1e9:.2f} GFLOP, "
        f"step ~{step_flops / 1e9:.2f} GFLOP; median of {args.steps} after {args.warmup} warmup"
    )
    print(
        f"{'pass':>4} {'threads':>7} {'matmul GF/s':>11} {'step ms':>8} {'utt/s':>7} {'x floor':>7}"
        f" {'extract ms':>10} {'utt/s':>7}"
    )
    thread_counts = [int(t) for t in args.threads.split(",")]
    previous = torch.get_num_threads()
    try:
        # Passes alternate thread counts so drift in the machine's load hits both alike.
        for rep, threads in itertools.product(range(args.repeats), thread_counts):
            torch.set_num_threads(threads)
            rate = matmul_rate()
            step_ms = median_ms(step, args.steps, args.warmup)
            extract_ms = median_ms(extract, args.steps, args.warmup)
            floor_ms = 1000 * step_flops / rate
            print(
                f"{rep:>4} {threads:>7} {rate / 1e9:>11.1f} {step_ms:>8.1f} {BATCH / step_ms * 1000:>7.0f}"
                f" {step_ms / floor_ms:>7.2f} {extract_ms:>10.1f} {BATCH / extract_ms * 1000:>7.0f}"
            )
    finally:
        torch.set_num_threads(previous)


if __name__ == "__main__":
    main()
