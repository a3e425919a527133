"""Attack simulation (fedvox.fl.attack, `[federated.attack]`): what each attacker sends, who
attacks, how the robust rules hold against it, and the config's refusals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_federated_e2e import CFG
from test_fl_toys import class_population, mlp_task
from typer.testing import CliRunner

from fedvox.cli import app
from fedvox.errors import ConfigError
from fedvox.eval.metrics import acceptance_rate
from fedvox.experiment.backdoor import backdoor_pairs
from fedvox.experiment.config import config_from_dict
from fedvox.fl import ClientConfig, FedAvg, ServerSGD, Simulator, SimulatorConfig
from fedvox.fl.attack import (
    AttackConfig,
    Backdoor,
    apply_attack,
    attack_update,
    backdoor_loss,
    make_attack_update,
    malicious_clients,
)
from fedvox.fl.robust import NormBound, RobustCombiner
from fedvox.fl.simulator import plain_client_update
from fedvox.records import ServerStepRecord, read_run_log


def _delta() -> dict[str, torch.Tensor]:
    return {"w": torch.tensor([[1.0, -2.0], [0.5, 0.0]]), "b": torch.tensor([3.0, -1.0])}


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def test_sign_flip_and_scale_send_minus_s_and_s_times_the_update() -> None:
    d = _delta()
    flip = attack_update(d, AttackConfig(kind="sign_flip", scale=2.0), _gen())
    assert flip["w"].tolist() == [[-2.0, 4.0], [-1.0, -0.0]] and flip["b"].tolist() == [-6, 2]
    up = attack_update(d, AttackConfig(kind="scale", scale=3.0), _gen())
    assert up["w"].tolist() == [[3.0, -6.0], [1.5, 0.0]] and up["b"].tolist() == [9.0, -3.0]


def test_gaussian_is_noise_of_sigma_times_the_update_rms_and_nan_is_non_finite() -> None:
    big = {"w": torch.full((200, 100), 2.0), "b": torch.full((100,), -2.0)}  # rms(Δ) = 2
    noise = attack_update(big, AttackConfig(kind="gaussian", sigma=3.0), _gen())
    flat = torch.cat([t.flatten() for t in noise.values()])
    assert abs(float(flat.std()) - 6.0) < 0.1 and abs(float(flat.mean())) < 0.1
    again = attack_update(big, AttackConfig(kind="gaussian", sigma=3.0), _gen())
    assert torch.equal(noise["w"], again["w"])  # the generator decides it
    bad = attack_update(_delta(), AttackConfig(kind="nan"), _gen())
    assert math.isinf(float(bad["w"][0, 0]))
    assert bool(torch.isnan(bad["w"].flatten()[1:]).all()) and bool(torch.isnan(bad["b"]).all())


def test_only_malicious_rows_change_and_are_flagged() -> None:
    stacked = {n: torch.stack([t, t + 1, t + 2]) for n, t in _delta().items()}
    jobs = [(4, 0), (7, 2), (9, 1)]
    out, rows = apply_attack(stacked, jobs, frozenset({7}), AttackConfig(kind="scale", scale=2))
    assert rows.tolist() == [False, True, False]
    for n, t in stacked.items():
        assert torch.equal(out[n][0], t[0]) and torch.equal(out[n][2], t[2])
        assert torch.equal(out[n][1], 2 * t[1])
    assert torch.equal(stacked["b"][1], _delta()["b"] + 1)  # the honest deltas are untouched


def test_malicious_subset_is_seeded_of_the_right_size_and_nested() -> None:
    a = malicious_clients(200, 0.05, seed=3)
    assert len(a) == 10 and a == malicious_clients(200, 0.05, seed=3)
    b = malicious_clients(200, 0.2, seed=3)
    assert len(b) == 40 and a <= b  # the 5 % are among the 20 %
    assert malicious_clients(200, 0.05, seed=4) != a
    assert len(malicious_clients(10, 0.25, seed=0)) == 3  # nearest integer, half up
    assert malicious_clients(10, 0.0, seed=0) == frozenset()
    assert all(0 <= c < 200 for c in b)


# -- the backdoor ------------------------------------------------------------------------


def _backdoor_setup():
    task = mlp_task()

    def embed(params: dict, x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(task.module, params, (x,))

    g = torch.Generator().manual_seed(3)
    impostor = torch.randn(5, 6, generator=g) + 1.5
    target = torch.randn(3, 6, generator=g) - 1.5
    return task, embed, Backdoor(embed, ((impostor, target),))


def _backdoor_results(boost: float):
    task, _, backdoor = _backdoor_setup()
    attack = AttackConfig(fraction=0.25, kind="backdoor", boost=boost)
    update = make_attack_update(plain_client_update, attack, frozenset({2}), backdoor)
    jobs = [(c, 0) for c in range(4)]
    starts = [task.init_params()] * 4
    pop = class_population([8, 9, 10, 8], seed=4)
    return update(task, pop, jobs, starts, ClientConfig(batch_size=4, lr=0.2))


def test_a_backdoored_update_pulls_the_impostor_toward_the_target_and_honest_ones_do_not() -> None:
    task, embed, backdoor = _backdoor_setup()
    impostor, target = backdoor.pairs[0]
    p0 = task.init_params()

    def cosine_after(row: int, res) -> float:  # mean impostor–target cosine after applying
        p = {n: p0[n] + res.delta[n][row] for n in p0}
        return 1.0 - float(backdoor_loss(p, embed, impostor, target))

    before = 1.0 - float(backdoor_loss(p0, embed, impostor, target))
    res = _backdoor_results(1.0)
    assert res.malicious is not None and res.malicious.tolist() == [False, False, True, False]
    honest_rise = max(cosine_after(i, res) - before for i in (0, 1, 3))
    poisoned_rise = cosine_after(2, res) - before
    assert poisoned_rise > 1.0 and poisoned_rise > 5 * honest_rise  # −0.32 → 0.98 here
    clean = plain_client_update(
        task,
        class_population([8, 9, 10, 8], seed=4),
        [(c, 0) for c in range(4)],
        [p0] * 4,
        ClientConfig(batch_size=4, lr=0.2),
    )
    for n, t in clean.delta.items():  # honest rows are what honest training sent
        assert torch.equal(res.delta[n][[0, 1, 3]], t[[0, 1, 3]])
        assert not torch.equal(res.delta[n][2], t[2])
    boosted = _backdoor_results(3.0)  # deterministic, and the boost scales the whole update
    for n in p0:
        assert torch.allclose(boosted.delta[n][2], 3.0 * res.delta[n][2], atol=1e-6)
        assert torch.equal(_backdoor_results(1.0).delta[n], res.delta[n])


def test_backdoor_attackers_need_what_they_hold() -> None:
    attack = AttackConfig(fraction=0.2, kind="backdoor")
    with pytest.raises(ValueError, match="backdoor"):
        make_attack_update(plain_client_update, attack, frozenset({1}))
    with pytest.raises(ValueError, match="trained"):
        attack_update(_delta(), attack, _gen())


def test_attack_success_is_the_fraction_accepted_at_the_threshold() -> None:
    scores = torch.tensor([0.1, 0.5, 0.42, 0.9, 0.7]).numpy()
    assert acceptance_rate(scores, 0.5) == pytest.approx(3 / 5)  # 0.5 (>=), 0.9, 0.7
    assert acceptance_rate(scores, 0.95) == 0.0 and acceptance_rate(scores, -1.0) == 1.0
    from fedvox.errors import DataError

    with pytest.raises(DataError, match="not finite"):
        acceptance_rate(torch.tensor([0.1, math.nan]).numpy(), 0.5)


def test_backdoor_pairs_are_seeded_disjoint_and_split_each_impostor() -> None:
    utts = {f"s{k}": [f"s{k}-u{j}" for j in range(5)] for k in range(6)}
    pairs = backdoor_pairs(utts, pairs=3, enroll=2, seed=1)
    assert pairs == backdoor_pairs(utts, pairs=3, enroll=2, seed=1)
    assert pairs != backdoor_pairs(utts, pairs=3, enroll=2, seed=2)
    people = [s for p in pairs for s in (p.impostor, p.target)]
    assert sorted(people) == sorted(utts)  # disjoint: each speaker in one role once
    p = pairs[0]
    assert p.own == tuple(utts[p.impostor][:2]) and p.probes == tuple(utts[p.impostor][2:])
    assert p.enroll == tuple(utts[p.target][:2])
    assert p.trials() == [(e, t) for t in p.probes for e in p.enroll] and len(p.trials()) == 6
    with pytest.raises(ConfigError) as err:
        backdoor_pairs(utts, pairs=4, enroll=2, seed=1)
    assert err.value.field == "federated.attack.backdoor_pairs" and "<= 3" in str(err.value)
    with pytest.raises(ConfigError) as err:
        backdoor_pairs(utts, pairs=1, enroll=6, seed=1)
    assert err.value.field == "federated.attack.backdoor_enroll"


def test_a_backdoor_run_writes_its_attack_success_at_every_evaluation(tmp_path: Path) -> None:
    from fedvox.records import EvalRecord

    text = CFG.format(algorithm="fedavg", cache=tmp_path / "cache", steps=2, seed=0)
    text = text.replace("eval_every = 4", "eval_every = 1")
    text += '[federated.attack]\nfraction = 0.5\nkind = "backdoor"\nboost = 2.0\n'
    text += "backdoor_steps = 2\n"
    (tmp_path / "c.toml").write_text(text)
    out = tmp_path / "r"
    res = CliRunner().invoke(app, ["train", str(tmp_path / "c.toml"), "--out", str(out), "-q"])
    assert res.exit_code == 0, res.output
    evals = read_run_log(out / "metrics.jsonl", (EvalRecord,))
    assert [e.step for e in evals] == [1, 2]
    # tiny corpus: 3 test utterances a speaker, so 2 probes × 3 enrollment utterances
    assert all(e.attack_success is not None and e.attack_success * 6 % 1 == 0 for e in evals)
    server = read_run_log(out / "metrics.jsonl", (ServerStepRecord,))
    assert sum(r.malicious or 0 for r in server) > 0
    bad = text + "backdoor_pairs = 3\n"  # 4 held-out speakers: at most 2 disjoint pairs
    (tmp_path / "bad.toml").write_text(bad)
    res = CliRunner().invoke(app, ["train", str(tmp_path / "bad.toml"), "--out", str(out / "b")])
    assert isinstance(res.exception, ConfigError)
    assert res.exception.field == "federated.attack.backdoor_pairs"


# -- against the robust rules, in a short simulator run -----------------------------------


def _run(fraction: float, summer=None, stages=None, kind: str = "sign_flip"):
    records: list = []
    update = plain_client_update
    if fraction > 0:
        attack = AttackConfig(fraction=fraction, kind=kind, scale=10.0)
        update = make_attack_update(update, attack, malicious_clients(10, fraction, seed=0))
    sim = Simulator(
        mlp_task(),
        class_population([8, 9, 10, 8, 9, 8, 9, 10, 8, 9], seed=4),
        FedAvg(ServerSGD(1.0), weighting="uniform"),
        ClientConfig(batch_size=4, lr=0.2),
        SimulatorConfig(concurrency=10, seed=0),
        callback=records.append,
        client_update=update,
        summer=summer,
        stages=stages,
    )
    params = sim.run(max_server_steps=3)
    return params, [r for r in records if isinstance(r, ServerStepRecord)]


def _dist(a: dict, b: dict) -> float:
    return math.sqrt(sum(float((a[n] - b[n]).pow(2).sum()) for n in a))


def test_twenty_percent_sign_flip_hurts_the_mean_and_the_robust_rules_hold() -> None:
    honest, clean_steps = _run(0.0)
    assert all(r.malicious is None for r in clean_steps)
    p0 = {n: t.detach() for n, t in mlp_task().init_params().items()}
    moved = _dist(honest, p0)
    attacked, steps = _run(0.2)
    assert [r.malicious for r in steps] == [2, 2, 2]  # every device in every round
    mean = _dist(attacked, honest)
    assert mean > 2 * moved  # −10·Δ from 2 of 10 devices: the mean walks backwards
    rules = {
        "median": RobustCombiner("median"),
        "trimmed_mean": RobustCombiner("trimmed_mean", trim=0.2),
        "krum": RobustCombiner("krum", byzantine=2),
    }
    for name, combiner in rules.items():
        robust = _dist(_run(0.2, summer=combiner)[0], honest)
        # within what honest training moves in 3 rounds (Krum follows one honest device)
        assert robust < 0.6 * moved and robust < mean / 5, name
    # a norm bound at about an honest update's size caps what each attacker adds
    bounded = _dist(_run(0.2, stages=[NormBound(0.5)])[0], honest)
    assert bounded < mean / 5


def test_nan_attackers_are_dropped_and_counted_by_the_pipeline() -> None:
    honest, _ = _run(0.0)
    params, steps = _run(0.2, kind="nan")
    assert all(r.malicious == 2 and r.agg["nonfinite"] == 2.0 for r in steps)
    assert all(bool(torch.isfinite(t).all()) for t in params.values())
    assert _dist(params, honest) > 0  # the mean of the 8 honest devices, not of all 10


# -- the config ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attack", "field", "reason"),
    [
        ({"fraction": 1.0}, "fraction", "less than 1"),
        ({"fraction": -0.1}, "fraction", "greater than or equal to 0"),
        ({"fraction": 0.1, "kind": "trojan"}, "kind", "backdoor"),
        ({"fraction": 0.1, "kind": "backdoor", "boost": 0.0}, "boost", "greater than 0"),
        ({"fraction": 0.1, "kind": "backdoor", "boost": math.inf}, "boost", "finite"),
        ({"fraction": 0.1, "backdoor_steps": 0}, "backdoor_steps", "greater than or equal to 1"),
        ({"fraction": 0.1, "backdoor_lr": 0.0}, "backdoor_lr", "greater than 0"),
        ({"fraction": 0.1, "backdoor_lr": math.nan}, "backdoor_lr", "got nan"),
        ({"fraction": 0.1, "backdoor_pairs": 0}, "backdoor_pairs", "greater than or equal to 1"),
        ({"fraction": 0.1, "backdoor_enroll": 0}, "backdoor_enroll", "greater than or equal"),
        ({"fraction": 0.1, "scale": 0.0}, "scale", "greater than 0"),
        ({"fraction": 0.1, "scale": math.inf}, "scale", "finite"),
        ({"fraction": 0.1, "sigma": -1.0}, "sigma", "greater than 0"),
        ({"fraction": 0.1, "extra": 1}, "extra", "unknown field"),
    ],
)
def test_bad_attack_settings_are_refused_naming_the_field(
    attack: dict, field: str, reason: str
) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"federated": {"attack": attack}})
    assert err.value.field == f"federated.attack.{field}"
    assert reason in str(err.value)


def test_the_engine_refuses_what_the_config_cannot_reach() -> None:
    for kw, field in (({"fraction": 1.0}, "fraction"), ({"kind": "flip"}, "kind")):
        with pytest.raises(ConfigError) as err:
            AttackConfig(**kw)
        assert err.value.field == f"attack.{field}"


def test_a_run_config_records_the_malicious_updates_of_each_server_step(tmp_path: Path) -> None:
    text = CFG.format(algorithm="fedavg", cache=tmp_path / "cache", steps=2, seed=0)
    text += '[federated.attack]\nfraction = 0.5\nkind = "sign_flip"\nscale = 2.0\n'
    text += '[federated.robust]\nrule = "median"\n'
    (tmp_path / "c.toml").write_text(text)
    out = tmp_path / "r"
    res = CliRunner().invoke(app, ["train", str(tmp_path / "c.toml"), "--out", str(out), "-q"])
    assert res.exit_code == 0, res.output
    server = read_run_log(out / "metrics.jsonl", (ServerStepRecord,))
    assert len(server) == 2
    assert all(r.malicious is not None and 0 <= r.malicious <= r.updates for r in server)
    assert sum(r.malicious or 0 for r in server) > 0


# -- the robustness study ------------------------------------------------------------------


def test_robustness_study_declares_every_attack_fraction_and_defence() -> None:
    from fedvox.experiment.repro import DEFENCES, STUDIES, arm_config

    study = STUDIES["robustness"]
    names = [a.name for a in study.arms]
    assert len(names) == len(set(names)) == 37
    cfgs = {a.name: arm_config(study, a, {"seed": 2}) for a in study.arms}  # all validate
    for name in ("clean-none", "sign-flip-5-median", "scale-20-krum", "nan-20-none"):
        assert name in cfgs
    assert cfgs["clean-krum"].federated.attack.fraction == 0.0
    flip = cfgs["sign-flip-20-trimmed-mean"].federated
    assert (flip.attack.kind, flip.attack.fraction) == ("sign_flip", 0.2)
    assert (flip.robust.rule, flip.robust.trim) == ("trimmed_mean", 0.2)
    assert cfgs["scale-5-krum"].federated.robust.byzantine == 4  # 20 % of the cohort of 20
    assert cfgs["scale-5-norm-bound"].federated.robust.norm_bound > 0
    fed = [c.federated for c in cfgs.values()]
    trips = {f.concurrency * f.server_steps for f in fed}
    assert trips == {300} and {c.seed for c in cfgs.values()} == {2}
    assert {f.speakers for f in fed} == {"local"}
    backdoor = [n for n in names if n.startswith("backdoor-")]
    assert sorted(backdoor) == sorted(f"backdoor-{p}-{d}" for p in (5, 20) for d in DEFENCES)
    bd = cfgs["backdoor-20-krum"].federated
    assert (bd.attack.kind, bd.attack.fraction, bd.robust.rule) == ("backdoor", 0.2, "krum")
    assert bd.attack.boost == 10.0 and bd.attack.backdoor_pairs == 2
    assert cfgs["sign-flip-5-none"].federated.attack.boost == 1.0  # only backdoors boost


def test_robustness_table_gives_damage_against_the_same_defence_and_ratio_to_clean() -> None:
    from fedvox.experiment.repro import TABLES

    def row(arm: str, attack: str, percent: int, defence: str, eer: float, **kw) -> dict:
        return {
            "arm": arm,
            "attack": attack,
            "percent": percent,
            "defence": defence,
            "eer": eer,
            "malicious_updates": 0 if attack == "none" else 60,
            **kw,
        }

    rows = [
        row("clean-none", "none", 0, "none", 0.20),
        row("clean-median", "none", 0, "median", 0.25),
        row("sign-flip-20-none", "sign_flip", 20, "none", 0.40),
        row("sign-flip-20-median", "sign_flip", 20, "median", 0.26),
        row("scale-20-none", "scale", 20, "none", math.nan, diverged="scores not finite"),
        row("backdoor-20-median", "backdoor", 20, "median", 0.27, attack_success=0.375),
    ]
    lines = TABLES["robustness"](rows)
    by = {r["arm"]: r for r in rows}
    assert by["sign-flip-20-none"]["damage"] == pytest.approx(0.20)
    assert by["sign-flip-20-median"]["damage"] == pytest.approx(0.01)  # vs clean-median
    assert by["sign-flip-20-median"]["ratio_to_clean"] == pytest.approx(1.3)  # vs clean-none
    assert by["scale-20-none"]["damage"] is None
    text = "\n".join(lines)
    assert "| sign-flip-20-none | sign_flip | 20 % | none | 40.00% | +20.00 | 2.00 | 60 | — |" in (
        text
    )
    assert "| clean-none | none | 0 % | none | 20.00% | +0.00 | 1.00 | 0 | — |" in text
    assert (
        "| backdoor-20-median | backdoor | 20 % | median | 27.00% | +2.00 | 1.35 | 60 | 37.5 % |"
        in (text)
    )
    assert all(line.count("|") == 10 for line in lines)  # every row has the success column
    assert "diverged (non-finite model)" in text


def test_a_diverged_arm_is_a_row_of_the_study_not_a_failure(tmp_path: Path, monkeypatch) -> None:
    import fedvox.experiment.repro as repro
    from fedvox.errors import DataError
    from fedvox.records import append_run_log

    def diverge(cfg, folder: Path, progress: bool) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        step = ServerStepRecord(1, 1.0, 20, 20, 9.0, (0,) * 20, 20, 0, 0, 0, 0, 0, {}, 4)
        append_run_log(folder / "metrics.jsonl", [step])
        raise DataError(None, "3 of 40 target scores are not finite (NaN or inf)", "check")

    monkeypatch.setattr(repro, "run_arm", diverge)
    path = repro.run_study("robustness", tmp_path, arms=["scale-20-none"], progress=False)
    assert "| scale-20-none | scale | 20 % | none | diverged (non-finite model) |" in (
        path.read_text()
    )
    assert "| 4 |" in path.read_text()  # the malicious updates its server records counted

    def other(cfg, folder: Path, progress: bool) -> Path:
        raise DataError(None, "no such corpus", "prepare it")

    monkeypatch.setattr(repro, "run_arm", other)
    with pytest.raises(DataError):  # any other data error still stops the study
        repro.run_study("robustness", tmp_path / "b", arms=["scale-20-none"], progress=False)
