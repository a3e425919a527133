"""Speaker heads: AAM-softmax (ArcFace) over training speakers, and its margin ramp.

Sits after the extractor during training only: embeddings + labels in, logits out.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedvox.errors import ConfigError

# Floor on sin^2(theta) before the square root: at cos = +-1, d sqrt/dx is infinite; the
# clamp gives a zero gradient there instead of NaN. The value error (<= 3e-4 in sin) only
# arises for an embedding already (anti)aligned with its class vector to float precision.
_SIN2_FLOOR = 1e-7


def check_margin(m: float, field: str = "model.margin") -> float:
    """The angular margin (radians) as a float; refuses one outside [0, pi/2)."""
    if not 0.0 <= m < math.pi / 2:
        raise ConfigError(field, f"margin={m} outside [0, pi/2)", "use 0-0.5")
    return float(m)


def aam_logits(cosine: Tensor, is_target: Tensor, scale: float, margin: float) -> Tensor:
    """AAM logits from cosines [..., C] and a boolean target mask [..., C]: s·cos θ_j, and
    s·cos(θ_y + m) in the target column, cos(θ + m) as cos·cos m − sin·sin m; past π − m the
    target falls back to s·(cos θ − 1 − cos(π − m)) (WeSpeaker). Pure, so it vmaps; shared by
    the centralised head and the federated speaker tasks."""
    if margin == 0.0:
        return scale * cosine
    cos_y = (cosine * is_target).sum(dim=-1, keepdim=True)
    sin_y = (1.0 - cos_y * cos_y).clamp(min=_SIN2_FLOOR).sqrt()
    phi = cos_y * math.cos(margin) - sin_y * math.sin(margin)
    threshold = math.cos(math.pi - margin)
    phi = torch.where(cos_y > threshold, phi, cos_y - (1.0 + threshold))
    return scale * torch.where(is_target, phi, cosine)


class AAMSoftmax(nn.Module):
    """Additive angular margin softmax (ArcFace; WeSpeaker's ArcMarginProduct): class vectors
    [n_classes, emb_dim] and `aam_logits` over the cosines to them (the target column found by
    comparison with the labels, so it works under torch.func.vmap).
    """

    def __init__(
        self, emb_dim: int, n_classes: int, scale: float = 30.0, margin: float = 0.2
    ) -> None:
        super().__init__()
        if emb_dim < 1 or n_classes < 1:
            raise ConfigError(
                "model.head", f"emb_dim={emb_dim}, n_classes={n_classes}", "use positive sizes"
            )
        if scale <= 0:
            raise ConfigError("model.head.scale", f"scale={scale} must be > 0", "use 30-32")
        self.emb_dim = emb_dim
        self.n_classes = n_classes
        self.scale = float(scale)
        self.weight = nn.Parameter(torch.empty(n_classes, emb_dim))
        nn.init.xavier_uniform_(self.weight)
        self.set_margin(margin)

    def set_margin(self, m: float) -> None:
        """Set the angular margin (radians), e.g. from `margin_schedule` each epoch."""
        self.margin = check_margin(m, "model.head.margin")

    def cosine(self, emb: Tensor) -> Tensor:
        """Cosine similarity [B, n_classes] between embeddings and class vectors."""
        return F.linear(F.normalize(emb, dim=-1), F.normalize(self.weight, dim=-1))

    def forward(self, emb: Tensor, labels: Tensor | None = None) -> Tensor:
        """Logits [B, n_classes]; without labels, plain s*cos (no margin) for inference."""
        cosine = self.cosine(emb)
        if labels is None:
            return self.scale * cosine
        is_target = torch.arange(self.n_classes, device=emb.device) == labels.unsqueeze(-1)
        return aam_logits(cosine, is_target, self.scale, self.margin)

    def extra_repr(self) -> str:
        return (
            f"emb_dim={self.emb_dim}, n_classes={self.n_classes}, "
            f"scale={self.scale}, margin={self.margin}"
        )


class LinearHead(nn.Module):
    """Plain softmax layer (Linear with bias), the x-vector output layer of Kaldi and W1."""

    def __init__(self, emb_dim: int, n_classes: int) -> None:
        super().__init__()
        self.emb_dim = emb_dim
        self.n_classes = n_classes
        self.linear = nn.Linear(emb_dim, n_classes)

    def forward(self, emb: Tensor, labels: Tensor | None = None) -> Tensor:
        """Logits [B, n_classes]; labels are accepted for a head-agnostic call and ignored."""
        return self.linear(emb)


def margin_schedule(
    progress: float, final_margin: float = 0.2, ramp_start: float = 0.2, ramp_end: float = 0.5
) -> float:
    """AAM margin at `progress` in [0, 1] of training: 0 before ramp_start, linear up to
    final_margin at ramp_end, constant after.

    Starting without a margin lets the classes separate before they are pushed apart by
    angle. WeSpeaker ramps between epochs 20 and 40 of 150 (0.13-0.27 of training);
    the defaults ramp over 0.2-0.5, gentler for the fewer, noisier federated rounds.
    """
    if not 0.0 <= ramp_start <= ramp_end <= 1.0:
        raise ConfigError(
            "train.margin_ramp",
            f"ramp [{ramp_start}, {ramp_end}] is not inside [0, 1] in order",
            "use 0 <= ramp_start <= ramp_end <= 1",
        )
    if progress >= ramp_end:
        return float(final_margin)
    if progress <= ramp_start:
        return 0.0
    return float(final_margin) * (progress - ramp_start) / (ramp_end - ramp_start)
