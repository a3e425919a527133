"""`fedvox repro fedbuff-concurrency`: one trip budget for every arm at every C, the common
target, trips to it per line (FedAvgM at its best lr), and Figure 1."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_repro import TINY_WORLD
from typer.testing import CliRunner

from fedvox.cli import app
from fedvox.experiment import compare
from fedvox.experiment.repro import (
    CONC_BROADCAST_TRIPS,
    CONC_BUFFER,
    CONC_DEVICES,
    CONC_FEDAVGM_LRS,
    CONC_LEVELS,
    CONC_TARGET_SHARE,
    CONC_TRIPS,
    STUDIES,
    _fedbuff_ratios,
    _target_sensitivity,
    add_trips_to_target,
    arm_config,
    study_order,
)

runner = CliRunner()
STUDY = STUDIES["fedbuff-concurrency"]


def _trips(cfg) -> int:
    f = cfg.federated
    per = {"fedavg": f.concurrency, "fedbuff": f.buffer_size, "fedasync": 1}[f.algorithm]
    return f.server_steps * per


@pytest.mark.parametrize("sets", [{}, {"federated.server_steps": 2000}])
def test_every_arm_spends_the_same_client_trips(sets: dict) -> None:
    cfgs = {a.name: arm_config(STUDY, a, sets) for a in STUDY.arms}
    budget = sets.get("federated.server_steps", CONC_TRIPS)
    fed = {n: c for n, c in cfgs.items() if c.federated is not None}
    assert {n: _trips(c) for n, c in fed.items()} == dict.fromkeys(fed, budget)
    # the broadcast is recomputed every CONC_BROADCAST_TRIPS trips in every arm (at least
    # once per version: FedAvg at C >= 100 and FedBuff K = 100 refresh every step)
    every = {
        n: max(_trips(c) // c.federated.server_steps, 1)
        * c.federated.reconstruction.broadcast_every
        for n, c in fed.items()
    }
    assert every == {
        n: max(CONC_BROADCAST_TRIPS, _trips(c) // c.federated.server_steps) for n, c in fed.items()
    }
    assert fed["fedasync-c10"].federated.reconstruction.broadcast_every == CONC_BROADCAST_TRIPS
    assert len({c.data.world for c in cfgs.values()}) == 1
    assert next(iter(cfgs.values())).data.world.train_devices == CONC_DEVICES
    for c in fed.values():
        f = c.federated
        assert f.init_from == "{arm:public-only}" and f.speakers == "local" and f.pack_clients
        assert f.local_epochs == 1 and f.delay == "half_normal"
    # the grid the issue names: three algorithms at every C, FedAvgM's lr sweep, the K sweep
    for c in CONC_LEVELS:
        assert f"fedbuff-c{c}" in fed and f"fedasync-c{c}" in fed
        grid = CONC_FEDAVGM_LRS[c]
        lrs = {fed[f"fedavgm-c{c}-lr{lr:g}"].federated.server_lr for lr in grid}
        assert lrs == set(grid) and len(grid) >= 3
        assert fed[f"fedavgm-c{c}-lr{grid[0]:g}"].federated.server_momentum > 0
    ks = {c.federated.buffer_size for n, c in fed.items() if n.startswith("fedbuff-c1000")}
    assert ks == {1, CONC_BUFFER, 100}


@pytest.mark.parametrize("study", ["fedbuff-concurrency", "dp-scale"])
def test_the_oracle_fine_tunes_the_public_model_and_runs_after_it(study: str) -> None:
    s = STUDIES[study]
    arms = {a.name: a for a in s.arms}
    oracle = arm_config(s, arms["pooled-oracle"], {})
    public = arm_config(s, arms["public-only"], {})
    assert oracle.federated is None and oracle.train.init_from == "{arm:public-only}"
    assert oracle.data.train == "world:devices" and public.data.train == "world:public"
    assert oracle.train.lr < public.train.lr  # fine-tuning steps, not from-scratch ones
    order = [a.name for a in study_order(s, [arms["pooled-oracle"]], {})]
    assert order == ["public-only", "pooled-oracle"]
    folders = {"public-only": Path("/runs/x/public-only")}
    done = arm_config(s, arms["pooled-oracle"], {}, folders)
    assert done.train.init_from == "/runs/x/public-only"


def _curve(name: str, trips: list[float], eer: list[float]) -> compare.RunCurve:
    t = np.asarray(trips, dtype=float)
    return compare.RunCurve(name, Path(name), t, t / 100, np.asarray(eer), np.arange(len(t)))


def test_target_and_trips_follow_the_best_fedavgm_lr(monkeypatch) -> None:
    curves = {
        "avg-lo": _curve("avg-lo", [0, 100, 200, 300], [0.30, 0.28, 0.26, 0.25]),
        "avg-hi": _curve("avg-hi", [0, 100, 200, 300], [0.30, 0.24, 0.22, 0.21]),  # best lr
        "buff": _curve("buff", [0, 50, 100, 150], [0.30, 0.25, 0.23, 0.22]),
        "async": _curve("async", [0, 100, 200, 300], [0.30, 0.27, 0.24, 0.23]),
        "buff-k100": _curve("buff-k100", [0, 100, 200, 300], [0.30, 0.30, 0.29, 0.29]),
        "buff-lo": _curve("buff-lo", [0, 50, 100, 150], [0.30, 0.28, 0.26, 0.25]),
    }
    monkeypatch.setattr(compare, "load_curve", lambda folder: curves[str(folder)])

    def row(arm: str, algorithm: str, **labels) -> dict:
        return {"arm": arm, "folder": arm, "trips": 300, "algorithm": algorithm,
                "concurrency": 100, "eer": 0.2, **labels}  # fmt: skip

    rows = [
        {"arm": "public-only", "folder": "p", "trips": None, "eer": 0.3},
        row("avg-lo", "fedavgm", server_lr=0.1),
        row("avg-hi", "fedavgm", server_lr=0.2),
        row("buff", "fedbuff", buffer=CONC_BUFFER),
        row("async", "fedasync"),
        row("buff-k100", "fedbuff", buffer=100),
        row("buff-lo", "fedbuff", buffer=CONC_BUFFER, server_lr=0.01),  # FedBuff's other lr
    ]
    target = add_trips_to_target(rows)
    by = {r["arm"]: r for r in rows}
    # half the way from public-only's 0.30 to the best line's best (avg-hi, 0.21)
    assert target == pytest.approx(0.30 - CONC_TARGET_SHARE * (0.30 - 0.21))
    assert CONC_TARGET_SHARE == 0.5
    assert [n for n, r in by.items() if r.get("on_line")] == ["avg-hi", "buff", "async"]
    assert by["avg-hi"]["trips_to_target"] == pytest.approx(100 * 0.045 / 0.06)
    assert by["buff"]["trips_to_target"] == pytest.approx(50 * 0.045 / 0.05)
    assert by["async"]["trips_to_target"] == pytest.approx(100 + 100 * 0.015 / 0.03)
    assert by["avg-lo"]["trips_to_target"] == pytest.approx(250.0)
    assert by["buff-k100"]["trips_to_target"] is None  # never reached: reported, not a line
    assert "trips_to_target" not in by["public-only"]
    assert _fedbuff_ratios(rows) == f"C=100: {75 / 45:.2f}x"
    # other targets: 0.25 / 0.75 of the way (0.2775 / 0.2325); FedAvgM's fewest trips per
    # target over its lrs, FedBuff K = 10's trips
    table = _target_sensitivity(rows)
    assert table[5].startswith("| 0.25 | 27.75% | ") and table[6].startswith("| 0.5 | 25.50% |")
    avg_q, buff_q = 100 * 0.0225 / 0.06, 50 * 0.0225 / 0.05
    assert table[5].endswith(f"| {avg_q / buff_q:.2f}x |")
    assert table[6].endswith(f"| {75 / 45:.2f}x |")
    avg_3q, buff_3q = 100 + 100 * 0.0075 / 0.02, 50 + 50 * 0.0175 / 0.02
    assert table[7] == f"| 0.75 | 23.25% | {avg_3q / buff_3q:.2f}x |"
    # without the public-only row: the worst of the lines' best EERs (every line reaches it)
    assert add_trips_to_target(rows[1:]) == pytest.approx(0.23)
    # FedAvgM short of the target: its budget over FedBuff's trips is a lower bound
    curves["avg-hi"] = _curve("avg-hi", [0, 100, 200, 300], [0.30, 0.29, 0.28, 0.27])
    curves["avg-lo"] = _curve("avg-lo", [0, 100, 200, 300], [0.30, 0.29, 0.285, 0.28])
    add_trips_to_target(rows)
    assert by["avg-hi"]["on_line"] and by["avg-hi"]["trips_to_target"] is None
    got = _fedbuff_ratios(rows)
    assert got.startswith("C=100: >") and float(got.split(">")[1][:-1]) > 300 / 50
    # now FedBuff's 0.22 is the best line's best: 0.75 of the way is 0.24, at 75 trips
    assert _target_sensitivity(rows)[-1] == f"| 0.75 | 24.00% | >{300 / 75:.2f}x |"


def test_concurrency_study_end_to_end_on_a_tiny_world(tmp_path: Path) -> None:
    out = tmp_path / "study"
    sets = [
        f'data.cache_dir="{tmp_path / "c"}"',
        "data.workers=1",
        *TINY_WORLD,
        "data.world.train_devices=12",
        "train.steps=4",
        "train.batch_size=8",
        "train.warmup_steps=1",
        "eval.asnorm_top_n=4",
        "eval.lda_dim=6",
        "federated.server_steps=20",
        "federated.eval_every=10",
        "federated.checkpoint_every=10",
        "federated.chunk_frames=60",
        "federated.reconstruction.public_speakers=4",
    ]
    arms = ["fedavgm-c10-lr0.01", "fedbuff-c10", "fedasync-c10"]
    args = ["repro", "fedbuff-concurrency", "--out", str(out), "-q"]
    for s in sets:
        args += ["--set", s]
    for a in arms:
        args += ["--arm", a]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    rows = {r["arm"]: r for r in json.loads((out / "rows.json").read_text())}
    assert set(rows) == {"public-only", *arms}  # the arms start from the public-only model
    for a in arms:
        assert rows[a]["trips"] == 20 and rows[a]["on_line"]
        start, best = rows["public-only"]["eer"], min(rows[b]["best_eer"] for b in arms)
        want = (
            start - CONC_TARGET_SHARE * (start - best)
            if best < start
            else max(rows[b]["best_eer"] for b in arms)
        )
        assert rows[a]["target_eer"] == pytest.approx(want)
    md = (out / "study.md").read_text()
    assert "Common target EER" in md and "| trips to target |" in md
    assert (out / "trips_vs_concurrency.png").stat().st_size > 0


def test_gap_closed_is_left_empty_when_the_oracle_is_not_better() -> None:
    from fedvox.experiment.repro import gap_closed

    assert gap_closed(0.17, 0.18, 0.08) == pytest.approx(0.1)
    # an oracle that did not learn (10,000 classes, too few steps): no gap, no ratio
    assert gap_closed(0.17, 0.18, 0.35) is None and gap_closed(0.17, 0.18, 0.18) is None
