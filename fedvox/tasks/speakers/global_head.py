"""Speakers as rows of a global AAM head: the x-vector extractor plus one class vector each.

Part of fedvox.tasks.speakers: the plain federated task (every parameter on the server), and
its codewords variant (`fix_head`: fixed random rows, never trained or sent).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from fedvox.models.heads import AAMSoftmax
from fedvox.models.step import speaker_losses
from fedvox.types import Batch, Params


class SpeakerTask(nn.Module):
    """The engine's task: extractor + AAM head, per-example loss as a pure function."""

    def __init__(self, extractor: nn.Module, head: AAMSoftmax):
        super().__init__()
        self.extractor = extractor
        self.head = head

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return speaker_losses(self.extractor, self.head, x, y)

    def init_params(self) -> Params:
        """The trained (global) parameters; fixed codeword rows are not among them."""
        return {n: p.detach().clone() for n, p in self.named_parameters() if p.requires_grad}

    def loss(self, params: Params, batch: Batch) -> Tensor:
        return functional_call(self, params, (batch["x"], batch["y"]))

    def load_params(self, params: Params) -> None:
        with torch.no_grad():
            for n, p in self.named_parameters():
                if n in params:
                    p.copy_(params[n])

    def fix_head(self, seed: int) -> None:
        """FedUV-style codewords: the head rows become fixed random unit vectors (from the
        seed, so any device can regenerate its own row), never trained, never sent.

        A learned head with one speaker per device drifts (docs/federated.md, notes); fixed
        rows cannot drift, and carry no voice: the server learns no voiceprint from them.
        """
        gen = torch.Generator().manual_seed(int(seed))
        w = self.head.weight
        with torch.no_grad():
            w.copy_(F.normalize(torch.randn(w.shape, generator=gen), dim=-1))
        w.requires_grad_(False)
