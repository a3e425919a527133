"""`fedvox repro`: studies run every arm on one base config and tabulate them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedvox.cli import app
from fedvox.errors import ConfigError
from fedvox.experiment.repro import STUDIES, Arm, Study, arm_config, run_study, study_order
from fedvox.models.io import load_model, weights_hash

runner = CliRunner()

TINY = [
    "data.workers=1",
    "data.synthetic.n_train_speakers=8",
    "data.synthetic.n_test_speakers=4",
    "data.synthetic.train_utts_per_speaker=5",
    "data.synthetic.test_utts_per_speaker=3",
    "data.synthetic.min_duration_s=1.0",
    "data.synthetic.max_duration_s=1.5",
    'data.synthetic.difficulty="clean"',
    "eval.asnorm_top_n=4",
    "eval.lda_dim=6",
    "train.steps=4",
    "train.batch_size=8",
    "train.warmup_steps=1",
    "federated.concurrency=4",
    "federated.buffer_size=2",
    "federated.server_steps=2",
    "federated.eval_every=2",
    "federated.checkpoint_every=2",
    "federated.chunk_frames=60",
    "federated.reconstruction.public_speakers=4",
    "federated.privacy.delta=0.01",
]


# A two-domain world of a few short recordings (the world studies): seconds to generate.
TINY_WORLD = [
    "data.world.public_speakers=4",
    "data.world.train_devices=6",
    "data.world.test_devices=8",
    "data.world.public_utts=[3, 3]",
    "data.world.public_duration_s=[1.0, 1.5]",
    "data.world.device_utts=[3, 4]",
    "data.world.device_duration_s=[1.0, 1.5]",
    # 6 devices: the cluster arms' k-anonymity minimum (10) would reveal no centroid
    "federated.reconstruction.cluster_min_devices=2",
]


def _sets(cache: Path, world: bool = False) -> list[str]:
    out: list[str] = []
    for s in [f'data.cache_dir="{cache}"', *TINY, *(TINY_WORLD if world else [])]:
        out += ["--set", s]
    return out


def test_arm_configs_share_the_base_and_differ_only_by_the_arm() -> None:
    study = STUDIES["fedrecon-speakers"]
    cfgs = {a.name: arm_config(study, a, {"seed": 3}) for a in study.arms}
    assert cfgs["centralised"].federated is None and cfgs["public-only"].federated is None
    assert cfgs["public-only"].data.train == "synthetic:public"
    fed = [c for n, c in cfgs.items() if n not in ("centralised", "public-only")]
    assert {c.federated.speakers for c in fed} == {"global_head", "codewords", "fedaws", "local"}
    assert {c.federated.server_steps for c in fed} == {40} and {c.seed for c in fed} == {3}
    assert {c.federated.algorithm for c in fed} == {"fedavg"}
    with pytest.raises(ConfigError):
        arm_config(study, study.arms[2], {"federated.concurrency": 0})


def test_dp_utility_study_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "study"
    args = ["repro", "dp-utility", "--out", str(out), "-q", "--arm", "fedavg-nodp"]
    args += ["--arm", "fedavg-z1.0", "--arm", "fedbuff-dpftrl-z1.0"]
    args += ["--arm", "public-only", "--arm", "pooled-oracle"]
    args += _sets(tmp_path / "c", world=True)
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    rows = {r["arm"]: r for r in json.loads((out / "rows.json").read_text())}
    assert rows["fedavg-nodp"]["epsilon"] is None
    assert rows["fedavg-z1.0"]["epsilon"] > 0 and rows["fedbuff-dpftrl-z1.0"]["epsilon"] > 0
    md = (out / "study.md").read_text()
    assert "| fedavg-z1.0 |" in md and (out / "eer_vs_epsilon.png").is_file()
    # the two references: gap closed in the table, and reference lines in the curves
    assert rows["public-only"]["gap_closed"] == 0.0 and rows["pooled-oracle"]["gap_closed"] == 1.0
    assert "| gap closed |" in md and (out / "gain_vs_trips.png").is_file()
    # a second call reuses the finished arms (no retraining: same files, same table)
    before = (out / "fedavg-nodp" / "metrics.json").stat().st_mtime_ns
    assert runner.invoke(app, args).exit_code == 0
    assert (out / "fedavg-nodp" / "metrics.json").stat().st_mtime_ns == before


def test_unknown_study_or_arm_is_refused(tmp_path: Path) -> None:
    res = runner.invoke(app, ["repro", "nope", "--out", str(tmp_path)])
    assert isinstance(res.exception, ConfigError) and "study" in str(res.exception)
    res = runner.invoke(app, ["repro", "dp-utility", "--arm", "x", "--out", str(tmp_path)])
    assert isinstance(res.exception, ConfigError) and "--arm" in str(res.exception)


def test_fedrecon_speakers_study_table(tmp_path: Path) -> None:
    out = tmp_path / "study"
    res = runner.invoke(
        app, ["repro", "fedrecon-speakers", "--out", str(out), "-q", *_sets(tmp_path / "c")]
    )
    assert res.exit_code == 0, res.output
    rows = {r["arm"]: r for r in json.loads((out / "rows.json").read_text())}
    assert set(rows) == {a.name for a in STUDIES["fedrecon-speakers"].arms}
    assert rows["centralised"]["trips"] is None and rows["public-only"]["trips"] is None
    pub, cen = rows["public-only"], rows["centralised"]
    if cen["eer"] < pub["eer"]:  # a gap to close: the references sit at 0 and 1
        assert pub["gap_closed"] == 0.0 and cen["gap_closed"] == 1.0
    else:  # the tiny world's oracle may be no better: no gap, no ratio, said in study.md
        assert pub["gap_closed"] is None and cen["gap_closed"] is None
        assert "no gap to close" in (out / "study.md").read_text()
    # local prototypes: downloads carry the public negatives, uploads only the extractor,
    # which is smaller than extractor + head of the global-head arm
    local, head = rows["fedrecon-local-speakers"], rows["fedavg-global-head"]
    assert local["mb_down_per_trip"] > local["mb_up_per_trip"]
    assert local["mb_up_per_trip"] < head["mb_up_per_trip"]
    assert "never leave the device" in (out / "study.md").read_text()


def test_federated_gain_study_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "study"
    args = ["repro", "federated-gain", "--out", str(out), "-q", *_sets(tmp_path / "c", True)]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    rows = {r["arm"]: r for r in json.loads((out / "rows.json").read_text())}
    assert set(rows) == {a.name for a in STUDIES["federated-gain"].arms}
    assert rows["public-only"]["gap_closed"] == 0.0
    assert rows["pooled-oracle"]["gap_closed"] == 1.0
    fed = [r for n, r in rows.items() if n not in ("public-only", "pooled-oracle")]
    assert all(isinstance(r["gap_closed"], float) for r in fed)
    assert all(r["trips"] == 8 and r["hours"] > 0 for r in fed)  # the same budget: 2 x 4
    assert rows["public-only"]["trips"] is None and rows["public-only"]["hours"] is None
    # the fine-tuning arms started from the public-only model, and say so
    public_hash = weights_hash(load_model(out / "public-only" / "model.pt"))
    for name, r in rows.items():
        manifest = json.loads((Path(r["folder"]) / "manifest.json").read_text())
        if name.startswith("ft-"):
            assert manifest["init_weights_sha256"] == public_hash
            assert manifest["init_from"] == str((out / "public-only" / "model.pt").resolve())
        else:
            assert "init_weights_sha256" not in manifest
    # every arm's config.toml alone says where its data came from
    cfg = (out / "ft-fedavg" / "config.toml").read_text()
    assert 'train = "world:devices"' in cfg and "train_devices = 6" in cfg
    md = (out / "study.md").read_text()
    assert "| gap closed |" in md and all(f"| {n} |" in md for n in rows)
    assert (out / "gain_vs_trips.png").stat().st_size > 0
    assert (out / "gain_vs_hours.png").stat().st_size > 0


def _dep_study(overrides: dict) -> Study:
    return Study(
        name="deps",
        title="dependencies",
        base={},
        arms=(
            Arm("base", {"federated": None}, centralised=True),
            Arm("a", {"federated.init_from": "{arm:base}"}),
            Arm("b", overrides),
        ),
    )


def test_arm_dependencies_run_first_and_become_folders(tmp_path: Path) -> None:
    study = _dep_study({"federated.init_from": "{arm:a}"})
    order = study_order(study, [study.arms[2]], {})
    assert [a.name for a in order] == ["base", "a", "b"]
    assert [a.name for a in study_order(study, [study.arms[0]], {})] == ["base"]
    cfg = arm_config(study, study.arms[1], {}, {"base": tmp_path / "base"})
    assert cfg.federated.init_from == str(tmp_path / "base")
    # a centralised arm ignores federated.* settings, so --set of one cannot make it depend
    assert study_order(study, [study.arms[0]], {"federated.init_from": "{arm:a}"}) == [
        study.arms[0]
    ]


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"federated.init_from": "{arm:nope}"}, "has no such arm"),
        ({"federated.init_from": "{arm:b}"}, "its own run folder"),
    ],
)
def test_bad_arm_references_are_refused(overrides: dict, words: str) -> None:
    study = _dep_study(overrides)
    with pytest.raises(ConfigError) as e:
        study_order(study, list(study.arms), {})
    assert e.value.field == "federated.init_from" and words in str(e.value)


def test_dependency_cycles_are_refused(tmp_path: Path) -> None:
    study = Study(
        name="cycle",
        title="",
        base={},
        arms=(
            Arm("x", {"federated.init_from": "{arm:y}"}),
            Arm("y", {"federated.init_from": "{arm:x}"}),
        ),
    )
    with pytest.raises(ConfigError) as e:
        study_order(study, [study.arms[0]], {})
    assert "x -> y -> x" in str(e.value)


def test_an_arm_runs_its_dependency_first(tmp_path: Path, monkeypatch) -> None:
    """--arm ft-fedavg alone runs public-only first and hands it its folder."""
    from fedvox.experiment import repro

    ran: list[tuple[str, str | None]] = []

    def fake_run(cfg, folder: Path, progress: bool) -> Path:
        ran.append((folder.name, cfg.federated.init_from if cfg.federated else None))
        raise SystemExit  # stop after recording the order of the first two

    monkeypatch.setattr(repro, "run_arm", fake_run)
    with pytest.raises(SystemExit):
        run_study("federated-gain", tmp_path, {}, ["ft-fedavg"], progress=False)
    assert ran == [("public-only", None)]
    order = study_order(STUDIES["federated-gain"], [STUDIES["federated-gain"].arms[3]], {})
    assert [a.name for a in order] == ["public-only", "ft-fedavg"]


def test_repro_help_teaches_the_gain_study() -> None:
    res = runner.invoke(app, ["repro", "--help"], env={"COLUMNS": "120"})
    assert res.exit_code == 0
    for words in ("federated-gain", "public-only", "pooled-oracle", "{arm:NAME}", "--arm"):
        assert words in res.output


def test_gain_arms_share_the_world_seed_and_client_trips() -> None:
    study = STUDIES["federated-gain"]
    for sets in ({}, {"federated.server_steps": 6, "federated.concurrency": 10}):
        cfgs = {a.name: arm_config(study, a, sets) for a in study.arms}
        assert len({c.data.world for c in cfgs.values()}) == 1
        assert {c.data.test for c in cfgs.values()} == {"world:test"}
        assert cfgs["public-only"].data.train == "world:public"
        assert cfgs["public-only"].federated is None and cfgs["pooled-oracle"].federated is None
        trips = {
            n: c.federated.server_steps
            * (
                c.federated.buffer_size
                if c.federated.algorithm == "fedbuff"
                else c.federated.concurrency
            )
            for n, c in cfgs.items()
            if c.federated is not None
        }
        assert len(set(trips.values())) == 1, trips
        ft = [c for n, c in cfgs.items() if n.startswith("ft-")]
        assert {c.federated.init_from for c in ft} == {"{arm:public-only}"}
    assert cfgs["fed-scratch"].data.world.train_devices >= 2000  # the world's default
