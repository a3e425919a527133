"""Compute devices: `train.device` resolved to a torch device, and the deterministic settings.

Base layer: training, evaluation and the federated engine ask here where to compute and
which PyTorch switches make a rerun on the same hardware give the same bits.
"""

from __future__ import annotations

import copy
import os
import re
from typing import Any

import torch
from torch import nn

from fedvox.errors import ConfigError

DEVICE_PATTERN = r"^(cpu|cuda(:\d+)?)$"
# cuBLAS picks its reduction order per workspace; a fixed workspace makes it deterministic
# (PyTorch's reproducibility notes). Must be in the environment before cuBLAS starts.
CUBLAS_WORKSPACE = ":4096:8"


def check_device_name(name: str, field: str = "train.device") -> str:
    """`name` if it is "cpu", "cuda" or "cuda:N", else a ConfigError naming `field`."""
    if not isinstance(name, str) or re.match(DEVICE_PATTERN, name) is None:
        raise ConfigError(field, f"unknown device {name!r}", 'use "cpu", "cuda" or "cuda:N"')
    return name


def resolve_device(name: str, field: str = "train.device") -> torch.device:
    """The torch device for `name`; a ConfigError naming `field` when CUDA is asked but absent."""
    check_device_name(name, field)
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ConfigError(
                field,
                f"{name!r} was asked but torch.cuda.is_available() is false (torch "
                f"{torch.__version__}, {build})",
                f'set {field} = "cpu" (or --device cpu), or run on a machine with an NVIDIA GPU '
                "and a CUDA build of torch",
            )
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ConfigError(
                field,
                f"{name!r} was asked but only {torch.cuda.device_count()} GPU(s) are visible",
                f'use "cuda:0" .. "cuda:{torch.cuda.device_count() - 1}"',
            )
    return device


def determinism_settings(device: str) -> dict[str, Any]:
    """The settings `set_determinism` applies for `device` (recorded in the run manifest)."""
    settings: dict[str, Any] = {
        "device": device,
        "deterministic_algorithms": True,
        "mixed_precision": False,
    }
    if device.startswith("cuda"):
        settings.update(
            cublas_workspace_config=CUBLAS_WORKSPACE,
            cudnn_deterministic=True,
            cudnn_benchmark=False,
            # TF32 rounds float32 matmuls and convolutions to a 10-bit mantissa
            allow_tf32=False,
        )
    return settings


def set_determinism(threads: int, device: str = "cpu") -> dict[str, Any]:
    """Deterministic kernels and a fixed thread count: same seed → same bits on the same
    hardware. Returns the settings applied (determinism_settings)."""
    settings = determinism_settings(device)
    if device.startswith("cuda"):
        # setdefault: a user's own stricter value (":16:8") is kept, and recorded as it is
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        settings["cublas_workspace_config"] = os.environ["CUBLAS_WORKSPACE_CONFIG"]
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    return settings


def module_on(module: nn.Module, device: torch.device | str) -> nn.Module:
    """`module` itself when its parameters are on `device`, else a copy moved there."""
    device = torch.device(device)
    first = next(module.parameters(), None)
    here = torch.device("cpu") if first is None else first.device
    if here.type == device.type and (device.index is None or here.index == device.index):
        return module
    return copy.deepcopy(module).to(device)


def to_cpu(obj: Any) -> Any:
    """`obj` with every tensor inside (dicts, lists, tuples) moved to the CPU (checkpoints)."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj
