"""What local training needs from a model: the Task protocols and ModuleTask over an nn.Module.

Part of fedvox.fl.local: a Task gives parameters and per-example losses; a ReconTask adds
local parameters; a task that is an MLP declares it (`lowrank_layers`) for the low-rank path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torch.func import functional_call

from fedvox.errors import ConfigError
from fedvox.fl.local.config import ReconConfig
from fedvox.types import Batch, Params

LossFn = Callable[[Params, Batch], Tensor]

# Parameter-free modules that act on each example independently: the low-rank path applies
# them to every client's rows at once.
ROWWISE = (
    nn.ReLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.GELU,
    nn.SiLU,
    nn.LeakyReLU,
    nn.ELU,
    nn.Softplus,
    nn.Identity,
)


@runtime_checkable
class Task(Protocol):
    """What the engine needs from a model: initial parameters and a functional loss.

    `loss(params, batch)` returns PER-EXAMPLE losses, shape [B]; the engine reduces them with
    a 0/1 mask so padded examples (short final batches under vmap) contribute nothing.
    """

    def init_params(self) -> Params: ...

    def loss(self, params: Params, batch: Batch) -> Tensor: ...


class ModuleTask:
    """A Task over an nn.Module via torch.func.functional_call.

    `loss_fn(outputs, batch)` gives per-example losses; `input_key` names the model input.
    Use LayerNorm/GroupNorm, not BatchNorm: running statistics are buffers mutated in place,
    which vmap over clients cannot carry (see docs/federated.md).
    """

    def __init__(
        self,
        module: nn.Module,
        loss_fn: Callable[[Tensor, Batch], Tensor],
        input_key: str = "x",
    ) -> None:
        self.module = module
        self.loss_fn = loss_fn
        self.input_key = input_key

    def init_params(self) -> Params:
        return {n: p.detach().clone() for n, p in self.module.named_parameters()}

    def loss(self, params: Params, batch: Batch) -> Tensor:
        out = functional_call(self.module, params, (batch[self.input_key],))
        return self.loss_fn(out, batch)

    def lowrank_layers(self) -> tuple[nn.Module, ...] | None:
        """The declared capability of the exact low-rank path (fl.local.lowrank): the layers
        when the module is an nn.Sequential of Linear, 1-D LayerNorm and row-wise activations
        without buffers and `loss` is ModuleTask's own, else None."""
        m = self.module
        eligible = (
            type(self).loss is ModuleTask.loss
            and isinstance(m, nn.Sequential)
            and not list(m.buffers())
            and all(
                isinstance(layer, nn.Linear)
                or (isinstance(layer, nn.LayerNorm) and len(layer.normalized_shape) == 1)
                or type(layer) in ROWWISE
                for layer in m
            )
        )
        return tuple(m) if eligible else None


class LowRankTask(Task, Protocol):
    """A Task that declares the exact low-rank path: `lowrank_layers()` gives layers whose
    composition maps batch[input_key] [B, features] to outputs with
    loss(params, batch) == loss_fn(outputs, batch) (params named "<layer index>.<name>"),
    or None where the model does not qualify (ModuleTask implements it)."""

    input_key: str
    loss_fn: Callable[[Tensor, Batch], Tensor]

    def lowrank_layers(self) -> tuple[nn.Module, ...] | None: ...


@runtime_checkable
class ReconTask(Protocol):
    """A model with global parameters (on the server) and local ones (on the device only).

    - `init_params()`: the GLOBAL parameters only; the server and aggregator know no others.
    - `init_local(client_ids, generator)`: fresh local parameters for those clients, stacked
      along a leading client axis (clients are stateless: called on every participation; the
      engine calls it once per job with a generator derived from (seed, client, trip)).
    - `loss(params, batch)`: PER-EXAMPLE losses [B]; `params` = global ∪ local of ONE client
      (unstacked); must be vmappable (torch.func) for the vectorised path.
    - optional `closed_form_local(global_params, batch, mask) -> local params` of one client
      from all its support examples (`mask` [n] marks real rows; padded rows repeat a real
      one), used when ReconConfig.closed_form is set (e.g. ridge regression, or a speaker
      prototype = mean embedding of the enrollment utterances).
    """

    def init_params(self) -> Params: ...

    def init_local(self, client_ids: Sequence[int], generator: torch.Generator) -> Params: ...

    def loss(self, params: Params, batch: Batch) -> Tensor: ...


def check_recon_task(task: ReconTask, recon: ReconConfig) -> None:
    """Refuse a task that lacks what Federated Reconstruction with `recon` calls."""
    for attr in ("init_params", "init_local", "loss"):
        if not callable(getattr(task, attr, None)):
            raise ConfigError(
                "task", f"{type(task).__name__} has no {attr}()", "implement fl.local.ReconTask"
            )
    if recon.closed_form and not callable(getattr(task, "closed_form_local", None)):
        raise ConfigError(
            "reconstruction.closed_form",
            f"{type(task).__name__} has no closed_form_local()",
            "set closed_form false (and steps >= 1), or implement closed_form_local",
        )
