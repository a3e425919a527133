"""Staleness histogram and per-virtual-hour rollup of a federated run's logs."""

from __future__ import annotations

from fedvox.experiment.fedstats import hourly_rollup, staleness_counts
from fedvox.records import ServerStepRecord, TripRecord


def _trip(start: float, end: float, status: str, tau: int = 0) -> TripRecord:
    aggregated = status == "aggregated"
    return TripRecord(
        time=end,
        client=0,
        trip=0,
        trip_id=0,
        start_time=start,
        start_version=0,
        status=status,
        bytes_down=2_000_000,
        bytes_up=1_000_000 if aggregated else 0,
        staleness=tau if aggregated or status == "stale" else None,
        loss=1.0 if aggregated else None,
        num_examples=4 if aggregated else None,
        server_step=1 if aggregated else None,
    )


def _step(virtual_time_s: float, concurrency: int) -> ServerStepRecord:
    return ServerStepRecord(
        step=1,
        virtual_time_s=virtual_time_s,
        trips=1,
        updates=1,
        loss=1.0,
        staleness=(0,),
        concurrency=concurrency,
        bytes_down=0,
        bytes_up=0,
        dropped_out=0,
        stale=0,
        cancelled=0,
    )


def test_staleness_counts_only_aggregated_updates() -> None:
    trips = [
        _trip(0, 1, "aggregated", 0),
        _trip(0, 2, "aggregated", 2),
        _trip(0, 3, "aggregated", 2),
        _trip(0, 4, "stale", 9),
        _trip(0, 5, "dropped_out"),
    ]
    assert staleness_counts(trips) == {0: 1, 2: 2}


def test_hourly_rollup_puts_trips_and_steps_in_their_hours() -> None:
    trips = [
        _trip(100, 3500, "aggregated", 1),
        _trip(3000, 3700, "aggregated", 3),  # started in hour 0, ended in hour 1
        _trip(3700, 7300, "dropped_out"),
        _trip(4000, 4100, "cancelled"),
    ]
    steps = [_step(3500, 4), _step(3700, 2), _step(3800, 6)]
    rows = hourly_rollup(trips, steps)
    assert [r["hour"] for r in rows] == [0, 1, 2]
    assert [r["trips_started"] for r in rows] == [2, 2, 0]
    assert [r["trips_aggregated"] for r in rows] == [1, 1, 0]
    assert rows[2]["trips_dropped_out"] == 1 and rows[1]["trips_cancelled"] == 1
    assert [r["server_steps"] for r in rows] == [1, 2, 0]
    assert rows[0]["mean_staleness"] == 1 and rows[1]["mean_staleness"] == 3
    assert rows[1]["mean_concurrency"] == 4.0 and rows[2]["mean_concurrency"] is None
    assert rows[0]["mb_up"] == 1.0 and rows[1]["mb_down"] == 4.0
