"""Secure aggregation that survives: an abort below the threshold skips the server step.

on_abort = "skip": the step leaves the model unchanged, is logged and counted, and the run
goes on deterministically; "stop" raises the protocol's error; a violation always stops.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_federated_e2e import CFG
from torch import nn
from typer.testing import CliRunner

import fedvox.privacy.secagg as secagg
from fedvox.cli import app
from fedvox.errors import StepSkipped
from fedvox.experiment.config import PrivacySection
from fedvox.fl import (
    ClientConfig,
    FedAvg,
    ModuleTask,
    Population,
    ServerSGD,
    Simulator,
    SimulatorConfig,
)
from fedvox.fl.simulator import SimRecord
from fedvox.privacy.dp import FixedClip
from fedvox.privacy.secagg import SecAggAbort, SecAggConfig, SecAggViolation, SecureSum
from fedvox.records import ServerStepRecord, TripRecord, read_run_log

# 4 clients a step, t = ⌈2/3·4⌉ = 3: each client drops with p = 0.4, so some steps have
# fewer than 3 survivors (abort) and others do not.
ABORTING = {"dropout": 0.4, "seed": 5, "threshold": 2 / 3}
STEPS = 12


def _toy(n_clients: int = 12, per_client: int = 6, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.normal(size=(n_clients * per_client, 5)).astype(np.float32))
    y = torch.from_numpy(rng.integers(3, size=n_clients * per_client))
    torch.manual_seed(seed)
    task = ModuleTask(
        nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)),
        lambda out, b: F.cross_entropy(out, b["y"], reduction="none"),
    )
    clients = list(np.arange(n_clients * per_client).reshape(n_clients, per_client))
    return task, Population({"x": x, "y": y}, clients, seed=seed)


def _sim(on_abort: str, records: list[SimRecord] | None = None) -> Simulator:
    task, pop = _toy()
    return Simulator(
        task,
        pop,
        FedAvg(ServerSGD(1.0, momentum=0.5), weighting="uniform"),
        ClientConfig(batch_size=3, lr=0.1),
        SimulatorConfig(concurrency=4, seed=1),
        callback=None if records is None else records.append,
        stages=[FixedClip(1.0)],
        summer=SecureSum(SecAggConfig(on_abort=on_abort, **ABORTING)),  # type: ignore[arg-type]
    )


def test_securesum_skip_raises_stepskipped_stop_raises_the_abort() -> None:
    deltas = {"a": torch.randn(4, 3, generator=torch.Generator().manual_seed(0))}
    weights = torch.ones(4)
    skip = SecureSum(SecAggConfig(on_abort="skip", **ABORTING))  # type: ignore[arg-type]
    stop = SecureSum(SecAggConfig(on_abort="stop", **ABORTING))  # type: ignore[arg-type]
    outcomes = []
    for _ in range(STEPS):
        try:
            skip(deltas, weights)
            outcomes.append("ok")
        except StepSkipped as err:
            outcomes.append("skipped")
            assert err.metrics["secagg_aborted"] == 1.0
            assert err.metrics["secagg_threshold"] == 3
            assert err.metrics["secagg_survivors"] < 3
            assert "below the threshold t=3" in err.reason
            assert isinstance(err.__cause__, SecAggAbort)
            with pytest.raises(SecAggAbort, match="below the threshold t=3"):
                stop(deltas, weights)
            continue
        stop(deltas, weights)  # the same call succeeds under either policy
    assert "ok" in outcomes and "skipped" in outcomes
    assert skip.aborted == outcomes.count("skipped")
    assert skip.state_dict()["aborted"] == skip.aborted


def test_violation_stops_even_with_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    def hostile(*args: object, **kwargs: object) -> None:
        raise SecAggViolation("client 1 refuses: asked for both shares of [2]")

    monkeypatch.setattr(secagg, "run_protocol", hostile)
    summer = SecureSum(SecAggConfig(on_abort="skip"))
    with pytest.raises(SecAggViolation, match="both shares"):
        summer({"a": torch.zeros(3, 2)}, torch.ones(3))
    assert summer.aborted == 0


def test_run_skips_aborted_steps_counts_them_and_is_deterministic(
    caplog: pytest.LogCaptureFixture,
) -> None:
    records: list[SimRecord] = []
    sim = _sim("skip", records)
    with caplog.at_level(logging.WARNING, logger="fedvox.fl.simulator"):
        sim.run(max_server_steps=STEPS)
    steps = [r for r in records if isinstance(r, ServerStepRecord)]
    assert len(steps) == STEPS  # the run went on to the end
    skipped = [r for r in steps if r.agg["secagg_aborted"] == 1.0]
    assert 0 < len(skipped) < STEPS
    assert sim.counters["skipped_steps"] == len(skipped) == sim.aggregator.summer.aborted
    assert steps[-1].agg["secagg_aborted_total"] == len(skipped)
    assert all(r.updates == 0 and r.agg["secagg_survivors"] < 3 for r in skipped)
    warned = [m for m in caplog.messages if "skipped, model unchanged" in m]
    assert len(warned) == len(skipped)
    assert f"server step {skipped[0].step} skipped" in warned[0]
    assert "survivors, below the threshold t=3" in warned[0]
    # the model of a skipped step is the model before it (bit for bit), momentum included
    replay = _sim("skip")
    before = {n: t.clone() for n, t in replay.params.items()}
    for r in steps:
        replay.run(max_server_steps=r.step)
        same = all(torch.equal(before[n], replay.params[n]) for n in before)
        assert same == (r.agg["secagg_aborted"] == 1.0), r.step
        before = {n: t.clone() for n, t in replay.params.items()}
    # same seed, same bits; and a resumed run too
    again = _sim("skip")
    again.run(max_server_steps=STEPS)
    part = _sim("skip")
    part.run(max_server_steps=skipped[0].step)
    resumed = _sim("skip")
    resumed.load_state_dict(part.state_dict())
    resumed.run(max_server_steps=STEPS)
    for n in sim.params:
        assert torch.equal(sim.params[n], again.params[n])
        assert torch.equal(sim.params[n], resumed.params[n])
    trips = [r for r in records if isinstance(r, TripRecord) and r.server_step == skipped[0].step]
    assert trips  # the skipped step's trips are logged against it


def test_run_stops_with_the_protocol_error_when_told_to() -> None:
    sim = _sim("stop")
    with pytest.raises(SecAggAbort, match="below the threshold t=3"):
        sim.run(max_server_steps=STEPS)


def test_config_defaults_to_skip_and_describes_it() -> None:
    p = PrivacySection()
    assert p.secagg_on_abort == "skip" and p.secagg_consistency_check is False
    fields = PrivacySection.model_fields
    assert "violation" in (fields["secagg_on_abort"].description or "")
    assert "ConsistencyCheck" in (fields["secagg_consistency_check"].description or "")


def test_cli_run_with_aborts_completes_and_reports_the_count(tmp_path: Path) -> None:
    text = CFG.format(algorithm="fedavg", cache=tmp_path / "cache", steps=6, seed=0)
    text += 'weighting = "uniform"\n[federated.privacy]\nsecure_aggregation = true\n'
    text += "secagg_dropout = 0.4\n"
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    out = tmp_path / "r"
    res = CliRunner().invoke(app, ["train", str(cfg), "--out", str(out), "-q"])
    assert res.exit_code == 0, res.output
    steps = read_run_log(out / "metrics.jsonl", (ServerStepRecord,))
    aborted = sum(int(r.agg["secagg_aborted"]) for r in steps)
    assert len(steps) == 6 and aborted > 0
    privacy = (out / "metrics.json").read_text()
    assert f'"secagg_aborted_steps": {aborted}' in privacy
    assert f"{aborted} of 6 server steps skipped" in (out / "report.md").read_text()
