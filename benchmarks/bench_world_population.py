"""Benchmark: the concurrency study's population — 10,000 world-sized devices, C = 1,000.

Issue 15's population check on the study's own engine path: Federated Reconstruction with
local speakers and public negatives (the server's broadcast, recomputed every 100 trips as in
the study: --broadcast-every versions to change it), xvector-tiny with
LayerNorm, one local epoch of batch 8, packed cohorts, half-normal delays, FedBuff K = 10 or
FedAvg (a cohort of C per round). The devices have the shapes of the study world
(fedvox repro fedbuff-concurrency): 3-12 recordings each (log-uniform), 2-4 s, cut into fixed
200-frame chunks of 30 MFCCs; the features are seeded noise of those shapes (what is
measured is time and memory, not learning: the world's 10,000 devices take ~2 h to
generate on this machine). Prints s/trip (median over server steps after the first fill,
and the share of the public negatives), peak RSS and its parts: the feature store (grows
with the population) and the rest (grows with concurrency).

    .venv/bin/python benchmarks/bench_world_population.py                  # FedBuff K = 10
    .venv/bin/python benchmarks/bench_world_population.py --algorithm fedavg --steps 2
    .venv/bin/python benchmarks/bench_world_population.py --devices 1000 --concurrency 100
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floor import load_average, peak_rss_mb

from fedvox.fl import (
    ClientConfig,
    DelayModel,
    FedAvg,
    FedBuff,
    ServerSGD,
    Simulator,
    SimulatorConfig,
)
from fedvox.fl.local import ReconConfig
from fedvox.fl.simulator import SimRecord
from fedvox.models import build_extractor
from fedvox.records import ServerStepRecord
from fedvox.tasks.speakers import (
    PublicStore,
    SpeakerReconTask,
    make_version_broadcast,
    received_broadcast_update,
    speaker_population,
)
from fedvox.tasks.speakers import update as speaker_update

FRAMES, FEAT, HOP_S = 200, 30, 0.01


def world_sizes(devices: int, seed: int) -> np.ndarray:
    """Chunks per device: 3-12 recordings (log-uniform) of 2-4 s, each cut into its own
    200-frame chunks (at least one), as the study world's devices are (measured there: 6.2
    chunks a device)."""
    rng = np.random.default_rng(seed)
    recs = np.exp(rng.uniform(np.log(3), np.log(12 + 1), size=devices)).astype(int)
    return np.array(
        [int(np.maximum(1, rng.uniform(2.0, 4.0, size=r) / HOP_S // FRAMES).sum()) for r in recs]
    )


def build(devices: int, public_speakers: int, seed: int = 0):
    """The store (seeded noise of the world's shapes), the population, the public store."""
    sizes = world_sizes(devices, seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(int(sizes.sum()), FRAMES, FEAT, generator=g)
    y = torch.from_numpy(np.repeat(np.arange(devices), sizes))
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    rows = [np.arange(offsets[i], offsets[i + 1]) for i in range(devices)]
    pop = speaker_population({"x": x, "y": y}, rows, seed=seed, max_local=1)
    px = torch.randn(public_speakers, FRAMES, FEAT, generator=g)
    public = PublicStore(px, torch.arange(public_speakers), tuple(map(str, range(public_speakers))))
    return pop, public, sizes, x.numel() * x.element_size()


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    pop, public, sizes, store_bytes = build(args.devices, args.public_speakers)
    built_s, rss_built = time.perf_counter() - t0, peak_rss_mb()
    torch.manual_seed(0)
    extractor = build_extractor("xvector-tiny", FEAT, norm="layer")
    task = SpeakerReconTask(extractor, scale=30.0, margin=0.0, max_local=1, negatives="public")
    neg_s = [0.0]
    real = speaker_update.public_prototypes

    def timed_negatives(*a, **kw):  # the server's per-version negatives, timed
        t = time.perf_counter()
        out = real(*a, **kw)
        neg_s[0] += time.perf_counter() - t
        return out

    speaker_update.public_prototypes = timed_negatives
    update = received_broadcast_update(ReconConfig(steps=0, closed_form=True, split="all"))
    per_step = args.buffer if args.algorithm == "fedbuff" else args.concurrency
    every = args.broadcast_every or max(1, 100 // per_step)  # the study's 100 trips
    algorithm = (
        FedBuff(args.buffer, ServerSGD(0.025))
        if args.algorithm == "fedbuff"
        else FedAvg(ServerSGD(0.05))
    )
    stamps: list[tuple[int, float, float]] = []  # (trips, time, negatives seconds so far)

    def on_record(r: SimRecord) -> None:
        if isinstance(r, ServerStepRecord):
            stamps.append((r.trips, time.perf_counter(), neg_s[0]))

    sim = Simulator(
        task,
        pop,
        algorithm,
        ClientConfig(epochs=1, batch_size=8, lr=0.01, pack=True),
        SimulatorConfig(
            concurrency=args.concurrency, delay=DelayModel("half_normal", mean=60.0), seed=0
        ),
        client_update=update,
        callback=on_record,
        broadcast=make_version_broadcast(task, public),
        broadcast_every=every,
    )
    start = time.perf_counter()
    sim.run(max_server_steps=args.steps)
    wall = time.perf_counter() - start
    per_trip, neg_share = [], []
    for (n0, a, g0), (n1, b, g1) in itertools.pairwise(stamps):
        if n1 > n0:
            per_trip.append((b - a) / (n1 - n0))
            neg_share.append((g1 - g0) / max(b - a, 1e-9))
    if not per_trip:  # one step: its own time over its trips
        per_trip, neg_share = [wall / stamps[-1][0]], [neg_s[0] / wall]
    peak = peak_rss_mb()
    print(
        f"world population {args.algorithm} ({args.devices:,} devices, {int(sizes.sum()):,} "
        f"chunks, {sizes.mean():.1f} per device; C={args.concurrency}"
        + (f", K={args.buffer}" if args.algorithm == "fedbuff" else "")
        + f"; {args.public_speakers} public negatives every {every} versions): {statistics.median(per_trip):.4f} s/trip "
        f"median over {len(per_trip)} server steps ({stamps[-1][0]:,} trips in {wall:.1f} s), "
        f"negatives {100 * statistics.median(neg_share):.1f} % of a step, "
        f"{args.threads} thread(s); peak RSS {peak:.0f} MB = feature store "
        f"{store_bytes / 2**20:.0f} MB (grows with devices) + {peak - store_bytes / 2**20:.0f} "
        f"MB (process, model, versions, in-flight trips); RSS after building {rss_built:.0f} MB "
        f"in {built_s:.1f} s; versions live {len(sim.versions)}; load {load_average():.2f}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=1000)
    ap.add_argument("--algorithm", choices=("fedbuff", "fedavg"), default="fedbuff")
    ap.add_argument("--buffer", type=int, default=10, help="FedBuff K")
    ap.add_argument("--steps", type=int, default=30, help="server steps to run")
    ap.add_argument("--public-speakers", type=int, default=100)
    ap.add_argument(
        "--broadcast-every",
        type=int,
        default=0,
        help="versions between recomputing the negatives (0: every 100 trips, as the study)",
    )
    ap.add_argument("--threads", type=int, default=1)
    run(ap.parse_args())


if __name__ == "__main__":
    main()
