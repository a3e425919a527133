"""Saved extractors: the model file a run writes, its weights hash, and loading it back.

Sits after training and before every consumer of a trained model (evaluation, enroll, export,
RECONEVAL); the file holds the weights and the preset that rebuilds the module around them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import nn

from fedvox.atomic import atomic_write
from fedvox.errors import DataError
from fedvox.models import build_extractor

MODEL_FILE = "model.pt"


def weights_hash(module: nn.Module) -> str:
    """sha256 of every tensor in the state dict, in order: equal hashes ⇔ equal weights."""
    h = hashlib.sha256()
    for k, v in module.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def save_model(
    path: Path,
    extractor: nn.Module,
    *,
    model_name: str,
    feat_dim: int,
    norm: str | None,
    embedding_layer: str | None,
) -> Path:
    """Write the trained extractor with the preset, normalisation and input size that rebuild
    it (atomic: a crash leaves the old file or none)."""
    blob = {
        "model_name": model_name,
        "norm": norm,
        "embedding_layer": embedding_layer,
        "feat_dim": feat_dim,
        "extractor": extractor.state_dict(),
        "weights_sha256": weights_hash(extractor),
    }
    return atomic_write(Path(path), lambda f: torch.save(blob, f))


def model_info(path: Path) -> dict:
    """What rebuilds the extractor saved at `path` (model_name, norm, embedding_layer,
    feat_dim) and its weights_sha256, without building it."""
    path = Path(path)
    if not path.is_file():
        raise DataError(path, "no trained model here", "pass a model file written by training")
    blob = torch.load(path, map_location="cpu", weights_only=False)
    return {k: v for k, v in blob.items() if k != "extractor"}


def load_model(path: Path) -> nn.Module:
    """The extractor saved at `path`, rebuilt from its preset, in eval mode."""
    path = Path(path)
    if not path.is_file():
        raise DataError(path, "no trained model here", "pass a model file written by training")
    blob = torch.load(path, map_location="cpu", weights_only=False)
    kw = {} if blob["embedding_layer"] is None else {"embedding_layer": blob["embedding_layer"]}
    extractor = build_extractor(blob["model_name"], blob["feat_dim"], norm=blob["norm"], **kw)
    extractor.load_state_dict(blob["extractor"])
    extractor.eval()
    return extractor
