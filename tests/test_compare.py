"""Run comparison: interpolated trips/hours to a target EER, default target, files written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedvox.errors import DataError
from fedvox.experiment.compare import (
    compare_runs,
    default_target,
    load_curve,
    mb_to_target,
    to_target,
)

# (step, trips, virtual seconds, eer) per eval record
RUN_A = [
    (10, 100, 360.0, 0.20),
    (20, 200, 720.0, 0.10),
    (30, 300, 1080.0, 0.06),
    (40, 400, 1440.0, 0.08),
]
RUN_B = [(10, 50, 1800.0, 0.30), (20, 150, 5400.0, 0.15), (30, 250, 9000.0, 0.12)]


def write_run(
    folder: Path,
    evals: list[tuple],
    name: str | None = None,
    federated: bool = True,
    mb_per_trip: float | None = None,
) -> Path:
    folder.mkdir(parents=True)
    if name is not None:
        (folder / "config.toml").write_text(f'name = "{name}"\nseed = 0\n\n[train]\nlr = 0.1\n')
    lines = [json.dumps({"kind": "train", "step": 1, "loss": 3.2})]
    for step, trips, t, eer in evals:
        rec = {"kind": "eval", "step": step, "eer": eer, "min_dcf_01": 0.5, "min_dcf_05": 0.3}
        rec |= {"eer_threshold": 0.7, "n_target": 10, "n_nontarget": 90}  # as quick_eval logs
        if federated:
            rec |= {"trips": trips, "virtual_time_s": t}
        if mb_per_trip is not None:
            rec |= {"bytes_up": round(trips * mb_per_trip * 1e6), "bytes_down": 0}
        lines.append(json.dumps(rec))
        lines.append(json.dumps({"kind": "train", "step": step, "loss": 1.0}))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + '\n{"kind": "ev')  # torn last line
    return folder


def test_load_curve_reads_eval_records_only(tmp_path):
    curve = load_curve(write_run(tmp_path / "a", RUN_A, name="fedbuff-k10"))
    assert curve.name == "fedbuff-k10" and curve.federated
    assert curve.steps.tolist() == [10, 20, 30, 40]
    assert curve.trips.tolist() == [100, 200, 300, 400]
    assert curve.hours.tolist() == [0.1, 0.2, 0.3, 0.4]
    assert curve.eer.tolist() == [0.20, 0.10, 0.06, 0.08]
    # no config.toml: the folder names the run
    assert load_curve(write_run(tmp_path / "folder-b", RUN_B)).name == "folder-b"


def test_to_target_interpolates_between_the_evals_around_the_crossing(tmp_path):
    a = load_curve(write_run(tmp_path / "a", RUN_A, name="a"))
    b = load_curve(write_run(tmp_path / "b", RUN_B, name="b"))
    # A crosses 0.12 between (100 trips, 0.1 h, 20%) and (200, 0.2 h, 10%): frac 0.8
    assert to_target(a, 0.12) == pytest.approx((180.0, 0.18), rel=1e-12)
    # A crosses 0.07 between (200, 0.2 h, 10%) and (300, 0.3 h, 6%): frac 0.75
    assert to_target(a, 0.07) == pytest.approx((275.0, 0.275), rel=1e-12)
    # B reaches 0.12 exactly at its last eval (250 trips, 2.5 h)
    assert to_target(b, 0.12) == pytest.approx((250.0, 2.5), rel=1e-12)
    # already at target at the first eval: its own trips, no extrapolation
    assert to_target(a, 0.25) == (100.0, 0.1)
    # never reached (best is 6%; the later rise to 8% does not matter)
    assert to_target(a, 0.05) == (None, None)
    assert to_target(b, 0.119) == (None, None)


def test_default_target_is_worst_best_eer(tmp_path):
    a = load_curve(write_run(tmp_path / "a", RUN_A, name="a"))
    b = load_curve(write_run(tmp_path / "b", RUN_B, name="b"))
    central = load_curve(write_run(tmp_path / "c", [(5, 0, 0, 0.30), (9, 0, 0, 0.25)], "c", False))
    assert default_target([a, b]) == 0.12
    # a centralised run has no trips: it does not set the federated runs' target
    assert default_target([a, b, central]) == 0.12
    assert default_target([central]) == 0.25
    for c in (a, b):
        assert to_target(c, default_target([a, b]))[0] is not None


def test_compare_runs_writes_table_and_plots(tmp_path):
    runs = [
        write_run(tmp_path / "a", RUN_A, name="a"),
        write_run(tmp_path / "b", RUN_B, name="b"),
        write_run(tmp_path / "c", [(5, 0, 0, 0.05), (9, 0, 0, 0.04)], "central", False),
    ]
    out = tmp_path / "cmp"
    md_path = compare_runs(runs, out)
    assert md_path == out / "compare.md"
    md = md_path.read_text()
    assert "Target EER: **12.00%**" in md and "default" in md
    rows = {
        r.split("|")[1].strip(): [x.strip() for x in r.split("|")[2:-1]]
        for r in md.splitlines()
        if r.startswith("| ") and not r.startswith("| run")
    }
    assert rows["a"] == ["8.00%", "6.00%", "180.0", "0.180"]
    assert rows["b"] == ["12.00%", "12.00%", "250.0", "2.500"]
    assert rows["c"][:2] == ["4.00%", "4.00%"] and "centralised" in rows["c"][2]
    assert "c: no trips" in md and "(config central)" in md
    for png in ("eer_vs_trips.png", "eer_vs_hours.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    assert not list(out.glob(".*.tmp"))

    md = compare_runs(runs[:1], out, target_eer=0.05).read_text()
    assert "Target EER: **5.00%** (given" in md
    assert "| a | 8.00% | 6.00% | not reached | not reached |" in md


def test_runs_are_labelled_by_folder(tmp_path):
    """One config run twice with different --set overrides: the folders tell them apart; two
    folders of one name get their parent folder."""
    runs = [write_run(tmp_path / "x1", RUN_A, "same"), write_run(tmp_path / "x2", RUN_B, "same")]
    md = compare_runs(runs, tmp_path / "out").read_text()
    assert "| x1 |" in md and "| x2 |" in md and "| same" not in md
    runs = [write_run(tmp_path / p / "arm", RUN_A, "arm") for p in ("study1", "study2")]
    md = compare_runs(runs, tmp_path / "out2").read_text()
    assert "| study1/arm |" in md and "| study2/arm |" in md


def test_clear_errors_for_folders_that_are_not_runs(tmp_path):
    no_evals = tmp_path / "no-evals"
    no_evals.mkdir()
    (no_evals / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 2.0}\n')
    with pytest.raises(DataError, match=r"no-evals/metrics\.jsonl: no eval records"):
        load_curve(no_evals)
    with pytest.raises(DataError, match=r"not a run folder"):
        load_curve(tmp_path / "nowhere")
    with pytest.raises(DataError, match="no eval records"):
        compare_runs([no_evals], tmp_path / "out")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text(
        '{"kind": "eval", "step": 1}\n{"kind": "eval", "step": 2, "eer": 0.1}\n'
    )
    with pytest.raises(DataError, match=r"metrics\.jsonl:1: .*'eer'"):
        load_curve(bad)
    (bad / "metrics.jsonl").write_text('garbage\n{"kind": "eval", "step": 2, "eer": 0.1}\n')
    with pytest.raises(DataError, match=r"metrics\.jsonl:1: not a JSON line"):
        load_curve(bad)


def test_centralised_curve_has_no_trips(tmp_path):
    c = load_curve(write_run(tmp_path / "c", [(5, 0, 0, 0.3), (9, 0, 0, 0.2)], "c", False))
    assert not c.federated and np.isnan(c.trips).all()
    assert to_target(c, 0.5) == (None, None)


def test_eer_against_mb_uploaded(tmp_path):
    runs = [
        write_run(tmp_path / "float32", RUN_A, mb_per_trip=4.0),
        write_run(tmp_path / "q4", RUN_B, mb_per_trip=0.5),
        write_run(tmp_path / "old", RUN_B),  # logged before bytes up were recorded
    ]
    a = load_curve(runs[0])
    assert a.mb_up.tolist() == [400.0, 800.0, 1200.0, 1600.0]
    assert mb_to_target(a, 0.12) == pytest.approx(720.0, rel=1e-12)  # 180 trips × 4 MB
    assert mb_to_target(load_curve(runs[2]), 0.12) is None
    out = tmp_path / "cmp"
    md = compare_runs(runs, out, target_eer=0.12, x=["mb_up"]).read_text()
    assert "--x mb_up" in md and "MB up to target" in md
    assert "| float32 | 8.00% | 6.00% | 180.0 | 0.180 | 720.00 | 1600.00 |" in md
    assert "| q4 | 12.00% | 12.00% | 250.0 | 2.500 | 125.00 | 125.00 |" in md
    assert "| old | 12.00% | 12.00% | 250.0 | 2.500 | not logged | not logged |" in md
    assert (out / "eer_vs_mb_up.png").read_bytes()[:4] == b"\x89PNG"
    assert not (out / "eer_vs_trips.png").exists()
    with pytest.raises(DataError, match="x-axis"):
        compare_runs(runs, out, x=["bytes"])


def test_cli_compare_x_mb_up(tmp_path):
    from typer.testing import CliRunner

    from fedvox.cli import app

    runs = [str(write_run(tmp_path / n, RUN_A, mb_per_trip=1.0)) for n in ("a", "b")]
    out = tmp_path / "cmp"
    res = CliRunner().invoke(
        app, ["compare", *runs, "--x", "mb_up", "--x", "trips", "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert (out / "eer_vs_mb_up.png").is_file() and (out / "eer_vs_trips.png").is_file()
