"""Tests for the client update: vectorised clients equal the per-client loop, and FedProx
pulls towards the global model."""

from __future__ import annotations

import pytest
import torch
from test_fl_toys import LinearTask, class_population, linear_population, mlp_task

from fedvox.fl import ClientConfig, train_clients
from fedvox.fl.client import _objective


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
        out[vec] = train_clients(task.loss, pop, jobs, starts, cfg)
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
    base = train_clients(task.loss, pop, [(0, 0)], [p0], ClientConfig(batch_size=4, lr=0.1))
    norm = train_clients(
        task.loss, pop, [(0, 0)], [p0], ClientConfig(batch_size=4, lr=0.1, lr_normalise=True)
    )
    for n in p0:
        assert torch.allclose(norm.delta[n], 0.75 * base.delta[n], atol=1e-7)


def test_fedprox_gradient_points_away_from_global_so_steps_pull_towards_it() -> None:
    def zero_loss(p, batch):
        return 0.0 * batch["x"].sum(-1)

    cfg = ClientConfig(mu=2.0)
    anchor = {"w": torch.tensor([1.0, -1.0])}
    p = {"w": torch.tensor([3.0, -4.0])}
    obj = _objective(zero_loss, cfg)
    g = torch.func.grad(lambda q: obj(q, anchor, {"x": torch.ones(2, 1)}, torch.ones(2))[0])(p)
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
        res = train_clients(task.loss, pop, jobs, [p0] * 3, cfg)
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
            task.loss,
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
