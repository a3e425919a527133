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
from fedvox.errors import ConfigError, DataError
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


_MODEL_FIX = "pass a model.pt written by fedvox training, or re-run the training that wrote it"
# A model file is rebuilt from these fields (and holds `extractor`, the weights).
_FIELDS: dict[str, tuple[type, ...]] = {
    "model_name": (str,),
    "feat_dim": (int,),
    "norm": (str, type(None)),
    "embedding_layer": (str, type(None)),
}
# No front end fedvox has makes more features; a larger number is a corrupt file, and
# building a model around it could take all memory.
MAX_FEAT_DIM = 1024


def _read_blob(path: Path) -> dict:
    """The checked dict of a model file, or DataError naming the file and the bad field."""
    path = Path(path)
    if not path.is_file():
        raise DataError(path, "no trained model here", "pass a model file written by training")
    try:
        # weights_only: a model file is data, so loading one must never run code from it.
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises a dozen types on a torn or foreign file
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise DataError(
            path,
            f"not a readable model file ({type(exc).__name__}{': ' + reason if reason else ''})",
            _MODEL_FIX,
        ) from None
    if not isinstance(blob, dict):
        raise DataError(path, f"holds a {type(blob).__name__}, not a fedvox model", _MODEL_FIX)
    for name, types in _FIELDS.items():
        if name not in blob:
            raise DataError(path, f"model file has no field '{name}'", _MODEL_FIX)
        value = blob[name]
        if not isinstance(value, types) or isinstance(value, bool):
            raise DataError(path, f"field '{name}' is {value!r}, of the wrong type", _MODEL_FIX)
    if not 1 <= blob["feat_dim"] <= MAX_FEAT_DIM:
        raise DataError(
            path, f"field 'feat_dim' is {blob['feat_dim']}, outside 1..{MAX_FEAT_DIM}", _MODEL_FIX
        )
    if not isinstance(blob.get("extractor"), dict):
        raise DataError(
            path, "field 'extractor' (the weights) is missing or not a dict", _MODEL_FIX
        )
    return blob


def model_info(path: Path) -> dict:
    """What rebuilds the extractor saved at `path` (model_name, norm, embedding_layer,
    feat_dim) and its weights_sha256, without building it."""
    return {k: v for k, v in _read_blob(path).items() if k != "extractor"}


def load_model(path: Path) -> nn.Module:
    """The extractor saved at `path`, rebuilt from its preset, in eval mode.

    A file that is not a model fedvox wrote, or whose weights do not fit its preset, is a
    DataError naming the file.
    """
    blob = _read_blob(path)
    kw = {} if blob["embedding_layer"] is None else {"embedding_layer": blob["embedding_layer"]}
    try:
        extractor = build_extractor(blob["model_name"], blob["feat_dim"], norm=blob["norm"], **kw)
    except ConfigError as err:
        raise DataError(
            path, f"cannot rebuild its model: {err.field} {err.problem}", _MODEL_FIX
        ) from None
    try:
        extractor.load_state_dict(blob["extractor"])
    except (RuntimeError, TypeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise DataError(
            path, f"its weights do not fit model '{blob['model_name']}' ({first})", _MODEL_FIX
        ) from None
    extractor.eval()
    return extractor
