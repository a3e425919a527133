"""The deployed server: fedvox's Algorithm and aggregation pipeline driven over a push/pull grid.

Runtime-free (fedvox.deploy.flower hands it Flower's Grid). Cohorts come from fl.selection
with the simulator's seed and selection counter, and updates are aggregated in arrival
order, so a deployment whose replies arrive in the simulator's order ends on its weights.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fedvox.deploy.grid import ERROR, QUERY, TRAIN, DeployError, Envelope, Grid
from fedvox.deploy.secagg import SecureRounds
from fedvox.errors import ConfigError, StepSkipped
from fedvox.fl.aggregation import Aggregator, stack
from fedvox.fl.algorithms.base import Algorithm
from fedvox.fl.selection import draw_cohort, draw_one
from fedvox.privacy.secagg import SecAggConfig
from fedvox.types import Params

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """The cohort and patience: C trips at once (sync: a round of ceil(C·(1+o)) invited),
    the selection seed, how often to poll the grid, how long to wait for a reply (a
    synchronous round's deadline), and how many nodes to wait for (up to `wait_nodes_s`)."""

    concurrency: int = 10
    over_selection: float = 0.0
    seed: int = 0
    poll_interval: float = 0.05
    reply_timeout: float | None = None
    max_empty_rounds: int = 10
    min_nodes: int = 0
    wait_nodes_s: float = 120.0


@dataclass
class _Trip:
    client: int
    trip: int
    version: int
    start: Params
    node: int = -1
    sent: float = 0.0  # seconds since the run began
    arrival: int | None = None  # the n-th update to arrive (1-based), once it has
    arrived: float | None = None


def _trip_state(trip: _Trip) -> dict[str, Any]:
    """A trip's bookkeeping without its start params (a checkpoint keeps each version once)."""
    return {f.name: getattr(trip, f.name) for f in dataclasses.fields(trip) if f.name != "start"}


def _clone(params: Params) -> Params:
    return {n: t.detach().clone() for n, t in params.items()}


STATE_FORMAT = "fedvox-deploy-server/1"  # what DeployServer.state_dict writes

# what became of a trip (the simulator's TripRecord statuses)
AGGREGATED, STALE, DROPPED_OUT, CANCELLED = "aggregated", "stale", "dropped_out", "cancelled"


@dataclass
class TripLog:
    """One trip's end, in the order trips ended: who, which version it started from, what
    became of it, and when (seconds since the run began). `arrival` numbers the replies
    that came back with an update, in arrival order (None for a trip that never did)."""

    client: int
    trip: int
    node: int
    version: int
    status: str
    sent: float
    ended: float
    arrival: int | None = None
    server_step: int | None = None
    staleness: int | None = None
    loss: float | None = None
    num_examples: int | None = None
    reason: str = ""


@dataclass
class StepLog:
    """What one server step aggregated: (client, trip) and staleness in arrival order, how
    many updates the aggregator kept, and their mean loss."""

    step: int
    jobs: list[tuple[int, int]]
    staleness: list[int]
    updates: int
    loss: float
    seconds: float = 0.0  # since the run began
    in_flight: int = 0  # trips under way when the step's last update arrived
    agg: dict[str, float] = field(default_factory=dict)  # the aggregator's metrics


@dataclass
class DeployServer:
    """Global parameters, the algorithm (with its server optimiser) and the aggregator; `run`
    drives them over a grid until `steps` server steps are done."""

    params: Params
    algorithm: Algorithm
    aggregator: Aggregator
    config: ServerConfig
    step: int = 0
    history: list[StepLog] = field(default_factory=list)
    on_step: Callable[[StepLog], None] | None = None
    on_trip: Callable[[TripLog], None] | None = None
    secure: SecAggConfig | None = None  # sum updates by secure aggregation over messages
    # what each model version's requests carry beside the params (Federated Reconstruction's
    # public negatives under a reserved key): computed once per version, never aggregated
    broadcast: Callable[[Params], Params] | None = None
    # after each server step, once its buffer is cleared: where `state_dict` can resume
    on_checkpoint: Callable[[DeployServer], None] | None = None

    def __post_init__(self) -> None:
        self.rounds = None if self.secure is None else SecureRounds(self.secure, self._collect)
        self._grid: Grid | None = None
        self.params = {n: t.detach().clone() for n, t in self.params.items()}
        self.trip_log: list[TripLog] = []  # every trip's end, in order: the arrival order
        self.arrivals = 0
        self.t0 = time.monotonic()
        self.selections = 0
        self.trips: dict[int, int] = {}  # trips started per client: keys the client's batches
        self.nodes: dict[int, int] = {}  # federation-wide client id -> node id
        self.num_examples: dict[int, int] = {}  # client -> examples (its node's QUERY reply)
        self._extra: tuple[int, Params] | None = None  # (version, its broadcast)
        self.in_flight: dict[str, _Trip] = {}  # asynchronous: request id -> trip under way
        self.pending: list[tuple[_Trip, Envelope]] = []  # asynchronous: the buffer
        self._restored: list[_Trip] = []  # in flight at the checkpoint resumed from
        self._elapsed = 0.0  # seconds the run had been going at that checkpoint
        self._clients: int | None = None  # clients the checkpointed run had discovered

    def run(self, grid: Grid, steps: int) -> Params:
        """Discover the nodes, then synchronous rounds or asynchronous trips to `steps`
        (from the step `load_state_dict` restored, if it did)."""
        self.t0 = time.monotonic() - self._elapsed
        self._grid = grid
        if self.secure is not None and not self.algorithm.barrier:
            raise ConfigError(
                "secure_aggregation",
                "secure aggregation over messages needs synchronous rounds",
                "use a FedAvg-family algorithm with it",
            )
        if self.step >= steps:  # resumed after the last step: no node is needed
            self._end_trips(self._restored)
            self._restored = []
            return self.params
        self.wait_for_nodes(grid)
        self.discover(grid)
        self.algorithm.validate(self.config.concurrency)
        if self.config.concurrency > len(self.nodes):
            raise ConfigError(
                "concurrency",
                f"C={self.config.concurrency} exceeds the {len(self.nodes)} connected nodes",
            )
        if self._clients is not None and self._clients != len(self.nodes):
            raise DeployError(
                f"the checkpoint's run had {self._clients} clients but {len(self.nodes)} nodes "
                "joined; start one node per shard of the run (as it was started) and resume again"
            )
        for trip in [*self._restored, *(t for t, _ in self.pending)]:
            trip.node = self.nodes[trip.client]  # a fresh SuperLink may number nodes anew
        if self.algorithm.barrier:
            self._run_sync(grid, steps)
        else:
            self._run_async(grid, steps)
        return self.params

    def wait_for_nodes(self, grid: Grid) -> None:
        """Poll until `min_nodes` nodes are connected, or give up after `wait_nodes_s`."""
        want, since = self.config.min_nodes, time.monotonic()
        while len(grid.nodes()) < want:
            if time.monotonic() - since > self.config.wait_nodes_s:
                raise DeployError(
                    f"{len(grid.nodes())} of {want} nodes connected after "
                    f"{self.config.wait_nodes_s:.0f} s"
                )
            time.sleep(max(self.config.poll_interval, 0.2))

    def discover(self, grid: Grid) -> None:
        """Ask every node which client it holds; clients are numbered 0..n-1 as in the
        simulator's population."""
        nodes = grid.nodes()
        ids = grid.push([Envelope(node, QUERY) for node in nodes])
        replies = self._collect(grid, ids, len(ids))
        self.nodes = {int(r.values["client"]): r.node for r in replies if r.kind != ERROR}
        self.num_examples = {
            int(r.values["client"]): int(r.values.get("num_examples", 0))
            for r in replies
            if r.kind != ERROR
        }
        failed = [
            f"node {r.node}: {r.values.get('reason', '')}" for r in replies if r.kind == ERROR
        ]
        if failed and not self.nodes:
            raise DeployError(f"no node could join: {failed[0]}")
        if failed:
            log.warning("%d nodes failed to join: %s", len(failed), "; ".join(failed))
        if sorted(self.nodes) != list(range(len(self.nodes))):
            raise DeployError(f"nodes hold clients {sorted(self.nodes)}, not 0..n-1")

    # -- synchronous: a barrier per round --------------------------------------------

    def _run_sync(self, grid: Grid, steps: int) -> None:
        """Rounds until `steps`: invite a cohort, aggregate the first C updates to arrive."""
        c, n = self.config.concurrency, len(self.nodes)
        m = min(math.ceil(c * (1 + self.config.over_selection)), n)
        empty = 0
        while self.step < steps:
            cohort = draw_cohort(self.config.seed, self.selections, n, m)
            self.selections += 1
            trips = [self._trip(cl) for cl in cohort]
            sent = dict(zip(self._send(grid, trips), trips, strict=True))
            arrived: list[tuple[_Trip, Envelope]] = []
            for reply in self._collect(grid, list(sent), c, count_errors=True):
                trip = self._arrive(sent.pop(reply.reply_to), reply)
                if reply.kind == ERROR:  # a failed trip is a dropout: it resolves, uploads nothing
                    self._log(trip, DROPPED_OUT, reply)
                else:
                    arrived.append((trip, reply))
            for trip, reply in arrived[c:]:  # after the C-th: the simulator's cancelled trips
                self._log(trip, CANCELLED, reply)
            for trip in sent.values():  # unanswered: cancelled once C arrived, else past deadline
                status = CANCELLED if len(arrived) >= c else DROPPED_OUT
                self._log(trip, status, None, "no reply before the deadline")
            if arrived:
                self._server_step(arrived[:c], len(cohort))
                self._checkpoint()
                empty = 0
            else:
                empty += 1
                if empty >= self.config.max_empty_rounds:
                    raise DeployError(f"{empty} rounds in a row with no reply from any node")

    # -- asynchronous: C trips in flight, a server step per K arrivals ----------------

    def _run_async(self, grid: Grid, steps: int) -> None:
        """Keep C trips in flight; each arrival is buffered (or dropped as stale), a server
        step every K, then its slot is refilled from the newest version. Trips in flight at
        the checkpoint resumed from are sent again first (same client, trip and version)."""
        k = self.algorithm.updates_per_step(self.config.concurrency)
        if self._restored:
            self.in_flight.update(
                zip(self._send(grid, self._restored), self._restored, strict=True)
            )
            self._restored = []
        self._fill(grid)
        waited = time.monotonic()
        while self.step < steps:
            if not self.in_flight:
                raise DeployError("no trip in flight and no node to invite")
            replies = grid.pull(list(self.in_flight))
            if not replies:
                self._wait(waited)
                continue
            waited = time.monotonic()
            for reply in replies:
                trip = self._arrive(self.in_flight.pop(reply.reply_to), reply)
                if reply.kind == ERROR:
                    self._log(trip, DROPPED_OUT, reply)
                else:
                    tau = self.step - trip.version
                    max_tau = self.algorithm.max_staleness
                    if max_tau is None or tau <= max_tau:
                        self.pending.append((trip, reply))
                    else:
                        self._log(trip, STALE, reply)
                if len(self.pending) >= k:
                    self._server_step(self.pending, len(self.in_flight) + 1)
                    self.pending = []
                    self._checkpoint()
                if self.step >= steps:  # done: start no trip that nothing would wait for
                    break
                self._fill(grid)
        self._end_trips(list(self.in_flight.values()))

    def _end_trips(self, trips: list[_Trip]) -> None:
        """Log trips still training when the run ended as cancelled."""
        for trip in trips:
            self._log(trip, CANCELLED, None, "the run ended")

    def _fill(self, grid: Grid) -> None:
        """Invite idle clients, one draw each, until C trips are in flight."""
        while len(self.in_flight) < self.config.concurrency:
            busy = {t.client for t in self.in_flight.values()}
            client = draw_one(self.config.seed, self.selections, len(self.nodes), busy)
            self.selections += 1
            if client is None:
                return
            trip = self._trip(client)
            (rid,) = self._send(grid, [trip])
            self.in_flight[rid] = trip

    # -- shared ----------------------------------------------------------------------

    def _trip(self, client: int) -> _Trip:
        """Open the next trip of `client` from the current version (bookkeeping only)."""
        trip = self.trips.get(client, 0)
        self.trips[client] = trip + 1
        return _Trip(client, trip, self.step, self.params, self.nodes[client], self._now())

    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _arrive(self, trip: _Trip, reply: Envelope) -> _Trip:
        """Stamp a trip whose reply was just pulled; an update gets the next arrival number."""
        trip.arrived = self._now()
        if reply.kind != ERROR:
            self.arrivals += 1
            trip.arrival = self.arrivals
        return trip

    def _log(
        self,
        trip: _Trip,
        status: str,
        reply: Envelope | None,
        reason: str = "",
        server_step: int | None = None,
    ) -> None:
        """Record how `trip` ended (staleness against the current server step)."""
        if reply is not None and reply.kind == ERROR:
            reason = str(reply.values.get("reason", reason))
        values = reply.values if reply is not None and reply.kind != ERROR else {}
        log_ = TripLog(
            trip.client,
            trip.trip,
            trip.node,
            trip.version,
            status,
            trip.sent,
            self._now() if trip.arrived is None else trip.arrived,
            trip.arrival,
            server_step,
            None if status in (DROPPED_OUT, CANCELLED) else self.step - trip.version,
            float(values["loss"]) if "loss" in values else None,
            int(values["num_examples"]) if "num_examples" in values else None,
            reason,
        )
        self.trip_log.append(log_)
        if self.on_trip is not None:
            self.on_trip(log_)

    def _send(self, grid: Grid, trips: list[_Trip]) -> list[str]:
        """Push each trip's request to its client's node: the params of the version it starts
        from (with that version's broadcast, if any) and its (client, trip), which key the
        client's batches."""
        secure = {"secure": True} if self.secure is not None else {}
        requests = [
            Envelope(
                t.node,
                TRAIN,
                t.start if self.broadcast is None else {**t.start, **self._version(t)},
                {"client": t.client, "trip": t.trip, "version": t.version, **secure},
                group=str(self.step + 1),
            )
            for t in trips
        ]
        return grid.push(requests)

    def _version(self, trip: _Trip) -> Params:
        """The broadcast of the version `trip` starts from, computed on its first request
        only (a trip re-sent after a resume may start from an older version)."""
        assert self.broadcast is not None
        if self._extra is None or self._extra[0] != trip.version:
            self._extra = (trip.version, self.broadcast(trip.start))
        return self._extra[1]

    def _wait(self, since: float) -> None:
        """Sleep one poll interval, or give up once nothing arrived for `reply_timeout`."""
        timeout = self.config.reply_timeout
        if timeout is not None and time.monotonic() - since > timeout:
            raise DeployError(f"no reply for {timeout} s")
        time.sleep(self.config.poll_interval)

    def _collect(
        self, grid: Grid, ids: list[str], want: int, count_errors: bool = False
    ) -> list[Envelope]:
        """Pull until `want` replies (errors count only toward everything resolving) or all of
        `ids` resolved or the reply timeout; replies in arrival order."""
        waiting, got, ok = set(ids), [], 0
        start = time.monotonic()
        while waiting and ok < want:
            replies = grid.pull(sorted(waiting))
            for reply in replies:
                waiting.discard(reply.reply_to)
                got.append(reply)
                ok += reply.kind != ERROR or not count_errors
                if ok >= want:
                    break
            if not replies:
                timeout = self.config.reply_timeout
                if timeout is not None and time.monotonic() - start > timeout:
                    log.warning(
                        "%d of %d requests unanswered after %s s", len(waiting), len(ids), timeout
                    )
                    break
                time.sleep(self.config.poll_interval)
        return got

    def _server_step(self, arrived: list[tuple[_Trip, Envelope]], in_flight: int = 0) -> None:
        """Stack the updates in arrival order, weight, aggregate, apply (Simulator._flush)."""
        jobs = [(t.client, t.trip) for t, _ in arrived]
        for (_, r), job in zip(arrived, jobs, strict=True):
            if (int(r.values["client"]), int(r.values["trip"])) != job:
                raise DeployError(f"reply for {(r.values['client'], r.values['trip'])}, sent {job}")
        n_ex = torch.tensor([int(r.values["num_examples"]) for _, r in arrived])
        loss = torch.tensor([float(r.values["loss"]) for _, r in arrived])
        staleness = torch.tensor([self.step - t.version for t, _ in arrived], dtype=torch.float64)
        weights = self.algorithm.client_weights(n_ex, staleness)
        try:
            if self.rounds is not None:  # the nodes hold their updates; only a sum comes back
                assert self._grid is not None
                shapes = {n: tuple(t.shape) for n, t in self.params.items()}
                nodes = [t.node for t, _ in arrived]
                group = str(self.step + 1)
                total, weight, count = self.rounds.secure_sum(
                    self._grid, group, nodes, weights, shapes
                )
                kept = torch.ones(len(arrived), dtype=torch.bool)
            else:
                kept = self.aggregator.accumulate(
                    stack([r.arrays for _, r in arrived]), weights, jobs
                )
                total, weight, count = self.aggregator.result()
        except StepSkipped as err:
            self.aggregator.skip_step(err.metrics)
            log.warning("server step %d skipped, model unchanged: %s", self.step + 1, err.reason)
            kept, count, total = torch.isfinite(loss), 0, None
        if total is not None:
            starts = [t.start for t, _ in arrived]
            new = self.algorithm.apply(self.params, total, weight, count, starts, staleness)
            self.params = {n: t.detach() for n, t in new.items()}
        for t, r in arrived:
            self._log(t, AGGREGATED, r, server_step=self.step + 1)
        self.step += 1
        mean_loss = float(loss[kept].mean()) if bool(kept.any()) else math.nan
        taus = [int(t) for t in staleness.tolist()]
        agg = self.aggregator.metrics()
        if self.rounds is not None and total is not None:
            agg.update(self.rounds.last)
        record = StepLog(self.step, jobs, taus, count, mean_loss, self._now(), in_flight, agg)
        self.history.append(record)
        if self.on_step is not None:
            self.on_step(record)

    # -- checkpoints ----------------------------------------------------------------

    def _checkpoint(self) -> None:
        if self.on_checkpoint is not None:
            self.on_checkpoint(self)

    def state_dict(self) -> dict[str, Any]:
        """What a server resumes from (taken at `on_checkpoint`, a step boundary): params,
        algorithm and aggregator state, selection counter, trips per client, arrivals, the
        clock, the trips in flight and the buffer (with the versions they started from)."""
        trips = [*self.in_flight.values(), *(t for t, _ in self.pending)]
        return {
            "format": STATE_FORMAT,
            "step": self.step,
            "params": _clone(self.params),
            "algorithm": self.algorithm.state_dict(),
            "aggregator": self.aggregator.state_dict(),
            "secagg": None if self.rounds is None else self.rounds.sums.state_dict(),
            "selections": self.selections,
            "trips": dict(self.trips),
            "arrivals": self.arrivals,
            "seconds": self._now(),
            "clients": len(self.nodes),
            "versions": {t.version: _clone(t.start) for t in trips},
            "in_flight": [_trip_state(t) for t in self.in_flight.values()],
            "pending": [(_trip_state(t), r) for t, r in self.pending],
            "history": [dataclasses.asdict(h) for h in self.history],
            "trip_log": [dataclasses.asdict(t) for t in self.trip_log],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from `state_dict`: the next `run` discovers the nodes again, re-sends the trips
        that were in flight (same client, trip and start version, so the same update) and
        continues from the stored step; nothing that happened after the checkpoint counts."""
        if state.get("format") != STATE_FORMAT:
            raise DeployError(
                f"checkpoint format {state.get('format')!r}, not {STATE_FORMAT!r}: not a "
                "deployed server's checkpoint"
            )
        self.params = _clone(state["params"])
        self.step = int(state["step"])
        self.algorithm.load_state_dict(state["algorithm"])
        self.aggregator.load_state_dict(state["aggregator"])
        if self.rounds is not None and state["secagg"] is not None:
            self.rounds.sums.load_state_dict(state["secagg"])
        self.selections = int(state["selections"])
        self.trips = {int(c): int(n) for c, n in state["trips"].items()}
        self.arrivals = int(state["arrivals"])
        self._elapsed = float(state["seconds"])
        self._clients = int(state["clients"])
        versions = state["versions"]
        self._restored = [_Trip(**t, start=versions[t["version"]]) for t in state["in_flight"]]
        self.in_flight = {}
        self.pending = [(_Trip(**t, start=versions[t["version"]]), r) for t, r in state["pending"]]
        self.history = [StepLog(**h) for h in state["history"]]
        self.trip_log = [TripLog(**t) for t in state["trip_log"]]
