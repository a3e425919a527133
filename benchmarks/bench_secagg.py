"""Benchmark secure aggregation (privacy/secagg.py): seconds and bytes per client and server.

Runs SecureSum over n clients with `dim` parameters each and protocol-level dropouts after
ShareKeys, once with the full graph (Bonawitz) and once with SecAgg+ neighbours, and prints
client seconds (mean per client, by stage), server seconds (unmasking includes regenerating
every PRG mask), bytes up/down per client (mean over survivors) and server totals.

    nice -n 10 .venv/bin/python benchmarks/bench_secagg.py                  # n=100, dim=10^6
    .venv/bin/python benchmarks/bench_secagg.py --n 10 --dim 1000
    .venv/bin/python benchmarks/bench_secagg.py --neighbours 20 --skip-full

The default scale is the largest 2^s (s ≤ 22) whose sum of n clients fits the 2^32 ring with
clip 8 (n=100: s=21); the ring check refuses anything larger.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from fedvox.fl.aggregation import weighted_sum
from fedvox.privacy.secagg import SecAggConfig, SecureSum


def largest_scale_bits(n: int, clip: float, modulus_bits: int) -> int:
    for s in range(22, -1, -1):
        if SecAggConfig(clip=clip, scale_bits=0, modulus_bits=modulus_bits).max_clients() < n:
            break
        cfg = SecAggConfig(clip=clip, scale_bits=s, modulus_bits=modulus_bits)
        if cfg.max_clients() >= n:
            return s
    raise SystemExit(f"no scale fits {n} clients in 2^{modulus_bits}: raise --modulus-bits")


def size(nbytes: float) -> str:
    for unit, factor in (("MB", 1e6), ("kB", 1e3)):
        if nbytes >= factor:
            return f"{nbytes / factor:.3f} {unit}"
    return f"{nbytes:.0f} B"


def run(label: str, cfg: SecAggConfig, deltas: dict, weights: torch.Tensor, seed: int) -> None:
    summer = SecureSum(cfg, seed)
    n = int(weights.shape[0])
    start = time.perf_counter()
    total, weight, count = summer(deltas, weights)
    wall = time.perf_counter() - start
    stats = summer.last_stats
    assert stats is not None
    surv = summer.last_survivors
    plain = weighted_sum({k: v[surv] for k, v in deltas.items()}, weights[surv])
    err = max(float((total[k] - plain[k]).abs().max()) for k in deltas)
    params = summer.protocol_params(n, 1, 0)
    print(
        f"\n== {label}: n={n}, dim={deltas['x'].shape[1]}, survivors={count}, "
        f"t={params.threshold}, share group={len(params.neighbours[0]) + 1}"
    )
    print("client seconds, mean per client that ran the stage:")
    client_total = 0.0
    for stage, secs in stats.client_seconds.items():
        client_total += float(np.mean(secs))
        print(
            f"  {stage:<14}{np.mean(secs):9.4f} s   (max {np.max(secs):.4f}, {len(secs)} clients)"
        )
    print(f"  {'all stages':<14}{client_total:9.4f} s")
    print("server seconds:")
    for stage, secs in stats.server_seconds.items():
        print(f"  {stage:<14}{secs:9.4f} s")
    up, down = stats.bytes_up[surv], stats.bytes_down[surv]
    print(f"bytes per surviving client: up {size(up.mean())}, down {size(down.mean())}")
    print(f"server totals: in {size(stats.bytes_up.sum())}, out {size(stats.bytes_down.sum())}")
    print(
        f"whole call {wall:.2f} s (all clients simulated serially); "
        f"max |secure − plain| {err:.2e}, Σw {weight:.6f} vs {float(weights[surv].sum()):.6f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--dim", type=int, default=1_000_000)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument(
        "--neighbours", type=int, default=None, help="SecAgg+ neighbours k (default 2*ceil(log2 n))"
    )
    parser.add_argument("--threshold", type=float, default=2 / 3)
    parser.add_argument("--modulus-bits", type=int, default=32)
    parser.add_argument("--scale-bits", type=int, default=None)
    parser.add_argument("--skip-full", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    scale = args.scale_bits
    if scale is None:
        scale = largest_scale_bits(args.n, 8.0, args.modulus_bits)
    k = args.neighbours or 2 * math.ceil(math.log2(args.n))
    g = torch.Generator().manual_seed(args.seed)
    deltas = {"x": torch.randn(args.n, args.dim, generator=g) * 0.1}
    weights = torch.rand(args.n, generator=g)
    print(
        f"ring 2^{args.modulus_bits}, scale 2^{scale}, clip 8, threshold {args.threshold:.3f}, "
        f"dropout {args.dropout} after ShareKeys, PRG AES-256-CTR"
    )
    base = dict(
        threshold=args.threshold,
        scale_bits=scale,
        modulus_bits=args.modulus_bits,
        dropout=args.dropout,
        dropout_after="share_keys",
    )
    if not args.skip_full:
        run("full graph (Bonawitz)", SecAggConfig(**base), deltas, weights, args.seed)
    run(f"SecAgg+ k={k}", SecAggConfig(**base, neighbours=k), deltas, weights, args.seed)


if __name__ == "__main__":
    main()
