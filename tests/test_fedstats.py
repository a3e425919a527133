"""Staleness histogram and per-virtual-hour rollup of a federated run's logs."""

from __future__ import annotations

from fedvox.experiment.fedstats import hourly_rollup, staleness_counts


def _trip(start: float, end: float, status: str, tau: int = 0) -> dict:
    return {
        "start_time": start,
        "time": end,
        "status": status,
        "staleness": tau,
        "bytes_up": 1_000_000 if status == "aggregated" else 0,
        "bytes_down": 2_000_000,
    }


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
    steps = [
        {"virtual_time_s": 3500, "concurrency": 4},
        {"virtual_time_s": 3700, "concurrency": 2},
        {"virtual_time_s": 3800, "concurrency": 6},
    ]
    rows = hourly_rollup(trips, steps)
    assert [r["hour"] for r in rows] == [0, 1, 2]
    assert [r["trips_started"] for r in rows] == [2, 2, 0]
    assert [r["trips_aggregated"] for r in rows] == [1, 1, 0]
    assert rows[2]["trips_dropped_out"] == 1 and rows[1]["trips_cancelled"] == 1
    assert [r["server_steps"] for r in rows] == [1, 2, 0]
    assert rows[0]["mean_staleness"] == 1 and rows[1]["mean_staleness"] == 3
    assert rows[1]["mean_concurrency"] == 4.0 and rows[2]["mean_concurrency"] is None
    assert rows[0]["mb_up"] == 1.0 and rows[1]["mb_down"] == 4.0
