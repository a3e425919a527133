"""Shards of a server step (fedvox.scale.shards, ClientConfig.shard): any cut of the jobs,
trained shard by shard and reassembled, gives the whole step's results bit for bit."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_fl_toys import class_population, mlp_task
from test_recon import LocalBiasTask, _shifted_population

from fedvox.errors import ConfigError, FedvoxError
from fedvox.fl.local import ClientConfig, ClientResults, ReconConfig, train_clients_recon
from fedvox.fl.local.train import train_clients
from fedvox.scale import BackendConfig, assemble, cut


def _versions(task, n: int = 3) -> list[dict[str, torch.Tensor]]:
    base = task.init_params()
    g = torch.Generator().manual_seed(5)
    return [
        {k: t + 0.05 * v * torch.randn(t.shape, generator=g) for k, t in base.items()}
        for v in range(n)
    ]


def _same(a: ClientResults, b: ClientResults) -> None:
    assert a.delta.keys() == b.delta.keys()
    for n in a.delta:
        assert torch.equal(a.delta[n], b.delta[n]), n
    assert torch.equal(a.num_examples, b.num_examples)
    assert torch.equal(a.loss, b.loss)


def _sharded(fn, jobs, starts, cfg, size: int) -> ClientResults:
    parts = [fn(jobs, starts, replace(cfg, shard=s)) for s in cut(len(jobs), size)]
    return assemble(parts, len(jobs))


PATHS = {
    "vmap-auto": {"lowrank": False},
    "vmap-chunks-of-3": {"lowrank": False, "chunk_size": 3},
    "loop": {"vectorised": False},
    "one-per-call": {"lowrank": False, "chunk_size": 1},
    "lowrank": {"lowrank": True},
    "lowrank-chunks-of-2": {"lowrank": True, "chunk_size": 2},
}


@pytest.mark.parametrize("path", list(PATHS))
def test_any_cut_of_a_step_reassembles_to_the_whole_step(path: str) -> None:
    task = mlp_task(d=6, h=40)
    pop = class_population([5 + (c % 6) for c in range(11)], seed=1)
    versions = _versions(task)
    # interleaved versions, as FedBuff's buffered arrivals are; a client twice (two trips)
    jobs = [(c, 0) for c in range(11)] + [(3, 1)]
    starts = [versions[i % 3] for i in range(len(jobs))]
    cfg = ClientConfig(batch_size=4, lr=0.2, **PATHS[path])

    def fn(j, s, c):
        return train_clients(task, pop, j, s, c)

    whole = fn(jobs, starts, cfg)
    assert whole.index is None
    for size in (1, 2, 5, 12, 40):
        _same(_sharded(fn, jobs, starts, cfg, size), whole)


@pytest.mark.parametrize("kw", [{"chunk_size": 2}, {"vectorised": False}, {}])
def test_reconstruction_shards_reassemble_to_the_whole_step(kw: dict) -> None:
    pop = _shifted_population([5 + c % 4 for c in range(9)])
    task = LocalBiasTask(pop.store["x"].shape[1], pop.store["y"].shape[1])
    versions = _versions(task, 2)
    jobs = [(c, 1) for c in range(9)]
    starts = [versions[i % 2] for i in range(9)]
    cfg = ClientConfig(batch_size=3, lr=0.05, **kw)
    recon = ReconConfig(steps=1)

    def fn(j, s, c):
        return train_clients_recon(task, pop, j, s, c, recon)

    whole = fn(jobs, starts, cfg)
    for size in (1, 4):
        _same(_sharded(fn, jobs, starts, cfg, size), whole)


def test_a_shard_inside_a_chunk_trains_nothing_and_the_chunk_goes_to_its_first_job() -> None:
    task = mlp_task(d=6, h=40)
    pop = class_population([6] * 6, seed=1)
    v = task.init_params()
    cfg = ClientConfig(batch_size=4, lr=0.2, lowrank=False, chunk_size=4)
    jobs = [(c, 0) for c in range(6)]
    # chunks {0..3}, {4, 5}: the shard [1, 3) owns no chunk's first job
    empty = train_clients(task, pop, jobs, [v] * 6, replace(cfg, shard=(1, 3)))
    assert empty.index.tolist() == [] and all(t.shape[0] == 0 for t in empty.delta.values())
    first = train_clients(task, pop, jobs, [v] * 6, replace(cfg, shard=(0, 1)))
    assert first.index.tolist() == [0, 1, 2, 3]


def test_assemble_refuses_a_missing_or_doubled_job() -> None:
    def part(index: list[int]) -> ClientResults:
        k = len(index)
        return ClientResults(
            {"w": torch.zeros(k, 2)}, torch.ones(k), torch.zeros(k), None, torch.tensor(index)
        )

    got = assemble([part([2, 3]), part([0, 1])], 4)
    assert got.delta["w"].shape == (4, 2)
    with pytest.raises(FedvoxError, match=r"not each of 0\.\.3 once"):
        assemble([part([0, 1]), part([1, 2])], 4)
    with pytest.raises(FedvoxError):
        assemble([part([0, 1])], 4)


def test_cut_follows_the_step_never_the_workers() -> None:
    assert cut(7, 3) == [(0, 3), (3, 6), (6, 7)]
    assert cut(2, 8) == [(0, 2)]


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"kind": "dask"}, "federated.backend.kind"),
        ({"workers": 0}, "federated.backend.workers"),
        ({"cpus_per_worker": 0}, "federated.backend.cpus_per_worker"),
        ({"gpus_per_worker": -1}, "federated.backend.gpus_per_worker"),
        ({"shard_size": 0}, "federated.backend.shard_size"),
    ],
)
def test_bad_backend_settings_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        BackendConfig(**kw)


def test_the_inline_engine_imports_no_ray() -> None:
    import subprocess
    import sys

    code = (
        "import sys, fedvox.experiment.federated, fedvox.scale, fedvox.cli; "
        "assert 'ray' not in sys.modules, 'ray was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
