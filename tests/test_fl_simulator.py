"""Tests for the simulator: determinism, snapshot/restore, staleness and dropouts, over-
selection, availability, metrics, and memory bounded by concurrency."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_fl_toys import class_population, mlp_task

from fedvox.fl import (
    ClientConfig,
    DelayModel,
    FedAsync,
    FedAvg,
    FedBuff,
    ServerAdam,
    ServerSGD,
    Simulator,
    SimulatorConfig,
    diurnal_availability,
)
from fedvox.records import ServerStepRecord, TripRecord


def _equal(a, b) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


def _build(kind: str, seed: int = 0, callback=None, **cfg) -> Simulator:
    pop = class_population([6 + (c % 7) for c in range(24)], seed=1)
    algos = {
        "fedbuff": lambda: FedBuff(3, ServerSGD(1.0, momentum=0.5), max_staleness=6),
        "fedavg": lambda: FedAvg(ServerAdam(0.05)),
        "fedasync": lambda: FedAsync(0.5),
    }
    config = SimulatorConfig(**{"concurrency": 6, "seed": seed, **cfg})
    return Simulator(
        mlp_task(),
        pop,
        algos[kind](),
        ClientConfig(batch_size=4, lr=0.2),
        config,
        callback=callback,
    )


@pytest.mark.parametrize("kind", ["fedbuff", "fedavg", "fedasync"])
def test_same_seed_same_params_bit_for_bit(kind: str) -> None:
    a = _build(kind, seed=3, dropout=0.2).run(max_server_steps=6)
    b = _build(kind, seed=3, dropout=0.2).run(max_server_steps=6)
    c = _build(kind, seed=4, dropout=0.2).run(max_server_steps=6)
    assert _equal(a, b)
    assert not _equal(a, c)


@pytest.mark.parametrize(
    ("kind", "cfg"),
    [("fedbuff", {}), ("fedavg", {"over_selection": 0.5, "dropout": 0.2}), ("fedasync", {})],
)
def test_snapshot_restore_continue_is_bit_identical(kind: str, cfg: dict, tmp_path) -> None:
    full = _build(kind, **cfg).run(max_server_steps=8)
    saw_pending = False
    for cut in (1, 5, 13, 22):
        sim = _build(kind, **cfg)
        sim.run(max_events=cut, max_server_steps=8)
        saw_pending |= bool(sim.pending)
        torch.save(sim.state_dict(), tmp_path / "snap.pt")
        sim.run(max_server_steps=2)  # the snapshot must not share state with the live run
        fresh = _build(kind, **cfg)
        fresh.load_state_dict(torch.load(tmp_path / "snap.pt"))
        assert _equal(fresh.run(max_server_steps=8), full), cut
    if kind == "fedbuff":
        assert saw_pending  # a cut fell while updates sat in the buffer, untrained


def test_max_staleness_drops_updates() -> None:
    recs = []
    pop = class_population([5] * 20)
    sim = Simulator(
        mlp_task(),
        pop,
        FedBuff(1, max_staleness=1),
        ClientConfig(batch_size=5),
        SimulatorConfig(concurrency=8, seed=2),
        callback=recs.append,
    )
    sim.run(max_server_steps=30)
    trips = [r for r in recs if isinstance(r, TripRecord)]
    stale = [r for r in trips if r.status == "stale"]
    assert stale and all(r.staleness > 1 for r in stale)
    assert all(r.staleness <= 1 for r in trips if r.status == "aggregated")
    assert sim.counters["stale"] == len(stale)


@pytest.mark.parametrize("kind", ["fedbuff", "fedavg"])
def test_dropped_trips_never_return(kind: str) -> None:
    recs = []
    sim = _build(kind, dropout=0.4, callback=recs.append)
    sim.run(max_server_steps=10)
    trips = [r for r in recs if isinstance(r, TripRecord)]
    dropped = {r.trip_id for r in trips if r.status == "dropped_out"}
    aggregated = {r.trip_id for r in trips if r.status == "aggregated"}
    assert dropped and not dropped & aggregated
    assert all(r.bytes_up == 0 for r in trips if r.status == "dropped_out")
    assert 0.2 < len(dropped) / (len(dropped) + len(aggregated)) < 0.6


def test_over_selection_keeps_the_first_c_to_finish() -> None:
    recs = []
    sim = _build("fedavg", over_selection=0.5, callback=recs.append)
    sim.run(max_server_steps=3)
    trips = [r for r in recs if isinstance(r, TripRecord)]
    for step in (1, 2, 3):
        kept = [r for r in trips if r.server_step == step]
        assert len(kept) == 6
    cancelled = [r for r in trips if r.status == "cancelled"]
    assert len(cancelled) == 3 * 3  # ceil(6·1.5) − 6 per round
    # a cancelled trip of round r would have finished after every kept trip of round r
    for step in (1, 2, 3):
        last_kept = max(r.time for r in trips if r.server_step == step)
        starts = {r.start_time for r in trips if r.server_step == step}
        assert all(r.time == last_kept for r in cancelled if r.start_time in starts)


def test_availability_hook_is_respected() -> None:
    pop = class_population([5] * 40)
    avail = diurnal_availability(40, seed=0, period=10.0, online_fraction=0.3)
    recs = []
    sim = Simulator(
        mlp_task(),
        pop,
        FedBuff(2),
        ClientConfig(batch_size=5),
        SimulatorConfig(concurrency=4, availability=avail, seed=1),
        callback=recs.append,
    )
    sim.run(max_server_steps=15)
    trips = [r for r in recs if isinstance(r, TripRecord)]
    assert len(trips) >= 30
    assert all(avail(r.client, r.start_time) for r in trips)


def test_metrics_records_and_memory_bounded_by_concurrency() -> None:
    recs, n_versions, started = [], [], []
    sim = None

    def cb(r):
        recs.append(r)
        n_versions.append(len(sim.versions))
        started.append(sim.counters["trips_started"])

    sim = _build("fedbuff", callback=cb)
    sim.run(max_server_steps=20)
    steps = [r for r in recs if isinstance(r, ServerStepRecord)]
    assert [r.step for r in steps] == list(range(1, 21))
    numel = sum(t.numel() for t in sim.params.values())
    trips = [r for r in recs if isinstance(r, TripRecord)]
    assert all(r.bytes_down == 4 * numel for r in trips)
    assert steps[-1].bytes_down == 4 * numel * started[recs.index(steps[-1])]
    assert all(r.updates == 3 and len(r.staleness) == 3 for r in steps)
    assert all(0 < r.concurrency <= 6 for r in steps)
    assert steps[-1].concurrency == 6  # C trips under way once the clock is running
    assert all(r.virtual_time_s >= q.virtual_time_s for q, r in itertools.pairwise(steps))
    assert max(n_versions) <= 6 + 3 + 1  # in flight + buffered + current


def test_training_reduces_loss() -> None:
    recs = []
    pop = class_population([20] * 12)
    sim = Simulator(
        mlp_task(),
        pop,
        FedAvg(),
        ClientConfig(batch_size=5, lr=0.2),
        SimulatorConfig(concurrency=4, delay=DelayModel("exponential")),
        callback=recs.append,
    )
    sim.run(max_server_steps=15)
    losses = [r.loss for r in recs if isinstance(r, ServerStepRecord)]
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3])
