"""Tests for the client update: vectorised clients (generic and low-rank paths) equal the
per-client loop, and FedProx pulls towards the global model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_fl_toys import LinearTask, class_population, linear_population, mlp_task
from torch import nn

from fedvox.errors import ConfigError
from fedvox.fl import (
    ClientConfig,
    FedBuff,
    ModuleTask,
    Population,
    ServerSGD,
    Simulator,
    SimulatorConfig,
    train_clients,
)
from fedvox.fl.local.lowrank import lowrank_plan
from fedvox.fl.local.steps import SOLO_BYTES, auto_chunk, objective


def _perturbed(params, scale: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    return {n: t + scale * torch.randn(t.shape, generator=g) for n, t in params.items()}


@pytest.mark.parametrize("lr_normalise", [False, True])
@pytest.mark.parametrize("mu", [0.0, 0.5])
def test_vectorised_equals_loop(mu: float, lr_normalise: bool) -> None:
    # different numbers of batches (1..4), short final batches, different starting versions
    pop = class_population([3, 7, 12, 5, 9])
    task = mlp_task()
    p0 = task.init_params()
    starts = [_perturbed(p0, 0.1 * i, i) for i in range(5)]
    jobs = [(c, 10 + c) for c in range(5)]
    out = {}
    for vec in (True, False):
        cfg = ClientConfig(
            epochs=2, batch_size=4, lr=0.3, mu=mu, lr_normalise=lr_normalise, vectorised=vec
        )
        out[vec] = train_clients(task, pop, jobs, starts, cfg)
    for n in p0:
        assert torch.allclose(out[True].delta[n], out[False].delta[n], atol=1e-5), n
        assert out[True].delta[n].abs().sum() > 0
    assert torch.allclose(out[True].loss, out[False].loss, atol=1e-5)
    assert out[True].num_examples.tolist() == [6, 14, 24, 10, 18]


def test_lr_normalisation_scales_the_short_batch_step() -> None:
    # one client, 3 examples, batch 4: the only batch is short (3 of 4)
    pop = linear_population([3])
    task = LinearTask()
    p0 = task.init_params()
    base = train_clients(task, pop, [(0, 0)], [p0], ClientConfig(batch_size=4, lr=0.1))
    norm = train_clients(
        task, pop, [(0, 0)], [p0], ClientConfig(batch_size=4, lr=0.1, lr_normalise=True)
    )
    for n in p0:
        assert torch.allclose(norm.delta[n], 0.75 * base.delta[n], atol=1e-7)


def test_fedprox_gradient_points_away_from_global_so_steps_pull_towards_it() -> None:
    def zero_loss(p, batch):
        return 0.0 * batch["x"].sum(-1)

    cfg = ClientConfig(mu=2.0)
    anchor = {"w": torch.tensor([1.0, -1.0])}
    p = {"w": torch.tensor([3.0, -4.0])}
    obj = objective(zero_loss, cfg)
    g = torch.func.grad(lambda q: obj(q, anchor, {}, {"x": torch.ones(2, 1)}, torch.ones(2))[0])(p)
    assert torch.allclose(g["w"], 2.0 * (p["w"] - anchor["w"]))
    stepped = p["w"] - 0.1 * g["w"]
    assert (stepped - anchor["w"]).norm() < (p["w"] - anchor["w"]).norm()


def test_fedprox_reduces_client_drift_on_non_iid_clients() -> None:
    pop = linear_population([20, 20, 20], noniid=3.0)
    task = LinearTask()
    p0 = task.init_params()
    jobs = [(c, 0) for c in range(3)]

    def drift(mu: float) -> torch.Tensor:
        cfg = ClientConfig(epochs=5, batch_size=5, lr=0.05, mu=mu)
        res = train_clients(task, pop, jobs, [p0] * 3, cfg)
        return torch.sqrt(sum((d.flatten(1) ** 2).sum(1) for d in res.delta.values()))

    free, prox = drift(0.0), drift(1.0)
    assert torch.all(prox < 0.9 * free)


@pytest.mark.parametrize("chunk_size", [None, 1, 2])
def test_vectorised_equals_loop_in_chunks_from_one_version(chunk_size) -> None:
    pop = class_population([3, 7, 12, 5, 9])
    task = mlp_task()
    p0 = task.init_params()
    jobs = [(c, 0) for c in range(5)]
    res = {
        vec: train_clients(
            task,
            pop,
            jobs,
            [p0] * 5,
            ClientConfig(batch_size=4, lr=0.3, vectorised=vec, chunk_size=chunk_size),
        )
        for vec in (True, False)
    }
    for n in p0:
        assert torch.allclose(res[True].delta[n], res[False].delta[n], atol=1e-5), n
    assert torch.equal(p0["0.weight"], task.init_params()["0.weight"])  # starts untouched


# -- the low-rank path (Sequential MLPs): W0 shared, per-client low-rank corrections --------


def _relu_mlp(seed: int = 1) -> ModuleTask:
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Linear(6, 8, bias=False),
        nn.ReLU(inplace=True),
        nn.Linear(8, 8),
        nn.GELU(),
        nn.Linear(8, 3),
    )
    return ModuleTask(net, lambda out, batch: F.cross_entropy(out, batch["y"], reduction="none"))


@pytest.mark.parametrize("make_task", [mlp_task, _relu_mlp])
@pytest.mark.parametrize(
    ("mu", "lr_normalise", "chunk_size"),
    [(0.0, False, None), (0.5, False, None), (0.0, True, 2), (0.5, True, 1)],
)
def test_lowrank_equals_loop(make_task, mu: float, lr_normalise: bool, chunk_size) -> None:
    # 1..4 batches per client, short final batches, 2 epochs, and three starting versions
    # interleaved (clients 0, 2, 4 share one), so groups are not contiguous
    pop = class_population([3, 7, 12, 5, 9, 6])
    task = make_task()
    p0 = task.init_params()
    other = [_perturbed(p0, 0.1, 1), _perturbed(p0, 0.2, 2)]
    starts = [p0, other[0], p0, other[1], p0, other[0]]
    jobs = [(c, 3 + c) for c in range(6)]
    out = {}
    for lowrank in (True, None):
        cfg = ClientConfig(
            epochs=2,
            batch_size=4,
            lr=0.3,
            mu=mu,
            lr_normalise=lr_normalise,
            lowrank=lowrank,
            chunk_size=chunk_size,
        )
        out[lowrank] = train_clients(task, pop, jobs, starts, cfg)
    ref = train_clients(
        task,
        pop,
        jobs,
        starts,
        ClientConfig(
            epochs=2, batch_size=4, lr=0.3, mu=mu, lr_normalise=lr_normalise, vectorised=False
        ),
    )
    for res in out.values():
        for n in p0:
            assert torch.allclose(res.delta[n], ref.delta[n], atol=1e-5), n
        assert torch.allclose(res.loss, ref.loss, atol=1e-5)
        assert torch.equal(res.num_examples, ref.num_examples)
    assert all(ref.delta[n].abs().sum() > 0 for n in p0)
    assert torch.equal(p0["0.weight"], make_task().init_params()["0.weight"])  # untouched


def test_lowrank_is_chosen_only_where_it_saves_work() -> None:
    # W2's MLP at rank 50 (5 steps x batch 10): the two wide layers go low-rank, 200->10 not
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(784, 200), nn.ReLU(), nn.Linear(200, 200), nn.Linear(200, 10))
    task = ModuleTask(net, lambda out, b: F.cross_entropy(out, b["y"], reduction="none"))
    pop = Population({"x": torch.zeros(4, 784), "y": torch.zeros(4, dtype=torch.long)}, [[0]])
    plan = lowrank_plan(task, pop, ClientConfig(), rank=50)
    assert plan is not None and plan.lowrank == {0, 2}
    assert lowrank_plan(task, pop, ClientConfig(lowrank=False), rank=50) is None
    assert lowrank_plan(task, pop, ClientConfig(vectorised=False), rank=50) is None
    assert lowrank_plan(task, pop, ClientConfig(), rank=1000) is None  # dense is cheaper
    assert lowrank_plan(task, pop, ClientConfig(lowrank=True), rank=1000).lowrank == {
        0,
        2,
        3,
    }
    # the toy MLP (6-8-3) is too narrow for batch 4: the generic path runs
    small = mlp_task()
    assert lowrank_plan(small, class_population([5]), ClientConfig(), rank=4) is None


def test_lowrank_refuses_a_model_it_cannot_run() -> None:
    pop = linear_population([4])
    task = LinearTask()  # not a ModuleTask
    with pytest.raises(ConfigError, match=r"client\.lowrank"):
        train_clients(task, pop, [(0, 0)], [task.init_params()], ClientConfig(lowrank=True))
    torch.manual_seed(0)
    conv = ModuleTask(nn.Sequential(nn.Linear(5, 4), nn.Dropout(0.1)), lambda o, b: o.sum(-1))
    with pytest.raises(ConfigError, match=r"client\.lowrank"):
        train_clients(conv, pop, [(0, 0)], [conv.init_params()], ClientConfig(lowrank=True))


def test_lowrank_is_bit_reproducible() -> None:
    pop = class_population([3, 7, 12, 5, 9])
    task = _relu_mlp()
    p0 = task.init_params()
    jobs = [(c, 0) for c in range(5)]
    cfg = ClientConfig(batch_size=4, lr=0.3, mu=0.1, lowrank=True)
    a, b = (train_clients(task, pop, jobs, [p0] * 5, cfg) for _ in range(2))
    for n in p0:
        assert torch.equal(a.delta[n], b.delta[n])
    assert torch.equal(a.loss, b.loss)


def _wide_mlp() -> ModuleTask:
    torch.manual_seed(2)
    net = nn.Sequential(nn.Linear(6, 48), nn.Tanh(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 3))
    return ModuleTask(net, lambda out, batch: F.cross_entropy(out, batch["y"], reduction="none"))


@pytest.mark.parametrize("mu", [0.0, 0.3])
def test_lowrank_in_the_simulator_matches_the_generic_path_and_is_reproducible(mu) -> None:
    # FedBuff with C=6, K=3: a buffer mixes start versions, so grouping by version is used
    pop = class_population([6 + (c % 7) for c in range(24)], seed=1)
    plan = lowrank_plan(_wide_mlp(), pop, ClientConfig(batch_size=2), rank=2 * 7)
    assert plan is not None and 2 in plan.lowrank  # the automatic path really is low-rank

    def run(lowrank):
        sim = Simulator(
            _wide_mlp(),
            pop,
            FedBuff(3, ServerSGD(1.0)),
            ClientConfig(batch_size=2, lr=0.1, mu=mu, lowrank=lowrank),
            SimulatorConfig(concurrency=6, seed=5),
        )
        return sim.run(max_server_steps=8)

    fast, again, generic = run(None), run(None), run(False)
    for n in fast:
        assert torch.equal(fast[n], again[n])
        assert torch.allclose(fast[n], generic[n], atol=1e-5), n
    assert not torch.equal(fast["2.weight"], _wide_mlp().init_params()["2.weight"])


def test_large_clients_train_one_at_a_time() -> None:
    small = {"w": torch.zeros(1000)}
    big = {"w": torch.zeros(SOLO_BYTES // 4)}
    assert auto_chunk(small, 100) == 100
    assert auto_chunk(big, 100) == 1
