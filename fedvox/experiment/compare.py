"""Run comparison (`fedvox compare RUN RUN…`): EER against client trips, virtual hours, MB up.

Reads finished run folders' metrics.jsonl eval records; writes a plot per x-axis (trips and
hours by default; `--x mb_up` for megabytes uploaded, e.g. compression arms) and a table.

Target: when none is given, the target EER is the worst of the federated runs' best EERs
(of all runs' when none is federated), so every compared run reaches it. Trips and hours to
target are linearly interpolated between the two evaluations around the first crossing.
Centralised runs (eval records without trips/virtual_time_s) are listed with their final
and best EER but left out of the plots and the to-target columns.
"""

from __future__ import annotations

import io
import math
import shlex
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fedvox.atomic import atomic_write, atomic_write_text
from fedvox.errors import DataError
from fedvox.records import EvalRecord, read_run_log_lines

METRICS = "metrics.jsonl"
CONFIG = "config.toml"
# x-axes `compare` can plot: RunCurve attribute → axis label
X_AXES = {"trips": "client trips", "hours": "virtual hours", "mb_up": "MB uploaded (all clients)"}


@dataclass
class RunCurve:
    """One run's held-out EER curve; trips/hours are NaN for a centralised run."""

    name: str
    path: Path
    trips: np.ndarray
    hours: np.ndarray
    eer: np.ndarray
    steps: np.ndarray
    mb_up: np.ndarray = field(default_factory=lambda: np.zeros(0))  # NaN where not logged

    @property
    def federated(self) -> bool:
        return bool(self.trips.size) and bool(np.all(np.isfinite(self.trips)))


def _run_name(run: Path) -> str:
    cfg = run / CONFIG
    if not cfg.is_file():
        return run.name
    try:
        name = tomllib.loads(cfg.read_text()).get("name")
    except tomllib.TOMLDecodeError as e:
        raise DataError(
            cfg, f"not valid TOML ({e})", "fix or restore the run's config.toml"
        ) from None
    return name if isinstance(name, str) and name else run.name


def _number(rec: EvalRecord, key: str, path: Path, line: int) -> float:
    """A field the curve plots: present and finite, else DataError naming the line."""
    v = getattr(rec, key)
    if v is None or not math.isfinite(v):
        raise DataError(
            path, f"eval record has no finite number '{key}' (got {v!r})", "fix the line", line
        )
    return float(v)


def load_curve(run: str | Path) -> RunCurve:
    """Read the eval records of one run folder, in logged order, sorted by server step."""
    run = Path(run)
    metrics = run / METRICS
    if not metrics.is_file():
        raise DataError(
            metrics,
            "not a run folder (no metrics.jsonl)",
            "give folders that `fedvox train` wrote",
        )
    rows: list[tuple[int, float, float, float, float]] = []
    fed_lines: list[int] = []
    cen_lines: list[int] = []
    for i, rec in read_run_log_lines(metrics, (EvalRecord,)):
        eer = _number(rec, "eer", metrics, i)
        step = rec.step
        if rec.trips is not None or rec.virtual_time_s is not None:
            trips = _number(rec, "trips", metrics, i)
            hours = _number(rec, "virtual_time_s", metrics, i) / 3600.0
            fed_lines.append(i)
        else:
            trips = hours = math.nan
            cen_lines.append(i)
        mb = math.nan if rec.bytes_up is None else rec.bytes_up / 1e6
        rows.append((step, trips, hours, eer, mb))
    if not rows:
        raise DataError(
            metrics,
            'no eval records (kind = "eval")',
            "let the run reach its first evaluation, or check it is a training run",
        )
    if fed_lines and cen_lines:
        raise DataError(
            metrics,
            "eval record without trips/virtual_time_s in a federated run",
            "every eval record of a federated run needs both",
            cen_lines[0],
        )
    rows.sort(key=lambda r: r[0])  # stable: equal steps keep their logged order
    arr = np.array(rows, dtype=np.float64).reshape(-1, 5)
    return RunCurve(
        name=_run_name(run),
        path=run,
        trips=arr[:, 1],
        hours=arr[:, 2],
        eer=arr[:, 3],
        steps=arr[:, 0].astype(np.int64),
        mb_up=arr[:, 4],
    )


def to_target(curve: RunCurve, target_eer: float) -> tuple[float | None, float | None]:
    """(trips, virtual hours) at which EER first reaches <= target; None if never.

    Linear between the eval before the crossing and the first one at or under the target; a
    first evaluation already at target counts at its own trips. (None, None) for a
    centralised run, which has no trips.
    """
    if not curve.federated:
        return None, None
    hit = np.flatnonzero(curve.eer <= target_eer)
    if hit.size == 0:
        return None, None
    i = int(hit[0])
    if i == 0:
        return float(curve.trips[0]), float(curve.hours[0])
    e0, e1 = curve.eer[i - 1], curve.eer[i]
    frac = (e0 - target_eer) / (e0 - e1)  # e0 > target >= e1, so 0 < frac <= 1
    trips = curve.trips[i - 1] + frac * (curve.trips[i] - curve.trips[i - 1])
    hours = curve.hours[i - 1] + frac * (curve.hours[i] - curve.hours[i - 1])
    return float(trips), float(hours)


def mb_to_target(curve: RunCurve, target_eer: float) -> float | None:
    """MB uploaded (all clients) when EER first reaches <= target, interpolated as in
    to_target; None if never, or if the run did not log bytes up."""
    if not curve.federated or not np.all(np.isfinite(curve.mb_up)):
        return None
    hit = np.flatnonzero(curve.eer <= target_eer)
    if hit.size == 0:
        return None
    i = int(hit[0])
    if i == 0:
        return float(curve.mb_up[0])
    e0, e1 = curve.eer[i - 1], curve.eer[i]
    frac = (e0 - target_eer) / (e0 - e1)
    return float(curve.mb_up[i - 1] + frac * (curve.mb_up[i] - curve.mb_up[i - 1]))


def default_target(curves: Sequence[RunCurve]) -> float:
    """The worst of the (federated, else all) runs' best EERs: every such run reaches it."""
    pool = [c for c in curves if c.federated] or list(curves)
    return float(max(c.eer.min() for c in pool))


def _labels(curves: Sequence[RunCurve]) -> list[str]:
    """Each run's folder name (chosen when it was run; a config name alone misleads when runs
    differ only by --set overrides), with its parent folder where two share a name."""
    names = [c.path.name for c in curves]
    return [
        f"{c.path.parent.name}/{c.path.name}" if names.count(c.path.name) > 1 else c.path.name
        for c in curves
    ]


def _plot(
    curves: Sequence[RunCurve],
    labels: Sequence[str],
    x_of: str,
    xlabel: str,
    target: float,
    path: Path,
) -> Path:
    fig = Figure(figsize=(6.4, 4.4), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    xs_all = []
    for c, label in zip(curves, labels, strict=True):
        if not c.federated:
            continue
        x = getattr(c, x_of)
        if not np.all(np.isfinite(x)):  # e.g. no bytes up in an older run's records
            continue
        xs_all.append(x)
        ax.plot(x, 100 * c.eer, marker="o", ms=3, lw=1.5, label=label)
    if xs_all:
        ax.axhline(100 * target, ls="--", lw=0.8, color="grey", label=f"target {100 * target:.2f}%")
        xs = np.concatenate(xs_all)
        # log x once the runs span over two decades of trips/hours
        if xs.min() > 0 and xs.max() / xs.min() > 100:
            ax.set_xscale("log")
        ax.legend(fontsize=8)
    else:
        ax.text(
            0.5, 0.5, "no federated runs to plot", ha="center", va="center", transform=ax.transAxes
        )
    ax.set_xlabel(xlabel)
    ax.set_ylabel("EER (%)")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return atomic_write(path, lambda f: f.write(buf.getvalue()))


def _fmt(x: float | None, spec: str) -> str:
    return "not reached" if x is None else format(x, spec)


def compare_runs(
    runs: Sequence[str | Path],
    out_dir: str | Path,
    target_eer: float | None = None,
    x: Sequence[str] = ("trips", "hours"),
) -> Path:
    """Write eer_vs_<x>.png for each x-axis in `x` (trips, hours, mb_up) and compare.md into
    out_dir; return compare.md. With mb_up the table adds MB up to target and in all."""
    if not runs:
        raise DataError(None, "no run folders to compare", "pass one or more RUN folders")
    bad = [a for a in x if a not in X_AXES]
    if bad or not x:
        raise DataError(None, f"unknown x-axis {bad or list(x)}", f"use --x from {list(X_AXES)}")
    out_dir = Path(out_dir)
    curves = [load_curve(r) for r in runs]
    labels = _labels(curves)
    given = target_eer is not None
    target = float(target_eer) if target_eer is not None else default_target(curves)

    axes = list(dict.fromkeys(x))
    for axis in axes:
        _plot(curves, labels, axis, X_AXES[axis], target, out_dir / f"eer_vs_{axis}.png")
    mb = "mb_up" in axes

    rule = (
        "given with --target"
        if given
        else "default: the worst of the federated runs' best EERs, so every one reaches it"
    )
    flags = "" if axes == ["trips", "hours"] else "".join(f" --x {a}" for a in axes)
    md = [
        "# fedvox compare",
        "",
        "```",
        "fedvox compare " + " ".join(shlex.quote(str(r)) for r in runs) + flags,
        "```",
        "",
        f"Target EER: **{100 * target:.2f}%** ({rule}).",
        "Trips and virtual hours to target are linearly interpolated between the two",
        "evaluations around the first crossing.",
        "",
        "| run | final EER | best EER | trips to target | virtual hours to target |"
        + (" MB up to target | MB up in all |" if mb else ""),
        "|---|---|---|---|---|" + ("---|---|" if mb else ""),
    ]
    notes = []
    for c, label in zip(curves, labels, strict=True):
        name = label.replace("|", "\\|")
        final, best = f"{100 * c.eer[-1]:.2f}%", f"{100 * c.eer.min():.2f}%"
        if c.federated:
            trips, hours = to_target(c, target)
            row = f"| {name} | {final} | {best} | {_fmt(trips, '.1f')} | {_fmt(hours, '.3f')} |"
            if mb:
                total = float(c.mb_up[-1]) if math.isfinite(c.mb_up[-1]) else None
                logged = "not logged" if total is None else _fmt(mb_to_target(c, target), ".2f")
                row += f" {logged} | {'not logged' if total is None else f'{total:.2f}'} |"
            md.append(row)
        else:
            row = f"| {name} | {final} | {best} | — (centralised) | — (centralised) |"
            md.append(row + (" — | — |" if mb else ""))
            notes.append(
                f"- {label}: no trips/virtual time in its eval records (centralised run): "
                "listed with its EER, left out of the plots."
            )
    md += [
        "",
        "Runs:",
        *(f"- {lab}: `{c.path}` (config {c.name})" for c, lab in zip(curves, labels, strict=True)),
    ]
    if notes:
        md += ["", "Notes:", *notes]
    md += [
        "",
        *(f"![EER vs {X_AXES[a]}](eer_vs_{a}.png)\n" for a in axes),
    ]
    return atomic_write_text(out_dir / "compare.md", "\n".join(md))
