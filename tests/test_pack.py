"""Packed vectorised cohorts (ClientConfig.pack, federated.pack_clients): clients of similar
size share a vmap call and finished clients are not computed, yet every client trains what the
one-at-a-time reference trains, rows in job order, on both the plain and the FedRecon path."""

from __future__ import annotations

import numpy as np
import torch
from test_fl_toys import LinearTask, linear_population
from test_speaker_recon import RECON, make_task, public_store, toy_chunks

from fedvox.fl import ClientConfig
from fedvox.fl.local import train_clients, train_clients_recon
from fedvox.fl.local.steps import objective, packed_units, pad, sgd_vectorised
from fedvox.tasks.speakers import make_speaker_recon_update, speaker_population

SIZES = [3, 17, 5, 11, 2, 9, 14, 4]  # examples per client: padded work when unsorted


def _close(a: dict, b: dict, atol: float = 1e-5) -> bool:
    return set(a) == set(b) and all(torch.allclose(a[n], b[n], atol=atol) for n in a)


def test_packed_units_take_the_largest_first_and_cover_every_job_once() -> None:
    units = packed_units([3, 9, 5, 9, 1], 2)
    assert units == [[1, 3], [2, 0], [4]]
    assert sorted(i for u in packed_units(SIZES, 3) for i in u) == list(range(len(SIZES)))


def test_packed_plain_clients_equal_the_loop_reference_in_job_order() -> None:
    pop = linear_population(SIZES, seed=2)
    task = LinearTask()
    p0 = task.init_params()
    jobs = [(c, 1) for c in range(len(SIZES))]
    base = dict(epochs=2, batch_size=3, lr=0.05, chunk_size=3)
    packed = train_clients(task, pop, jobs, [p0] * len(jobs), ClientConfig(**base, pack=True))
    plain = train_clients(task, pop, jobs, [p0] * len(jobs), ClientConfig(**base))
    loop = train_clients(task, pop, jobs, [p0] * len(jobs), ClientConfig(**base, vectorised=False))
    assert _close(packed.delta, loop.delta) and _close(plain.delta, loop.delta)
    assert torch.equal(packed.num_examples, loop.num_examples)
    assert torch.allclose(packed.loss, loop.loss, atol=1e-5)


def test_packed_speaker_reconstruction_equals_the_loop_with_public_negatives() -> None:
    x, y = toy_chunks(len(SIZES), max(SIZES), seed=4)
    rows = [np.arange(i * max(SIZES), i * max(SIZES) + n) for i, n in enumerate(SIZES)]
    pop = speaker_population({"x": x, "y": y}, rows, seed=0)
    task, public = make_task(), public_store()
    p0 = task.init_params()
    v1 = {n: t + 0.02 for n, t in p0.items()}
    starts = [p0, v1] * (len(SIZES) // 2)  # two versions in one step (FedBuff)
    jobs = [(c, 0) for c in range(len(SIZES))]
    update = make_speaker_recon_update(public, RECON)
    base = dict(batch_size=2, lr=0.03, chunk_size=3)
    packed = update(task, pop, jobs, starts, ClientConfig(**base, pack=True))
    loop = update(task, pop, jobs, starts, ClientConfig(**base, vectorised=False))
    assert _close(packed.delta, loop.delta)
    assert torch.equal(packed.num_examples, loop.num_examples)
    again = update(task, pop, jobs, starts, ClientConfig(**base, pack=True))
    assert all(torch.equal(packed.delta[n], again.delta[n]) for n in packed.delta)


def test_skipping_idle_clients_in_any_order_equals_padding_them() -> None:
    """Not a prefix (unsorted sizes): the gathered rows are written back to the right clients."""
    pop = linear_population([2, 9, 4, 7], seed=5)
    task = LinearTask()
    p0 = task.init_params()
    cfg = ClientConfig(batch_size=2, lr=0.1)
    batches = [pop.batch_indices(c, 0, 2, 1) for c in range(4)]
    rows, mask_t, active = pad(batches, 2)
    assert not bool(active[:, -1][:2].all())  # the idle clients are not a leading block
    data = pop.gather(rows)
    obj = objective(task.loss, cfg)
    got = {}
    for skip in (False, True):
        p = {n: t.unsqueeze(0).repeat(4, *[1] * t.dim()) for n, t in p0.items()}
        loss = sgd_vectorised(obj, p, p, {}, data, mask_t, active, cfg.lr, skip_idle=skip)
        got[skip] = (p, loss)
    assert _close(got[True][0], got[False][0], atol=1e-6)
    assert torch.allclose(got[True][1], got[False][1], atol=1e-6)


def test_recon_path_packs_by_query_size() -> None:
    """train_clients_recon with pack=True and chunk 2 over unequal clients matches chunk 1."""
    from test_recon import LocalBiasTask, _shifted_population

    from fedvox.fl.local import ReconConfig

    pop = _shifted_population(SIZES, seed=1)
    task = LocalBiasTask()
    p0 = task.init_params()
    jobs = [(c, 3) for c in range(len(SIZES))]
    recon = ReconConfig(steps=1, lr=0.1)
    base = dict(epochs=2, batch_size=3, lr=0.05)
    packed = train_clients_recon(
        task, pop, jobs, [p0] * len(jobs), ClientConfig(**base, chunk_size=2, pack=True), recon
    )
    single = train_clients_recon(
        task, pop, jobs, [p0] * len(jobs), ClientConfig(**base, chunk_size=1), recon
    )
    assert _close(packed.delta, single.delta)
    assert torch.equal(packed.num_examples, single.num_examples)
