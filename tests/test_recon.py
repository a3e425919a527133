"""Tests for Federated Reconstruction: FedAvg as the no-local-parameter case, local params never
reach the aggregator (sync and buffered async), zero weight for non-finite deltas,
reconstruction with frozen global params, splits and determinism."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_fl_toys import LinearTask, linear_population

from fedvox.errors import ConfigError
from fedvox.fl import (
    ClientConfig,
    FedAvg,
    FedBuff,
    Population,
    ServerAdam,
    ServerSGD,
    Simulator,
    SimulatorConfig,
    train_clients,
)
from fedvox.fl.aggregation import Aggregator, plain_sum
from fedvox.fl.local import (
    ReconConfig,
    make_recon_update,
    recon_eval,
    reconstruct,
    split_client,
    train_clients_recon,
)
from fedvox.tasks.mf import MFTask, mf_population, synthetic_ratings


class NoLocalTask(LinearTask):
    """LinearTask as a ReconTask without local parameters (FedAvg's special case)."""

    def init_local(self, client_ids, generator):
        return {}


class LocalBiasTask(LinearTask):
    """y ≈ x @ w + b_client: w global, the bias local (clients' offsets differ)."""

    def init_params(self):
        return {"w": self.w0.clone()}

    def init_local(self, client_ids, generator):
        return {"b": 0.1 * torch.randn(len(client_ids), self.b0.shape[0], generator=generator)}

    def loss(self, params, batch):
        pred = batch["x"] @ params["w"] + params["b"]
        return ((pred - batch["y"]) ** 2).sum(-1)


def _shifted_population(sizes, seed=0) -> Population:
    """linear_population with a per-client offset on y, so the local bias matters."""
    pop = linear_population(sizes, seed=seed)
    y = pop.store["y"].clone()
    for c in range(pop.num_clients):
        y[pop.order[pop.offsets[c] : pop.offsets[c + 1]]] += 2.0 * (c % 3 - 1)
    return Population({"x": pop.store["x"], "y": y}, [
        pop.order[pop.offsets[c] : pop.offsets[c + 1]] for c in range(pop.num_clients)
    ], seed=seed)  # fmt: skip


def _perturbed(params, scale, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: t + scale * torch.randn(t.shape, generator=g) for n, t in params.items()}


def _equal(a, b) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("vectorised", [True, False])
def test_without_local_params_it_is_fedavg_bit_for_bit(vectorised: bool) -> None:
    pop = linear_population([3, 7, 12, 5, 9, 1])
    task = NoLocalTask()
    p0 = task.init_params()
    starts = [p0, p0, *[_perturbed(p0, 0.1, i) for i in range(4)]]  # shared and own versions
    jobs = [(c, 3 + c) for c in range(6)]
    cfg = ClientConfig(epochs=2, batch_size=4, lr=0.2, mu=0.3, vectorised=vectorised)
    plain = train_clients(task, pop, jobs, starts, cfg)
    # split "all": query = FedAvg's batches; with no local params reconstruction is a no-op
    for steps in (0, 3):
        recon = train_clients_recon(task, pop, jobs, starts, cfg, ReconConfig(steps, split="all"))
        assert _equal(recon.delta, plain.delta)
        assert torch.equal(recon.num_examples, plain.num_examples)
        assert torch.equal(recon.loss, plain.loss)


def test_without_local_params_a_simulator_run_is_fedavg_bit_for_bit() -> None:
    pop = linear_population([4 + c % 6 for c in range(20)], seed=2)

    def run(update):
        sim = Simulator(
            NoLocalTask(),
            pop,
            FedAvg(ServerAdam(0.05)),
            ClientConfig(batch_size=3, lr=0.1),
            SimulatorConfig(concurrency=5, seed=1, dropout=0.2),
            client_update=update,
        )
        return sim.run(max_server_steps=5)

    a = run(None)
    b = run(make_recon_update(ReconConfig(steps=2, split="all")))
    assert _equal(a, b)
    assert not _equal(a, NoLocalTask().init_params())


class SpySummer:
    """Records every tensor the aggregator is given (the server's whole view of the clients)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, torch.Tensor]] = []

    def __call__(self, deltas, weights):
        self.seen.append({n: t.clone() for n, t in deltas.items()})
        return plain_sum(deltas, weights)


class SpyUpdate:
    """Wraps the recon update to keep the clients' reconstructed local params for comparison."""

    def __init__(self, task, recon) -> None:
        self.task, self.recon, self.local = task, recon, []
        self.update = make_recon_update(recon)

    def __call__(self, task, population, jobs, starts, cfg):
        # the local params each client reconstructs in this trip (same streams as training)
        from fedvox.rng import Purpose, torch_generator

        for c, t in jobs:
            gen = torch_generator(population.seed, Purpose.RECON_INIT, c, t)
            self.local.append(task.init_local([c], gen)["user_emb"][0])
        return self.update(task, population, jobs, starts, cfg)


@pytest.mark.parametrize("algo", ["fedavg", "fedbuff"])
def test_local_params_never_reach_the_aggregator(algo: str) -> None:
    data = synthetic_ratings(30, 20, 2, (6, 12), seed=0)
    pop = mf_population(data, range(30))
    task = MFTask(20, dim=4, seed=0)
    spy = SpySummer()
    update = SpyUpdate(task, ReconConfig(steps=1, lr=0.1))
    algorithm = FedAvg(ServerSGD(1.0)) if algo == "fedavg" else FedBuff(3, ServerSGD(1.0))
    sim = Simulator(
        task,
        pop,
        algorithm,
        ClientConfig(batch_size=3, lr=0.1),
        SimulatorConfig(concurrency=6, seed=0),
        client_update=update,
        summer=spy,
    )
    params = sim.run(max_server_steps=4)
    assert len(spy.seen) == 4
    global_names = {"item_emb", "item_bias", "global_bias"}
    assert set(params) == global_names
    for deltas in spy.seen:
        assert set(deltas) == global_names
        k = len(deltas["global_bias"])
        assert deltas["item_emb"].shape == (k, 20, 4)
        assert deltas["item_bias"].shape == (k, 20)
    # no user vector (as initialised on the device) appears anywhere in what the server got
    received = torch.cat([t.reshape(-1) for d in spy.seen for t in d.values()])
    for u in update.local:
        assert not any(torch.equal(received[i : i + 4], u) for i in range(len(received) - 3))
    # and the aggregator itself refuses a local key
    with pytest.raises(ValueError, match="user_emb"):
        sim.aggregator.accumulate({**spy.seen[0], "user_emb": torch.zeros(1, 4)}, torch.ones(1))


def test_non_finite_delta_gets_zero_weight() -> None:
    pop = _shifted_population([6, 8, 7])
    x = pop.store["x"].clone()
    x[pop.order[pop.offsets[1]]] = float("inf")  # client 1 diverges
    pop = Population({"x": x, "y": pop.store["y"]}, [
        pop.order[pop.offsets[c] : pop.offsets[c + 1]] for c in range(3)
    ])  # fmt: skip
    task = LocalBiasTask()
    p0 = task.init_params()
    for vec in (True, False):
        cfg = ClientConfig(batch_size=2, lr=0.05, vectorised=vec)
        res = train_clients_recon(task, pop, [(0, 0), (1, 0), (2, 0)], [p0] * 3, cfg, ReconConfig())
        # the delta stays non-finite: the aggregator drops and counts it, whatever the weights
        assert res.num_examples[1] == 0 and not torch.isfinite(res.delta["w"][1]).all()
        assert (res.num_examples[[0, 2]] > 0).all()
        assert torch.isfinite(res.delta["w"][[0, 2]]).all() and res.delta["w"][0].abs().sum() > 0
        agg = Aggregator(names=list(p0))
        assert agg.accumulate(res.delta, torch.ones(3)).tolist() == [True, False, True]
        total, weight, count = agg.result()
        assert torch.isfinite(total["w"]).all() and weight == 2.0 and count == 2
        assert agg.metrics()["nonfinite"] == 1.0


def test_reconstruction_freezes_global_and_lowers_support_loss() -> None:
    pop = _shifted_population([10, 12, 9, 11], seed=3)
    task = LocalBiasTask()
    params = _perturbed(task.init_params(), 0.5, 0)
    before = {n: t.clone() for n, t in params.items()}
    cfg = ClientConfig(batch_size=4)
    at_init = reconstruct(task, pop, params, ReconConfig(steps=0), client=cfg, part="all")
    rebuilt = reconstruct(task, pop, params, ReconConfig(steps=5, lr=0.1), client=cfg, part="all")
    loop = reconstruct(
        task, pop, params, ReconConfig(steps=5, lr=0.1), part="all",
        client=ClientConfig(batch_size=4, vectorised=False),
    )  # fmt: skip
    assert _equal(params, before)  # the global params were not touched
    assert torch.allclose(rebuilt["b"], loop["b"], atol=1e-5)
    for c in range(pop.num_clients):
        batch = pop.gather(pop.order[pop.offsets[c] : pop.offsets[c + 1]])
        loss0 = task.loss({**params, "b": at_init["b"][c]}, batch).mean()
        loss1 = task.loss({**params, "b": rebuilt["b"][c]}, batch).mean()
        assert loss1 < loss0
        # the bias approaches its optimum, the mean residual
        best = (batch["y"] - batch["x"] @ params["w"]).mean(0)
        assert (rebuilt["b"][c] - best).norm() < 0.5 * (at_init["b"][c] - best).norm()


def test_training_is_deterministic_and_independent_of_the_cohort() -> None:
    pop = _shifted_population([9, 14, 5, 11, 3], seed=1)
    task = LocalBiasTask()
    p0 = task.init_params()
    jobs = [(c, 2) for c in range(5)]
    cfg = ClientConfig(epochs=2, batch_size=3, lr=0.05, mu=0.1)
    recon = ReconConfig(steps=2, lr=0.1)
    a = train_clients_recon(task, pop, jobs, [p0] * 5, cfg, recon)
    b = train_clients_recon(task, pop, jobs, [p0] * 5, cfg, recon)
    assert _equal(a.delta, b.delta) and torch.equal(a.loss, b.loss)
    loop = train_clients_recon(task, pop, jobs, [p0] * 5, ClientConfig(
        epochs=2, batch_size=3, lr=0.05, mu=0.1, vectorised=False), recon)  # fmt: skip
    assert torch.allclose(a.delta["w"], loop.delta["w"], atol=1e-5)
    alone = train_clients_recon(task, pop, [(3, 2)], [p0], cfg, recon)
    assert torch.allclose(alone.delta["w"][0], a.delta["w"][3], atol=1e-6)
    other_trip = train_clients_recon(task, pop, [(3, 5)], [p0], cfg, recon)
    assert not torch.allclose(other_trip.delta["w"][0], a.delta["w"][3])
    # query weight: epochs x odd-batch examples (client 4 has 3 examples = one batch: all)
    assert a.num_examples.tolist() == [6, 12, 4, 10, 6]


def test_joint_training_differs_and_matches_the_loop() -> None:
    pop = _shifted_population([9, 14, 6], seed=4)
    task = LocalBiasTask()
    p0 = task.init_params()
    jobs = [(c, 0) for c in range(3)]
    out = {}
    for vec in (True, False):
        cfg = ClientConfig(batch_size=3, lr=0.05, mu=0.2, vectorised=vec)
        out[vec] = train_clients_recon(task, pop, jobs, [p0] * 3, cfg, ReconConfig(joint=True))
    assert set(out[True].delta) == {"w"}
    assert torch.allclose(out[True].delta["w"], out[False].delta["w"], atol=1e-5)
    cfg = ClientConfig(batch_size=3, lr=0.05, mu=0.2)
    sep = train_clients_recon(task, pop, jobs, [p0] * 3, cfg, ReconConfig())
    assert not torch.allclose(sep.delta["w"], out[True].delta["w"])


def test_splits() -> None:
    pop = linear_population([11, 3, 1])
    rng = lambda: np.random.default_rng(0)  # noqa: E731
    own = lambda c: set(pop.order[pop.offsets[c] : pop.offsets[c + 1]].tolist())  # noqa: E731
    sp = split_client(pop, 0, rng(), 2, 2, ReconConfig())
    support = set(np.concatenate(sp.support).tolist())
    query = set(np.concatenate(sp.query).tolist())
    assert support.isdisjoint(query) and support | query == own(0)
    assert len(sp.support) == 3 and len(sp.query) == 6 and sp.num_query == 5  # 2 epochs
    fr = split_client(pop, 0, rng(), 4, 1, ReconConfig(split="fraction", support_fraction=0.3))
    assert sum(map(len, fr.support)) == 3 and fr.num_query == 8
    for c, b in ((1, 4), (2, 2)):  # one batch / one example: both halves are all the data
        sp = split_client(pop, c, rng(), b, 1, ReconConfig())
        assert set(np.concatenate(sp.support).tolist()) == own(c) == set(sp.query[0].tolist())


def test_recon_eval_counts_query_examples() -> None:
    pop = _shifted_population([10, 12], seed=5)
    task = LocalBiasTask()
    metric = lambda p, b: {"loss": task.loss(p, b)}  # noqa: E731
    m0 = recon_eval(task, pop, task.init_params(), ReconConfig(steps=0), metric)
    m5 = recon_eval(task, pop, task.init_params(), ReconConfig(steps=5, lr=0.05), metric)
    assert m0["examples"] == m5["examples"] == 12.0  # odd batches of 10: 10, and 12: 2 (b=10)
    assert m5["loss"] < m0["loss"]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"steps": -1}, "reconstruction.steps"),
        ({"lr": 0.0}, "reconstruction.lr"),
        ({"split": "halves"}, "reconstruction.split"),
        ({"support_fraction": 1.0}, "reconstruction.support_fraction"),
        ({"min_examples_to_split": 1}, "reconstruction.min_examples_to_split"),
    ],
)
def test_bad_config_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        ReconConfig(**kwargs)
    assert err.value.field == field


def test_closed_form_needs_the_task_to_have_one() -> None:
    pop = linear_population([4, 5])
    task = LocalBiasTask()
    with pytest.raises(ConfigError) as err:
        train_clients_recon(
            task,
            pop,
            [(0, 0)],
            [task.init_params()],
            ClientConfig(),
            ReconConfig(0, closed_form=True),
        )
    assert err.value.field == "reconstruction.closed_form"


def test_groups_split_keeps_whole_groups_on_each_side() -> None:
    from fedvox.fl.local import ReconConfig, split_client
    from fedvox.fl.population import Population

    n = 12
    store = {
        "x": torch.zeros(n, 2),
        "group": torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 4, 4]),
    }
    pop = Population(store, [np.arange(10), np.arange(10, 12)], seed=0)
    recon = ReconConfig(split="groups")
    for trip in range(5):
        sp = split_client(pop, 0, np.random.default_rng(trip), 4, 1, recon)
        sup = {int(store["group"][r]) for b in sp.support for r in b}
        qry = {int(store["group"][r]) for b in sp.query for r in b}
        assert sup and qry and not sup & qry  # no recording on both sides
        assert sup | qry == {0, 1, 2, 3}
        assert sp.num_query == sum(len(b) for b in sp.query)
    one = split_client(pop, 1, np.random.default_rng(0), 4, 1, recon)  # a single group
    assert sorted(r for b in one.query for r in b) == [10, 11]
