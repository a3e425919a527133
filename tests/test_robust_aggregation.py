"""Robust aggregation and hostile updates: the rules against hand-worked values, the combiner
in the pipeline (buffering, determinism, resume), the config's refusals, non-finite updates
dropped under every algorithm, and one hostile client of five in the simulator."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_federated_e2e import CFG
from test_fl_toys import class_population, mlp_task
from test_recon import LocalBiasTask, _shifted_population
from typer.testing import CliRunner

from fedvox.cli import app
from fedvox.errors import ConfigError
from fedvox.experiment.config import config_from_dict
from fedvox.experiment.robust import build_robust
from fedvox.fl import (
    ClientConfig,
    FedAsync,
    FedAvg,
    FedBuff,
    Population,
    ReconConfig,
    ServerSGD,
    Simulator,
    SimulatorConfig,
    make_recon_update,
)
from fedvox.fl.aggregation import Aggregator, select_rows
from fedvox.fl.local import ClientResults
from fedvox.fl.robust import (
    NormBound,
    RobustCombiner,
    coordinate_median,
    krum,
    krum_scores,
    trimmed_mean,
)
from fedvox.fl.simulator import plain_client_update
from fedvox.records import ServerStepRecord, read_run_log


def _equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


def _rows(*values: list[float]) -> dict[str, torch.Tensor]:
    """Stacked deltas of two parameters from rows [a0, a1, b]: 'a' has 2 coordinates, 'b' 1."""
    t = torch.tensor(values, dtype=torch.float32)
    return {"a": t[:, :2].clone(), "b": t[:, 2].clone()}


# -- the rules, by hand --------------------------------------------------------------------


def test_median_odd_and_even_counts() -> None:
    odd = _rows([1, 9, 0], [3, -1, 5], [2, 4, -5])
    med = coordinate_median(odd)
    assert med["a"].tolist() == [2.0, 4.0] and med["b"].item() == 0.0
    even = _rows([1, 9, 0], [3, -1, 5], [2, 4, -5], [10, 0, 1])
    med = coordinate_median(even)  # the mean of the two middle values per coordinate
    assert med["a"].tolist() == [2.5, 2.0] and med["b"].item() == 0.5


def test_trimmed_mean_cuts_each_side_per_coordinate() -> None:
    d = _rows([1, 50, 0], [2, -50, 1], [3, 0, 2], [4, 1, 3], [100, 2, 4])
    out = trimmed_mean(d, 0.2)  # ⌊0.2·5⌋ = 1 value cut from each side of every coordinate
    assert out["a"].tolist() == [3.0, 1.0] and out["b"].item() == 2.0
    assert _equal(trimmed_mean(d, 0.0), {n: t.mean(0) for n, t in d.items()})
    assert _equal(trimmed_mean(d, 0.19), trimmed_mean(d, 0.0))  # ⌊0.95⌋ = 0: nothing cut


def test_krum_picks_the_honest_cluster_and_multi_krum_averages() -> None:
    # honest 0, 1, 2, 3 on one axis (split over two parameters), one outlier far away
    d = _rows([0, 0, 0], [1, 0, 0], [0, 2, 0], [0, 0, 3], [100, -100, 100])
    # squared distances: 0–1: 1, 0–2: 4, 0–3: 9, 1–2: 5, 1–3: 10, 2–3: 13; n − f − 2 = 2
    assert krum_scores(d, 1).tolist()[:4] == [1 + 4, 1 + 5, 4 + 5, 9 + 10]
    agg, chosen = krum(d, 1)
    assert chosen.tolist() == [0] and _equal(agg, {n: t[0] for n, t in d.items()})
    agg, chosen = krum(d, 1, average=3)  # scores 5, 6, 9 are the three best
    assert chosen.tolist() == [0, 1, 2]
    assert agg["a"].tolist() == pytest.approx([1 / 3, 2 / 3]) and agg["b"].item() == 0.0
    with pytest.raises(ValueError, match="n > 2f"):
        krum_scores(d, 2)  # 5 ≤ 2·2 + 2


def test_norm_bound_scales_the_joint_norm_only_when_above() -> None:
    d = _rows([3, 0, 4], [0.3, 0, 0.4])  # norms 5 and 0.5, over both parameters jointly
    stage = NormBound(1.0)
    out, w = stage(d, torch.tensor([2.0, 1.0]))
    assert out["a"][0].tolist() == pytest.approx([0.6, 0.0])
    assert out["b"][0].item() == pytest.approx(0.8)
    assert _equal({n: t[1] for n, t in out.items()}, {n: t[1] for n, t in d.items()})
    assert w.tolist() == [2.0, 1.0]
    stage.end_step(2)
    assert stage.last_metrics() == {"norm_bound": 1.0, "fraction_bounded": 0.5}
    with pytest.raises(ConfigError, match=r"robust\.norm_bound"):
        NormBound(0.0)


# -- the combiner in the pipeline ----------------------------------------------------------


def _batch(seed: int, k: int = 5) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = {"w": torch.randn(k, 3, 4, generator=g), "b": torch.randn(k, 4, generator=g)}
    return d, torch.rand(k, generator=g) + 0.5


@pytest.mark.parametrize("rule", ["median", "trimmed_mean", "krum"])
def test_combiner_returns_aggregate_times_weight_and_fedavg_recovers_it(rule: str) -> None:
    d, w = _batch(0)
    w[2] = 0.0  # a zero-weight row is dropped, not counted
    agg = Aggregator(names=["w", "b"], summer=RobustCombiner(rule, trim=0.25, byzantine=0))
    agg.accumulate(d, w)
    total, weight, count = agg.result()
    kept, _ = select_rows(d, w, w > 0)
    expect = {
        "median": coordinate_median,
        "trimmed_mean": lambda x: trimmed_mean(x, 0.25),
        "krum": lambda x: krum(x, 0)[0],
    }[rule](kept)
    assert count == 4 and weight == pytest.approx(float(w.sum()))
    assert all(torch.allclose(total[n] / weight, expect[n], atol=1e-6) for n in expect)
    p = {"w": torch.zeros(3, 4), "b": torch.zeros(4)}
    new = FedAvg(ServerSGD(1.0)).apply(p, total, weight, count, [p], torch.zeros(5))
    assert all(torch.allclose(new[n], -expect[n], atol=1e-6) for n in expect)


def test_combiner_buffers_a_step_and_is_deterministic() -> None:
    (d1, w1), (d2, w2) = _batch(1, 3), _batch(2, 4)
    both = ({n: torch.cat([d1[n], d2[n]]) for n in d1}, torch.cat([w1, w2]))

    def run(parts):
        agg = Aggregator(summer=RobustCombiner("krum", byzantine=1, krum_average=2))
        for d, w in parts:
            agg.accumulate(d, w)
        return agg.result()

    split, whole, again = run([(d1, w1), (d2, w2)]), run([both]), run([(d1, w1), (d2, w2)])
    assert _equal(split[0], whole[0]) and split[1:] == whole[1:]
    assert _equal(split[0], again[0]) and split[1:] == again[1:]  # same inputs, same bits


def test_combiner_state_round_trip_mid_step() -> None:
    (d1, w1), (d2, w2) = _batch(3, 3), _batch(4, 3)
    agg = Aggregator(stages=[NormBound(2.0)], summer=RobustCombiner("median"))
    agg.accumulate(d1, w1)
    state = agg.state_dict()
    agg.accumulate(d2, w2)
    straight = agg.result()
    fresh = Aggregator(stages=[NormBound(2.0)], summer=RobustCombiner("median"))
    fresh.load_state_dict(state)
    fresh.accumulate(d2, w2)
    resumed = fresh.result()
    assert _equal(straight[0], resumed[0]) and straight[1:] == resumed[1:]
    assert agg.metrics() == fresh.metrics()


def test_krum_skips_a_step_thinned_by_dropouts() -> None:
    d, w = _batch(5, 3)  # configured for more, but only 3 ≤ 2·1 + 2 arrived
    agg = Aggregator(summer=RobustCombiner("krum", byzantine=1))
    agg.accumulate(d, w)
    total, weight, count = agg.result()
    assert weight == 0.0 and count == 0 and all(not t.any() for t in total.values())
    assert agg.metrics()["robust_skipped"] == 1.0


# -- refusals at load time -----------------------------------------------------------------


def _cfg(robust: dict, privacy: dict | None = None, **federated) -> None:
    f = {"robust": robust, "privacy": privacy or {}, "weighting": "uniform", **federated}
    config_from_dict({"federated": f})


@pytest.mark.parametrize(
    ("robust", "privacy", "federated", "field", "reason"),
    [
        ({"rule": "median"}, {"secure_aggregation": True}, {}, "rule", "only ever sees"),
        ({"rule": "krum"}, {"mechanism": "gaussian"}, {}, "rule", "sensitivity"),
        ({"rule": "trimmed_mean"}, {"mechanism": "dp_ftrl"}, {}, "rule", "sensitivity"),
        ({"rule": "median"}, {}, {"algorithm": "fedasync"}, "rule", "one update"),
        (
            {"rule": "krum", "byzantine": 1},
            {},
            {"algorithm": "fedbuff", "buffer_size": 4, "concurrency": 8},
            "byzantine",
            "2f + 2 = 4",
        ),
        (
            {"rule": "krum", "byzantine": 2, "krum_average": 9},
            {},
            {"concurrency": 10},
            "krum_average",
            "n − f = 8",
        ),
        ({"rule": "krum", "trim": 0.5}, {}, {}, "trim", "0.5"),
        ({"rule": "mode"}, {}, {}, "rule", "mean"),
        ({"norm_bound": -1.0}, {}, {}, "norm_bound", "0"),
    ],
)
def test_impossible_robust_settings_are_refused_naming_field_and_reason(
    robust: dict, privacy: dict, federated: dict, field: str, reason: str
) -> None:
    with pytest.raises(ConfigError) as err:
        _cfg(robust, privacy, **federated)
    assert err.value.field == f"federated.robust.{field}"
    assert reason in str(err.value)


def test_norm_bound_composes_with_secure_aggregation_and_dp() -> None:
    _cfg({"norm_bound": 1.0}, {"secure_aggregation": True, "mechanism": "gaussian"})
    cfg = config_from_dict(
        {"federated": {"robust": {"rule": "krum", "byzantine": 2, "norm_bound": 3.0}}}
    )
    assert cfg.federated is not None
    pipe = build_robust(cfg.federated)
    assert isinstance(pipe.stages[0], NormBound) and pipe.stages[0].bound == 3.0
    assert pipe.combiner is not None and pipe.combiner.byzantine == 2
    assert build_robust(config_from_dict({"federated": {}}).federated).combiner is None


# -- non-finite updates never reach the model ------------------------------------------------


class Poison:
    """A client update that keeps the clean results (and jobs) of every call and, unless
    `row` is None, sets one value of that row of the first call's delta to `value`."""

    def __init__(self, row: int | None, inner=plain_client_update, value: float = math.nan):
        self.row, self.inner, self.value = row, inner, value
        self.clean: list[ClientResults] = []
        self.jobs: list[list[tuple[int, int]]] = []

    def __call__(self, task, population, jobs, starts, cfg) -> ClientResults:
        res = self.inner(task, population, jobs, starts, cfg)
        self.clean.append(res)
        self.jobs.append(list(jobs))
        if self.row is None or len(self.clean) > 1:
            return res
        delta = {n: t.clone() for n, t in res.delta.items()}
        delta[next(iter(delta))][self.row].view(-1)[0] = self.value
        return ClientResults(delta, res.num_examples, res.loss)


def _sim(algorithm, update, concurrency: int = 4, task=None, pop: Population | None = None):
    records: list = []
    sim = Simulator(
        task or mlp_task(),
        pop or class_population([6, 7, 8, 9, 6, 7], seed=2),
        algorithm,
        ClientConfig(batch_size=4, lr=0.2),
        SimulatorConfig(concurrency=concurrency, seed=1),
        callback=records.append,
        client_update=update,
    )
    return sim, records


def _without(res: ClientResults, row: int, weights: torch.Tensor):
    keep = torch.ones(len(weights), dtype=torch.bool)
    keep[row] = False
    agg = Aggregator()
    agg.accumulate(*select_rows(res.delta, weights, keep))
    return agg.result()


def _first_step(records: list) -> ServerStepRecord:
    return next(r for r in records if isinstance(r, ServerStepRecord))


def _finite(params: dict) -> bool:
    return all(torch.isfinite(t).all() for t in params.values())


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_fedavg_drops_a_non_finite_update_and_equals_the_cohort_without_it(value) -> None:
    poison = Poison(1, value=value)
    sim, records = _sim(FedAvg(ServerSGD(1.0)), poison)
    p0 = {n: t.clone() for n, t in sim.params.items()}
    new = sim.run(max_server_steps=1)
    res = poison.clean[0]
    total, weight, count = _without(res, 1, res.num_examples.to(torch.float32))
    expect = FedAvg(ServerSGD(1.0)).apply(p0, total, weight, count, [p0], torch.zeros(3))
    assert _finite(new) and _equal(new, expect)
    step = _first_step(records)
    assert step.agg["nonfinite"] == 1.0 and step.updates == 3 and math.isfinite(step.loss)
    assert _finite(sim.run(max_server_steps=3))


def test_fedbuff_drops_a_non_finite_update_and_divides_the_rest_by_k() -> None:
    poison = Poison(0)
    sim, records = _sim(FedBuff(3, ServerSGD(1.0)), poison, concurrency=5)
    p0 = {n: t.clone() for n, t in sim.params.items()}
    new = sim.run(max_server_steps=1)
    tau = torch.tensor(_first_step(records).staleness, dtype=torch.float64)
    total, weight, count = _without(poison.clean[0], 0, FedBuff(3).client_weights(None, tau))
    expect = FedBuff(3, ServerSGD(1.0)).apply(p0, total, weight, count, [p0] * 3, tau)
    assert _finite(new) and _equal(new, expect)
    assert _first_step(records).agg["nonfinite"] == 1.0
    assert _finite(sim.run(max_server_steps=6))


def test_fedasync_drops_a_non_finite_update_and_keeps_the_model() -> None:
    sim, records = _sim(FedAsync(0.5), Poison(0))
    p0 = {n: t.clone() for n, t in sim.params.items()}
    assert _equal(sim.run(max_server_steps=1), p0)  # the step without its one update
    assert _first_step(records).agg["nonfinite"] == 1.0 and _first_step(records).updates == 0
    assert _finite(sim.run(max_server_steps=6))


def test_local_speakers_drop_a_diverged_client_under_uniform_weights() -> None:
    pop = _shifted_population([6, 8, 7, 5])
    x = pop.store["x"].clone()
    x[pop.order[pop.offsets[2]]] = float("inf")  # client 2's data makes its update diverge
    pop = Population({"x": x, "y": pop.store["y"]}, [
        pop.order[pop.offsets[c] : pop.offsets[c + 1]] for c in range(4)
    ], seed=0)  # fmt: skip
    spy = Poison(None, inner=make_recon_update(ReconConfig()))
    sim, records = _sim(FedAvg(ServerSGD(1.0), weighting="uniform"), spy, 4, LocalBiasTask(), pop)
    p0 = {n: t.clone() for n, t in sim.params.items()}
    new = sim.run(max_server_steps=1)
    row = [c for c, _ in spy.jobs[0]].index(2)
    res = spy.clean[0]
    assert not torch.isfinite(res.delta["w"][row]).all()  # it did diverge
    total, weight, count = _without(res, row, torch.ones(4))
    expect = FedAvg(ServerSGD(1.0)).apply(p0, total, weight, count, [p0], torch.zeros(3))
    assert _finite(new) and _equal(new, expect)
    assert _first_step(records).agg["nonfinite"] == 1.0


# -- one hostile client of five ------------------------------------------------------------


class Scaled:
    """Client 0 sends its update times −200 (a model-replacement style attack)."""

    def __call__(self, task, population, jobs, starts, cfg) -> ClientResults:
        res = plain_client_update(task, population, jobs, starts, cfg)
        scale = torch.tensor([-200.0 if c == 0 else 1.0 for c, _ in jobs])
        delta = {n: t * scale.reshape(-1, *[1] * (t.dim() - 1)) for n, t in res.delta.items()}
        return ClientResults(delta, res.num_examples, res.loss)


def _five(update, rule: str | None) -> dict:
    summer = None if rule is None else RobustCombiner(rule, trim=0.2, byzantine=1)
    sim = Simulator(
        mlp_task(),
        class_population([8, 9, 10, 8, 9], seed=4),
        FedAvg(ServerSGD(1.0), weighting="uniform"),
        ClientConfig(batch_size=4, lr=0.2),
        SimulatorConfig(concurrency=5, seed=0),
        client_update=update,
        summer=summer,
    )
    return sim.run(max_server_steps=3)


def _dist(a: dict, b: dict) -> float:
    return math.sqrt(sum(float((a[n] - b[n]).pow(2).sum()) for n in a))


def test_median_and_krum_hold_one_hostile_client_of_five_where_the_mean_does_not() -> None:
    honest = _five(None, None)
    p0 = {n: t.detach() for n, t in mlp_task().init_params().items()}
    moved = _dist(honest, p0)
    mean = _dist(_five(Scaled(), None), honest)
    assert mean > 20 * moved  # the mean follows the attacker
    for rule in ("median", "trimmed_mean", "krum"):
        robust = _dist(_five(Scaled(), rule), honest)
        # within what honest training moves in these 3 rounds, 4 orders below the mean's error
        assert robust < 0.75 * moved and robust < mean / 1000, rule


def test_a_run_config_wires_norm_bound_and_krum_into_the_pipeline(tmp_path: Path) -> None:
    text = CFG.format(algorithm="fedavg", cache=tmp_path / "cache", steps=2, seed=0)
    text += '[federated.robust]\nrule = "krum"\nbyzantine = 0\nkrum_average = 2\nnorm_bound = 5.0\n'
    (tmp_path / "c.toml").write_text(text)
    out = tmp_path / "r"
    res = CliRunner().invoke(app, ["train", str(tmp_path / "c.toml"), "--out", str(out), "-q"])
    assert res.exit_code == 0, res.output
    server = read_run_log(out / "metrics.jsonl", (ServerStepRecord,))
    assert len(server) == 2
    for r in server:
        assert r.agg["norm_bound"] == 5.0 and r.agg["robust_inputs"] == 4.0
        assert r.agg["robust_skipped"] == 0.0 and r.agg["nonfinite"] == 0.0
