"""Training throughput (utterances/s) and extraction real-time factor of the x-vector models.

Run: .venv/bin/python benchmarks/bench_train.py [--model xvector-small] [--threads 1 2]
Synthetic tensors stand in for features; the numbers measure the model, not the data layer.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from fedvox.eval.extract import embed_utterances
from fedvox.models import build_extractor, count_parameters
from fedvox.models.heads import AAMSoftmax
from fedvox.models.step import train_step


def bench(model: str, threads: int, feat_dim: int, batch: int, frames: int, steps: int) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    ext = build_extractor(model, feat_dim)
    emb_dim = ext(torch.zeros(2, 50, feat_dim)).shape[1]
    head = AAMSoftmax(emb_dim, 200)
    opt = torch.optim.Adam([*ext.parameters(), *head.parameters()], lr=1e-3)
    x = torch.randn(batch, frames, feat_dim)
    y = torch.randint(0, 200, (batch,))
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        train_step(ext, head, opt, x, y)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    # extraction: 50 utterances of 4 s (400 frames at 10 ms) one at a time, as evaluation does
    utts = [
        np.random.default_rng(i).normal(size=(400, feat_dim)).astype(np.float32) for i in range(50)
    ]
    t0 = time.perf_counter()
    embed_utterances(ext, utts)
    ext_s = time.perf_counter() - t0
    return {
        "model": model,
        "params": count_parameters(ext),
        "threads": threads,
        "ms_per_step": 1000 * step_s,
        "train_utt_per_s": batch / step_s,
        "extract_rtf": ext_s / (50 * 4.0),
        "extract_x_realtime": (50 * 4.0) / ext_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", nargs="+", default=["xvector-small"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--feat-dim", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--frames", type=int, default=300)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    print(
        f"{'model':>14} {'params':>9} {'thr':>3} {'ms/step':>8} {'train utt/s':>11} {'extract RTF':>11} {'x realtime':>10}"
    )
    for m in a.model:
        for t in a.threads:
            r = bench(m, t, a.feat_dim, a.batch, a.frames, a.steps)
            print(
                f"{r['model']:>14} {r['params']:>9,} {r['threads']:>3} {r['ms_per_step']:>8.1f} "
                f"{r['train_utt_per_s']:>11.1f} {r['extract_rtf']:>11.5f} {r['extract_x_realtime']:>10.0f}"
            )


if __name__ == "__main__":
    main()
