"""Benchmark: a study arm's server steps in process (1 thread) against Ray workers × 1 thread.

The arm's config and data are built as bench_world_trip.py builds them (defaults ← study
base ← arm ← --set); the simulator is federated.build_setup's, so the Ray runs go through
[federated.backend] kind = "ray" exactly as `fedvox train` would. Three runs of the same
steps from the same seed: inline (train.threads = 1), Ray with 1 worker, Ray with
--workers workers (cpus_per_worker = 1, so 1 thread each). Printed: s/server step (median
of the timed steps), the speed-up of N workers over inline, Ray's overhead per server step
(1 worker minus inline: the same computation, plus shipping versions, shards and results),
whether the weights are bit-identical across the three, and the summed RSS of this process
and all its descendants (Ray's GCS, raylet, workers; pages of the shared object store count
once per process that maps them, so this over-counts).

    .venv/bin/python benchmarks/bench_ray.py --cache-dir /tmp/benchcache --steps 2 \\
        --set data.workers=1 --set data.world.train_devices=40 --set data.world.test_devices=20 \\
        --set data.world.public_speakers=30 --set federated.reconstruction.public_speakers=30 \\
        --set federated.concurrency=8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_world_trip import bench_config
from floor import load_average

from fedvox.device import set_determinism
from fedvox.experiment.config import parse_override
from fedvox.experiment.federated import _set_margin, build_setup
from fedvox.experiment.prepare import prepare
from fedvox.models.heads import margin_schedule


def tree_rss_mb(root: int | None = None) -> float:
    """Summed VmRSS (MiB) of process `root` (default: this one) and all its descendants."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        pid, ppid = int(entry), int(fields.get("PPid", "0").strip())
        children.setdefault(ppid, []).append(pid)
        rss[pid] = int(fields.get("VmRSS", "0 kB").split()[0])
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total / 1024


def measure(cfg, data, steps: int, warmup: int) -> dict[str, Any]:
    """Warm-up then timed server steps of a fresh simulator; its weights and the tree's RSS."""
    setup = build_setup(cfg, data)
    sim, task = setup.simulator, setup.task
    _set_margin(task, margin_schedule(0.0, cfg.model.margin, *cfg.model.margin_ramp))
    try:
        sim.run(max_server_steps=warmup)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            sim.run(max_server_steps=sim.server_step + 1)
            times.append(time.perf_counter() - t)
        rss = tree_rss_mb()
        params = {n: t.clone() for n, t in sim.params.items()}
    finally:
        if setup.backend is not None:
            setup.backend.close()
    return {
        "s_per_step": statistics.median(times),
        "steps_s": times,
        "rss_mb": rss,
        "params": params,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Prepare the arm, measure inline, 1 Ray worker and N Ray workers; print and return."""
    sets = dict(parse_override(s) for s in args.set)
    sets["train.threads"] = 1
    base = bench_config(args.study, args.arm, sets, args.cache_dir)
    set_determinism(1)
    data = prepare(base, progress=not args.quiet)
    ray_sets = {
        "federated.backend.kind": "ray",
        "federated.backend.cpus_per_worker": 1,
        "federated.backend.shard_size": args.shard_size,
    }
    runs = {
        "inline": base,
        "ray-1": bench_config(
            args.study,
            args.arm,
            {**sets, **ray_sets, "federated.backend.workers": 1},
            args.cache_dir,
        ),
        f"ray-{args.workers}": bench_config(
            args.study,
            args.arm,
            {**sets, **ray_sets, "federated.backend.workers": args.workers},
            args.cache_dir,
        ),
    }
    got = {name: measure(cfg, data, args.steps, args.warmup) for name, cfg in runs.items()}
    ref = got["inline"]["params"]
    same = {name: all(torch.equal(ref[n], r["params"][n]) for n in ref) for name, r in got.items()}
    inline, one, many = (got[n]["s_per_step"] for n in runs)
    f = base.federated
    assert f is not None
    result = {
        "study": args.study,
        "arm": args.arm,
        "concurrency": f.concurrency,
        "model": base.model.name,
        "timed_steps": args.steps,
        "shard_size": args.shard_size,
        "s_per_step": {n: round(r["s_per_step"], 3) for n, r in got.items()},
        "steps_s": {n: [round(t, 3) for t in r["steps_s"]] for n, r in got.items()},
        "speedup": round(inline / many, 3),
        "ray_overhead_s_per_step": round(one - inline, 3),
        "rss_mb_process_tree": {n: round(r["rss_mb"], 1) for n, r in got.items()},
        "bit_identical_to_inline": same,
        "load_average": load_average(),
        "cpus": os.cpu_count(),
    }
    print(
        f"{args.study}/{args.arm} C={f.concurrency}: s/server step inline {inline:.2f}, "
        f"1 Ray worker {one:.2f}, {args.workers} Ray workers {many:.2f} (speed-up "
        f"{inline / many:.2f}x; Ray overhead {one - inline:+.2f} s/step); RSS of the process "
        f"tree {result['rss_mb_process_tree']} MiB; bit-identical {same}; load average "
        f"{result['load_average']:.1f} on {os.cpu_count()} CPUs"
    )
    return result


def main() -> None:
    """Parse the command line and run the benchmark."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--study", default="federated-gain")
    ap.add_argument("--arm", default="ft-fedavg", help="a federated arm of the study")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--cache-dir", default=None, help="data.cache_dir (default: the config's)")
    ap.add_argument("--workers", type=int, default=2, help="Ray workers of the parallel run")
    ap.add_argument("--shard-size", type=int, default=4, help="federated.backend.shard_size")
    ap.add_argument("--steps", type=int, default=2, help="timed server steps")
    ap.add_argument("--warmup", type=int, default=1, help="server steps before timing")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args()
    result = run(args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
