"""Tests for the matrix-factorisation task: MovieLens loader errors and capping, reproducible
user splits, the ridge closed form, and a small FedRecon run that beats no reconstruction."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedvox.errors import DataError
from fedvox.fl import ClientConfig, FedAvg, ServerSGD, Simulator, SimulatorConfig
from fedvox.fl.local import ReconConfig, make_recon_update, recon_eval
from fedvox.tasks.mf import (
    MFTask,
    centralised_mf,
    load_movielens,
    mf_population,
    rmse_accuracy,
    select_users,
    split_seen,
    split_users,
    synthetic_ratings,
)

GOOD = ["1::1193::5::978300760", "1::661::3::978302109", "2::1193::4::978298413"]


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        ("3::10::4", "expected 4 fields"),
        ("3::10::4::97830::1", "expected 4 fields"),
        ("3::ten::4::978300760", "non-integer"),
        ("3::10::4.5::978300760", "non-integer"),
        ("3::10::6::978300760", "outside 1-5"),
        ("3::10::0::978300760", "outside 1-5"),
        ("", "expected 4 fields"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, bad: str, problem: str) -> None:
    path = tmp_path / "ratings.dat"
    path.write_text("\n".join([*GOOD, bad, GOOD[0]]) + "\n")
    with pytest.raises(DataError) as err:
        load_movielens(path)
    assert err.value.line == 4
    assert problem in str(err.value) and f"{path}:4: " in str(err.value)


def test_missing_file_is_a_data_error(tmp_path) -> None:
    with pytest.raises(DataError, match="not found"):
        load_movielens(tmp_path / "nope.dat")


def test_loader_makes_ids_dense_and_keeps_earliest_ratings(tmp_path) -> None:
    lines = [f"7::{100 + i}::{1 + i % 5}::{1000 - i}" for i in range(5)]  # later lines earlier
    lines += ["3::100::2::5", "3::555::4::6"]
    path = tmp_path / "ratings.dat"
    path.write_text("\n".join(lines) + "\n")
    r = load_movielens(path, max_per_user=3)
    assert r.user.tolist() == [0, 0, 1, 1, 1]  # user 3 -> 0, user 7 -> 1
    # user 7 keeps its 3 earliest: the last three lines (movies 104, 103, 102), in time order
    assert r.item.tolist() == [0, 5, 4, 3, 2]
    assert r.rating.tolist() == [2.0, 4.0, 5.0, 4.0, 3.0]
    assert len(load_movielens(path, max_per_user=None).user) == 7


def test_user_split_is_reproducible_and_disjoint() -> None:
    a = split_users(1000, seed=3)
    b = split_users(1000, seed=3)
    c = split_users(1000, seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a[0], c[0])
    assert [len(x) for x in a] == [800, 100, 100]
    assert np.array_equal(np.sort(np.concatenate(a)), np.arange(1000))


def test_seen_split_holds_out_a_fifth_of_each_user() -> None:
    r = synthetic_ratings(20, 50, 2, (10, 20), seed=1)
    tr, te = split_seen(r, 0.2, seed=0)
    assert len(np.intersect1d(tr, te)) == 0 and len(tr) + len(te) == len(r.user)
    for u in range(20):
        n = int((r.user == u).sum())
        assert int((r.user[te] == u).sum()) == round(0.2 * n)
    tr2, _ = split_seen(r, 0.2, seed=0)
    assert np.array_equal(tr, tr2)


def test_synthetic_ratings_are_whole_stars_of_distinct_items() -> None:
    r = synthetic_ratings(10, 30, 3, 12, seed=0)
    assert set(np.unique(r.rating)) <= {1.0, 2.0, 3.0, 4.0, 5.0}
    for u in range(10):
        assert len(np.unique(r.item[r.user == u])) == 12


@pytest.mark.parametrize("user_bias", [True, False])
def test_closed_form_is_the_ridge_solution(user_bias: bool) -> None:
    task = MFTask(12, dim=3, user_bias=user_bias, ridge=0.7, seed=2)
    g = task.init_params()
    gen = torch.Generator().manual_seed(0)
    g = {n: t + torch.randn(t.shape, generator=gen) for n, t in g.items()}
    item = torch.tensor([0, 3, 5, 5, 7, 11, 2, 2])
    rating = torch.tensor([4.0, 2.0, 5.0, 3.0, 1.0, 4.0, 9.0, 9.0])
    mask = torch.tensor([1.0, 1, 1, 1, 1, 1, 0, 0])  # padding rows must not count
    out = task.closed_form_local(g, {"item": item, "rating": rating}, mask)
    n = 6
    x = g["item_emb"][item[:n]].double().numpy()
    if user_bias:
        x = np.hstack([x, np.ones((n, 1))])
    y = (rating[:n] - g["global_bias"] - g["item_bias"][item[:n]]).double().numpy()
    a = np.vstack([x, np.sqrt(0.7) * np.eye(x.shape[1])])
    w = np.linalg.lstsq(a, np.concatenate([y, np.zeros(x.shape[1])]), rcond=None)[0]
    assert np.allclose(out["user_emb"].numpy(), w[:3], atol=1e-4)
    if user_bias:
        assert np.isclose(float(out["user_bias"]), w[3], atol=1e-4)
    # the closed form minimises the support loss + ridge: a nudge makes it worse
    obj = lambda u: float(  # noqa: E731
        (task.loss({**g, **out, "user_emb": u}, {"item": item, "rating": rating}) * mask).sum()
        + 0.7 * ((u**2).sum() + (out["user_bias"] ** 2 if user_bias else 0))
    )
    assert obj(out["user_emb"]) < obj(out["user_emb"] + 0.01)


def test_small_fedrecon_run_beats_no_reconstruction() -> None:
    data = synthetic_ratings(200, 40, 2, (20, 40), seed=0)
    train, _, test = split_users(200, seed=0)
    task = MFTask(40, dim=3, seed=0)
    client = ClientConfig(batch_size=5, lr=0.2)
    sim = Simulator(
        task,
        mf_population(data, train),
        FedAvg(ServerSGD(1.0, momentum=0.9)),
        client,
        SimulatorConfig(concurrency=20, seed=0),
        client_update=make_recon_update(ReconConfig(steps=1, lr=0.2)),
    )
    params = sim.run(max_server_steps=150)
    test_pop = mf_population(data, test)
    res = {}
    for name, rc in {
        "none": ReconConfig(steps=0),
        "one": ReconConfig(steps=1, lr=0.2),
        "closed": ReconConfig(steps=0, closed_form=True),
    }.items():
        res[name] = rmse_accuracy(
            recon_eval(task, test_pop, params, rc, task.metrics, client=client)
        )
    start = rmse_accuracy(
        recon_eval(task, test_pop, task.init_params(), ReconConfig(steps=1, lr=0.2), task.metrics)
    )
    assert res["one"]["rmse"] < 0.8 * res["none"]["rmse"]
    assert res["one"]["rmse"] < 0.8 * start["rmse"]  # training helped unseen users
    assert res["closed"]["rmse"] < 0.8 * res["none"]["rmse"]
    assert res["one"]["accuracy"] > res["none"]["accuracy"]


def test_centralised_baseline_learns_seen_users() -> None:
    data = synthetic_ratings(60, 30, 2, (20, 30), seed=1)
    seen = select_users(data, range(60))
    tr, te = split_seen(seen, 0.2, seed=0)
    part = lambda ix: type(seen)(seen.user[ix], seen.item[ix], seen.rating[ix])  # noqa: E731
    task = MFTask(30, dim=3, seed=0)
    _, m1 = centralised_mf(task, part(tr), part(te), 60, epochs=1, batch_size=64)
    _, m30 = centralised_mf(task, part(tr), part(te), 60, epochs=30, batch_size=64, l2=0.02)
    assert m30["rmse"] < 0.8 * m1["rmse"]
