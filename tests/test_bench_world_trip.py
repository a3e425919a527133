"""benchmarks/bench_world_trip.py: its timed trips are the simulator's trips, one time each."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from fedvox.experiment.federated import build_setup
from fedvox.experiment.prepare import prepare
from fedvox.fl.population import Population

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_world_trip.py"

# federated-gain's ft-fedavg on a world of a few short recordings, cohort 2
TINY = {
    "data.workers": 1,
    "data.world.public_speakers": 4,
    "data.world.train_devices": 6,
    "data.world.test_devices": 8,
    "data.world.public_utts": [3, 3],
    "data.world.public_duration_s": [1.0, 1.5],
    "data.world.device_utts": [3, 4],
    "data.world.device_duration_s": [1.0, 1.5],
    "federated.chunk_frames": 60,
    "federated.reconstruction.public_speakers": 4,
    "federated.concurrency": 2,
}


def _bench():
    sys.path.insert(0, str(BENCH.parent))  # for its `floor` import
    spec = importlib.util.spec_from_file_location("bench_world_trip", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_two_trips_are_timed_and_train_what_the_simulator_trains(
    tmp_path: Path,
) -> None:
    bench = _bench()
    cfg = bench.bench_config("federated-gain", "ft-fedavg", TINY, str(tmp_path / "cache"))
    assert cfg.federated.init_from is None and cfg.federated.speakers == "local"
    data = prepare(cfg, progress=False)
    setup = build_setup(cfg, data)
    gather = Population.gather
    m = bench.measure_trips(setup, rounds=1, warmup=0)
    assert len(m.trip_s) == len(m.examples) == 2 and all(t > 0 for t in m.trip_s)
    assert not m.split and m.server_steps == 1  # xvector-tiny trains a cohort vectorised
    assert Population.gather is gather  # the step timers are gone
    for key in ("data", "forward", "backward", "optimizer", "enrolment", "negatives"):
        assert m.buckets[key] > 0, key
    assert abs(sum(m.buckets.values()) - m.wall_s) < 0.05 * m.wall_s
    # one job per call gives the bits of the simulator's own cohort call
    plain = build_setup(cfg, data).simulator
    plain.run(max_server_steps=1)
    got = setup.simulator.params
    assert all(torch.equal(got[n], t) for n, t in plain.params.items())
