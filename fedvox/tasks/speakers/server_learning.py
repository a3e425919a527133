"""Server learning: after each server step, a few SGD steps on the server's own public corpus.

Part of fedvox.tasks.speakers: `ServerLearning` wraps any fl Algorithm (as `Spreadout` does)
and trains the extractor with an AAM head over the public speakers that only the server
holds: the head is never among the broadcast parameters, so no device sees it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from fedvox.errors import ConfigError
from fedvox.fl.algorithms.base import Algorithm, AlgorithmWrapper
from fedvox.models.heads import AAMSoftmax
from fedvox.rng import Purpose, derived_rng, torch_generator
from fedvox.tasks.speakers.common import EXTRACTOR
from fedvox.tasks.speakers.global_head import SpeakerTask
from fedvox.tasks.speakers.public import PublicStore
from fedvox.types import Params

HEAD = "head.weight"  # the server head's name inside its SpeakerTask


class ServerLearning(AlgorithmWrapper):
    """Any algorithm, then `steps` SGD steps (lr, momentum) of the AAM speaker loss on random
    batches of `public` after each server step that aggregated something.

    Only the extractor's parameters (EXTRACTOR prefix) move; the task's other global
    parameters are left as the inner algorithm set them. Batch t (counted over the whole
    run) is drawn from (seed, SERVER_LEARNING, t) and the head starts from
    (seed, SERVER_HEAD), so the head, the momentum and the step counter (state_dict) are all
    a resume needs. Weights, barrier and staleness are the inner algorithm's.
    """

    def __init__(
        self,
        inner: Algorithm,
        extractor: nn.Module,
        public: PublicStore,
        steps: int = 1,
        lr: float = 1e-3,
        batch_size: int = 32,
        momentum: float = 0.0,
        seed: int = 0,
        scale: float = 30.0,
        margin: float = 0.2,
    ) -> None:
        if steps < 1:
            raise ConfigError("server_learning.steps", f"must be >= 1, got {steps}", "use e.g. 1")
        if not lr > 0:
            raise ConfigError("server_learning.lr", f"must be > 0, got {lr}", "use e.g. 0.01")
        if batch_size < 2:
            raise ConfigError("server_learning.batch_size", f"must be >= 2, got {batch_size}")
        if not 0 <= momentum < 1:
            raise ConfigError("server_learning.momentum", f"must be in [0, 1), got {momentum}")
        if public.n_speakers < 2:
            raise ConfigError(
                "data.public",
                f"{public.n_speakers} public speaker(s): a speaker loss needs at least 2",
                "point data.public at a corpus with more speakers",
            )
        super().__init__(inner, "server_learning")
        self.public = public
        self.steps, self.lr, self.momentum = steps, float(lr), float(momentum)
        self.batch_size = min(batch_size, len(public.x))
        self.seed = int(seed)
        with torch.no_grad():
            emb_dim = extractor(public.x[:2]).shape[1]
        with torch.random.fork_rng(devices=[]):  # the global torch stream is left untouched
            head = AAMSoftmax(emb_dim, public.n_speakers, scale=scale, margin=margin)
        with torch.no_grad():
            head.weight.copy_(
                nn.init.xavier_uniform_(
                    torch.empty_like(head.weight),
                    generator=torch_generator(seed, Purpose.SERVER_HEAD),
                )
            )
        self.model = SpeakerTask(extractor, head)  # a pure loss function of given params
        self.head = head.weight.detach().clone()
        self.velocity: dict[str, Tensor] = {}
        self.taken = 0  # server-learning SGD steps so far (the batch stream's counter)

    def batch(self, t: int) -> Tensor:
        """Store rows of server-learning step t (without replacement within the batch)."""
        rng = derived_rng(self.seed, Purpose.SERVER_LEARNING, t)
        return torch.from_numpy(rng.choice(len(self.public.x), self.batch_size, replace=False))

    def after_step(self, new: Params) -> Params:
        names = [n for n in new if n.startswith(EXTRACTOR)]
        if not names:
            raise ConfigError(
                "federated.server_learning",
                "the task has no extractor parameters",
                "use a speaker task",
            )
        w = {n: new[n].detach().clone() for n in names}
        w[HEAD] = self.head.clone()
        for _ in range(self.steps):
            rows = self.batch(self.taken)
            batch = {"x": self.public.x[rows], "y": self.public.y[rows]}
            with torch.enable_grad():
                leaves = {n: t.requires_grad_(True) for n, t in w.items()}
                loss = self.model.loss(leaves, batch).mean()
                grads = torch.autograd.grad(loss, list(leaves.values()))
            with torch.no_grad():
                for (n, t), g in zip(leaves.items(), grads, strict=True):
                    if self.momentum > 0:
                        v = self.velocity.get(n)
                        g = g if v is None else self.momentum * v + g
                        self.velocity[n] = g.detach().clone()
                    w[n] = (t - self.lr * g).detach()
            self.taken += 1
        self.head = w.pop(HEAD)
        return {**new, **w}

    def state_dict(self) -> dict[str, Any]:
        return {
            "inner": self.inner.state_dict(),
            "head": self.head.clone(),
            "velocity": {n: t.clone() for n, t in self.velocity.items()},
            "taken": self.taken,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        self.head = state["head"].clone()
        self.velocity = {n: t.clone() for n, t in state["velocity"].items()}
        self.taken = int(state["taken"])
