"""The deployed server: fedvox's Algorithm and aggregation pipeline driven over a push/pull grid.

Runtime-free (fedvox.deploy.flower hands it Flower's Grid). Cohorts come from fl.selection
with the simulator's seed and selection counter, and updates are aggregated in arrival
order, so a deployment whose replies arrive in the simulator's order ends on its weights.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

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

    def run(self, grid: Grid, steps: int) -> Params:
        """Discover the nodes, then synchronous rounds or asynchronous trips to `steps`."""
        self.t0 = time.monotonic()
        self._grid = grid
        if self.secure is not None and not self.algorithm.barrier:
            raise ConfigError(
                "secure_aggregation",
                "secure aggregation over messages needs synchronous rounds",
                "use a FedAvg-family algorithm with it",
            )
        self.wait_for_nodes(grid)
        self.discover(grid)
        self.algorithm.validate(self.config.concurrency)
        if self.config.concurrency > len(self.nodes):
            raise ConfigError(
                "concurrency",
                f"C={self.config.concurrency} exceeds the {len(self.nodes)} connected nodes",
            )
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
            sent = {
                i: self._trip(cl) for i, cl in zip(self._push(grid, cohort), cohort, strict=True)
            }
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
                empty = 0
            else:
                empty += 1
                if empty >= self.config.max_empty_rounds:
                    raise DeployError(f"{empty} rounds in a row with no reply from any node")

    # -- asynchronous: C trips in flight, a server step per K arrivals ----------------

    def _run_async(self, grid: Grid, steps: int) -> None:
        """Keep C trips in flight; each arrival is buffered (or dropped as stale), a server
        step every K, then its slot is refilled from the newest version."""
        k = self.algorithm.updates_per_step(self.config.concurrency)
        in_flight: dict[str, _Trip] = {}
        pending: list[tuple[_Trip, Envelope]] = []
        self._fill(grid, in_flight)
        waited = time.monotonic()
        while self.step < steps:
            if not in_flight:
                raise DeployError("no trip in flight and no node to invite")
            replies = grid.pull(list(in_flight))
            if not replies:
                self._wait(waited)
                continue
            waited = time.monotonic()
            for reply in replies:
                trip = self._arrive(in_flight.pop(reply.reply_to), reply)
                if reply.kind == ERROR:
                    self._log(trip, DROPPED_OUT, reply)
                else:
                    tau = self.step - trip.version
                    max_tau = self.algorithm.max_staleness
                    if max_tau is None or tau <= max_tau:
                        pending.append((trip, reply))
                    else:
                        self._log(trip, STALE, reply)
                if len(pending) >= k:
                    self._server_step(pending, len(in_flight) + 1)
                    pending = []
                if self.step >= steps:  # done: start no trip that nothing would wait for
                    break
                self._fill(grid, in_flight)
        for trip in in_flight.values():  # still training when the run ended
            self._log(trip, CANCELLED, None, "the run ended")

    def _fill(self, grid: Grid, in_flight: dict[str, _Trip]) -> None:
        """Invite idle clients, one draw each, until C trips are in flight."""
        while len(in_flight) < self.config.concurrency:
            busy = {t.client for t in in_flight.values()}
            client = draw_one(self.config.seed, self.selections, len(self.nodes), busy)
            self.selections += 1
            if client is None:
                return
            (rid,) = self._push(grid, [client])
            in_flight[rid] = self._trip(client)

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

    def _push(self, grid: Grid, clients: list[int]) -> list[str]:
        """Send the current global params to each client's node; the trip number the request
        carries is the one `_trip` opens next for that client."""
        arrays = self.params if self.broadcast is None else {**self.params, **self._version()}
        requests = [
            Envelope(
                self.nodes[c],
                TRAIN,
                arrays,
                {
                    "client": c,
                    "trip": self.trips.get(c, 0),
                    "version": self.step,
                    **({"secure": True} if self.secure is not None else {}),
                },
                group=str(self.step + 1),
            )
            for c in clients
        ]
        return grid.push(requests)

    def _version(self) -> Params:
        """The current version's broadcast, computed on its first request only."""
        assert self.broadcast is not None
        if self._extra is None or self._extra[0] != self.step:
            self._extra = (self.step, self.broadcast(self.params))
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
