"""Federated run diagnostics: staleness histogram and a per-virtual-hour rollup of the clock.

Reads a run folder's trips.jsonl (one record per client trip) and metrics.jsonl (server
steps) and writes staleness.png and hourly.csv next to them; the report links both.
"""

from __future__ import annotations

import csv
import io
from collections import Counter
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fedvox.atomic import atomic_write, atomic_write_text
from fedvox.records import ServerStepRecord, TripRecord, read_run_log

HOURLY_FIELDS = (
    "hour",
    "trips_started",
    "trips_aggregated",
    "trips_dropped_out",
    "trips_stale",
    "trips_cancelled",
    "server_steps",
    "mean_staleness",
    "mean_concurrency",
    "mb_up",
    "mb_down",
)


def staleness_counts(trips: list[TripRecord]) -> dict[int, int]:
    """How many aggregated updates had each staleness τ (server steps behind)."""
    counts = Counter(t.staleness for t in trips if t.status == "aggregated")
    return dict(sorted(counts.items()))


def hourly_rollup(trips: list[TripRecord], steps: list[ServerStepRecord]) -> list[dict]:
    """One row per virtual hour: trips by outcome (at their end time), server steps, mean
    staleness of what was aggregated, mean achieved concurrency, megabytes up and down."""
    if not trips and not steps:
        return []
    last = max([t.time for t in trips] + [s.virtual_time_s for s in steps])
    hours = int(last // 3600) + 1
    rows = [{k: 0 for k in HOURLY_FIELDS} | {"hour": h} for h in range(hours)]
    stale_sum = np.zeros(hours)
    conc_sum = np.zeros(hours)
    for t in trips:
        end = rows[int(t.time // 3600)]
        rows[int(t.start_time // 3600)]["trips_started"] += 1
        end[f"trips_{t.status}"] += 1  # every TRIP_STATUSES has its column
        if t.status == "aggregated" and t.staleness is not None:
            stale_sum[end["hour"]] += t.staleness
        end["mb_up"] += t.bytes_up / 1e6
        end["mb_down"] += t.bytes_down / 1e6
    for s in steps:
        h = int(s.virtual_time_s // 3600)
        rows[h]["server_steps"] += 1
        conc_sum[h] += s.concurrency
    for h, row in enumerate(rows):
        row["mean_staleness"] = (
            round(stale_sum[h] / row["trips_aggregated"], 3) if row["trips_aggregated"] else None
        )
        row["mean_concurrency"] = (
            round(conc_sum[h] / row["server_steps"], 2) if row["server_steps"] else None
        )
        row["mb_up"] = round(row["mb_up"], 3)
        row["mb_down"] = round(row["mb_down"], 3)
    return rows


def plot_staleness(counts: dict[int, int], path: Path, title: str) -> Path:
    """Bar chart of aggregated updates per staleness τ (atomic PNG)."""
    fig = Figure(figsize=(6, 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if counts:
        ax.bar(list(counts), list(counts.values()), width=0.8, color="#4a7ab5")
    total = sum(counts.values())
    mean = sum(k * v for k, v in counts.items()) / total if total else 0.0
    ax.set_xlabel("staleness τ (server steps between download and aggregation)")
    ax.set_ylabel("aggregated updates")
    ax.set_title(f"{title} — mean τ {mean:.2f}, {total} updates")
    fig.tight_layout()
    return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))


def write_fed_stats(run_path: Path, title: str) -> dict | None:
    """staleness.png + hourly.csv for a federated run folder; None when it has no trips."""
    trips = read_run_log(run_path / "trips.jsonl", (TripRecord,))
    steps = read_run_log(run_path / "metrics.jsonl", (ServerStepRecord,))
    if not trips:
        return None
    counts = staleness_counts(trips)
    plot_staleness(counts, run_path / "staleness.png", title)
    rows = hourly_rollup(trips, steps)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=HOURLY_FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(run_path / "hourly.csv", buf.getvalue())
    return {"staleness": counts, "hours": len(rows)}
