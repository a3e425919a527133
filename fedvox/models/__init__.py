"""Speaker-embedding extractors (x-vector, ECAPA-TDNN), speaker heads and the training step.

Sits between features and scoring; `build_extractor` turns a config's model name into a module
and `fedvox.models.io` saves and reloads a trained one.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from fedvox.errors import ConfigError
from fedvox.models.ecapa import ECAPATDNN
from fedvox.models.heads import AAMSoftmax, LinearHead, margin_schedule
from fedvox.models.step import speaker_loss, train_step
from fedvox.models.xvector import NORMS, XVector

__all__ = [
    "ECAPATDNN",
    "MODEL_PRESETS",
    "NORMS",
    "AAMSoftmax",
    "LinearHead",
    "XVector",
    "build_extractor",
    "count_parameters",
    "margin_schedule",
    "speaker_loss",
    "train_step",
]

_ARCHITECTURES: dict[str, type[nn.Module]] = {"xvector": XVector, "ecapa": ECAPATDNN}

# "arch" picks the class; the rest are its constructor arguments. feat_dim comes from the
# front end (30 for Kaldi v2 MFCC / the small model, 80 fbank for ECAPA).
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # Kaldi voxceleb/v2 size: 4,491,668 parameters at feat_dim 30 with BatchNorm (affine).
    "xvector": {
        "arch": "xvector",
        "widths": (512, 512, 512, 512, 1500),
        "emb_dim": 512,
        "embedding_layer": "a",
        "norm": "batch",
    },
    # CPU size: the Kaldi shape at half width (256x4 + 768, segment layers 256). The
    # embedding is segment b (WeSpeaker's choice): the AAM head then trains on the embedding
    # itself, so cosine scoring works without PLDA and speaker prototypes live in embedding
    # space, as Federated Reconstruction needs (measured: docs/verification.md, Models).
    "xvector-small": {
        "arch": "xvector",
        "widths": (256, 256, 256, 256, 768),
        "emb_dim": 256,
        "embedding_layer": "b",
        "norm": "batch",
    },
    # Study size: the small shape at half width again, about a quarter of its frame-layer
    # FLOPs, for many-device federated studies and the quick demo on a loaded 2-core machine.
    "xvector-tiny": {
        "arch": "xvector",
        "widths": (128, 128, 128, 128, 384),
        "emb_dim": 128,
        "embedding_layer": "b",
        "norm": "batch",
    },
    "ecapa-small": {"arch": "ecapa", "channels": 256, "emb_dim": 192, "norm": "batch"},
    "ecapa-c512": {"arch": "ecapa", "channels": 512, "emb_dim": 192, "norm": "batch"},
}


def build_extractor(
    name: str, feat_dim: int, norm: str | None = None, **overrides: Any
) -> nn.Module:
    """The extractor for preset `name` on `feat_dim` features; `norm` and `overrides`
    (constructor arguments, e.g. emb_dim=192) replace the preset's values."""
    if name not in MODEL_PRESETS:
        raise ConfigError(
            "model.name", f"unknown model '{name}'", "use one of: " + ", ".join(MODEL_PRESETS)
        )
    kwargs = dict(MODEL_PRESETS[name])
    cls = _ARCHITECTURES[kwargs.pop("arch")]
    allowed = set(inspect.signature(cls.__init__).parameters) - {"self", "feat_dim"}
    for key in overrides:
        if key not in allowed:
            raise ConfigError(
                f"model.{key}",
                f"'{key}' is not an option of model '{name}'",
                "use one of: " + ", ".join(sorted(allowed)),
            )
    kwargs.update(overrides)
    if norm is not None:
        kwargs["norm"] = norm
    return cls(feat_dim=feat_dim, **kwargs)


def count_parameters(module: nn.Module) -> int:
    """Number of trainable parameter elements (buffers such as BN running stats excluded)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)
