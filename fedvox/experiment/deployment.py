"""A fedvox experiment as a real federation on Flower's runtime: nodes, server side, local launch.

Orchestration above fedvox.deploy: a run folder as `fedvox train` writes it, a shard of the
prepared data per node, the server's loop (run by Flower's ServerApp in its own process) and
`fedvox deploy local`, which starts a SuperLink and SuperNodes and stops them by PID.
"""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import subprocess
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from fedvox.atomic import atomic_write_text, sha256_file
from fedvox.deploy import ClientNode, DeployError, DeployServer, Envelope, Grid, ServerConfig
from fedvox.deploy import flower_commands as fc
from fedvox.deploy.keys import KeyLayout, write_keys
from fedvox.deploy.processes import Processes, free_port, wait_for_port
from fedvox.deploy.secagg import SecAggNode
from fedvox.deploy.server import StepLog, TripLog
from fedvox.deploy.shard import load_shard, node_shard, save_shard, shard_population
from fedvox.errors import ConfigError, DataError, FedvoxError
from fedvox.experiment import node_data as nd
from fedvox.experiment.config import ExperimentConfig, config_from_dict
from fedvox.experiment.node_data import check_own_data, own_data_key
from fedvox.experiment.runfolder import RunFolder, count_lines, truncate_lines
from fedvox.fl.population import Population
from fedvox.fl.simulator import ClientUpdate, plain_client_update
from fedvox.models.heads import margin_schedule
from fedvox.privacy.secagg import SecAggConfig
from fedvox.records import EvalRecord, ServerStepRecord, TripRecord, append_run_log
from fedvox.tasks.speakers import SpeakerReconTask, received_broadcast_update
from fedvox.types import Params

STATUS_FILE = "deploy-status.json"  # written by the server process when the run ends
ARRIVALS_FILE = "arrivals.jsonl"  # every trip's end as the deployed server saw it
DEPLOY_DIR = "deploy"  # keys, Flower's homes, the app folder, node shards and process logs


# -- what can be deployed ---------------------------------------------------------------


def check_deployable(cfg: ExperimentConfig) -> None:
    """Refuse, naming the field, what a deployed run cannot do yet (it would silently differ
    from the simulator or need protocol rounds that are not messages yet)."""
    f = cfg.federated
    if f is None:
        raise ConfigError("federated", "a deployed run needs a [federated] table", "add one")
    refusals = {
        "federated.privacy.secure_aggregation": (
            f.privacy.secure_aggregation
            and (f.algorithm != "fedavg" or f.privacy.mechanism != "none"),
            "secure aggregation over messages runs with synchronous FedAvg and without DP "
            '(clipping on the device is not done yet); use algorithm = "fedavg", mechanism = "none"',
        ),
        "federated.privacy.secagg_consistency_check": (
            f.privacy.secure_aggregation and f.privacy.secagg_consistency_check,
            "the signed protocol is not wired over messages yet; set it to false",
        ),
        "federated.privacy.mechanism": (
            f.privacy.mechanism == "dp_ftrl",
            'DP-FTRL needs once-per-epoch selection, which the deployed server lacks; use "gaussian" or "none"',
        ),
        "federated.attack.fraction": (f.attack.fraction > 0, "attacks are simulated only; set 0"),
        "federated.compression.kind": (
            f.compression.kind != "none",
            'compression would run on the server, not the devices; set "none"',
        ),
        "federated.reconstruction.broadcast_every": (
            f.reconstruction.broadcast_every != 1,
            "the deployed server computes every version's broadcast; set 1",
        ),
        "federated.reconstruction.panel": (
            f.reconstruction.panel != "training",
            'a held-out panel is simulated only; set "training"',
        ),
    }
    for field, (bad, fix) in refusals.items():
        if bad:
            raise ConfigError(field, "not supported by a deployed run yet", fix)


def margin_at(cfg: ExperimentConfig, version: int) -> float:
    """The AAM margin clients train with from server step `version`: as in run_federated, the
    schedule's value at the last evaluation or checkpoint boundary."""
    f = cfg.federated
    assert f is not None
    start = max(
        version // f.eval_every * f.eval_every,
        version // f.checkpoint_every * f.checkpoint_every,
    )
    return margin_schedule(start / f.server_steps, cfg.model.margin, *cfg.model.margin_ramp)


def _set_margin(task: nn.Module, margin: float) -> None:
    from fedvox.experiment.federated import _set_margin as set_margin

    set_margin(task, margin)


# -- the node side ----------------------------------------------------------------------


@dataclass
class SpeakerNode(ClientNode):
    """A node of a speaker run: sets the margin schedule's value for the request's version
    before training, as the simulator does between its chunks of steps."""

    cfg: ExperimentConfig | None = None

    def handle(self, request: Envelope) -> Envelope:
        """Answer one request (ClientNode.handle) with the run's margin set first."""
        if self.cfg is not None and "version" in request.values:
            _set_margin(self.task, margin_at(self.cfg, int(request.values["version"])))
        return super().handle(request)


CONFIG_KEY = "fedvox-config"  # run-config key: the run's resolved config.toml, as text
PARTITION_KEY = "partition-sha256"  # run-config key: which partition the shards must be of
NODE_DATA_KEY = "node-data"  # run-config key: "shards" (prepared here) or "own" (on nodes)
OWN_DATA = "own"


def load_node(node_config: dict[str, Any], run_config: dict[str, Any]) -> SpeakerNode:
    """A node from its node config (`shard`: the path of its shard; or its own data,
    `kaldi-dir`/`voxceleb-dir` and `client`) and the run's config (the experiment config
    travels with the run, so one SuperNode serves run after run)."""
    own = own_data_key(node_config)
    if own is None and "shard" not in node_config:
        raise ConfigError(
            "node-config.shard",
            "missing: the node config names no data",
            "start the SuperNode with --node-config 'shard=\"/path/to/node-i.pt\"' (a shard "
            "of `fedvox deploy prepare`) or 'kaldi-dir=\"/path/to/data\" client=i' (its own)",
        )
    if CONFIG_KEY not in run_config:
        raise ConfigError(f"run-config.{CONFIG_KEY}", "missing", "submit the run's app folder")
    try:
        cfg = config_from_dict(tomllib.loads(str(run_config[CONFIG_KEY])), "the run's config")
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"run-config.{CONFIG_KEY}", f"not TOML ({err})", "resubmit") from None
    check_deployable(cfg)
    if own is not None:
        return _own_data_node(cfg, own, node_config, run_config)
    path = Path(str(node_config["shard"]))
    shard = load_shard(path)
    meta = shard["meta"]
    if meta.get("partition") != run_config.get(PARTITION_KEY):
        raise DeployError(
            f"{path} holds a shard of another partition than this run's; give the node the "
            "shard `fedvox deploy prepare` wrote for this run (same data, partition and seed)"
        )
    population = shard_population(shard)
    max_local = meta.get("max_local")
    task, update = _node_task(cfg, int(meta["feat_dim"]), int(meta["n_speakers"]), max_local)
    return _speaker_node(cfg, task, population, int(shard["client"]), update)


def _own_data_node(
    cfg: ExperimentConfig, key: str, node_config: dict[str, Any], run_config: dict[str, Any]
) -> SpeakerNode:
    """A node on its own Kaldi dir or VoxCeleb folder: features extracted here with the run's
    settings, its speakers local (Federated Reconstruction)."""
    check_own_data(cfg)
    want = run_config.get(nd.FEATURES_KEY)
    if want is not None and want != nd.features_sha256(cfg):
        raise ConfigError(
            f"run-config.{nd.FEATURES_KEY}",
            "the node's feature extraction differs from the server's (another fedvox version)",
            "install the server's fedvox commit on the node",
        )
    client = nd.node_client(node_config)
    rate = cfg.features.feature_config().fbank.sample_rate
    corpus = nd.load_own_corpus(key, Path(str(node_config[key])), rate)
    cache = nd.node_cache(key, node_config)
    dim = run_config.get(nd.FEAT_DIM_KEY)
    population, speakers = nd.own_population(
        cfg,
        corpus,
        client,
        int(run_config.get("nodes", 0)),
        cache,
        None if dim is None else int(dim),
    )
    feat_dim = int(population.store["x"].shape[-1])
    task, update = _node_task(cfg, feat_dim, 0, speakers)
    return _speaker_node(cfg, task, population, client, update)


def _node_task(
    cfg: ExperimentConfig, feat_dim: int, n_speakers: int, max_local: int | None
) -> tuple[nn.Module, ClientUpdate]:
    """A node's task and client update: with local speakers (Federated Reconstruction) the
    prototype task trained against the negatives each request carries; else the global one."""
    from fedvox.experiment.federated import global_task, recon_task

    f = cfg.federated
    assert f is not None
    if f.speakers != "local":
        return global_task(cfg, feat_dim, n_speakers), plain_client_update
    if max_local is None:
        raise DeployError(
            "the node's shard has no local-speaker slots (max_local); write the shards "
            "again with `fedvox deploy prepare` for this config"
        )
    task = recon_task(cfg, feat_dim, int(max_local))
    return task, received_broadcast_update(f.reconstruction.recon_config())


def _speaker_node(
    cfg: ExperimentConfig,
    task: nn.Module,
    population: Population,
    client: int,
    update: ClientUpdate,
) -> SpeakerNode:
    """The node of `client` over `population`, with secure aggregation if the run uses it."""
    f = cfg.federated
    assert f is not None
    secure = _secagg_config(cfg, population.num_clients)
    node = SpeakerNode(task, population, client, f.client_config(), update=update, cfg=cfg)
    node.secure = None if secure is None else SecAggNode(secure)  # secrets from the OS
    return node


def _secagg_config(cfg: ExperimentConfig, n_clients: int) -> SecAggConfig | None:
    """The run's secure-aggregation parameters (server and nodes derive the same), if any."""
    from fedvox.experiment.privacy import build_privacy

    f = cfg.federated
    if f is None or not f.privacy.secure_aggregation:
        return None
    summer = build_privacy(f, n_clients, cfg.seed).summer
    return getattr(summer, "config", None)


def write_shards(run: RunFolder, cfg: ExperimentConfig, nodes: int | None) -> list[Path]:
    """Prepare the data, partition it as `fedvox train` would, and write one shard per client
    under RUN/deploy/nodes/; `nodes` (if given) must equal the number of clients."""
    from fedvox.experiment.federated import PARTITION_FILE, build_setup
    from fedvox.experiment.prepare import prepare

    data = prepare(cfg, progress=False)
    setup = build_setup(cfg, data)
    population = setup.simulator.population
    n = population.num_clients
    if nodes is not None and nodes != n:
        raise ConfigError(
            "federated.partition",
            f"the partition gives {n} clients but --nodes is {nodes}; a node holds one client",
            f'set federated.partition.scheme = "dirichlet" and n_clients = {nodes} '
            f"(or run --nodes {n})",
        )
    setup.partition.save(run.path / PARTITION_FILE)
    meta = {
        "feat_dim": data.feat_dim,
        "n_speakers": len(data.train_speakers()),
        "partition": sha256_file(run.path / PARTITION_FILE),
    }
    if isinstance(setup.task, SpeakerReconTask):  # local speakers: the simulator's slots
        meta["max_local"] = setup.task.max_local
    paths = []
    for c in range(n):
        shard = node_shard(population, c)
        shard["meta"] = meta
        paths.append(save_shard(run.path / DEPLOY_DIR / "nodes" / f"node-{c}.pt", shard))
    return paths


# -- the server side --------------------------------------------------------------------


def _trip_record(t: TripLog, seq: int, down: int, up: int) -> TripRecord:
    """A deployed trip as the simulator's record (times are wall-clock seconds)."""
    got = t.status in ("aggregated", "stale")
    return TripRecord(
        time=round(t.ended, 3),
        client=t.client,
        trip=t.trip,
        trip_id=seq,
        start_time=round(t.sent, 3),
        start_version=t.version,
        status=t.status,
        bytes_down=down,
        bytes_up=up if got else 0,
        staleness=t.staleness if got else None,
        loss=t.loss if t.status == "aggregated" else None,
        num_examples=t.num_examples if t.status == "aggregated" else None,
        server_step=t.server_step,
    )


class _RunLog:
    """Writes a deployed run's trips.jsonl, arrivals.jsonl and metrics.jsonl (server steps,
    quick evaluations) as trips end and steps happen, counters as the simulator keeps them,
    and its checkpoints; `resume` (a checkpoint) cuts the logs back to where it was taken."""

    def __init__(
        self, run, cfg, data, task, server: DeployServer, down: int, up: int, resume=None
    ) -> None:
        from fedvox.experiment.federated import TRIPS_FILE

        self.run, self.cfg, self.data, self.task, self.server = run, cfg, data, task, server
        self.down, self.up = down, up
        self.trips_path = run.path / TRIPS_FILE
        self.paths = {
            "metrics": run.metrics_path,
            "trips": self.trips_path,
            "arrivals": run.path / ARRIVALS_FILE,
        }
        self.counts = {"trips": 0, "dropped_out": 0, "stale": 0, "cancelled": 0}
        if resume is not None:
            self.counts = dict(resume["counts"])
        for name, path in self.paths.items():
            truncate_lines(path, 0 if resume is None else int(resume["log_lines"][name]))

    def on_checkpoint(self, server: DeployServer) -> None:
        """Every federated.checkpoint_every server steps and at the last: the server's state,
        the counters and each log's length, atomically (RunFolder.save_checkpoint)."""
        f = self.cfg.federated
        if server.step % f.checkpoint_every and server.step < f.server_steps:
            return
        state = {
            "deployed": server.state_dict(),
            "log_lines": {name: count_lines(path) for name, path in self.paths.items()},
            "counts": dict(self.counts),
            "config_hash": self.cfg.hash(),
            "config": self.cfg.to_dict(),
        }
        self.run.save_checkpoint(server.step, state)

    def on_trip(self, t: TripLog) -> None:
        """One trip's end: a TripRecord and its full TripLog line."""
        c = self.counts
        c["trips" if t.status in ("aggregated", "stale") else t.status] += 1
        c["stale"] += t.status == "stale"
        seq = c["trips"] + c["dropped_out"] + c["cancelled"]
        append_run_log(self.trips_path, [_trip_record(t, seq, self.down, self.up)])
        with open(self.run.path / ARRIVALS_FILE, "a") as fh:
            fh.write(json.dumps(dataclasses.asdict(t), sort_keys=True) + "\n")

    def on_step(self, s: StepLog) -> None:
        """One server step's record, an evaluation when due, then the next margin."""
        from fedvox.experiment.evaluate import quick_eval

        f, c = self.cfg.federated, self.counts
        rec = ServerStepRecord(
            step=s.step,
            virtual_time_s=round(s.seconds, 3),
            trips=c["trips"],
            updates=s.updates,
            loss=s.loss,
            staleness=tuple(s.staleness),
            concurrency=s.in_flight,
            bytes_down=sum(self.server.trips.values()) * self.down,
            bytes_up=c["trips"] * self.up,
            dropped_out=c["dropped_out"],
            stale=c["stale"],
            cancelled=c["cancelled"],
            agg=s.agg,
        )
        records: list = [rec]
        if s.step % f.eval_every == 0 or s.step == f.server_steps:
            self.task.load_params(self.server.params)
            m = quick_eval(self.task.extractor, self.cfg, self.data)
            records.append(
                EvalRecord(
                    step=s.step,
                    trips=c["trips"],
                    virtual_time_s=rec.virtual_time_s,
                    bytes_up=rec.bytes_up,
                    bytes_down=rec.bytes_down,
                    loss=s.loss,
                    **m,
                )
            )
        append_run_log(self.run.metrics_path, records)
        _set_margin(self.task, margin_at(self.cfg, s.step))


def serve(grid: Grid, run_config: dict[str, Any]) -> None:
    """The ServerApp's body: the run folder's config, trained over `grid` by a DeployServer,
    logged, evaluated and reported like `fedvox train`; STATUS_FILE says how it ended."""
    run = RunFolder.open(Path(str(run_config["run-dir"])))
    try:
        _serve(run, grid, run_config)
    except BaseException as err:
        status = {"status": "failed", "error": f"{type(err).__name__}: {err}"}
        atomic_write_text(run.path / STATUS_FILE, json.dumps(status, indent=2) + "\n")
        raise


def _serve(run: RunFolder, grid: Grid, run_config: dict[str, Any]) -> None:
    from fedvox.experiment.federated import build_setup
    from fedvox.experiment.prepare import prepare
    from fedvox.experiment.runner import _evaluate_and_finish
    from fedvox.training.centralised import set_determinism

    cfg = run.config()
    check_deployable(cfg)
    if run_config.get(NODE_DATA_KEY) == OWN_DATA:  # nodes on their own data folders
        check_own_data(cfg)
    f = cfg.federated
    assert f is not None
    found = None
    if _flag(run_config.get(RESUME_KEY, False)):  # checked before any data is prepared
        found = load_resume_state(run)
        _check_node_config(run_config.get(CONFIG_KEY), cfg, f"run-config.{CONFIG_KEY}")
    else:  # starting over: a checkpoint of an earlier attempt must not be resumed into this one
        for old in run.checkpoint_dir.glob("ckpt-*"):
            old.unlink()
    set_determinism(cfg.train.threads)
    data = prepare(cfg, progress=False)
    setup = build_setup(cfg, data)
    sim, task = setup.simulator, setup.task
    server = _deploy_server(cfg, sim, run_config, setup.broadcast)
    ckpt = None if found is None else found[1]
    if ckpt is not None:
        server.load_state_dict(ckpt["deployed"])
        _set_margin(task, margin_at(cfg, server.step))
    down, up = sim.bytes_down_per_trip, sim.bytes_up_per_trip
    log = _RunLog(run, cfg, data, task, server, down, up, ckpt)
    server.on_trip, server.on_step, server.on_checkpoint = (
        log.on_trip,
        log.on_step,
        log.on_checkpoint,
    )
    t0 = time.perf_counter()
    params = server.run(grid, f.server_steps)
    task.load_params(params)
    seconds = time.perf_counter() - t0
    run.update_manifest(
        federated_seconds=round(seconds, 1),
        deployed={
            "runtime": "flower",
            "nodes": len(server.nodes),
            "steps": server.step,
            "resumed_from_step": None if found is None else found[0],
            "seconds": round(seconds, 2),
            "seconds_per_step": round(seconds / max(server.step, 1), 3),
            "bytes_down_per_trip": log.down,
            "bytes_up_per_trip": log.up,
            "examples_per_client": [server.num_examples[c] for c in sorted(server.num_examples)],
            "virtual_time_s": "wall-clock seconds since the server started",
        },
    )
    _evaluate_and_finish(run, cfg, data, task.extractor, t0, False)
    status = {"status": "completed", "steps": server.step, "seconds": round(seconds, 2)}
    atomic_write_text(run.path / STATUS_FILE, json.dumps(status, indent=2) + "\n")


def _deploy_server(
    cfg: ExperimentConfig,
    sim: Any,
    run_config: dict[str, Any],
    broadcast: Callable[[Params], Params] | None = None,
) -> DeployServer:
    """A DeployServer on the simulator's params, algorithm and aggregator (and local
    speakers' per-version broadcast), patient as the run config says."""
    f = cfg.federated
    assert f is not None
    timeout = float(run_config.get("reply-timeout", 0)) or None
    return DeployServer(
        sim.params,
        sim.algorithm,
        sim.aggregator,
        ServerConfig(
            concurrency=f.concurrency,
            over_selection=f.over_selection,
            seed=sim.config.seed,
            poll_interval=0.25,  # each poll is an HTTPS request to the SuperLink
            reply_timeout=timeout,
            min_nodes=int(run_config.get("nodes", 0)),
            wait_nodes_s=float(run_config.get("wait-nodes-s", 120)),
        ),
        secure=_secagg_config(cfg, sim.population.num_clients),
        broadcast=broadcast,
    )


# -- checkpoints and resume -------------------------------------------------------------

RESUME_KEY = "resume"  # run-config key: true continues the run from its newest checkpoint


def _flag(value: Any) -> bool:
    """A run-config boolean (TOML gives a bool; a string "true" counts too)."""
    return value is True or str(value).strip().lower() == "true"


def is_deployed(run: RunFolder) -> bool:
    """Whether `fedvox deploy prepare`/`local` made this run folder (it has an app folder)."""
    return (app_folder(run) / "pyproject.toml").is_file()


def _config_diff(old: Any, new: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """The dotted fields whose values differ between two config dicts, with both values."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[tuple[str, Any, Any]] = []
        for key in sorted(set(old) | set(new)):
            out += _config_diff(old.get(key), new.get(key), f"{prefix}{key}.")
        return out
    return [] if old == new else [(prefix.rstrip("."), old, new)]


def load_resume_state(run: RunFolder) -> tuple[int, dict[str, Any]]:
    """A deployed run's newest valid checkpoint and its step; a DataError or ConfigError
    naming the file or field (and the fix) when the folder cannot be resumed."""
    if not is_deployed(run):
        raise DataError(
            app_folder(run) / "pyproject.toml",
            f"{run.path} is not a deployed run (no Flower app folder)",
            f"continue a `fedvox train` run with `fedvox resume {run.path}`",
        )
    cfg = run.config()
    f = cfg.federated
    found = run.load_latest_checkpoint()
    if found is None or f is None:
        every = "?" if f is None else f.checkpoint_every
        raise DataError(
            run.checkpoint_dir,
            "no valid checkpoint: the run stopped before its first one "
            f"(written every federated.checkpoint_every = {every} server steps)",
            f"start it again: `fedvox deploy local {run.config_path} --out {run.path} --overwrite`",
        )
    step, ckpt = found
    if "deployed" not in ckpt:
        raise DataError(
            run.checkpoint_dir / f"ckpt-{step:09d}.pt",
            "a simulator checkpoint, not a deployed run's",
            f"continue it with `fedvox resume {run.path}`",
        )
    if ckpt["config_hash"] != cfg.hash():
        field, old, new = ([*_config_diff(ckpt["config"], cfg.to_dict()), ("(config)", "", "")])[0]
        raise ConfigError(
            field,
            f"is {new!r} but was {old!r} when the checkpoint of step {step} was written",
            "put back the config the run started with (a resumed run is the same run), or "
            "start a new run with another --out",
            source=str(run.config_path),
        )
    return step, ckpt


def _check_node_config(text: Any, cfg: ExperimentConfig, source: str) -> None:
    """The config the nodes get (the app's run config) must be the run folder's."""
    try:
        theirs = config_from_dict(tomllib.loads(str(text)), source)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(CONFIG_KEY, f"not TOML ({err})", "resubmit", source=source) from None
    if theirs.hash() != cfg.hash():
        field, old, new = ([*_config_diff(cfg.to_dict(), theirs.to_dict()), ("(config)", "", "")])[
            0
        ]
        raise ConfigError(
            field,
            f"the nodes would train with {new!r}, the run folder's config.toml says {old!r}",
            "put back the config the run started with in both (or start a new run)",
            source=source,
        )


# -- a local federation: one SuperLink, N SuperNodes, by PID ----------------------------


@dataclass(frozen=True)
class LocalSettings:
    """How `fedvox deploy local` runs the federation: transport settings, not the experiment."""

    nodes: int | None = None  # None: one node per client of the config's partition
    insecure: bool = False
    keys: Path | None = None  # None: make a CA, certificate and node keys in the run folder
    reply_timeout: float | None = None  # a synchronous round's deadline; async patience
    wait_nodes_s: float = 120.0
    timeout_s: float = 3600.0
    own_data: bool = False  # nodes train on their own data folders: no shards are written


class LocalFederation:
    """A SuperLink and SuperNodes on loopback, each process started and stopped by its PID
    (a context manager: leaving it stops them all, also on Ctrl-C)."""

    def __init__(self, root: Path, keys: KeyLayout | None) -> None:
        self.root = Path(root).resolve()  # Flower wants absolute paths in its files
        self.keys = None if keys is None else KeyLayout(keys.root.resolve())
        self.home = self.root / "flwr-home"
        self.procs = Processes(self.root / "logs")
        self.link = fc.Link("127.0.0.1", free_port(), self.keys)
        self.env = fc.runtime_env(self.home)
        self.node_argv: dict[int, list[str]] = {}
        self.node_ids: dict[int, int] = {}  # node i → the id the SuperLink registered

    def __enter__(self) -> LocalFederation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.procs.stop_all()

    def start_link(self, timeout: float = 60.0) -> None:
        """Start the SuperLink and wait until it listens."""
        fc.write_connection(self.home, self.link)
        m = self.procs.start("superlink", fc.superlink_argv(self.link), self.env)
        wait_for_port(self.link.host, self.link.port, timeout, m.proc)

    def flwr(self, argv: list[str], timeout: float = 120.0) -> str:
        """Run one `flwr` command against this SuperLink; its output, or a DeployError."""
        try:
            res = subprocess.run(
                argv,
                env={**self.procs.env, **self.env},
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as err:
            raise DeployError(f"{fc.shell(argv)} took over {timeout:.0f} s") from err
        if res.returncode != 0:
            raise DeployError(f"{fc.shell(argv)} failed: {(res.stdout + res.stderr)[-800:]}")
        return res.stdout

    def register(self, i: int) -> int | None:
        """Let node i's public key in (node authentication); the node id the SuperLink gave."""
        if self.keys is None:
            return None
        text = self.flwr(fc.register_argv(self.keys.node_pub(i)))
        found = re.search(r"SuperNode (\d+) registered", text)
        if found is None:
            raise DeployError(f"registering node {i} printed no node id: {text[-300:]}")
        self.node_ids[i] = int(found.group(1))
        return self.node_ids[i]

    def start_node(self, i: int, node_config: dict[str, Any], name: str | None = None) -> None:
        """Start SuperNode i holding `node_config` (its shard), signing with node i's key."""
        key = None if self.keys is None else self.keys.node_key(i)
        argv = fc.supernode_argv(self.link, key, node_config, free_port(), max_wait_s=60)
        self.node_argv[i] = argv
        env = {**self.env, "FLWR_HOME": str(self.root / f"node-{i}-home")}
        self.procs.start(name or f"node-{i}", argv, env)

    def node_status(self) -> dict[int, str]:
        """The SuperLink's view of its registered nodes: node id → status."""
        out = fc.json_output(self.flwr(fc.nodes_argv()), "flwr supernode ls")
        return {int(n["node-id"]): str(n["status"]) for n in out.get("nodes", [])}

    def restart_node(self, i: int, timeout: float = 180.0) -> None:
        """Start node i again after a crash. The SuperLink refuses a node it still believes
        online, so wait until its heartbeat lapsed (up to a minute in flwr 1.42)."""
        deadline, node_id = time.monotonic() + timeout, self.node_ids.get(i)
        while node_id is not None and self.node_status().get(node_id) == "online":
            if time.monotonic() > deadline:
                raise DeployError(f"node {node_id} still counted online after {timeout:.0f} s")
            time.sleep(3.0)
        name = f"node-{i}"
        argv = self.node_argv[i]
        env = {**self.env, "FLWR_HOME": str(self.root / f"node-{i}-home")}
        self.procs.start(name, argv, env)

    def submit(self, app: Path, overrides: dict[str, Any] | None = None) -> int:
        """`flwr run` the app folder (run-config `overrides`, e.g. resume); the run's id."""
        out = fc.json_output(self.flwr(fc.run_argv(app.resolve(), overrides)), "flwr run")
        return int(out["run-id"])

    def traffic(self, run_id: int) -> dict[str, Any]:
        """Flower's account of a run: status, and bytes in and out of the SuperLink."""
        out = fc.json_output(self.flwr(fc.list_argv(run_id)), "flwr ls")
        runs = out.get("runs") or [{}]
        return {"status": runs[0].get("status"), **(runs[0].get("network-traffic") or {})}

    def wait(
        self, run: RunFolder, timeout: float, tick: Callable[[], None] | None = None
    ) -> dict[str, Any]:
        """Until the server process writes STATUS_FILE; a dead SuperLink or the timeout fail."""
        deadline = time.monotonic() + timeout
        status_path = run.path / STATUS_FILE
        while not status_path.exists():
            self.procs.watch()
            if self.procs.running["superlink"].proc.poll() is not None:
                raise DeployError(f"the SuperLink exited; see {self.procs.logs / 'superlink.log'}")
            if time.monotonic() > deadline:
                raise DeployError(f"the run did not finish in {timeout:.0f} s")
            if tick is not None:
                tick()
            time.sleep(0.5)
        return json.loads(status_path.read_text())


def prepare_deployed_run(
    cfg: ExperimentConfig,
    out: Path,
    settings: LocalSettings,
    overwrite: bool = False,
    loopback_keys: bool = False,
) -> tuple[RunFolder, list[Path], KeyLayout | None]:
    """The run folder, the node shards and the app folder; the keys given (checked), or with
    `loopback_keys` a fresh CA, certificate and node keys for 127.0.0.1 in the run folder."""
    check_deployable(cfg)
    if settings.own_data:
        check_own_data(cfg)
        if settings.nodes is None or settings.nodes < 1:
            raise ConfigError(
                "--nodes", "missing: nodes on their own data", "say how many: --nodes N"
            )
    run = RunFolder.create(out, cfg, overwrite=overwrite)
    shards = [] if settings.own_data else write_shards(run, cfg, settings.nodes)
    n = len(shards) or int(settings.nodes or 0)
    write_run_app(run, n, settings)
    keys = None
    if not settings.insecure:
        if settings.keys is not None:
            keys = KeyLayout(settings.keys)
            keys.check(n)
        elif loopback_keys:
            where = run.path / DEPLOY_DIR / "keys"
            keys = write_keys(where, ["localhost", "127.0.0.1"], n, overwrite)
    return run, shards, keys


def app_folder(run: RunFolder) -> Path:
    """The Flower app folder `flwr run` submits for this run."""
    return run.path / DEPLOY_DIR / "fedvox-app"


def shards_of(run: RunFolder) -> list[Path]:
    """The node shards a prepared run holds, node 0 first."""
    found = sorted(
        (run.path / DEPLOY_DIR / "nodes").glob("node-*.pt"), key=lambda p: int(p.stem[5:])
    )
    if not found:
        raise FedvoxError(
            f"{run.path} holds no node shards. "
            f"Fix: `fedvox deploy prepare CONFIG --out {run.path}` first"
        )
    return found


def write_run_app(run: RunFolder, nodes: int, settings: LocalSettings) -> Path:
    """The Flower app folder of this run (its run config points the ServerApp at the run)."""
    timeout = settings.reply_timeout or 0.0
    cfg = run.config()
    config: dict[str, Any] = {
        CONFIG_KEY: run.config_path.read_text(),
        NODE_DATA_KEY: OWN_DATA if settings.own_data else "shards",
        nd.FEATURES_KEY: nd.features_sha256(cfg),
        nd.FEAT_DIM_KEY: cfg.features.num_mel_bins,
        "run-dir": str(run.path.resolve()),
        "nodes": nodes,
        "wait-nodes-s": settings.wait_nodes_s,
        "reply-timeout": timeout,
        "message-ttl": timeout,
        RESUME_KEY: False,  # `flwr run ... --run-config resume=true` continues the run
    }
    if not settings.own_data:
        config[PARTITION_KEY] = sha256_file(run.path / "partition.json")
    return fc.write_app(app_folder(run), "fedvox-run", config)


def node_config(shard: Path) -> dict[str, Any]:
    """What a SuperNode is started with: its own shard (the run's config comes with a run)."""
    return {"shard": str(shard.resolve())}


def deploy_local(
    cfg: ExperimentConfig, out: Path, settings: LocalSettings, overwrite: bool = False
) -> dict[str, Any]:
    """`fedvox deploy local`: a SuperLink and one SuperNode per client on loopback (TLS and
    node authentication unless insecure), the run to its end, every process stopped."""
    if settings.own_data:
        raise ConfigError(
            "--own-data",
            "`deploy local` starts every node here, from the shards it writes",
            "use `fedvox deploy prepare --own-data` and `print-commands` for nodes on their "
            "own machines",
        )
    run, shards, keys = prepare_deployed_run(cfg, out, settings, overwrite, loopback_keys=True)
    return _local(run, shards, keys, settings, resume=False)


def resume_local(path: Path, settings: LocalSettings) -> dict[str, Any]:
    """`fedvox deploy resume`: a fresh loopback federation for a deployed run's shards (its
    keys as `deploy local` made them, `settings.keys` or none), the run submitted again with
    resume = true, every process stopped at the end."""
    run = RunFolder.open(path)
    check_resumable(run)
    shards = shards_of(run)
    keys = _resume_keys(run, settings, len(shards))
    step = begin_resume(run)
    return {**_local(run, shards, keys, settings, resume=True), "resumed_from_step": step}


def _resume_keys(run: RunFolder, settings: LocalSettings, nodes: int) -> KeyLayout | None:
    """The keys a resumed loopback federation uses: none if insecure, --keys, or the run's."""
    if settings.insecure:
        return None
    where = settings.keys or run.path / DEPLOY_DIR / "keys"
    if not where.is_dir():
        raise ConfigError(
            "--keys",
            f"the run folder holds no keys ({where})",
            "pass --keys with the folder of `fedvox deploy keys` the run used, or --insecure",
        )
    keys = KeyLayout(where)
    keys.check(nodes)
    return keys


def _local(
    run: RunFolder,
    shards: list[Path],
    keys: KeyLayout | None,
    settings: LocalSettings,
    resume: bool,
) -> dict[str, Any]:
    """Run (or resume) a prepared run on a loopback federation; its status, in the manifest."""
    t0 = time.perf_counter()
    previous = signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the federation too
    try:
        status, run_id, traffic = _run_local(run, shards, keys, settings, resume)
    finally:
        signal.signal(signal.SIGTERM, previous)
    status.update(
        run_id=run_id,
        wall_s=round(time.perf_counter() - t0, 1),
        tls=keys is not None,
        node_authentication=keys is not None,
        flower=traffic,
    )
    run.update_manifest(deploy_local=status)
    if status["status"] != "completed":
        hint = ""
        if any(run.checkpoint_dir.glob("ckpt-*.pt")):
            hint = f"; continue it from its last checkpoint with `fedvox deploy resume {run.path}`"
        raise FedvoxError(
            f"the deployed run failed: {status.get('error')}. "
            f"Logs: {run.path / DEPLOY_DIR / 'logs'}{hint}"
        )
    return status


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _run_local(
    run: RunFolder,
    shards: list[Path],
    keys: KeyLayout | None,
    settings: LocalSettings,
    resume: bool = False,
) -> tuple[dict[str, Any], int, dict[str, Any]]:
    """Start the SuperLink, register and start the nodes, run; every process stopped by PID
    when this returns or raises."""
    with LocalFederation(run.path / DEPLOY_DIR, keys) as fed:
        fed.start_link()
        for i in range(len(shards)):
            fed.register(i)
        for i, shard in enumerate(shards):
            fed.start_node(i, node_config(shard))
        run_id = fed.submit(app_folder(run), {RESUME_KEY: True} if resume else None)
        status = fed.wait(run, settings.timeout_s)
        return status, run_id, fed.traffic(run_id)


def _app_pyproject(run: RunFolder) -> Path:
    return app_folder(run) / "pyproject.toml"


def _app_run_config(run: RunFolder) -> dict[str, Any]:
    """The run config in the run's Flower app folder (what `flwr run` submits)."""
    doc = tomllib.loads(_app_pyproject(run).read_text())
    return dict(doc["tool"]["flwr"]["app"]["config"])


def check_resumable(run: RunFolder) -> int:
    """The step a deployed run resumes from; refuses (naming the file or field) a folder
    with no checkpoint, another config in config.toml or the app folder, or that completed."""
    step, _ = load_resume_state(run)
    config = _app_run_config(run)
    _check_node_config(config.get(CONFIG_KEY), run.config(), str(_app_pyproject(run)))
    if _status(run).get("status") == "completed":
        raise FedvoxError(
            f"{run.path} completed ({STATUS_FILE}): there is nothing to resume. "
            f"Fix: read {run.report_path}, or start a new run with another --out"
        )
    return step


def _status(run: RunFolder) -> dict[str, Any]:
    try:
        return dict(json.loads((run.path / STATUS_FILE).read_text()))
    except (OSError, ValueError):
        return {"status": "stopped without a status (killed)"}


def begin_resume(run: RunFolder) -> int:
    """`check_resumable`, then note the interruption in the manifest and clear the status
    file (a waiting `deploy local` then sees the resumed run's); the step it resumes from."""
    step = check_resumable(run)
    config = _app_run_config(run)
    if RESUME_KEY not in config:  # an app folder from before resume: the key must exist
        fc.write_app(app_folder(run), "fedvox-run", {**config, RESUME_KEY: False})
    resumes = run.manifest().get("deploy_resumes", [])
    run.update_manifest(deploy_resumes=[*resumes, {"from_step": step, "before": _status(run)}])
    (run.path / STATUS_FILE).unlink(missing_ok=True)
    return step


def resume_commands(run: RunFolder) -> list[str]:
    """`begin_resume`, then the `flwr run` that resumes the run on a federation started by
    hand (`print_commands`: the SuperLink and the nodes up again)."""
    step = begin_resume(run)
    home = run.path.resolve() / DEPLOY_DIR / "flwr-home"
    argv = fc.run_argv(app_folder(run).resolve(), {RESUME_KEY: True})
    return [
        f"# resumes {run.path} from its checkpoint of server step {step}; on the SuperLink "
        "machine, once the SuperLink and every node are up (see print-commands):",
        f"{fc.shell([], {'FLWR_HOME': str(home)})} {fc.shell(_bare(argv))}",
    ]


def print_commands(
    run: RunFolder,
    host: str,
    port: int,
    keys: Path | None,
    node_dir: str = "/opt/fedvox-node",
    layout_key: str = "kaldi-dir",
) -> list[str]:
    """The commands that run a prepared run's federation on separate machines, in order,
    with the files each node machine needs (copied into `node_dir` there, an absolute path:
    Flower's app processes do not share the shell's working folder). With nodes on their
    own data, each keeps its folder (`layout_key`: kaldi-dir or voxceleb-dir) in node_dir/data."""
    if not Path(node_dir).is_absolute():
        raise ConfigError("--node-dir", f"{node_dir!r} is relative", "give an absolute path")
    if layout_key not in nd.DATA_KEYS:
        raise ConfigError("--node-layout", f"unknown {layout_key!r}", "use kaldi or voxceleb")
    app_config = run_app_config(run)
    own = app_config.get(NODE_DATA_KEY) == OWN_DATA
    shards = [] if own else shards_of(run)
    n = int(app_config.get("nodes", 0)) if own else len(shards)
    layout = None if keys is None else KeyLayout(keys)
    if layout is not None:
        layout.check(n)
    home = run.path.resolve() / DEPLOY_DIR / "flwr-home"
    fc.write_connection(home, fc.Link(host, port, layout))
    env = fc.shell([], fc.RUNTIME_ENV)
    flwr_env = fc.shell([], {"FLWR_HOME": str(home)})
    server = fc.Link(host, port, layout, bind="0.0.0.0")
    lines = [
        "# 1. on the SuperLink machine (the one holding the run folder):",
        f"{env} {fc.shell(_bare(fc.superlink_argv(server)))}",
    ]
    if layout is not None:
        lines.append("# 2. on the SuperLink machine: register each node's public key")
        lines += [
            f"{flwr_env} {fc.shell(_bare(fc.register_argv(layout.node_pub(i))))}" for i in range(n)
        ]
    lines.append("# 3. on each node machine (fedvox[deploy] installed there):")
    for i in range(n):
        data = None if own else shards[i]
        lines += _node_lines(i, data, host, port, layout, node_dir, layout_key)
    lines += [
        "# 4. on the SuperLink machine, once the nodes are up: start the run",
        f"{flwr_env} {fc.shell(_bare(fc.run_argv(app_folder(run).resolve())))}",
        f"# the run folder {run.path.resolve()} fills as it trains; report.md at the end",
        "# if the server dies: start the SuperLink and nodes again (2.-3.), then run what "
        f"`fedvox deploy resume {run.path} --command-only` prints",
    ]
    return lines


def _node_lines(
    i: int,
    shard: Path | None,
    host: str,
    port: int,
    layout: KeyLayout | None,
    node_dir: str,
    layout_key: str,
) -> list[str]:
    """Node i's files to copy and its `flower-supernode` command: with its shard, or (shard
    None) on its own data folder, which stays on the node."""
    files = [] if shard is None else [shard]
    if shard is not None:
        there: dict[str, Any] = {"shard": f"{node_dir}/{shard.name}"}
        keeps = ""
    else:
        data = f"{node_dir}/data"
        there = {layout_key: data, nd.CLIENT_KEY: i, nd.CACHE_KEY: f"{node_dir}/cache"}
        what = "a Kaldi dir: wav.scp, utt2spk" if layout_key == "kaldi-dir" else "VoxCeleb"
        keeps = f"#    node {i}: keeps its own data in {data} ({what}); it never leaves the node"
    key = None
    node_keys = None
    if layout is not None:
        files += [layout.ca_cert, layout.node_key(i)]
        node_keys = KeyLayout(Path(node_dir))  # ca.pem sits in node_dir on a node
        key = Path(node_dir) / layout.node_key(i).name
    argv = fc.supernode_argv(fc.Link(host, port, node_keys), key, there, 9094)
    lines = [keeps] if keeps else []
    if files:
        copied = " ".join(str(p.resolve()) for p in files)
        lines.append(f"#    node {i}: copy {copied} into {node_dir}/")
    env = fc.shell([], fc.RUNTIME_ENV)
    return [*lines, f"{env} {fc.shell(_bare(argv))}"]


def run_app_config(run: RunFolder) -> dict[str, Any]:
    """The run config of a prepared run's app folder (what `flwr run` submits)."""
    path = app_folder(run) / "pyproject.toml"
    try:
        return dict(tomllib.loads(path.read_text())["tool"]["flwr"]["app"]["config"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return {}


def _bare(argv: list[str]) -> list[str]:
    """A command as another machine runs it: the program by name, from its PATH."""
    return [Path(argv[0]).name, *argv[1:]]
