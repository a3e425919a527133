"""Matrix factorisation for Federated Reconstruction: ratings data, the ReconTask, the baseline.

Ratings (synthetic or MovieLens-1M ratings.dat) → one client per user (mf_population) → MFTask
(items global, user vector local) trained by fl.Simulator + fl.local; centralised_mf compares.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from fedvox.errors import ConfigError, DataError
from fedvox.fl.population import Population
from fedvox.rng import Purpose, derived_rng
from fedvox.types import Batch, Params

# (seed, purpose) streams of this module


class Ratings(NamedTuple):
    """Ratings as parallel arrays; users and items are dense ids 0..n-1."""

    user: np.ndarray  # int64
    item: np.ndarray  # int64
    rating: np.ndarray  # float32


def synthetic_ratings(
    n_users: int,
    n_items: int,
    rank: int,
    ratings_per_user: int | tuple[int, int],
    noise: float = 0.3,
    seed: int = 0,
) -> Ratings:
    """Low-rank ratings on MovieLens' integer 1–5 scale.

    score = 3.5 + b_item + u·v/√rank (u, v ~ N(0, 1)) + N(0, noise²), rounded and clipped to
    1..5; most variance is per-user (u·v, std 1), so a model without the user vector is poor.
    Each user rates `ratings_per_user` distinct items (an int, or a (low, high) range).
    """
    if rank < 1 or n_users < 1 or n_items < 1:
        raise ConfigError("synthetic.rank", "n_users, n_items and rank must be >= 1")
    lo, hi = (
        (ratings_per_user, ratings_per_user)
        if isinstance(ratings_per_user, int)
        else ratings_per_user
    )
    if not 1 <= lo <= hi <= n_items:
        raise ConfigError(
            "synthetic.ratings_per_user",
            f"{ratings_per_user} is not within 1..n_items={n_items}",
            "use fewer ratings per user or more items",
        )
    rng = derived_rng(seed, Purpose.MF_SYNTH)
    u = rng.normal(size=(n_users, rank))
    v = rng.normal(size=(n_items, rank))
    b_item = rng.normal(scale=0.3, size=n_items)
    counts = rng.integers(lo, hi + 1, size=n_users)
    users = np.repeat(np.arange(n_users), counts)
    items = np.concatenate([rng.choice(n_items, size=c, replace=False) for c in counts])
    score = 3.5 + b_item[items] + (u[users] * v[items]).sum(1) / np.sqrt(rank)
    score += rng.normal(scale=noise, size=len(score))
    rating = np.clip(np.rint(score), 1, 5).astype(np.float32)
    return Ratings(users.astype(np.int64), items.astype(np.int64), rating)


def load_movielens(path: str | Path, max_per_user: int | None = 300) -> Ratings:
    """MovieLens-1M `ratings.dat` (UserID::MovieID::Rating::Timestamp), ids made dense.

    Keeps each user's `max_per_user` EARLIEST ratings (by timestamp, then file order), as the
    TFF FedRecon setup caps users at 300; None keeps all. Raises DataError naming file:line.
    """
    path = Path(path)
    if max_per_user is not None and max_per_user < 1:
        raise ConfigError("movielens.max_per_user", f"must be >= 1, got {max_per_user}")
    if not path.is_file():
        raise DataError(path, "file not found", "give the path to MovieLens-1M ratings.dat")
    cols: list[list[int]] = [[], [], [], []]
    with path.open(encoding="latin-1") as f:
        for lineno, line in enumerate(f, start=1):
            fields = line.rstrip("\r\n").split("::")
            if len(fields) != 4:
                raise DataError(
                    path,
                    f"expected 4 fields UserID::MovieID::Rating::Timestamp, got {len(fields)}",
                    "repair or remove this line (ratings.dat of MovieLens-1M)",
                    line=lineno,
                )
            try:
                values = [int(x) for x in fields]
            except ValueError:
                raise DataError(
                    path,
                    f"non-integer field in {line.strip()!r}",
                    "every field must be an integer",
                    line=lineno,
                ) from None
            if not 1 <= values[2] <= 5:
                raise DataError(
                    path,
                    f"rating {values[2]} outside 1-5",
                    "ratings must be whole stars 1..5",
                    line=lineno,
                )
            for col, x in zip(cols, values, strict=True):
                col.append(x)
    if not cols[0]:
        raise DataError(path, "no ratings", "give a non-empty ratings.dat")
    raw_user, raw_item, rating, stamp = (np.asarray(c, dtype=np.int64) for c in cols)
    _, user = np.unique(raw_user, return_inverse=True)
    _, item = np.unique(raw_item, return_inverse=True)
    order = np.lexsort((np.arange(len(user)), stamp, user))  # user, then time, then file order
    if max_per_user is not None:
        sorted_user = user[order]
        starts = np.searchsorted(sorted_user, sorted_user, side="left")
        order = order[np.arange(len(order)) - starts < max_per_user]
    return Ratings(user[order], item[order], rating[order].astype(np.float32))


def split_users(
    n_users: int, seed: int = 0, fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TFF's user split: (train, val, test) user ids, disjoint, sorted, reproducible from seed."""
    if len(fractions) != 3 or min(fractions) < 0 or abs(sum(fractions) - 1) > 1e-6:
        raise ConfigError("split.fractions", f"need 3 fractions summing to 1, got {fractions}")
    perm = derived_rng(seed, Purpose.MF_USER_SPLIT).permutation(n_users)
    a = round(fractions[0] * n_users)
    b = a + round(fractions[1] * n_users)
    return np.sort(perm[:a]), np.sort(perm[a:b]), np.sort(perm[b:])


def select_users(ratings: Ratings, users: Sequence[int] | np.ndarray) -> Ratings:
    keep = np.isin(ratings.user, np.asarray(users))
    return Ratings(ratings.user[keep], ratings.item[keep], ratings.rating[keep])


def split_seen(
    ratings: Ratings, holdout: float = 0.2, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Row indices (train, test) holding out `holdout` of EACH user's ratings (at least one
    when the user has two or more), for the centralised baseline on seen users."""
    if not 0 < holdout < 1:
        raise ConfigError("split.holdout", f"must be in (0, 1), got {holdout}", "use 0.2")
    rng = derived_rng(seed, Purpose.MF_SEEN_SPLIT)
    order = np.argsort(ratings.user, kind="stable")
    bounds = np.flatnonzero(np.diff(ratings.user[order])) + 1
    train, test = [], []
    for rows in np.split(order, bounds):
        rows = rows[rng.permutation(len(rows))]
        h = max(1, round(holdout * len(rows))) if len(rows) >= 2 else 0
        test.append(rows[:h])
        train.append(rows[h:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def mf_population(ratings: Ratings, users: Sequence[int] | np.ndarray, seed: int = 0) -> Population:
    """One client per user: client i holds the ratings of `users[i]` (store: item, rating)."""
    users = np.asarray(users, dtype=np.int64)
    order = np.argsort(ratings.user, kind="stable")
    bounds = np.searchsorted(ratings.user[order], [users, users + 1])
    missing = users[bounds[0] == bounds[1]]
    if missing.size:
        raise ConfigError(
            "population.users",
            f"user {int(missing[0])} has no ratings ({missing.size} such users)",
            "pick users that have ratings",
        )
    clients = [order[a:b] for a, b in zip(bounds[0], bounds[1], strict=True)]
    store = {
        "item": torch.from_numpy(ratings.item.astype(np.int64)),
        "rating": torch.from_numpy(ratings.rating.astype(np.float32)),
    }
    return Population(store, clients, seed=seed)


class MFTask:
    """rating ≈ u·v_item + b_item + b + b_user: items global, the user vector (and bias) local.

    Global: item_emb [n_items, dim], item_bias [n_items], global_bias []; local: user_emb
    [dim], user_bias []. init_local draws u ~ N(0, init_scale²), b_user = 0, so "no
    reconstruction" (ReconConfig steps=0, closed_form False) predicts ≈ b_item + b.
    closed_form_local is ridge regression of (u, b_user) on the support ratings, penalty `ridge`.
    """

    def __init__(
        self,
        n_items: int,
        dim: int = 50,
        *,
        item_bias: bool = True,
        user_bias: bool = True,
        init_scale: float = 0.1,
        mean: float = 3.0,
        ridge: float = 1.0,
        seed: int = 0,
    ) -> None:
        if dim < 1:
            raise ConfigError("mf.dim", f"must be >= 1, got {dim}", "use e.g. 50")
        if not ridge > 0:
            raise ConfigError("mf.ridge", f"must be > 0, got {ridge}", "use e.g. 1.0")
        self.n_items, self.dim = n_items, dim
        self.item_bias, self.user_bias = item_bias, user_bias
        self.init_scale, self.mean, self.ridge, self.seed = init_scale, mean, ridge, seed

    def init_params(self) -> Params:
        g = torch.Generator().manual_seed(
            int(derived_rng(self.seed, Purpose.MF_ITEM_INIT).integers(2**62))
        )
        p = {
            "item_emb": self.init_scale * torch.randn(self.n_items, self.dim, generator=g),
            "global_bias": torch.tensor(float(self.mean)),
        }
        if self.item_bias:
            p["item_bias"] = torch.zeros(self.n_items)
        return p

    def init_local(self, client_ids: Sequence[int], generator: torch.Generator) -> Params:
        k = len(client_ids)
        p = {"user_emb": self.init_scale * torch.randn(k, self.dim, generator=generator)}
        if self.user_bias:
            p["user_bias"] = torch.zeros(k)
        return p

    def predict(self, params: Params, item: Tensor) -> Tensor:
        """Predictions for `item` [B]; user_emb [dim] (one user) or [B, dim] (one per row)."""
        pred = (params["item_emb"][item] * params["user_emb"]).sum(-1) + params["global_bias"]
        if self.item_bias:
            pred = pred + params["item_bias"][item]
        if self.user_bias:
            pred = pred + params["user_bias"]
        return pred

    def loss(self, params: Params, batch: Batch) -> Tensor:
        return (self.predict(params, batch["item"]) - batch["rating"]) ** 2

    def metrics(self, params: Params, batch: Batch) -> dict[str, Tensor]:
        """Per-example squared error and hit = |prediction − rating| < 0.5 (TFF's accuracy)."""
        err = self.predict(params, batch["item"]) - batch["rating"]
        return {"se": err**2, "hit": (err.abs() < 0.5).to(err.dtype)}

    def closed_form_local(self, global_params: Params, batch: Batch, mask: Tensor) -> Params:
        """Ridge: argmin Σ mask·(r − b − b_item − x·w)² + ridge·‖w‖², x = [v_item, 1]."""
        item = batch["item"]
        y = batch["rating"] - global_params["global_bias"]
        if self.item_bias:
            y = y - global_params["item_bias"][item]
        x = global_params["item_emb"][item]
        if self.user_bias:
            x = torch.cat([x, torch.ones_like(x[:, :1])], 1)
        xw = x * mask.unsqueeze(1)
        a = xw.T @ x + self.ridge * torch.eye(x.shape[1], dtype=x.dtype)
        w = torch.linalg.solve(a, xw.T @ y)
        out = {"user_emb": w[: self.dim]}
        if self.user_bias:
            out["user_bias"] = w[self.dim]
        return out


def rmse_accuracy(values: dict[str, float]) -> dict[str, float]:
    """RMSE and accuracy from mean squared error ("se") and hit rate ("hit")."""
    return {"rmse": float(np.sqrt(values["se"])), "accuracy": float(values["hit"])}


def centralised_mf(
    task: MFTask,
    train: Ratings,
    test: Ratings,
    n_users: int,
    epochs: int = 20,
    batch_size: int = 256,
    lr: float = 0.01,
    l2: float = 0.0,
    seed: int = 0,
) -> tuple[Params, dict[str, float]]:
    """The centralised baseline: MF with one embedding row per user, Adam on pooled ratings,
    evaluated on held-out ratings of the SAME (seen) users. `l2` adds l2·(‖u‖² + ‖v‖²) per
    example. Returns (params with user_emb [n_users, dim], {"rmse", "accuracy"} on test)."""
    torch_gen = torch.Generator().manual_seed(
        int(derived_rng(seed, Purpose.MF_CENTRAL).integers(2**62))
    )
    params = task.init_params()
    local = task.init_local(range(n_users), torch_gen)
    params.update(local)
    params = {n: t.clone().requires_grad_(True) for n, t in params.items()}
    opt = torch.optim.Adam(params.values(), lr=lr)
    user = torch.from_numpy(train.user)
    item = torch.from_numpy(train.item)
    rating = torch.from_numpy(train.rating)
    rng = derived_rng(seed, Purpose.MF_CENTRAL_BATCHES)
    for _ in range(epochs):
        perm = torch.from_numpy(rng.permutation(len(user)))
        for i in range(0, len(perm), batch_size):
            ix = perm[i : i + batch_size]
            p = _per_row(params, user[ix])
            loss = task.loss(p, {"item": item[ix], "rating": rating[ix]}).mean()
            if l2 > 0:
                v = params["item_emb"][item[ix]]
                loss = loss + l2 * ((p["user_emb"] ** 2).sum(1) + (v**2).sum(1)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    params = {n: t.detach() for n, t in params.items()}
    with torch.no_grad():
        p = _per_row(params, torch.from_numpy(test.user))
        m = task.metrics(
            p, {"item": torch.from_numpy(test.item), "rating": torch.from_numpy(test.rating)}
        )
    return params, rmse_accuracy({n: float(t.mean()) for n, t in m.items()})


def _per_row(params: Params, user: Tensor) -> Params:
    """Centralised params with the user rows of each example selected."""
    out = dict(params)
    out["user_emb"] = params["user_emb"][user]
    if "user_bias" in params:
        out["user_bias"] = params["user_bias"][user]
    return out
