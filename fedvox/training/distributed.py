"""Data-parallel centralised training (torch.distributed DDP), one process per worker.

Every rank holds the same chunk sampler (same seed), draws the same batch and trains on its
contiguous slice of it; DDP averages the gradients, so each step is the full batch's mean
gradient (exactly, for batch-independent layers; batch norm normalises per slice, as DDP
does, with rank 0's running statistics). Bits repeat on reruns with the same worker count,
not across worker counts: the sum's order changes with the slicing.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fedvox.errors import ConfigError
from fedvox.models.step import speaker_loss

# Rank 0 prepares data and evaluates while the others wait at a collective: generous.
TIMEOUT = datetime.timedelta(hours=6)


@dataclass(frozen=True)
class Workers:
    """This process's place among the training workers (torchrun's environment)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Whether this process writes the run folder, logs, checkpoints and evaluates."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def workers_from_env() -> Workers:
    """RANK / WORLD_SIZE / LOCAL_RANK as torchrun sets them; one worker without them."""
    if "WORLD_SIZE" not in os.environ:
        return Workers()
    return Workers(
        int(os.environ.get("RANK", "0")),
        int(os.environ["WORLD_SIZE"]),
        int(os.environ.get("LOCAL_RANK", "0")),
    )


def init_workers(expected: int, device: str) -> Workers:
    """Join the process group when launched with `expected` > 1 workers (gloo on the CPU,
    nccl on GPUs); refuses a launch whose world size is not train.workers."""
    w = workers_from_env()
    if expected == 1 and not w.distributed:
        return w
    if w.world_size != expected:
        raise ConfigError(
            "train.workers",
            f"{expected}, but this process was launched among {w.world_size} workers",
            "launch with `fedvox train` (it starts train.workers processes itself) or set "
            "train.workers to torchrun's --nproc-per-node",
        )
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(w.local_rank)
        dist.init_process_group(backend, timeout=TIMEOUT)
    return w


def barrier(w: Workers) -> None:
    """Wait for every worker (no-op with one)."""
    if w.distributed:
        dist.barrier()


def shutdown(w: Workers) -> None:
    """Leave the process group, all workers together: a worker that tore its gloo pairs down
    while rank 0 was still evaluating was seen to abort (SIGABRT, "terminate called without an
    active exception"), failing the run."""
    if w.distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class SpeakerLoss(nn.Module):
    """Extractor + head as one module whose forward is the training loss, so DDP can wrap
    both (its gradient hooks then cover every trained parameter)."""

    def __init__(self, extractor: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.extractor = extractor
        self.head = head

    def forward(self, feats: Tensor, labels: Tensor) -> Tensor:
        return speaker_loss(self.extractor, self.head, feats, labels)


def batch_slice(batch_size: int, w: Workers) -> slice:
    """This rank's contiguous, equal part of a batch; batch_size must divide evenly."""
    if batch_size % w.world_size:
        raise ConfigError(
            "train.batch_size",
            f"{batch_size} does not split evenly over train.workers = {w.world_size}",
            f"use a multiple of {w.world_size}",
        )
    per = batch_size // w.world_size
    return slice(w.rank * per, (w.rank + 1) * per)


def ddp_train_step(
    model: nn.Module,
    params: list[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    feats: Tensor,
    labels: Tensor,
    world_size: int,
    max_grad_norm: float | None = None,
) -> float:
    """One step of a DDP-wrapped SpeakerLoss on this rank's slice; returns the full batch's
    mean loss (the ranks' slice losses averaged)."""
    optimizer.zero_grad(set_to_none=True)
    loss = model(feats, labels)
    loss.backward()  # DDP all-reduces (averages) the gradients here
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_grad_norm)
    optimizer.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return float(mean) / world_size
