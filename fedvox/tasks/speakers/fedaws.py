"""FedAwS (Yu et al. 2020): positive-only class vectors on clients, spreadout on the server.

Part of fedvox.tasks.speakers: the task (extractor + global class vectors) and `Spreadout`,
a wrapper that adds the server's spreadout to any fl Algorithm (FedAvg, FedBuff, ...).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from fedvox.errors import ConfigError
from fedvox.fl.algorithms.base import Algorithm, AlgorithmWrapper
from fedvox.tasks.speakers.common import embedding_dim, extractor_params
from fedvox.types import Batch, Params

CLASS_VECTORS = "head.weight"  # FedAwS's global class-vector matrix W [n_classes, emb_dim]


class FedAwSTask(nn.Module):
    """Extractor + global class vectors W [n_classes, emb_dim] (one row per training speaker),
    trained with a POSITIVE-ONLY loss: each client sees only its own speakers' rows.

    Loss (Yu et al. 2020, the positive part of their cosine contrastive loss):
    (max(0, pos_margin − cos(e, w_y)))², pos_margin 0.9 as in the paper. Without the
    server's spreadout (FedAwS algorithm) this collapses every row and embedding together.
    """

    def __init__(
        self,
        extractor: nn.Module,
        n_classes: int,
        pos_margin: float = 0.9,
        emb_dim: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if n_classes < 2:
            raise ConfigError("model.n_classes", f"need >= 2 classes, got {n_classes}")
        if not -1.0 < pos_margin <= 1.0:
            raise ConfigError("model.pos_margin", f"must be in (-1, 1], got {pos_margin}")
        self.extractor = extractor
        self.emb_dim = embedding_dim(extractor, emb_dim)
        self.n_classes = int(n_classes)
        self.pos_margin = float(pos_margin)
        self.head = nn.Linear(self.emb_dim, n_classes, bias=False)
        gen = torch.Generator().manual_seed(int(seed))
        with torch.no_grad():
            self.head.weight.copy_(
                F.normalize(torch.randn(n_classes, self.emb_dim, generator=gen), dim=-1)
            )

    def init_params(self) -> Params:
        return {n: p.detach().clone() for n, p in self.named_parameters()}

    def load_params(self, params: Mapping[str, Tensor]) -> None:
        with torch.no_grad():
            for n, p in self.named_parameters():
                p.copy_(params[n])

    def embed(self, params: Mapping[str, Tensor], x: Tensor) -> Tensor:
        return functional_call(self.extractor, extractor_params(params), (x,))

    def loss(self, params: Params, batch: Batch) -> Tensor:
        e = F.normalize(self.embed(params, batch["x"]), dim=-1)
        w = F.normalize(params[CLASS_VECTORS], dim=-1)
        is_target = batch["y"].unsqueeze(-1) == torch.arange(self.n_classes)
        cos_y = ((e @ w.transpose(0, 1)) * is_target).sum(-1)
        return (self.pos_margin - cos_y).clamp(min=0.0) ** 2


def spreadout_loss(w: Tensor, nu: float) -> Tensor:
    """reg_sp(W) = Σ_{i≠j} max(0, ν − ‖ŵ_i − ŵ_j‖)² on L2-normalised rows ŵ (Yu et al. 2020;
    ν is their margin, configurable; on the unit sphere distances lie in [0, 2])."""
    wn = F.normalize(w, dim=-1)
    d2 = (2.0 - 2.0 * wn @ wn.T).clamp(min=1e-12)  # the clamp keeps sqrt's gradient finite
    off = ~torch.eye(len(w), dtype=torch.bool)
    return ((nu - d2.sqrt()).clamp(min=0.0) ** 2 * off).sum()


def spreadout(w: Tensor, nu: float, lr: float, steps: int) -> Tensor:
    """`steps` gradient steps of spreadout_loss on W (a new tensor; deterministic)."""
    w = w.detach().clone()
    for _ in range(steps):
        with torch.enable_grad():
            v = w.requires_grad_(True)
            (g,) = torch.autograd.grad(spreadout_loss(v, nu), v)
        w = (w - lr * g).detach()
    return w


class Spreadout(AlgorithmWrapper):
    """Any algorithm, then `spread_steps` steps of spreadout on the class vectors `class_key`
    after each server step (FedAwS: the server alone sees every class, so it alone can push
    them apart). Weights, barrier, staleness and state are the inner algorithm's."""

    def __init__(
        self,
        inner: Algorithm,
        nu: float = 1.0,
        spread_lr: float = 0.1,
        spread_steps: int = 1,
        class_key: str = CLASS_VECTORS,
    ) -> None:
        if not nu > 0:
            raise ConfigError("algorithm.nu", f"must be > 0, got {nu}", "use e.g. 1.0")
        if not spread_lr > 0:
            raise ConfigError("algorithm.spread_lr", f"must be > 0, got {spread_lr}")
        if spread_steps < 1:
            raise ConfigError("algorithm.spread_steps", f"must be >= 1, got {spread_steps}")
        super().__init__(inner, "spreadout")
        self.nu, self.spread_lr, self.spread_steps = float(nu), float(spread_lr), spread_steps
        self.class_key = class_key

    def after_step(self, new: Params) -> Params:
        if self.class_key not in new:
            raise ConfigError(
                "algorithm.class_key", f"no parameter {self.class_key!r}", "use FedAwSTask"
            )
        w = spreadout(new[self.class_key], self.nu, self.spread_lr, self.spread_steps)
        return {**new, self.class_key: w}
