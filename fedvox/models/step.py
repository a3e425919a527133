"""One training step of extractor + speaker head, eager or functional (torch.func).

Called by trainers and by the federated engine, which vmaps `functional_loss` over clients.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call


def _head_input(extractor: nn.Module, feats: Tensor) -> Tensor:
    # Extractors may train the head on a layer above the embedding (Kaldi x-vector, embedding
    # at segment a); they say so through `head_input`. Anything else trains on forward().
    head_input = getattr(extractor, "head_input", None)
    if head_input is None:
        return extractor(feats)
    return head_input(feats)


def speaker_loss(extractor: nn.Module, head: nn.Module, feats: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy of the head's (AAM) logits for features [B, T, F] and labels [B]."""
    return F.cross_entropy(head(_head_input(extractor, feats), labels), labels)


def speaker_losses(extractor: nn.Module, head: nn.Module, feats: Tensor, labels: Tensor) -> Tensor:
    """Per-example cross-entropy [B]: the federated engine masks padded examples with it."""
    logits = head(_head_input(extractor, feats), labels)
    return F.cross_entropy(logits, labels, reduction="none")


def train_step(
    extractor: nn.Module,
    head: nn.Module,
    optimizer: torch.optim.Optimizer,
    feats: Tensor,
    labels: Tensor,
    max_grad_norm: float | None = None,
) -> float:
    """zero_grad, loss, backward, optional global-norm clip over both modules, step.

    Returns the loss before the step, as a float.
    """
    optimizer.zero_grad(set_to_none=True)
    loss = speaker_loss(extractor, head, feats, labels)
    loss.backward()
    if max_grad_norm is not None:
        params = [p for m in (extractor, head) for p in m.parameters() if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    return float(loss.detach())


class SpeakerModel(nn.Module):
    """extractor + head as one module whose forward is the loss.

    Its names ("extractor.<name>", "head.<name>") are the keys of the parameter dicts that
    `functional_loss` takes; the wrapper holds the original modules, it copies nothing.
    """

    def __init__(self, extractor: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.extractor = extractor
        self.head = head

    def forward(self, feats: Tensor, labels: Tensor) -> Tensor:
        return speaker_loss(self.extractor, self.head, feats, labels)


def merged_parameters(
    extractor: nn.Module, head: nn.Module, include_buffers: bool = False
) -> dict[str, Tensor]:
    """{"extractor.<name>": tensor, "head.<name>": tensor} for `functional_loss` (detached)."""
    model = SpeakerModel(extractor, head)
    out = {k: v.detach() for k, v in model.named_parameters()}
    if include_buffers:
        out.update({k: v.detach() for k, v in model.named_buffers()})
    return out


def functional_loss(
    extractor: nn.Module, head: nn.Module
) -> Callable[[dict[str, Tensor], Tensor, Tensor], Tensor]:
    """f(params, feats, labels) -> loss, the modules' structure with tensors from `params`.

    `params` is keyed as `merged_parameters` (parameters, optionally buffers; any name left
    out is taken from the modules). f is pure, so the federated engine can run
    torch.func.vmap(torch.func.grad(f)) over parameters stacked along a client axis. Use
    norm="layer" or "none" there: BatchNorm in training mode updates running statistics in
    place, which vmap cannot do, and mixes examples within a client's batch.
    """
    model = SpeakerModel(extractor, head)

    def loss(params: dict[str, Tensor], feats: Tensor, labels: Tensor) -> Tensor:
        return functional_call(model, params, (feats, labels))

    return loss
