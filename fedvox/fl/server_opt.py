"""Server optimisers: apply the aggregated update Δ̄ to the global model (Reddi et al. 2021).

Last stage of a server step: Δ̄ = mean of Δ = w_start − w_local is gradient-like, so it is
used directly as the pseudo-gradient g (SGD with lr 1 and one client gives w_local back).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fedvox.errors import ConfigError
from fedvox.types import Params


def _positive(field: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(field, f"must be > 0, got {value}", "use a positive value")


class ServerOptimizer:
    """Base: `step(params, g)` returns NEW tensors (old versions may still be in flight)."""

    def __init__(self, lr: float) -> None:
        _positive("server_opt.lr", lr)
        self.lr = float(lr)
        self.state: dict[str, Any] = {"step": 0}
        # lr multiplier as a function of the server step (warm-up, decay); config, not state
        self.schedule: Callable[[int], float] | None = None

    @property
    def step_lr(self) -> float:
        """The learning rate of the next step: lr × schedule(step)."""
        if self.schedule is None:
            return self.lr
        return self.lr * float(self.schedule(int(self.state["step"])))

    def step(self, params: Params, g: Params) -> Params:
        out = self._step(params, g)
        self.state["step"] += 1
        return out

    def _step(self, params: Params, g: Params) -> Params:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {
            k: ({n: t.clone() for n, t in v.items()} if isinstance(v, dict) else v)
            for k, v in self.state.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = {
            k: ({n: t.clone() for n, t in v.items()} if isinstance(v, dict) else v)
            for k, v in state.items()
        }


class ServerSGD(ServerOptimizer):
    """w ← w − lr·m, m = momentum·m + g (PyTorch's convention). lr=1, momentum=0 is FedAvg."""

    def __init__(self, lr: float = 1.0, momentum: float = 0.0) -> None:
        super().__init__(lr)
        if not 0 <= momentum < 1:
            raise ConfigError("server_opt.momentum", f"must be in [0, 1), got {momentum}")
        self.momentum = float(momentum)

    def _step(self, params: Params, g: Params) -> Params:
        if self.momentum == 0:
            return {n: p - self.step_lr * g[n] for n, p in params.items()}
        m = self.state.setdefault("m", {})
        out = {}
        for n, p in params.items():
            m[n] = self.momentum * m[n] + g[n] if n in m else g[n].clone()
            out[n] = p - self.step_lr * m[n]
        return out


class _Adaptive(ServerOptimizer):
    """FedAdam/FedYogi/FedAdagrad of Reddi et al. 2021, Algorithm 2: no bias correction,
    v starts at tau² and the step is lr·m / (sqrt(v) + tau)."""

    def __init__(self, lr: float, beta1: float, beta2: float, tau: float) -> None:
        super().__init__(lr)
        _positive("server_opt.tau", tau)
        if not 0 <= beta1 < 1:
            raise ConfigError("server_opt.beta1", f"must be in [0, 1), got {beta1}")
        if not 0 <= beta2 < 1:
            raise ConfigError("server_opt.beta2", f"must be in [0, 1), got {beta2}")
        self.beta1, self.beta2, self.tau = float(beta1), float(beta2), float(tau)

    def _v(self, v: Tensor, g2: Tensor) -> Tensor:
        raise NotImplementedError

    def _step(self, params: Params, g: Params) -> Params:
        m = self.state.setdefault("m", {})
        v = self.state.setdefault("v", {})
        out = {}
        for n, p in params.items():
            gn = g[n]
            m_prev = m.get(n, torch.zeros_like(gn))
            v_prev = v.get(n, torch.full_like(gn, self.tau**2))
            m[n] = self.beta1 * m_prev + (1 - self.beta1) * gn
            v[n] = self._v(v_prev, gn * gn)
            out[n] = p - self.step_lr * m[n] / (v[n].sqrt() + self.tau)
        return out


class ServerAdam(_Adaptive):
    def __init__(
        self, lr: float = 1e-2, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3
    ):
        super().__init__(lr, beta1, beta2, tau)

    def _v(self, v: Tensor, g2: Tensor) -> Tensor:
        return self.beta2 * v + (1 - self.beta2) * g2


class ServerYogi(_Adaptive):
    def __init__(
        self, lr: float = 1e-2, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3
    ):
        super().__init__(lr, beta1, beta2, tau)

    def _v(self, v: Tensor, g2: Tensor) -> Tensor:
        return v - (1 - self.beta2) * g2 * torch.sign(v - g2)


class ServerAdagrad(_Adaptive):
    """v accumulates g² (no decay); m keeps Reddi et al.'s beta1 (0 gives classic Adagrad)."""

    def __init__(self, lr: float = 1e-1, beta1: float = 0.9, tau: float = 1e-3):
        super().__init__(lr, beta1, 0.0, tau)

    def _v(self, v: Tensor, g2: Tensor) -> Tensor:
        return v + g2


SERVER_OPTIMIZERS = {
    "sgd": ServerSGD,
    "adam": ServerAdam,
    "yogi": ServerYogi,
    "adagrad": ServerAdagrad,
}


def warmup_decay(warmup: int, total: int, final_ratio: float) -> Callable[[int], float]:
    """Multiplier: linear warm-up over `warmup` steps, then exponential decay to
    `final_ratio` at step `total` (the centralised trainer's schedule, in server steps)."""

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        frac = min(1.0, (step - warmup) / max(1, total - warmup))
        return math.exp(frac * math.log(final_ratio))

    return schedule


def make_server_optimizer(name: str, **kwargs: Any) -> ServerOptimizer:
    """Build a server optimiser by name ('sgd', 'adam', 'yogi', 'adagrad')."""
    if name not in SERVER_OPTIMIZERS:
        raise ConfigError(
            "server_opt.name",
            f"unknown server optimiser {name!r}",
            f"use one of {', '.join(SERVER_OPTIMIZERS)}",
        )
    return SERVER_OPTIMIZERS[name](**kwargs)
