"""Tests for the engine's parts: population streams, delays, server optimisers, aggregation,
and the refusal of impossible configurations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_fl_toys import LinearTask, linear_population

from fedvox.errors import ConfigError
from fedvox.fl import (
    Aggregator,
    ClientConfig,
    DelayModel,
    EventQueue,
    FedBuff,
    Population,
    ServerAdagrad,
    ServerAdam,
    ServerSGD,
    ServerYogi,
    Simulator,
    SimulatorConfig,
    client_delta,
    make_algorithm,
    make_server_optimizer,
    staleness_weight,
)
from fedvox.rng import Purpose

# -- population -------------------------------------------------------------------------


def test_batches_depend_on_client_and_trip_not_call_order() -> None:
    pop = linear_population([7, 7, 7], seed=3)
    a = pop.batch_indices(1, 5, batch_size=3)
    pop.batch_indices(0, 0, batch_size=3)  # other calls in between change nothing
    b = pop.batch_indices(1, 5, batch_size=3)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    c = pop.batch_indices(1, 6, batch_size=3)
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))
    assert [len(x) for x in a] == [3, 3, 1]  # short final batch kept


def test_epochs_reshuffle_and_cover_every_example() -> None:
    pop = linear_population([6], seed=0)
    bl = pop.batch_indices(0, 0, batch_size=4, epochs=2)
    assert [len(x) for x in bl] == [4, 2, 4, 2]
    assert sorted(np.concatenate(bl[:2]).tolist()) == list(range(6))
    assert sorted(np.concatenate(bl[2:]).tolist()) == list(range(6))


def test_client_without_data_is_refused() -> None:
    store = {"x": torch.zeros(4, 2)}
    with pytest.raises(ConfigError, match="client 1 has no data"):
        Population(store, [[0, 1], [], [2, 3]])


# -- clock ------------------------------------------------------------------------------


@pytest.mark.parametrize("dist", ["half_normal", "uniform", "exponential", "constant"])
def test_delay_distributions_have_their_mean(dist: str) -> None:
    model = DelayModel(dist, mean=2.0)
    draws = [
        model.sample(0, 1, 1.0, np.random.default_rng([7, Purpose.DELAY, i])) for i in range(4000)
    ]
    assert min(draws) >= 0
    assert np.mean(draws) == pytest.approx(2.0, rel=0.06)


def test_delay_speed_and_data_scaling() -> None:
    model = DelayModel("constant", mean=1.0, speed=np.array([1.0, 3.0]), scale_by_examples=True)
    rng = np.random.default_rng(0)
    assert model.sample(1, 20, 10.0, rng) == pytest.approx(6.0)


def test_event_queue_orders_by_time_then_insertion() -> None:
    q = EventQueue()
    q.push(2.0, "complete", "a")
    q.push(1.0, "complete", "b")
    q.push(1.0, "complete", "c")
    assert [q.pop()[3] for _ in range(3)] == ["b", "c", "a"]


# -- server optimisers (hand-computed) --------------------------------------------------


def _one(opt, x: float, grads: list[float]) -> float:
    p = {"x": torch.tensor([x], dtype=torch.float64)}
    for g in grads:
        p = opt.step(p, {"x": torch.tensor([g], dtype=torch.float64)})
    return float(p["x"][0])


def test_server_sgd_momentum_two_steps() -> None:
    # m1 = 0.5, x1 = 1 - 0.1*0.5 = 0.95; m2 = 0.9*0.5 + 1.0 = 1.45, x2 = 0.95 - 0.145
    assert _one(ServerSGD(0.1, momentum=0.9), 1.0, [0.5, 1.0]) == pytest.approx(0.805)


def test_server_adam_two_steps() -> None:
    tau, lr = 1e-3, 0.1
    m1, v1 = 0.1 * 0.5, 0.99 * tau**2 + 0.01 * 0.25
    x1 = 1.0 - lr * m1 / (math.sqrt(v1) + tau)
    m2, v2 = 0.9 * m1 + 0.1 * -1.0, 0.99 * v1 + 0.01 * 1.0
    x2 = x1 - lr * m2 / (math.sqrt(v2) + tau)
    assert _one(ServerAdam(lr, tau=tau), 1.0, [0.5]) == pytest.approx(x1, rel=1e-12)
    assert _one(ServerAdam(lr, tau=tau), 1.0, [0.5, -1.0]) == pytest.approx(x2, rel=1e-12)


def test_server_yogi_two_steps() -> None:
    tau, lr = 1e-3, 0.1
    m1 = 0.05
    v1 = tau**2 - 0.01 * 0.25 * np.sign(tau**2 - 0.25)  # = tau² + 0.0025
    x1 = 1.0 - lr * m1 / (math.sqrt(v1) + tau)
    m2 = 0.9 * m1 + 0.1 * 0.01
    v2 = v1 - 0.01 * 1e-4 * np.sign(v1 - 1e-4)  # v1 > g²: v shrinks
    x2 = x1 - lr * m2 / (math.sqrt(v2) + tau)
    assert v2 < v1
    assert _one(ServerYogi(lr, tau=tau), 1.0, [0.5, 0.01]) == pytest.approx(x2, rel=1e-12)


def test_server_adagrad_two_steps() -> None:
    tau, lr = 1e-3, 0.1
    m1, v1 = 0.05, tau**2 + 0.25
    x1 = 1.0 - lr * m1 / (math.sqrt(v1) + tau)
    m2, v2 = 0.9 * m1 + 0.1 * 0.5, v1 + 0.25
    x2 = x1 - lr * m2 / (math.sqrt(v2) + tau)
    assert _one(ServerAdagrad(lr, tau=tau), 1.0, [0.5, 0.5]) == pytest.approx(x2, rel=1e-12)


def test_server_optimiser_does_not_modify_params_in_place() -> None:
    p = {"x": torch.ones(3)}
    for opt in (ServerSGD(1.0, 0.9), ServerAdam(), ServerYogi(), ServerAdagrad()):
        opt.step(p, {"x": torch.ones(3)})
        assert torch.equal(p["x"], torch.ones(3))


# -- aggregation ------------------------------------------------------------------------


def test_aggregator_weighted_sum_with_a_stage() -> None:
    deltas = {"w": torch.tensor([[1.0, 0.0], [0.0, 2.0], [4.0, 4.0]])}
    agg = Aggregator()
    agg.accumulate({"w": deltas["w"][:2]}, torch.tensor([1.0, 3.0]))
    agg.accumulate({"w": deltas["w"][2:]}, torch.tensor([2.0]))
    total, weight, count = agg.result()
    assert torch.allclose(total["w"], torch.tensor([9.0, 14.0]))
    assert (weight, count) == (6.0, 3)

    def halve(d, w):  # a stand-in for clipping: the algorithm never sees it
        return {n: t / 2 for n, t in d.items()}, w

    agg = Aggregator([halve])
    agg.accumulate(deltas, torch.ones(3))
    assert torch.allclose(agg.result()[0]["w"], torch.tensor([2.5, 3.0]))


def test_client_delta_sign() -> None:
    assert torch.equal(
        client_delta({"w": torch.tensor(3.0)}, {"w": torch.tensor(1.0)})["w"], torch.tensor(2.0)
    )


def test_staleness_weights() -> None:
    tau = torch.tensor([0.0, 3.0, 8.0])
    assert torch.allclose(staleness_weight(tau, "sqrt"), torch.tensor([1.0, 0.5, 1 / 3]))
    assert torch.allclose(staleness_weight(tau, "constant"), torch.ones(3))
    assert torch.allclose(staleness_weight(tau, "polynomial", a=1.0), 1 / (1 + tau))
    assert torch.allclose(
        staleness_weight(tau, "hinge", a=1.0, b=3.0), torch.tensor([1.0, 1.0, 1 / 6])
    )


# -- validation -------------------------------------------------------------------------


def _sim(algorithm=None, **cfg):
    pop = linear_population([4, 4, 4])
    return Simulator(
        LinearTask(),
        pop,
        algorithm or FedBuff(2),
        ClientConfig(batch_size=2),
        SimulatorConfig(**cfg),
    )


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: _sim(FedBuff(3), concurrency=2), "algorithm.buffer_size"),
        (lambda: _sim(concurrency=4), "concurrency"),
        (lambda: _sim(concurrency=0), "concurrency"),
        (lambda: _sim(concurrency=2, dropout=1.0), "dropout"),
        (lambda: _sim(concurrency=2, over_selection=-0.1), "over_selection"),
        (lambda: make_algorithm("fedsgd"), "algorithm.name"),
        (lambda: make_server_optimizer("rmsprop"), "server_opt.name"),
        (lambda: ServerSGD(0.0), "server_opt.lr"),
        (lambda: ServerAdam(tau=-1.0), "server_opt.tau"),
        (lambda: ClientConfig(lr=-0.1), "client.lr"),
        (lambda: ClientConfig(batch_size=0), "client.batch_size"),
        (lambda: ClientConfig(mu=-1.0), "client.mu"),
        (lambda: DelayModel("lognormal"), "clock.delay"),
        (lambda: DelayModel(mean=0.0), "clock.mean_delay"),
        (lambda: FedBuff(2, staleness="linear"), "algorithm.staleness"),
        (lambda: make_algorithm("fedasync", alpha=0.0), "algorithm.alpha"),
        (lambda: make_algorithm("fedavg", weighting="median"), "algorithm.weighting"),
    ],
)
def test_impossible_settings_are_refused_naming_the_field(build, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        build()
    assert err.value.field == field


def test_server_lr_schedule_warms_up_and_decays_by_server_step() -> None:
    from fedvox.fl.server_opt import ServerSGD, warmup_decay

    sched = warmup_decay(warmup=4, total=14, final_ratio=0.01)
    assert [sched(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert abs(sched(14) - 0.01) < 1e-12 and abs(sched(9) - 0.1) < 1e-12
    opt = ServerSGD(2.0)
    opt.schedule = sched
    p = {"w": torch.zeros(1)}
    g = {"w": torch.ones(1)}
    steps = []
    for _ in range(5):
        new = opt.step(p, g)
        steps.append(float(p["w"] - new["w"]))
        p = new
    assert steps == [0.5, 1.0, 1.5, 2.0, 2.0]
    # resuming: a fresh optimiser with the saved state continues the schedule where it was
    again = ServerSGD(2.0)
    again.schedule = sched
    again.load_state_dict({"step": 2})
    assert float(again.step({"w": torch.zeros(1)}, g)["w"]) == -1.5


# -- random crops: groups of rows drawn per epoch ----------------------------------------------


def test_group_sampling_draws_take_rows_per_group_fresh_each_epoch_and_trip() -> None:
    # client 0: groups 0 (rows 0-4) and 1 (rows 5-7); client 1: group 2 (rows 8-13)
    groups = np.array([0] * 5 + [1] * 3 + [2] * 6)
    take = np.array([2, 1, 3])
    store = {"x": torch.arange(14.0).unsqueeze(1)}
    pop = Population(store, [np.arange(8), np.arange(8, 14)], seed=3, groups=groups, take=take)
    assert pop.num_examples(0) == 3 and pop.num_examples(1) == 3
    assert list(pop.examples()) == [3, 3]
    pop.examples()[0] = 99  # a copy: the caller cannot change what the population draws
    assert pop.num_examples(0) == 3
    seen = set()
    for trip in range(20):
        batches = pop.batch_indices(0, trip, batch_size=2, epochs=2)
        assert [len(b) for b in batches] == [2, 1, 2, 1]
        for e in (0, 1):
            epoch = np.concatenate(batches[2 * e : 2 * e + 2])
            assert len(set(epoch)) == 3
            assert np.sum(groups[epoch] == 0) == 2 and np.sum(groups[epoch] == 1) == 1
            seen.add(tuple(sorted(epoch)))
        again = pop.batch_indices(0, trip, batch_size=2, epochs=2)
        assert all(np.array_equal(a, b) for a, b in zip(batches, again, strict=True))
    assert len(seen) > 5  # fresh draws, not one fixed subset
    plain = Population(store, [np.arange(8), np.arange(8, 14)], seed=3)
    assert plain.num_examples(0) == 8


def test_group_sampling_refuses_bad_counts() -> None:
    store = {"x": torch.zeros(4, 1)}
    with pytest.raises(ConfigError, match="take"):
        Population(store, [np.arange(4)], groups=np.array([0, 0, 1, 1]), take=np.array([3, 1]))
    with pytest.raises(ConfigError, match="together"):
        Population(store, [np.arange(4)], groups=np.array([0, 0, 1, 1]))
