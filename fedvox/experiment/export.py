"""Export of a trained extractor for deployment without fedvox (TorchScript).

The exported module maps features [batch, frames, bins] to embeddings; it is checked
against the eager model on an input of a length it was not traced with.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fedvox.atomic import atomic_write
from fedvox.experiment.runfolder import RunFolder
from fedvox.experiment.runner import MODEL_FILE, load_model


def export_torchscript(run_path: Path, out: Path) -> tuple[Path, float]:
    """Script (or, failing that, trace) the extractor, save atomically, verify; returns
    (path, max abs difference from eager on a fresh-length input)."""
    run = RunFolder.open(run_path)
    extractor, _ = load_model(run)
    feat_dim = int(
        torch.load(run.path / MODEL_FILE, map_location="cpu", weights_only=False)["feat_dim"]
    )
    try:
        module = torch.jit.script(extractor)
    except Exception:
        # Tracing bakes shapes of ops it records; statistics pooling is length-generic, and
        # the check below proves the traced module on a different length.
        module = torch.jit.trace(extractor, torch.randn(1, 300, feat_dim))
    atomic_write(out, lambda f: torch.jit.save(module, f))
    loaded = torch.jit.load(str(out))
    x = torch.randn(2, 237, feat_dim)
    with torch.no_grad():
        diff = float((loaded(x) - extractor(x)).abs().max())
    return out, diff
