"""Tiny tasks and populations shared by the federated-engine tests (plus checks of them).

Linear regression and a small MLP classifier: fast enough that the whole fl suite runs in
seconds, rich enough that clients disagree (non-IID) and staleness matters.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedvox.fl import ModuleTask, Population

# Tiny models gain nothing from a second thread, and on a shared 2-core machine a 2-thread
# process slows several-fold whenever another process holds a core (docs/benchmarks.md).
torch.set_num_threads(1)


class LinearTask:
    """y ≈ x @ w + b, per-example squared error."""

    def __init__(self, d: int = 5, o: int = 2, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.w0 = torch.randn(d, o, generator=g) * 0.1
        self.b0 = torch.zeros(o)

    def init_params(self) -> dict[str, torch.Tensor]:
        return {"w": self.w0.clone(), "b": self.b0.clone()}

    def loss(self, params, batch):
        pred = batch["x"] @ params["w"] + params["b"]
        return ((pred - batch["y"]) ** 2).sum(-1)


def mlp_task(d: int = 6, h: int = 8, k: int = 3, seed: int = 0) -> ModuleTask:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.LayerNorm(h), nn.Linear(h, k))
    return ModuleTask(net, lambda out, batch: F.cross_entropy(out, batch["y"], reduction="none"))


def linear_population(
    sizes: list[int], d: int = 5, o: int = 2, seed: int = 0, noniid: float = 1.0
) -> Population:
    """Each client has its own true weights (shift `noniid` from a shared one)."""
    rng = np.random.default_rng(seed)
    w_true = rng.normal(size=(d, o))
    xs, ys, idx, start = [], [], [], 0
    for n in sizes:
        x = rng.normal(size=(n, d))
        w_c = w_true + noniid * rng.normal(size=(d, o))
        xs.append(x)
        ys.append(x @ w_c + 0.1 * rng.normal(size=(n, o)))
        idx.append(np.arange(start, start + n))
        start += n
    store = {
        "x": torch.tensor(np.concatenate(xs), dtype=torch.float32),
        "y": torch.tensor(np.concatenate(ys), dtype=torch.float32),
    }
    return Population(store, idx, seed=seed)


def class_population(sizes: list[int], d: int = 6, k: int = 3, seed: int = 0) -> Population:
    """Gaussian classes, x = mu[y] + noise; each client mostly holds one class (non-IID)."""
    rng = np.random.default_rng(seed)
    mu = rng.normal(size=(k, d))
    xs, ys, idx, start = [], [], [], 0
    for c, n in enumerate(sizes):
        y = np.where(rng.random(n) < 0.7, c % k, rng.integers(k, size=n))
        xs.append(mu[y] + rng.normal(size=(n, d)))
        ys.append(y)
        idx.append(np.arange(start, start + n))
        start += n
    store = {
        "x": torch.tensor(np.concatenate(xs), dtype=torch.float32),
        "y": torch.tensor(np.concatenate(ys), dtype=torch.long),
    }
    return Population(store, idx, seed=seed)


def test_linear_population_slices_the_store() -> None:
    pop = linear_population([3, 5, 2])
    assert pop.num_clients == 3
    assert [pop.num_examples(c) for c in range(3)] == [3, 5, 2]
    rows = np.concatenate(pop.batch_indices(1, 0, batch_size=2))
    assert sorted(rows.tolist()) == [3, 4, 5, 6, 7]


def test_mlp_task_gives_per_example_losses() -> None:
    task = mlp_task()
    pop = class_population([4])
    batch = next(pop.client_batches(0, 0, batch_size=4))
    assert task.loss(task.init_params(), batch).shape == (4,)
