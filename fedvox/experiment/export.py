"""Export of a trained extractor for deployment without fedvox (TorchScript or ONNX).

The exported model maps features [batch, frames, bins] to embeddings; each export is
checked against the eager model on an input of a length it was not traced with.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

from fedvox.atomic import atomic_write
from fedvox.experiment.runfolder import RunFolder, load_run_model


def export_torchscript(run_path: Path, out: Path) -> tuple[Path, float]:
    """Script (or, failing that, trace) the extractor, save atomically, verify; returns
    (path, max abs difference from eager on a fresh-length input)."""
    run = RunFolder.open(run_path)
    extractor, _ = load_run_model(run)
    feat_dim = int(extractor.feat_dim)
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


def export_onnx(run_path: Path, out: Path) -> tuple[Path, float]:
    """ONNX with dynamic batch and frame axes, checked with onnx's checker and reference
    evaluator against eager; returns (path, max abs difference).

    Uses torch's TorchScript-based exporter (dynamo=False): the default dynamo exporter
    needs onnxscript, which fedvox does not depend on.
    """
    import onnx
    from onnx.reference import ReferenceEvaluator

    run = RunFolder.open(run_path)
    extractor, _ = load_run_model(run)
    feat_dim = int(extractor.feat_dim)
    buf = io.BytesIO()
    torch.onnx.export(
        extractor,
        (torch.randn(1, 300, feat_dim),),
        buf,
        dynamo=False,
        input_names=["feats"],
        output_names=["embedding"],
        dynamic_axes={"feats": {0: "batch", 1: "frames"}, "embedding": {0: "batch"}},
    )
    data = buf.getvalue()
    proto = onnx.load_from_string(data)
    onnx.checker.check_model(proto)
    atomic_write(out, lambda f: f.write(data))
    x = torch.randn(2, 237, feat_dim)
    (got,) = ReferenceEvaluator(proto).run(None, {"feats": x.numpy()})
    with torch.no_grad():
        diff = float((torch.from_numpy(got) - extractor(x)).abs().max())
    return out, diff
