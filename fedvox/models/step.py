"""One training step of extractor + speaker head, and the per-example loss it is made of.

Called by the centralised trainer (`train_step`) and by the global-head speaker task, which
vmaps `speaker_losses` over clients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


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
