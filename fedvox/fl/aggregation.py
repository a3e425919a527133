"""Aggregation primitives: broadcast, client delta, weighted sum (a pipeline of stages).

Between the client update (fl/local/) and the server optimiser (fl/server_opt.py).
Algorithms only choose weights and how to turn (sum, total weight) into Δ̄; non-finite
updates are dropped first, then clipping, secure summation, robust combining and DP noise
are stages here, invisible to the algorithms.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from fedvox.types import Params

log = logging.getLogger(__name__)


def broadcast(versions: dict[int, Params], version: int, names: Sequence[str]) -> Params:
    """What the server sends a client: the global parameters of `version` (shared, read-only)."""
    params = versions[version]
    return {n: params[n] for n in names}


def client_delta(start: Params, local: Params) -> Params:
    """Δ = w_start − w_local: gradient-like, so SGD(lr=1) on Δ̄ of one client returns w_local."""
    return {n: start[n] - local[n] for n in start}


def stack(params: Sequence[Params]) -> Params:
    """Stack a list of parameter dicts along a new leading client axis."""
    return {n: torch.stack([p[n] for p in params]) for n in params[0]}


def unstack(stacked: Params, i: int) -> Params:
    return {n: t[i] for n, t in stacked.items()}


def weighted_sum(deltas: Params, weights: Tensor) -> Params:
    """Σ_i w_i Δ_i over the leading client axis of stacked deltas."""
    return {n: torch.tensordot(weights.to(d.dtype), d, dims=1) for n, d in deltas.items()}


FINITE_BLOCK_BYTES = 64 * 2**20  # finite_rows' float64 temporary, at most


def finite_rows(deltas: Params, weights: Tensor) -> Tensor:
    """Which clients sent a wholly finite delta (and weight): a bool per leading row.

    A float64 row sum is non-finite exactly when the row holds a NaN or ±Inf (float32 values
    cannot overflow it), and it needs no per-element temporary as isfinite() would.
    """
    ok = torch.isfinite(weights.to(torch.float64))
    for d in deltas.values():
        flat = d.reshape(d.shape[0], math.prod(d.shape[1:]))  # also for 0 rows
        # in blocks of rows: sum(dtype=float64) casts its whole input first, a temporary of
        # twice the stacked deltas (2.3 GB for a cohort of 1,000 xvector-tiny updates)
        rows = max(1, FINITE_BLOCK_BYTES // max(8 * flat.shape[1], 1))
        for i in range(0, flat.shape[0], rows):
            block = flat[i : i + rows].sum(1, dtype=torch.float64)
            ok[i : i + rows] &= torch.isfinite(block)
    return ok


def select_rows(deltas: Params, weights: Tensor, keep: Tensor) -> tuple[Params, Tensor]:
    """The stacked deltas and weights of the rows where `keep` is True (a copy)."""
    idx = keep.nonzero().flatten()
    return {n: d.index_select(0, idx) for n, d in deltas.items()}, weights.index_select(0, idx)


class SumStage(Protocol):
    """A per-client stage applied to stacked deltas before they are summed (clip, quantise).

    May also define `end_step(count)` (called once per server step, after the sum, e.g. for
    adaptive clipping), `discard_step()` (the step was skipped: forget what it saw),
    `state_dict()` / `load_state_dict()` (saved with the simulator), `upload_bytes(shapes)`
    (what one client sends, when the stage changes it) and `needs_jobs = True` (it is then
    called with a third argument, the (client, trip) of each row: device state, seeds).
    """

    def __call__(self, deltas: Params, weights: Tensor) -> tuple[Params, Tensor]: ...


class Summer(Protocol):
    """Turns stacked deltas and weights into (Σ w_i Δ_i, Σ w_i, number of inputs summed).

    The plain summer is `weighted_sum`; secure aggregation replaces it with a protocol whose
    server only ever sees masked inputs. Fewer inputs than given may survive (dropouts); when
    no sum can be formed it may raise fedvox.errors.StepSkipped (see Aggregator.skip_step).
    """

    def __call__(self, deltas: Params, weights: Tensor) -> tuple[Params, float, int]: ...


class Combiner(Protocol):
    """A summer that needs every update of a server step at once (median, trimmed mean, Krum).

    `add` buffers a batch of stacked deltas (possibly of 0 rows); `combine` returns
    (aggregate × Σw, Σw, count) over what was buffered this step (zeros, 0, 0 if no row was)
    and empties the buffer, so the algorithms' Σ/Σw (or Σ/K) arithmetic is unchanged.
    """

    def add(self, deltas: Params, weights: Tensor) -> None: ...

    def combine(self) -> tuple[Params, float, int]: ...


class NoiseStage(Protocol):
    """A stage on the aggregated sum, before the server optimiser (DP noise, DP-FTRL tree)."""

    def __call__(self, total: Params, weight: float, count: int) -> tuple[Params, float]: ...


def plain_sum(deltas: Params, weights: Tensor) -> tuple[Params, float, int]:
    """The default Summer: the server sees every weighted delta (no secure aggregation)."""
    return weighted_sum(deltas, weights), float(weights.sum()), int(weights.shape[0])


class Aggregator:
    """The aggregation pipeline: drop non-finite → per-client stages → sum → noise stages.

    `names` fixes the parameters it accepts: a delta with any other key (e.g. a parameter
    kept local on the device, Federated Reconstruction) is refused, so a local parameter
    structurally cannot reach the server's sum. A client whose delta or weight holds a NaN
    or Inf is dropped before any stage (as if it had not sent), counted as `nonfinite` in
    the step's metrics and logged: no algorithm can receive it. `summer` may be a Combiner
    (robust rules), which sees the whole step's updates at result().
    """

    def __init__(
        self,
        stages: Sequence[SumStage] = (),
        names: Sequence[str] | None = None,
        summer: Summer | Combiner | None = None,
        noise: Sequence[NoiseStage] = (),
    ) -> None:
        self.stages = list(stages)
        self.names = None if names is None else frozenset(names)
        self.summer: Summer | Combiner = summer if summer is not None else plain_sum
        self.noise = list(noise)
        self._last_nonfinite = 0
        self._last_skip: dict[str, float] = {}
        self.reset()

    def reset(self) -> None:
        self.total: Params | None = None
        self.weight = 0.0
        self.count = 0
        self.nonfinite = 0  # clients dropped for a non-finite update this step
        self.accumulated = False

    @property
    def combines(self) -> bool:
        """Whether the summer is a Combiner (needs the whole step's updates at once)."""
        return hasattr(self.summer, "combine")

    def _stages(
        self, deltas: Params, weights: Tensor, jobs: Sequence[tuple[int, int]] | None
    ) -> tuple[Params, Tensor]:
        for stage in self.stages:
            if getattr(stage, "needs_jobs", False):
                if jobs is None:
                    raise ValueError(f"{type(stage).__name__} needs the (client, trip) of each row")
                deltas, weights = stage(deltas, weights, jobs)  # type: ignore[call-arg]
            else:
                deltas, weights = stage(deltas, weights)
        return deltas, weights

    def accumulate(
        self, deltas: Params, weights: Tensor, jobs: Sequence[tuple[int, int]] | None = None
    ) -> Tensor:
        """Add a batch of client deltas (stacked, leading axis = client) with their weights
        and, for stages that keep device state, the (client, trip) of each row; returns
        which rows were kept (False: dropped for a non-finite delta or weight)."""
        if self.names is not None and set(deltas) != self.names:
            extra = sorted(set(deltas) - self.names)
            missing = sorted(self.names - set(deltas))
            raise ValueError(
                f"aggregator refuses this update: unexpected parameters {extra}, "
                f"missing {missing} (only global parameters may be aggregated)"
            )
        self.accumulated = True
        keep = finite_rows(deltas, weights)
        if not bool(keep.all()):
            dropped = int((~keep).sum())
            self.nonfinite += dropped
            log.warning("aggregator dropped %d client update(s) holding NaN or Inf", dropped)
            if self.total is None:  # what the step sums to if nobody is left
                self.total = {n: d.new_zeros(d.shape[1:]) for n, d in deltas.items()}
            deltas, weights = select_rows(deltas, weights, keep)
            if jobs is not None:
                jobs = [j for j, k in zip(jobs, keep.tolist(), strict=True) if k]
        if self.combines:
            if weights.numel():
                deltas, weights = self._stages(deltas, weights, jobs)
            self.summer.add(deltas, weights)  # type: ignore[union-attr]
            return keep
        if not weights.numel():  # nothing left to sum (a secure sum of 0 inputs would abort)
            return keep
        deltas, weights = self._stages(deltas, weights, jobs)
        part, weight, count = self.summer(deltas, weights)  # type: ignore[operator]
        if self.total is None:
            self.total = part
        else:
            self.total = {n: self.total[n] + part[n] for n in part}
        self.weight += weight
        self.count += count
        return keep

    def result(self) -> tuple[Params, float, int]:
        """(Σ w_i Δ_i + noise, Σ w_i, number of updates); resets for the next server step.

        With a Combiner the sum is (robust aggregate) × Σ w_i. A step whose every update
        was dropped sums to zeros with weight 0 (the algorithms then leave the model as is).
        """
        if not self.accumulated:
            raise RuntimeError("aggregator is empty")
        if self.combines:
            self.total, self.weight, self.count = self.summer.combine()  # type: ignore[union-attr]
        if self.total is None:
            raise RuntimeError("aggregator is empty")
        total, weight, count = self.total, self.weight, self.count
        self._last_nonfinite = self.nonfinite
        self._last_skip = {}
        for stage in self.noise:
            total, weight = stage(total, weight, count)
        for stage in [*self.stages, self.summer, *self.noise]:
            end = getattr(stage, "end_step", None)
            if end is not None:
                end(count)
        self.reset()
        return total, weight, count

    def skip_step(self, metrics: dict[str, float] | None = None) -> None:
        """Drop the step whose sum could not be formed (the summer raised StepSkipped): no
        noise is drawn, stages forget what they saw, and `metrics` join the step's metrics."""
        self._last_nonfinite = self.nonfinite
        self._last_skip = dict(metrics or {})
        for stage in [*self.stages, self.summer, *self.noise]:
            discard = getattr(stage, "discard_step", None)
            if discard is not None:
                discard()
        self.reset()

    def upload_bytes(self, shapes: dict[str, tuple[int, ...]]) -> int:
        """Bytes one client uploads per trip: float32 values, unless a stage compresses them
        (its size) or the summer sends its own encoding (secure aggregation's masked input)."""
        size = 4 * sum(math.prod(s) for s in shapes.values())
        for stage in [*self.stages, self.summer]:
            sized = getattr(stage, "upload_bytes", None)
            if sized is not None:
                size = int(sized(shapes))
        return size

    def metrics(self) -> dict[str, float]:
        """What the stages report about the last server step (e.g. clip_norm,
        fraction_clipped); a server-step record stores them as agg_<name>."""
        out: dict[str, float] = {"nonfinite": float(self._last_nonfinite)}
        for stage in [*self.stages, self.summer, *self.noise]:
            last = getattr(stage, "last_metrics", None)
            if last is not None:
                out.update(last())
        out.update(self._last_skip)
        return out

    def _stateful(self) -> list[Any]:
        return [s for s in [*self.stages, self.summer, *self.noise] if hasattr(s, "state_dict")]

    def state_dict(self) -> dict[str, Any]:
        total = None if self.total is None else {n: t.clone() for n, t in self.total.items()}
        stages = [s.state_dict() for s in self._stateful()]
        return {
            "total": total,
            "weight": self.weight,
            "count": self.count,
            "nonfinite": self.nonfinite,
            "accumulated": self.accumulated,
            "stages": stages,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        total = state["total"]
        self.total = None if total is None else {n: t.clone() for n, t in total.items()}
        self.weight = float(state["weight"])
        self.count = int(state["count"])
        self.nonfinite = int(state.get("nonfinite", 0))
        self.accumulated = bool(state.get("accumulated", total is not None))
        for stage, st in zip(self._stateful(), state.get("stages", []), strict=False):
            stage.load_state_dict(st)
