"""The federated simulator: one event loop on a virtual clock drives every algorithm.

Sits between the population/task (data and model) and the run folder the lead wires up:
client trips are events; synchronous FL is the same loop with a barrier per round.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedvox.errors import ConfigError, StepSkipped
from fedvox.fl.aggregation import Aggregator, Combiner, NoiseStage, Summer, SumStage
from fedvox.fl.algorithms.base import Algorithm
from fedvox.fl.clock import Availability, DelayModel, EventQueue
from fedvox.fl.local import ClientConfig, ClientResults, Task, train_clients
from fedvox.fl.population import Population
from fedvox.fl.selection import draw_cohort, draw_one
from fedvox.records import EpochRecord, ServerStepRecord, TripRecord
from fedvox.rng import Purpose, derived_rng
from fedvox.types import Params

# what the simulator hands its callback, in the order things happen
SimRecord = TripRecord | ServerStepRecord | EpochRecord
# (task, population, jobs [(client, trip)], starting params per job, client config) -> results
ClientUpdate = Callable[
    [Task, Population, list[tuple[int, int]], list[Params], ClientConfig], ClientResults
]


def plain_client_update(
    task: Task,
    population: Population,
    jobs: list[tuple[int, int]],
    starts: list[Params],
    cfg: ClientConfig,
) -> ClientResults:
    """The default client update: local SGD on every parameter the server sends."""
    return train_clients(task, population, jobs, starts, cfg)


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SimulatorConfig:
    """The clock and cohort: C concurrent trips, over-selection (sync), dropouts, availability.

    Randomness for selection, delays and dropouts derives from (seed, purpose, ids); client
    batches derive from the population's own seed.
    """

    concurrency: int = 10
    delay: DelayModel = field(default_factory=DelayModel)
    over_selection: float = 0.0
    dropout: float = 0.0
    availability: Availability | None = None
    retry_interval: float = 1.0
    seed: int = 0
    # DP-FTRL needs each client at most once per tree: with once_per_epoch a client that has
    # started a trip is not selected again until every client has (an epoch); then a new epoch
    # begins, noise stages with restart() restart their tree, and clients still in flight or
    # buffered count as used in the new epoch (their update lands in the new tree).
    once_per_epoch: bool = False


class Simulator:
    """Discrete-event federated training: `run()` until a stop condition, `params` at the end.

    Trips start at a virtual time with the current model version and complete after a sampled
    delay; training runs lazily, batched over the clients a server step aggregates.
    """

    def __init__(
        self,
        task: Task,
        population: Population,
        algorithm: Algorithm,
        client: ClientConfig,
        config: SimulatorConfig,
        callback: Callable[[SimRecord], None] | None = None,
        stages: list[SumStage] | None = None,
        client_update: ClientUpdate | None = None,
        summer: Summer | Combiner | None = None,
        noise: list[NoiseStage] | None = None,
        extra_bytes_down: int = 0,
        broadcast: Callable[[Params], Params] | None = None,
        broadcast_every: int = 1,
    ) -> None:
        _validate(population, algorithm, config)
        if broadcast_every < 1:
            raise ConfigError(
                "broadcast_every", f"must be >= 1, got {broadcast_every}", "use 1 (every version)"
            )
        self.task = task
        self.population = population
        self.algorithm = algorithm
        self.client = client
        self.config = config
        self.callback = callback
        self.client_update = client_update or plain_client_update
        # What a version's requests carry beside its params (e.g. public negatives), computed
        # by the server when a trip first starts from the version, and recomputed only once
        # `broadcast_every` versions have passed since the last one: the versions in between
        # carry that one (a server that refreshes a costly broadcast periodically).
        self.broadcast = broadcast
        self.broadcast_every = broadcast_every
        self._broadcasts: dict[int, Params] = {}  # refresh version -> what it computed
        self._broadcast_of: dict[int, int] = {}  # live version -> its refresh version
        self._refreshed: int | None = None  # the last refresh version
        # The server holds only global parameters: a task with local (on-device) parameters
        # returns just the global ones from init_params, and the aggregator accepts no others.
        params = {n: t.detach().clone() for n, t in task.init_params().items()}
        self.global_names: list[str] = list(params)
        self.aggregator = Aggregator(stages or [], self.global_names, summer, noise or [])
        self.bytes_per_trip = 4 * sum(params[n].numel() for n in self.global_names)
        # what an upload carries: float32 values, or the compressed / masked encoding
        shapes = {n: tuple(params[n].shape) for n in self.global_names}
        self.bytes_up_per_trip = self.aggregator.upload_bytes(shapes)
        # what a download carries besides the global parameters (e.g. public negatives)
        self.bytes_down_per_trip = self.bytes_per_trip + int(extra_bytes_down)
        self.examples = population.examples()
        self.mean_examples = float(self.examples.mean())
        self.k = algorithm.updates_per_step(config.concurrency)
        self.events = EventQueue()
        self.time = 0.0
        self.server_step = 0
        self.versions: dict[int, Params] = {0: params}
        self.refs: dict[int, int] = {0: 1}  # the server's own reference to its current version
        self.in_flight: dict[int, dict[str, Any]] = {}
        self.pending: list[dict[str, Any]] = []
        self.client_trips: dict[int, int] = {}  # trips started per client (touched ones only)
        self.counters = {
            "trips_started": 0,
            "trips_completed": 0,
            "selections": 0,
            "bytes_down": 0,
            "bytes_up": 0,
            "dropped_out": 0,
            "stale": 0,
            "cancelled": 0,
            "skipped_steps": 0,  # server steps whose sum could not be formed (model unchanged)
        }
        self.round = {"id": 0, "outstanding": 0}
        self.retry_pending = False
        self.started = False
        self.epoch = 0
        self.used: set[int] = set()  # clients that started a trip this epoch (once_per_epoch)

    # -- public -------------------------------------------------------------------------

    @property
    def params(self) -> Params:
        return self.versions[self.server_step]

    def run(
        self,
        max_server_steps: int | None = None,
        max_trips: int | None = None,
        max_time: float | None = None,
        max_events: int | None = None,
    ) -> Params:
        """Process events until a limit is reached (or nothing is left); returns the params."""
        events = 0
        while not self._done(max_server_steps, max_trips):
            if max_events is not None and events >= max_events:
                break
            if max_time is not None and self.events and self.events.heap[0][0] > max_time:
                break
            if not self.step():
                break
            events += 1
        return self.params

    def step(self) -> bool:
        """Process one event (starting the clock first if needed); False when none is left."""
        if not self.started:
            self.started = True
            if self.algorithm.barrier:
                self._start_round(0.0)
            else:
                self._fill(0.0)
            return True
        if not self.events:
            return False
        time, _, kind, payload = self.events.pop()
        self.time = time
        if kind == "retry":
            self.retry_pending = False
            if self.algorithm.barrier:
                self._start_round(time)
            else:
                self._fill(time)
        else:
            self._complete(time, payload)
        return True

    # -- starting trips -----------------------------------------------------------------

    def _eligible(self, c: int, time: float) -> bool:
        avail = self.config.availability
        if self.config.once_per_epoch and c in self.used:
            return False
        return c not in self._busy and (avail is None or avail(c, time))

    def _blocked(self) -> set[int]:
        """Clients that cannot start a trip now: in flight, or used this epoch."""
        busy = self._busy
        return busy | self.used if self.config.once_per_epoch else busy

    def _new_epoch(self, time: float) -> None:
        """Every client has had its turn: restart noise trees; in-flight/buffered count as used."""
        self.epoch += 1
        self.used = self._busy | {it["client"] for it in self.pending}
        for stage in self.aggregator.noise:
            restart = getattr(stage, "restart", None)
            if restart is not None:
                restart()
        self._emit(EpochRecord(epoch=self.epoch, step=self.server_step, virtual_time_s=time))

    @property
    def _busy(self) -> set[int]:
        return {t["client"] for t in self.in_flight.values()}

    def _select_one(self, time: float) -> int | None:
        selection = self.counters["selections"]
        self.counters["selections"] += 1
        n = self.population.num_clients
        if self.config.once_per_epoch and len(self._blocked()) >= n:
            if len(self._busy) + len(self.pending) >= n:
                return None  # nobody free even in a new epoch: wait for trips to end
            self._new_epoch(time)
        avail = self.config.availability
        return draw_one(
            self.config.seed,
            selection,
            n,
            self._blocked(),
            None if avail is None else lambda c: avail(c, time),
        )

    def _select_cohort(self, time: float, m: int) -> list[int]:
        selection = self.counters["selections"]
        self.counters["selections"] += 1
        n = self.population.num_clients
        if self.config.once_per_epoch and n - len(self._blocked()) < m:
            self._new_epoch(time)  # too few unused clients left for a whole cohort
        if self.config.availability is None and not self.in_flight and not self.used:
            return draw_cohort(self.config.seed, selection, n, m)
        eligible = np.array([c for c in range(n) if self._eligible(c, time)], dtype=np.int64)
        return draw_cohort(self.config.seed, selection, n, m, eligible)

    def _launch(self, client: int, time: float) -> None:
        trip_id = self.counters["trips_started"]
        self.counters["trips_started"] += 1
        # the client's own trip number keys its randomness: independent of other clients
        trip = self.client_trips.get(client, 0)
        self.client_trips[client] = trip + 1
        if self.config.once_per_epoch:
            self.used.add(client)
        rng = derived_rng(self.config.seed, Purpose.DELAY, client, trip)
        duration = self.config.delay.sample(
            client, int(self.examples[client]), self.mean_examples, rng
        )
        dropped = False
        if self.config.dropout > 0:
            drng = derived_rng(self.config.seed, Purpose.DROPOUT, client, trip)
            dropped = bool(drng.random() < self.config.dropout)
        version = self.server_step
        self.refs[version] = self.refs.get(version, 0) + 1
        if self.broadcast is not None:
            self._attach_broadcast(version)
        self.counters["bytes_down"] += self.bytes_down_per_trip
        self.in_flight[trip_id] = {
            "client": client,
            "trip": trip,
            "trip_id": trip_id,
            "version": version,
            "start": time,
            "dropped": dropped,
            "round": self.round["id"],
        }
        # A dropped trip never uploads; the server frees its slot when it would have ended.
        self.events.push(time + duration, "complete", trip_id)

    def _retry_later(self, time: float) -> None:
        if not self.retry_pending:
            self.retry_pending = True
            self.events.push(time + self.config.retry_interval, "retry", None)

    def _fill(self, time: float) -> None:
        while len(self.in_flight) < self.config.concurrency:
            c = self._select_one(time)
            if c is None:
                self._retry_later(time)
                return
            self._launch(c, time)

    def _start_round(self, time: float) -> None:
        c = self.config.concurrency
        m = min(math.ceil(c * (1 + self.config.over_selection)), self.population.num_clients)
        cohort = self._select_cohort(time, m)
        if not cohort:
            self._retry_later(time)
            return
        self.round["id"] += 1
        self.round["outstanding"] = len(cohort)
        for client in cohort:
            self._launch(client, time)

    # -- completing trips ---------------------------------------------------------------

    def _release(self, version: int) -> None:
        self.refs[version] -= 1
        if self.refs[version] == 0:
            del self.refs[version]
            del self.versions[version]
            r = self._broadcast_of.pop(version, None)
            if r is not None and r != self._refreshed and r not in self._broadcast_of.values():
                del self._broadcasts[r]

    def _attach_broadcast(self, version: int) -> None:
        """Give `version` its broadcast: a fresh one once `broadcast_every` versions have
        passed since the last, else the last one."""
        if version in self._broadcast_of:
            return
        assert self.broadcast is not None
        r = self._refreshed
        if r is None or version < r or version - r >= self.broadcast_every:
            self._broadcasts[version] = {
                n: t.detach() for n, t in self.broadcast(self.versions[version]).items()
            }
            if r is None or version > r:
                if r is not None and r not in self._broadcast_of.values():
                    del self._broadcasts[r]
                self._refreshed = version
            r = version
        self._broadcast_of[version] = r

    def _sent(self, items: list[dict[str, Any]], starts: list[Params]) -> list[Params]:
        """What each trip received: its version's params with the version's broadcast (one
        dict per version, so clients of one version share it)."""
        if self.broadcast is None:
            return starts
        merged: dict[int, Params] = {}
        for it in items:
            v = it["version"]
            if v not in merged:
                self._attach_broadcast(v)  # a checkpoint from before broadcasts were kept
                merged[v] = {**self.versions[v], **self._broadcasts[self._broadcast_of[v]]}
        return [merged[it["version"]] for it in items]

    def _trip_record(self, trip: dict[str, Any], time: float, status: str, **kw: Any) -> TripRecord:
        return TripRecord(
            time=time,
            client=trip["client"],
            trip=trip["trip"],
            trip_id=trip["trip_id"],
            start_time=trip["start"],
            start_version=trip["version"],
            status=status,
            bytes_down=self.bytes_down_per_trip,
            bytes_up=self.bytes_up_per_trip if status in ("aggregated", "stale") else 0,
            **kw,
        )

    def _emit(self, record: SimRecord) -> None:
        if self.callback is not None:
            self.callback(record)

    def _complete(self, time: float, trip_id: int) -> None:
        trip = self.in_flight.pop(trip_id, None)
        if trip is None:  # cancelled by the end of its round (over-selection)
            return
        barrier = self.algorithm.barrier
        if barrier:
            self.round["outstanding"] -= 1
        if trip["dropped"]:
            self.counters["dropped_out"] += 1
            self._release(trip["version"])
            self._emit(self._trip_record(trip, time, "dropped_out"))
        else:
            self.counters["trips_completed"] += 1
            self.counters["bytes_up"] += self.bytes_up_per_trip
            tau = self.server_step - trip["version"]
            max_tau = self.algorithm.max_staleness
            if max_tau is not None and tau > max_tau:
                self.counters["stale"] += 1
                self._release(trip["version"])
                self._emit(self._trip_record(trip, time, "stale", staleness=tau))
            else:
                self.pending.append({**trip, "arrival": time, "staleness": tau})
        if barrier:
            if len(self.pending) >= self.k or self.round["outstanding"] == 0:
                self._end_round(time)
        else:
            if len(self.pending) >= self.k:
                self._flush(time)
            self._fill(time)

    def _end_round(self, time: float) -> None:
        if self.pending:
            self._flush(time)
        for trip_id in sorted(self.in_flight):
            trip = self.in_flight.pop(trip_id)
            self.counters["cancelled"] += 1
            self._release(trip["version"])
            self._emit(self._trip_record(trip, time, "cancelled"))
        self.round["outstanding"] = 0
        self._start_round(time)

    def _flush(self, time: float) -> None:
        """One server step: train the pending clients together, sum, apply."""
        items, self.pending = self.pending, []
        jobs = [(it["client"], it["trip"]) for it in items]
        starts = [self.versions[it["version"]] for it in items]
        sent = self._sent(items, starts)
        results = self.client_update(self.task, self.population, jobs, sent, self.client)
        staleness = torch.tensor([it["staleness"] for it in items], dtype=torch.float64)
        weights = self.algorithm.client_weights(results.num_examples, staleness)
        try:
            kept = self.aggregator.accumulate(results.delta, weights, jobs)
            total, weight, count = self.aggregator.result()
            skipped = None
        except StepSkipped as err:  # e.g. secure aggregation aborted below its threshold
            self.aggregator.skip_step(err.metrics)
            self.counters["skipped_steps"] += 1
            log.warning(
                "server step %d skipped, model unchanged: %s", self.server_step + 1, err.reason
            )
            kept, count, skipped = torch.isfinite(results.loss), 0, err
        # the step's loss is over the updates it kept (a dropped, diverged client's is NaN)
        loss = results.loss if bool(kept.all()) else results.loss[kept]
        # achieved concurrency: trips under way when this step's last update arrived (a
        # synchronous round's cohort; for async, the in-flight ones plus the arrival itself)
        if self.algorithm.barrier:
            concurrency = len(items) + len(self.in_flight)
        else:
            concurrency = len(self.in_flight) + 1
        if skipped is None:
            new = self.algorithm.apply(self.params, total, weight, count, starts, staleness)
            new = {n: t.detach() for n, t in new.items()}
        else:
            new = dict(self.params)  # the same tensors: nothing was applied
        old = self.server_step
        self.server_step += 1
        self.versions[self.server_step] = new
        self.refs[self.server_step] = 1
        for it in items:
            self._release(it["version"])
        self._release(old)
        for i, it in enumerate(items):
            self._emit(
                self._trip_record(
                    it,
                    it["arrival"],
                    "aggregated",
                    staleness=it["staleness"],
                    loss=float(results.loss[i]),
                    num_examples=int(results.num_examples[i]),
                    server_step=self.server_step,
                )
            )
        c = self.counters
        self._emit(
            ServerStepRecord(
                step=self.server_step,
                virtual_time_s=time,
                trips=c["trips_completed"],
                updates=count,
                loss=float(loss.mean()),
                staleness=tuple(it["staleness"] for it in items),
                concurrency=concurrency,
                bytes_down=c["bytes_down"],
                bytes_up=c["bytes_up"],
                dropped_out=c["dropped_out"],
                stale=c["stale"],
                cancelled=c["cancelled"],
                agg=self.aggregator.metrics(),
                malicious=None if results.malicious is None else int(results.malicious.sum()),
            )
        )

    def _done(self, max_server_steps: int | None, max_trips: int | None) -> bool:
        if max_server_steps is not None and self.server_step >= max_server_steps:
            return True
        return max_trips is not None and self.counters["trips_completed"] >= max_trips

    # -- snapshot -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-identically: params of every referenced version,
        optimiser state, event heap, in-flight and buffered trips, counters. RNG streams are
        derived from counters, so no generator state is stored."""
        return {
            "time": self.time,
            "server_step": self.server_step,
            "versions": {v: {n: t.clone() for n, t in p.items()} for v, p in self.versions.items()},
            "refs": dict(self.refs),
            "in_flight": copy.deepcopy(self.in_flight),
            "pending": copy.deepcopy(self.pending),
            "counters": dict(self.counters),
            "client_trips": dict(self.client_trips),
            "round": dict(self.round),
            "retry_pending": self.retry_pending,
            "started": self.started,
            "epoch": self.epoch,
            "used": sorted(self.used),
            "events": copy.deepcopy(self.events.state_dict()),
            "algorithm": self.algorithm.state_dict(),
            "aggregator": self.aggregator.state_dict(),
            "broadcasts": {
                r: {n: t.clone() for n, t in b.items()} for r, b in self._broadcasts.items()
            },
            "broadcast_of": dict(self._broadcast_of),
            "refreshed": self._refreshed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.time = float(state["time"])
        self.server_step = int(state["server_step"])
        self.versions = {
            int(v): {n: t.clone() for n, t in p.items()} for v, p in state["versions"].items()
        }
        self.refs = {int(v): int(r) for v, r in state["refs"].items()}
        self.in_flight = {int(k): dict(v) for k, v in copy.deepcopy(state["in_flight"]).items()}
        self.pending = copy.deepcopy(state["pending"])
        self.counters = {"skipped_steps": 0, **state["counters"]}
        self.client_trips = {int(c): int(n) for c, n in state["client_trips"].items()}
        self.round = dict(state["round"])
        self.retry_pending = bool(state["retry_pending"])
        self.started = bool(state["started"])
        self.epoch = int(state.get("epoch", 0))
        self.used = {int(c) for c in state.get("used", [])}
        self.events.load_state_dict(copy.deepcopy(state["events"]))
        self.algorithm.load_state_dict(state["algorithm"])
        self.aggregator.load_state_dict(state["aggregator"])
        self._broadcasts = {
            int(r): {n: t.clone() for n, t in b.items()}
            for r, b in state.get("broadcasts", {}).items()
        }
        self._broadcast_of = {int(v): int(r) for v, r in state.get("broadcast_of", {}).items()}
        refreshed = state.get("refreshed")
        self._refreshed = None if refreshed is None else int(refreshed)


def _validate(population: Population, algorithm: Algorithm, config: SimulatorConfig) -> None:
    """Refuse impossible settings before anything runs, naming the field."""
    n = population.num_clients
    c = config.concurrency
    if c < 1:
        raise ConfigError("concurrency", f"must be >= 1, got {c}", "use e.g. 10")
    if c > n:
        raise ConfigError(
            "concurrency", f"C={c} exceeds the population of {n} clients", f"use C <= {n}"
        )
    if config.over_selection < 0:
        raise ConfigError("over_selection", f"must be >= 0, got {config.over_selection}")
    if not 0 <= config.dropout < 1:
        raise ConfigError("dropout", f"must be in [0, 1), got {config.dropout}", "use e.g. 0.1")
    if not config.retry_interval > 0:
        raise ConfigError("retry_interval", f"must be > 0, got {config.retry_interval}")
    if not isinstance(algorithm, Algorithm):
        raise ConfigError("algorithm", f"not an algorithm: {algorithm!r}", "use make_algorithm")
    algorithm.validate(c)
