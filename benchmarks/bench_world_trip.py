"""Benchmark: one client trip of a study's federated arm at 1 thread, and where it goes.

Default: federated-gain's ft-fedavg in the two-domain world. The arm's config is built exactly as `fedvox repro` builds it (repro.arm_config: defaults ←
study base ← arm ← --set), the data by prepare() (the world is generated once and cached
under data.cache_dir), and the simulator by federated.build_setup; the simulator then runs
its cohorts (concurrency devices per server step from one model version) through the arm's
own client update. federated.init_from is dropped unless --set gives it: random weights cost
the same per trip. Evaluations and checkpoints of a real run are not included.

Per-trip wall time: when the update trains clients one at a time (xvector-small is over
fl/local/steps.py's SOLO_BYTES, so the study's does), each job of a cohort is passed to the
same update on its own — the same computation. Otherwise (vectorised cohorts) every trip is
charged an equal share of its cohort's call. The server's broadcast (public negatives, once
per `broadcast_every` versions) is computed by the simulator when a trip starts, outside the
client update: it is in the breakdown and in "with the server" s/trip, not in the median.

Breakdown: exclusive wall time of named steps of the local-training core and the server
(the innermost named step gets the time; what no step claims is "other"), measured on the
timed server steps themselves. cProfile cannot split them: the extractor's forward is the
same code under enrolment, the public negatives and training. A separate cProfile pass (no
step timers) gives the top functions by cumulative time. The floor (docs/benchmarks.md):
3 × forward FLOPs per example × examples trained, at the matmul rate of this process.

    .venv/bin/python benchmarks/bench_world_trip.py                 # ft-fedavg, default world
    .venv/bin/python benchmarks/bench_world_trip.py --arm fed-scratch --rounds 5 --json t.json
    .venv/bin/python benchmarks/bench_world_trip.py --cache-dir /tmp/benchcache --rounds 1 \\
        --set data.workers=1 --set data.world.train_devices=40 --set data.world.test_devices=20 \\
        --set data.world.public_speakers=30 --set federated.reconstruction.public_speakers=30
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import importlib
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floor import forward_flops, load_average, matmul_rate, peak_rss_mb, train_flops

from fedvox.errors import ConfigError
from fedvox.experiment.config import ExperimentConfig, parse_override
from fedvox.experiment.federated import FederatedSetup, _set_margin, build_setup
from fedvox.experiment.prepare import PreparedData, prepare
from fedvox.experiment.repro import STUDIES, arm_config
from fedvox.fl.local import ClientConfig, ClientResults
from fedvox.fl.local.steps import auto_chunk
from fedvox.fl.population import Population
from fedvox.models.heads import margin_schedule
from fedvox.training.centralised import set_determinism
from fedvox.types import Params

# The modules whose globals the step timers replace (by name: fedvox.fl.local exports a
# function `reconstruct` that hides its submodule of that name from `import ... as`).
local_reconstruct = importlib.import_module("fedvox.fl.local.reconstruct")
local_steps = importlib.import_module("fedvox.fl.local.steps")
local_train = importlib.import_module("fedvox.fl.local.train")
speaker_update = importlib.import_module("fedvox.tasks.speakers.update")

# Buckets of the breakdown, in print order, with what each holds.
BUCKETS: dict[str, str] = {
    "data": "data gathering / batching (split, batch indices, pad, gather)",
    "forward": "forward (the loss: extractor + head)",
    "backward": "backward (torch.autograd.grad)",
    "optimizer": "optimizer step (in-place SGD; vmap glue when vectorised)",
    "enrolment": "prototype reconstruction / enrolment",
    "negatives": "public negatives (server, once per version)",
    "aggregation": "aggregation + server step (weights, sum, apply)",
    "other": "other (simulator, client-update glue)",
    "harness": "benchmark harness (joining per-trip results)",
}


class StepClock:
    """Exclusive wall time per bucket: a named step's time less the named steps inside it."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(BUCKETS, 0.0)
        self.stack: list[str] = []
        self.mark = 0.0

    def _enter(self, bucket: str) -> None:
        now = time.perf_counter()
        if self.stack:
            self.seconds[self.stack[-1]] += now - self.mark
        self.stack.append(bucket)
        self.mark = now

    def _exit(self) -> None:
        now = time.perf_counter()
        self.seconds[self.stack.pop()] += now - self.mark
        self.mark = now

    @contextlib.contextmanager
    def region(self, bucket: str) -> Iterator[None]:
        """Charge the time inside to `bucket` (less the named steps it calls)."""
        self._enter(bucket)
        try:
            yield
        finally:
            self._exit()

    def wrap(self, bucket: str, fn: Callable) -> Callable:
        """`fn` with its calls charged to `bucket`."""

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._enter(bucket)
            try:
                return fn(*args, **kwargs)
            finally:
                self._exit()

        return timed

    def reset(self) -> None:
        """Zero the totals (after the warm-up)."""
        self.seconds = dict.fromkeys(BUCKETS, 0.0)


def step_targets(setup: FederatedSetup) -> list[tuple[object, str, str]]:
    """(owner, attribute, bucket) of every named step: module globals where the local-training
    core looks them up, the population's and task's methods, and the server's aggregation."""
    sim = setup.simulator
    return [
        (Population, "gather", "data"),
        (Population, "batch_indices", "data"),
        (local_train, "split_client", "data"),
        (local_steps, "pad", "data"),
        (local_reconstruct, "pad", "data"),
        (setup.task, "loss", "forward"),
        (torch.autograd, "grad", "backward"),  # also what torch.func.grad calls
        (local_steps, "sgd_step_", "optimizer"),
        (local_steps, "sgd_vectorised", "optimizer"),
        (local_reconstruct, "sgd_vectorised", "optimizer"),
        (local_train, "init_locals", "enrolment"),
        (local_train, "reconstruct_one", "enrolment"),
        (local_train, "reconstruct_stacked", "enrolment"),
        (speaker_update, "public_prototypes", "negatives"),
        (sim.algorithm, "client_weights", "aggregation"),
        (sim.algorithm, "apply", "aggregation"),
        (sim.aggregator, "accumulate", "aggregation"),
        (sim.aggregator, "result", "aggregation"),
        (sim.aggregator, "metrics", "aggregation"),
    ]


@contextlib.contextmanager
def instrumented(setup: FederatedSetup, clock: StepClock) -> Iterator[None]:
    """Every step of step_targets timed by `clock` inside the block (restored after)."""
    with contextlib.ExitStack() as stack:
        for owner, name, bucket in step_targets(setup):
            fn = getattr(owner, name)  # AttributeError: the core moved, update the targets
            stack.enter_context(mock.patch.object(owner, name, clock.wrap(bucket, fn)))
        yield


def one_at_a_time(cfg: ClientConfig, start: Params, k: int) -> bool:
    """Whether a cohort of k clients of `start`'s size is surely trained one client at a time
    (then splitting it into one-job calls changes nothing)."""
    return not cfg.vectorised or (cfg.chunk_size or auto_chunk(start, k)) == 1


def join_results(parts: Sequence[ClientResults]) -> ClientResults:
    """One-job results stacked as the cohort's call would have returned them."""
    delta = {n: torch.cat([p.delta[n] for p in parts]) for n in parts[0].delta}
    return ClientResults(
        delta,
        torch.cat([p.num_examples for p in parts]),
        torch.cat([p.loss for p in parts]),
    )


@dataclass
class TripLog:
    """Per-trip wall times and examples trained, and how the times were taken."""

    seconds: list[float] = field(default_factory=list)
    examples: list[int] = field(default_factory=list)
    split: bool | None = None  # True: one job per call; False: equal shares of a cohort call


def timed_update(inner: Callable, log: TripLog, clock: StepClock | None) -> Callable:
    """The simulator's client update, timing every trip into `log` (see the module note)."""

    def update(
        task: Any,
        population: Population,
        jobs: list[tuple[int, int]],
        starts: list[Params],
        cfg: ClientConfig,
    ) -> ClientResults:
        split = one_at_a_time(cfg, starts[0], len(jobs))
        log.split = split if log.split is None else log.split and split
        if split:
            parts = []
            for job, start in zip(jobs, starts, strict=True):
                t = time.perf_counter()
                parts.append(inner(task, population, [job], [start], cfg))
                log.seconds.append(time.perf_counter() - t)
            with clock.region("harness") if clock else contextlib.nullcontext():
                results = join_results(parts)
        else:
            t = time.perf_counter()
            results = inner(task, population, jobs, starts, cfg)
            log.seconds += [(time.perf_counter() - t) / len(jobs)] * len(jobs)
        log.examples += [int(n) for n in results.num_examples]
        return results

    return update


def bench_config(
    study: str, arm: str, sets: Mapping[str, Any], cache_dir: str | None = None
) -> ExperimentConfig:
    """The arm's config as `fedvox repro` builds it, with federated.init_from dropped unless
    `sets` names it (random init: the same cost per trip) and data.cache_dir = `cache_dir`."""
    if study not in STUDIES:
        raise ConfigError("--study", f"unknown study {study!r}", f"use one of {list(STUDIES)}")
    s = STUDIES[study]
    found = [a for a in s.arms if a.name == arm]
    if not found:
        raise ConfigError("--arm", f"no arm {arm!r} in {study}", f"use {[a.name for a in s.arms]}")
    sets = {"federated.init_from": None, **sets}
    if cache_dir is not None:
        sets["data.cache_dir"] = cache_dir
    cfg = arm_config(s, found[0], sets)
    if cfg.federated is None:
        raise ConfigError("--arm", f"{arm} is centralised: it makes no client trips", "")
    return cfg


@dataclass
class TripMeasurement:
    """What measure_trips returns: per-trip times, the breakdown and the run's totals."""

    trip_s: list[float]
    examples: list[int]
    split: bool
    buckets: dict[str, float]
    wall_s: float
    server_steps: int
    profile: pstats.Stats | None = None
    profile_trips: int = 0
    profile_s: float = 0.0


def measure_trips(
    setup: FederatedSetup, rounds: int, warmup: int = 1, profile_rounds: int = 0
) -> TripMeasurement:
    """Run `warmup` server steps, then `rounds` timed ones with step timers, then
    `profile_rounds` under cProfile (no step timers), all on the simulator of `setup`."""
    sim = setup.simulator
    inner = sim.client_update
    clock, log = StepClock(), TripLog()
    sim.client_update = timed_update(inner, log, clock)
    try:
        with instrumented(setup, clock):
            if warmup:
                sim.run(max_server_steps=sim.server_step + warmup)
            log.seconds.clear()
            log.examples.clear()
            clock.reset()
            first = sim.server_step
            t0 = time.perf_counter()
            with clock.region("other"):
                sim.run(max_server_steps=sim.server_step + rounds)
            wall = time.perf_counter() - t0
        out = TripMeasurement(
            list(log.seconds),
            list(log.examples),
            bool(log.split),
            dict(clock.seconds),
            wall,
            sim.server_step - first,
        )
        if profile_rounds:
            plog = TripLog()
            sim.client_update = timed_update(inner, plog, None)
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            sim.run(max_server_steps=sim.server_step + profile_rounds)
            prof.disable()
            out.profile_s = time.perf_counter() - t0
            out.profile, out.profile_trips = pstats.Stats(prof), len(plog.seconds)
        setup.records.clear()
        return out
    finally:
        sim.client_update = inner


def _where(func: tuple[str, int, str]) -> str:
    """A cProfile function key as short text: fedvox-relative or site-packages-relative path."""
    path, line, name = func
    for marker in ("/fedvox/", "/site-packages/", "/benchmarks/"):
        if marker in path:
            path = marker.strip("/") + "/" + path.split(marker, 1)[1]
            break
    return f"{path}:{line}({name})" if line else name


def top_functions(stats: pstats.Stats, n: int = 15) -> list[dict[str, Any]]:
    """The n functions with the largest cumulative time: calls, tottime, cumtime, where."""
    table = stats.stats  # type: ignore[attr-defined]  # {function: (cc, nc, tt, ct, callers)}
    rows = sorted(table.items(), key=lambda kv: kv[1][3], reverse=True)
    return [
        {"calls": nc, "tottime_s": tt, "cumtime_s": ct, "function": _where(func)}
        for func, (_cc, nc, tt, ct, _callers) in rows[:n]
    ]


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def flops_per_example(setup: FederatedSetup) -> float:
    """Forward FLOPs of the extractor per training chunk (the loss head is negligible)."""
    x = setup.simulator.population.store["x"][:4]
    with torch.no_grad():
        return forward_flops(lambda: setup.task.extractor(x)) / len(x)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Prepare the arm's data and simulator, measure, print the result; returns it as JSON."""
    sets = dict(parse_override(s) for s in args.set)
    if args.threads is not None:
        sets["train.threads"] = args.threads
    cfg = bench_config(args.study, args.arm, sets, args.cache_dir)
    f = cfg.federated
    assert f is not None
    set_determinism(cfg.train.threads)  # as run_federated does
    t = time.perf_counter()
    data: PreparedData = prepare(cfg, progress=not args.quiet)
    prep_s = time.perf_counter() - t
    setup = build_setup(cfg, data)
    sim, task = setup.simulator, setup.task
    if args.chunk is not None:  # clients per vectorised call (1: one at a time, no vmap)
        sim.client = replace(sim.client, chunk_size=args.chunk)
    _set_margin(task, margin_schedule(0.0, cfg.model.margin, *cfg.model.margin_ramp))
    n_params = sum(v.numel() for v in sim.params.values())
    m = measure_trips(setup, args.rounds, args.warmup, args.profile_rounds)
    fwd = flops_per_example(setup)
    rate = matmul_rate()
    trips = len(m.trip_s)
    median, p90, mean = statistics.median(m.trip_s), _pct(m.trip_s, 90), float(np.mean(m.trip_s))
    examples = float(np.mean(m.examples))
    floor = train_flops(fwd, round(examples)) / rate
    total = sum(m.buckets.values())
    per_trip_all = (total - m.buckets["harness"]) / trips
    study_trips = f.server_steps * sim.k
    line = (
        f"world trip {args.study}/{args.arm}: {median:.3f} s/trip median, p90 {p90:.3f}, "
        f"mean {mean:.3f}, {trips} trips measured ({m.server_steps} server step(s) of "
        f"{sim.k} after {args.warmup} warm-up; per trip: "
        f"{'one job per call' if m.split else 'equal shares of vectorised cohorts'}), "
        f"{torch.get_num_threads()} thread(s), {cfg.model.name} {n_params:,} params "
        f"({4 * n_params / 2**20:.2f} MiB), {examples:.1f} examples trained/trip "
        f"({f.local_epochs} epochs, batch {f.local_batch_size}), floor {floor:.3f} s/trip "
        f"(mean/floor {mean / floor:.1f}x at {rate / 1e9:.1f} GFLOP/s), with the server "
        f"{per_trip_all:.3f} s/trip -> {study_trips:,} trips ≈ "
        f"{study_trips * per_trip_all / 3600:.2f} h without evaluations, "
        f"{sim.population.num_clients} devices, data prepared in {prep_s:.0f} s, "
        f"peak RSS {peak_rss_mb():.0f} MB, load {load_average():.2f}"
    )
    print(line, flush=True)
    print(f"\nbreakdown over the {trips} timed trips ({total:.2f} s wall, step timers):")
    for key, label in BUCKETS.items():
        s = m.buckets[key]
        print(f"  {label:<62} {s:9.3f} s {100 * s / total:6.1f} %  {s / trips:8.4f} s/trip")
    print(f"  {'total':<62} {total:9.3f} s {100.0:6.1f} %  {total / trips:8.4f} s/trip")
    top = []
    if m.profile is not None:
        top = top_functions(m.profile, 15)
        print(
            f"\ncProfile, {m.profile_trips} more trips ({m.profile_s:.2f} s, "
            f"{m.profile_s / max(m.profile_trips, 1):.3f} s/trip under the profiler), top 15 "
            "by cumulative time:"
        )
        print(f"  {'cumtime':>9} {'tottime':>9} {'calls':>8}  function")
        for r in top:
            print(f"  {r['cumtime_s']:9.3f} {r['tottime_s']:9.3f} {r['calls']:>8}  {r['function']}")
    return {
        "line": line,
        "study": args.study,
        "arm": args.arm,
        "threads": torch.get_num_threads(),
        "model": cfg.model.name,
        "params": n_params,
        "devices": sim.population.num_clients,
        "trips": trips,
        "server_steps": m.server_steps,
        "per_trip": "split" if m.split else "cohort_share",
        "s_per_trip_median": median,
        "s_per_trip_p90": p90,
        "s_per_trip_mean": mean,
        "s_per_trip_with_server": per_trip_all,
        "examples_per_trip": examples,
        "floor_s_per_trip": floor,
        "matmul_flops_per_s": rate,
        "forward_flops_per_example": fwd,
        "breakdown_s": m.buckets,
        "trip_s": m.trip_s,
        "cprofile_top": top,
        "load": load_average(),
        "sets": dict(sets),
        "config": cfg.to_dict(),
    }


def main() -> None:
    """Parse the command line and run the benchmark."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--study", default="federated-gain")
    ap.add_argument("--arm", default="ft-fedavg", help="a federated arm of the study")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field after the study and arm (TOML value; repeatable)",
    )
    ap.add_argument("--cache-dir", default=None, help="data.cache_dir (default: the config's)")
    ap.add_argument(
        "--threads", type=int, default=None, help="train.threads (default: the arm's, 1)"
    )
    ap.add_argument(
        "--chunk", type=int, default=None, help="clients per vectorised call (1: a loop)"
    )
    ap.add_argument("--rounds", type=int, default=3, help="timed server steps")
    ap.add_argument("--warmup", type=int, default=1, help="server steps before timing")
    ap.add_argument("--profile-rounds", type=int, default=1, help="server steps under cProfile")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args()
    result = run(args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
