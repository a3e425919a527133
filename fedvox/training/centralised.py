"""Centralised training: the pooled-data baseline every federated result is compared to.

Feeds random chunks to the models' one-step function, ramps the AAM margin, decays the
learning rate, logs metrics and writes atomic, resumable checkpoints.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from fedvox.device import resolve_device, to_cpu
from fedvox.device import set_determinism as apply_determinism
from fedvox.models import build_extractor
from fedvox.models.heads import AAMSoftmax, margin_schedule
from fedvox.models.step import train_step
from fedvox.progress import training_progress
from fedvox.rng import Purpose, derived_rng, derived_seed
from fedvox.training.chunks import ChunkSampler
from fedvox.training.distributed import SpeakerLoss, Workers, batch_slice, ddp_train_step


@dataclass(frozen=True)
class ModelConfig:
    """The extractor preset and its AAM head (a run's [model] table, normalisation resolved)."""

    name: str
    norm: str | None
    embedding_layer: str | None
    scale: float
    margin: float
    margin_ramp: tuple[float, float]


@dataclass(frozen=True)
class TrainConfig:
    """Optimiser, learning-rate schedule and random-chunk batches (a run's [train] table)."""

    steps: int
    batch_size: int
    chunk_frames: tuple[int, int]
    optimizer: str
    lr: float
    final_lr: float
    warmup_steps: int
    weight_decay: float
    max_grad_norm: float | None
    threads: int
    device: str = "cpu"
    workers: int = 1  # data-parallel processes (DDP); see fedvox.training.distributed


@dataclass(frozen=True)
class CentralisedConfig:
    """Everything centralised training reads: the seed, the model and the schedule."""

    seed: int
    model: ModelConfig
    train: TrainConfig


def set_determinism(threads: int, device: str = "cpu") -> None:
    """Deterministic kernels and a fixed thread count: same seed → same bits (on the same
    hardware; fedvox.device.set_determinism, which also sets the CUDA switches)."""
    apply_determinism(threads, device)


def build_models(
    cfg: CentralisedConfig, feat_dim: int, n_speakers: int
) -> tuple[nn.Module, AAMSoftmax]:
    """Extractor and AAM head, initialised from (seed, "init") only."""
    torch.manual_seed(derived_seed(cfg.seed, Purpose.INIT, bits=32))
    overrides = {}
    if cfg.model.embedding_layer is not None:
        overrides["embedding_layer"] = cfg.model.embedding_layer
    extractor = build_extractor(cfg.model.name, feat_dim, norm=cfg.model.norm, **overrides)
    emb_dim = extractor(torch.zeros(2, 50, feat_dim)).shape[1]
    head = AAMSoftmax(emb_dim, n_speakers, scale=cfg.model.scale, margin=0.0)
    return extractor, head


def lr_at(step: int, t: TrainConfig) -> float:
    """Linear warm-up, then exponential decay from lr to final_lr at the last step."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    frac = min(1.0, (step - t.warmup_steps) / span)
    return t.lr * math.exp(frac * math.log(t.final_lr / t.lr))


def make_optimizer(params: Iterable[nn.Parameter], t: TrainConfig) -> torch.optim.Optimizer:
    """Adam, or SGD with Nesterov momentum 0.9, at the schedule's starting rate."""
    if t.optimizer == "adam":
        return torch.optim.Adam(params, lr=t.lr, weight_decay=t.weight_decay)
    return torch.optim.SGD(
        params, lr=t.lr, momentum=0.9, weight_decay=t.weight_decay, nesterov=True
    )


@dataclass
class TrainState:
    """What a checkpoint holds and a resumed run restores."""

    extractor: nn.Module
    head: AAMSoftmax
    optimizer: torch.optim.Optimizer
    sampler: ChunkSampler
    step: int = 0
    history: list[dict] = field(default_factory=list)

    def to_checkpoint(self) -> dict:
        return {
            "step": self.step,
            # on the CPU, so a checkpoint written on a GPU resumes anywhere
            "extractor": to_cpu(self.extractor.state_dict()),
            "head": to_cpu(self.head.state_dict()),
            "optimizer": to_cpu(self.optimizer.state_dict()),
            "sampler": self.sampler.state(),
            "torch_rng": torch.get_rng_state(),
        }

    def load_checkpoint(self, ckpt: dict) -> None:
        self.step = int(ckpt["step"])
        self.extractor.load_state_dict(ckpt["extractor"])
        self.head.load_state_dict(ckpt["head"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.sampler.load_state(ckpt["sampler"])
        torch.set_rng_state(ckpt["torch_rng"])


@torch.no_grad()
def imprint_head(
    head: AAMSoftmax,
    extractor: nn.Module,
    feats: list[np.ndarray],
    labels: np.ndarray,
    max_frames: int,
    progress: bool = False,
) -> None:
    """Set each class vector to its speaker's mean unit-length embedding under `extractor`
    (weight imprinting): a pretrained extractor then starts with a head that already
    separates the new speakers, so fine-tuning refines it instead of erasing it."""
    from fedvox.eval.extract import embed_utterances
    from fedvox.progress import task_progress

    with task_progress("imprint head", len(feats), enabled=progress) as tick:
        emb = embed_utterances(extractor, feats, max_frames=max_frames, progress=tick)
    unit = torch.nn.functional.normalize(torch.from_numpy(emb).double(), dim=1)
    sums = torch.zeros(head.n_classes, unit.shape[1], dtype=torch.float64)
    sums.index_add_(0, torch.from_numpy(np.asarray(labels, dtype=np.int64)), unit)
    empty = sums.norm(dim=1) == 0
    if bool(empty.any()):
        raise ValueError(f"imprint_head: {int(empty.sum())} classes have no utterances")
    head.weight.copy_(torch.nn.functional.normalize(sums, dim=1).to(head.weight))


def init_training(
    cfg: CentralisedConfig,
    feats: list[np.ndarray],
    labels: np.ndarray,
    n_speakers: int,
    init_extractor: nn.Module | None = None,
    progress: bool = False,
) -> TrainState:
    """Fresh models (on cfg.train.device), optimiser and chunk sampler for a config; with
    `init_extractor`, the extractor starts from its weights and the head is imprinted."""
    device = resolve_device(cfg.train.device)
    set_determinism(cfg.train.threads, cfg.train.device)
    extractor, head = build_models(cfg, feats[0].shape[1], n_speakers)
    if init_extractor is not None:
        extractor.load_state_dict(init_extractor.state_dict())
        imprint_head(head, extractor, feats, labels, cfg.train.chunk_frames[1], progress)
    extractor.to(device)
    head.to(device)
    opt = make_optimizer([*extractor.parameters(), *head.parameters()], cfg.train)
    rng = derived_rng(cfg.seed, Purpose.CHUNKS)
    sampler = ChunkSampler(feats, labels, cfg.train.batch_size, tuple(cfg.train.chunk_frames), rng)
    return TrainState(extractor, head, opt, sampler)


def train(
    state: TrainState,
    cfg: CentralisedConfig,
    on_step: Callable[[TrainState, dict], None] | None = None,
    progress: bool = True,
    workers: Workers | None = None,
) -> TrainState:
    """Run from state.step to cfg.train.steps; `on_step` sees each step's record (logging,
    checkpoints, periodic evaluation). With `workers` of more than one process, each trains
    its slice of every batch under DDP (the group must be initialised)."""
    t = cfg.train
    device = resolve_device(t.device)
    w = workers or Workers()
    step_fn = _local_step(state, t) if not w.distributed else _ddp_step(state, t, w)
    state.extractor.train()
    state.head.train()
    with training_progress(t.steps, state.step, enabled=progress and w.is_main) as bar:
        while state.step < t.steps:
            t0 = time.perf_counter()
            x, y = state.sampler.next_batch()
            lr = lr_at(state.step, t)
            for g in state.optimizer.param_groups:
                g["lr"] = lr
            margin = margin_schedule(state.step / t.steps, cfg.model.margin, *cfg.model.margin_ramp)
            state.head.set_margin(margin)
            loss = step_fn(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device))
            if not math.isfinite(loss):
                raise FloatingPointError(
                    f"training loss became {loss} at step {state.step}. "
                    "Fix: lower train.lr or set train.max_grad_norm"
                )
            state.step += 1
            dt = time.perf_counter() - t0
            rec = {
                "step": state.step,
                "loss": loss,
                "lr": lr,
                "margin": margin,
                "frames": int(x.shape[1]),
            }
            bar.update(loss=loss, rate=x.shape[0] / dt)
            if on_step is not None:
                on_step(state, rec)
    return state


def _local_step(state: TrainState, t: TrainConfig) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """One process: the whole batch through models/step.train_step."""

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        return train_step(
            state.extractor, state.head, state.optimizer, x, y, max_grad_norm=t.max_grad_norm
        )

    return step


def _ddp_step(
    state: TrainState, t: TrainConfig, w: Workers
) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """This rank's slice of each batch through a DDP-wrapped extractor + head."""
    from torch.nn.parallel import DistributedDataParallel

    part = batch_slice(t.batch_size, w)
    device = resolve_device(t.device)
    ids = None
    if device.type == "cuda":  # this rank's GPU (init_workers set it from LOCAL_RANK)
        ids = [device.index if device.index is not None else torch.cuda.current_device()]
    model = DistributedDataParallel(SpeakerLoss(state.extractor, state.head), device_ids=ids)
    params = [*state.extractor.parameters(), *state.head.parameters()]

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        return ddp_train_step(
            model, params, state.optimizer, x[part], y[part], w.world_size, t.max_grad_norm
        )

    return step
