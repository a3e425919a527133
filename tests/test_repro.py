"""`fedvox repro`: studies run every arm on one base config and tabulate them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedvox.cli import app
from fedvox.errors import ConfigError
from fedvox.experiment.repro import STUDIES, arm_config

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


def _sets(cache: Path) -> list[str]:
    out: list[str] = []
    for s in [f'data.cache_dir="{cache}"', *TINY]:
        out += ["--set", s]
    return out


def test_arm_configs_share_the_base_and_differ_only_by_the_arm() -> None:
    study = STUDIES["fedrecon-speakers"]
    cfgs = {a.name: arm_config(study, a, {"seed": 3}) for a in study.arms}
    assert cfgs["centralised"].federated is None
    fed = [c for n, c in cfgs.items() if n != "centralised"]
    assert {c.federated.speakers for c in fed} == {"global_head", "codewords", "fedaws", "local"}
    assert {c.federated.server_steps for c in fed} == {40} and {c.seed for c in fed} == {3}
    assert {c.federated.algorithm for c in fed} == {"fedavg"}
    with pytest.raises(ConfigError):
        arm_config(study, study.arms[1], {"federated.concurrency": 0})


def test_dp_utility_study_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "study"
    args = ["repro", "dp-utility", "--out", str(out), "-q", "--arm", "fedavg-nodp"]
    args += ["--arm", "fedavg-z1.0", "--arm", "fedbuff-dpftrl-z1.0", *_sets(tmp_path / "c")]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    rows = {r["arm"]: r for r in json.loads((out / "rows.json").read_text())}
    assert rows["fedavg-nodp"]["epsilon"] is None
    assert rows["fedavg-z1.0"]["epsilon"] > 0 and rows["fedbuff-dpftrl-z1.0"]["epsilon"] > 0
    md = (out / "study.md").read_text()
    assert "| fedavg-z1.0 |" in md and (out / "eer_vs_epsilon.png").is_file()
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
    assert rows["centralised"]["trips"] is None
    # local prototypes: downloads carry the public negatives, uploads only the extractor,
    # which is smaller than extractor + head of the global-head arm
    local, head = rows["fedrecon-local-speakers"], rows["fedavg-global-head"]
    assert local["mb_down_per_trip"] > local["mb_up_per_trip"]
    assert local["mb_up_per_trip"] < head["mb_up_per_trip"]
    assert "never leave the device" in (out / "study.md").read_text()
