"""Federated speaker training: the x-vector trained by the engine on a virtual clock.

Wires prepared features, a partition of training speakers over clients, the speaker task
(extractor + global AAM head) and the fedvox.fl simulator into a resumable run folder.
The global head's rows are per-speaker vectors the server sees: a voiceprint leak that
Federated Reconstruction (local speaker parameters) removes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fedvox.data.partition import Partition, partition_corpus
from fedvox.device import resolve_device
from fedvox.errors import ConfigError
from fedvox.experiment.backdoor import build_backdoor
from fedvox.experiment.compression import build_compression
from fedvox.experiment.config import (
    FEDERATED_PATHS,
    ExperimentConfig,
    FederatedSection,
    ReconstructionSection,
    toml_paths,
)
from fedvox.experiment.evaluate import quick_eval
from fedvox.experiment.prepare import InitModel, PreparedData
from fedvox.experiment.privacy import PrivacyPipeline, build_privacy
from fedvox.experiment.robust import build_robust
from fedvox.experiment.runfolder import RunFolder, count_lines, truncate_lines
from fedvox.fl import Algorithm, Population, Simulator
from fedvox.fl.attack import make_attack_update, malicious_clients
from fedvox.fl.local.placement import on_device
from fedvox.fl.simulator import ClientUpdate, SimRecord, plain_client_update
from fedvox.models import build_extractor
from fedvox.models.heads import AAMSoftmax, margin_schedule
from fedvox.progress import task_progress
from fedvox.records import EvalRecord, Record, ServerStepRecord, TripRecord, append_run_log
from fedvox.rng import Purpose, derived_seed
from fedvox.tasks.speakers import (
    DomainClusters,
    FedAwSTask,
    ServerLearning,
    SpeakerReconTask,
    SpeakerTask,
    Spreadout,
    make_version_broadcast,
    received_broadcast_update,
    speaker_population,
)
from fedvox.training.centralised import set_determinism
from fedvox.training.chunks import chunk_store
from fedvox.types import Params

PARTITION_FILE = "partition.json"
TRIPS_FILE = "trips.jsonl"


def build_federated_extractor(
    cfg: ExperimentConfig, feat_dim: int, init: InitModel | None = None
) -> nn.Module:
    """The extractor with batch-independent LayerNorm (vmap over clients cannot carry
    BatchNorm statistics) unless the config names a norm; seeded from the run seed, then
    given the weights of `init` (federated.init_from) if there is one."""
    torch.manual_seed(derived_seed(cfg.seed, Purpose.INIT, bits=32))
    kw = {} if cfg.model.embedding_layer is None else {"embedding_layer": cfg.model.embedding_layer}
    extractor = build_extractor(cfg.model.name, feat_dim, norm=cfg.model_norm(), **kw)
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in extractor.modules()):
        raise ConfigError(
            "model.norm",
            "BatchNorm cannot be trained by vectorised federated clients",
            'use model.norm = "layer" (or leave it unset) for federated runs',
        )
    if init is not None:
        extractor.load_state_dict(init.extractor.state_dict())
    return extractor


def build_task(
    cfg: ExperimentConfig, feat_dim: int, n_speakers: int, init: InitModel | None = None
) -> SpeakerTask:
    """Extractor plus the global AAM head over all training speakers."""
    extractor = build_federated_extractor(cfg, feat_dim, init)
    emb_dim = extractor(torch.zeros(2, 50, feat_dim)).shape[1]
    return SpeakerTask(
        extractor, AAMSoftmax(emb_dim, n_speakers, scale=cfg.model.scale, margin=0.0)
    )


@dataclass
class FederatedSetup:
    """Everything a federated run is built from; rebuilt identically on resume."""

    task: nn.Module  # SpeakerTask, SpeakerReconTask or FedAwSTask
    simulator: Simulator
    partition: Partition
    privacy: PrivacyPipeline
    records: list[SimRecord] = field(default_factory=list)
    backend: Any = None  # fedvox.scale's RayBackend when [federated.backend] kind = "ray"
    # a backdoor's impostor-vs-target (enroll, test) trials, scored at every evaluation
    backdoor_trials: list[tuple[str, str]] = field(default_factory=list)
    # local speakers: what each model version's broadcast adds (public negatives, domain
    # centre) as the server computes it; a deployed server ships it with every request
    broadcast: Callable[[Params], dict[str, Tensor]] | None = None


def build_setup(cfg: ExperimentConfig, data: PreparedData) -> FederatedSetup:
    """Partition → population of fixed chunks → task → algorithm → simulator."""
    f = cfg.federated
    assert f is not None
    utts, labels = data.train_labels()
    part = partition_corpus(
        utts,
        data.train_corpus.speaker_of,
        f.partition.partition_config(),
        seed=cfg.seed,
        exclude_speakers=data.test_corpus.speakers(),
    )
    store, rows, take = chunk_store(data.train_feats, utts, labels, f.chunk_frames, f.chunk_hop)
    crops = {} if take is None else {"groups": store["group"].numpy(), "take": take}
    row_of = dict(zip(utts, rows, strict=True))
    clients = [np.concatenate([row_of[u] for u in client]) for client in part.clients]
    algorithm = build_algorithm(f)
    client_update = None
    extra_bytes_down = 0
    broadcast = None
    if f.speakers == "local":
        task, population, client_update, extra_bytes_down, broadcast = _local_speakers(
            cfg, data, store, clients, crops
        )
    else:
        population = Population(store, clients, seed=cfg.seed, **crops)
        task = _global_task(cfg, data)
    if f.server_learning is not None:
        algorithm = _server_learning(cfg, data, task, algorithm)
    backend = None
    if f.backend.kind == "ray":  # client training on Ray actors; the rest stays here
        try:
            from fedvox.scale.actors import RayBackend
        except ImportError as err:
            raise ConfigError(
                "federated.backend.kind",
                f"'ray' needs Ray, which does not import here ({err})",
                "pip install 'fedvox[ray]' (ray 2.60) on every node, or use kind = \"inline\"",
            ) from err
        update = client_update or plain_client_update
        backend = RayBackend(update, population, f.backend.backend_config(), cfg.train.device)
        client_update = backend
    else:
        client_update = _placed(cfg, client_update)
    client_update, trials = _attacked(cfg, data, task, population.num_clients, client_update)
    privacy = build_privacy(f, population.num_clients, cfg.seed)
    robust = build_robust(f)  # refused with secure aggregation, so one summer at most
    compress = build_compression(f, privacy, robust, cfg.seed)
    stages = robust.stages + privacy.stages  # bound each update, then DP-clip it,
    if compress is not None:  # then compress it (and keep it within those bounds)
        stages.append(compress)
    setup = FederatedSetup(task, None, part, privacy, backend=backend, backdoor_trials=trials)  # type: ignore[arg-type]
    setup.broadcast = broadcast
    with toml_paths(FEDERATED_PATHS):  # e.g. C larger than the population
        sim = Simulator(
            task,
            population,
            algorithm,
            f.client_config(),
            f.simulator_config(cfg.seed, once_per_epoch=privacy.mechanism == "dp_ftrl"),
            callback=setup.records.append,
            stages=stages,
            summer=robust.combiner or privacy.summer,
            noise=privacy.noise,
            client_update=client_update,
            extra_bytes_down=extra_bytes_down,
            broadcast=broadcast,
            broadcast_every=f.reconstruction.broadcast_every,
        )
    setup.simulator = sim
    return setup


def _attacked(
    cfg: ExperimentConfig,
    data: PreparedData,
    task: Any,
    num_clients: int,
    client_update: Any,
) -> tuple[Any, list[tuple[str, str]]]:
    """`client_update` with [federated.attack]'s malicious devices (on the devices: after
    honest training, before the server), and a backdoor's (enroll, test) trials to score."""
    f = cfg.federated
    assert f is not None
    if f.attack.fraction <= 0:
        return client_update, []
    attack = f.attack.attack_config(cfg.seed)
    malicious = malicious_clients(num_clients, attack.fraction, cfg.seed)
    backdoor, trials = None, []
    if attack.kind == "backdoor":
        a = f.attack
        backdoor, pairs = build_backdoor(
            task.extractor,
            data.test_feats,
            data.test_corpus.speaker_of,
            a.backdoor_pairs,
            a.backdoor_enroll,
            f.chunk_frames,
            cfg.seed,
        )
        trials = [t for p in pairs for t in p.trials()]
    update = make_attack_update(client_update or plain_client_update, attack, malicious, backdoor)
    return update, trials


def _placed(cfg: ExperimentConfig, update: ClientUpdate | None) -> ClientUpdate | None:
    """The client update on train.device (the server stays on the CPU); None: the plain
    in-process one."""
    device = resolve_device(cfg.train.device)
    if device.type == "cpu":
        return update
    f = cfg.federated
    assert f is not None
    if f.speakers == "local":
        raise ConfigError(
            "train.device",
            "federated.speakers = 'local' (public negatives) trains on the CPU only for now",
            'set train.device = "cpu" for this mode, or use speakers = "global_head"',
        )
    return on_device(update or plain_client_update, device)


def build_algorithm(f: FederatedSection) -> Algorithm:
    """The algorithm of [federated]; FedAwS wraps it in the server's spreadout."""
    algorithm = f.algorithm_object(f.server_optimizer_object())
    if f.speakers != "fedaws":
        return algorithm
    a = f.fedaws
    return Spreadout(algorithm, nu=a.nu, spread_lr=a.spread_lr, spread_steps=a.spread_steps)


def _server_learning(
    cfg: ExperimentConfig, data: PreparedData, task: nn.Module, algorithm: Algorithm
) -> Algorithm:
    """`algorithm` followed by SGD on the prepared public corpus after each server step."""
    s = cfg.federated.server_learning if cfg.federated is not None else None
    assert s is not None
    if data.public_train is None:
        raise ConfigError(
            "federated.server_learning", "no public corpus was prepared", "prepare(cfg) first"
        )
    with toml_paths(FEDERATED_PATHS):
        return ServerLearning(
            algorithm,
            task.extractor,
            data.public_train,
            steps=s.steps,
            lr=s.lr,
            batch_size=s.batch_size,
            momentum=s.momentum,
            seed=cfg.seed,
            scale=cfg.model.scale,
            margin=cfg.model.margin,
        )


def _global_task(cfg: ExperimentConfig, data: PreparedData) -> nn.Module:
    """The task of the modes whose speakers live on the server: global head, codewords, FedAwS."""
    return global_task(cfg, data.feat_dim, len(data.train_speakers()), data.init)


def global_task(
    cfg: ExperimentConfig, feat_dim: int, n_speakers: int, init: InitModel | None = None
) -> nn.Module:
    """`_global_task` from sizes alone: what a deployed node builds (its weights then come
    from the server with every request)."""
    f = cfg.federated
    assert f is not None
    if f.speakers == "fedaws":
        return FedAwSTask(
            build_federated_extractor(cfg, feat_dim, init),
            n_speakers,
            pos_margin=f.fedaws.pos_margin,
            seed=cfg.seed,
        )
    task = build_task(cfg, feat_dim, n_speakers, init)
    if f.speakers == "codewords":
        task.fix_head(derived_seed(cfg.seed, Purpose.CODEWORDS, bits=32))
    return task


def recon_task(
    cfg: ExperimentConfig, feat_dim: int, max_local: int, init: InitModel | None = None
) -> SpeakerReconTask:
    """The local-speaker task (extractor global, `max_local` prototype slots local, public
    negatives): what the simulator trains and what a deployed node builds."""
    return SpeakerReconTask(
        build_federated_extractor(cfg, feat_dim, init),
        scale=cfg.model.scale,
        margin=0.0,
        max_local=max_local,
        negatives="public",
    )


def _local_speakers(
    cfg: ExperimentConfig,
    data: PreparedData,
    store: dict[str, Tensor],
    clients: list[np.ndarray],
    crops: dict[str, np.ndarray],
) -> tuple[SpeakerReconTask, Population, Any, int, Callable[[Params], dict[str, Tensor]]]:
    """Federated Reconstruction of speaker prototypes: task, population with local speaker
    slots, the client update (closed-form enrollment + the prepared public negatives), extra
    bytes down, and the server's per-version broadcast on its own."""
    f = cfg.federated
    assert f is not None
    r = f.reconstruction
    y = store["y"].numpy()
    sources, clients = panel_split(clients, r)
    max_local = max(len(np.unique(y[c])) for c in clients)
    task = recon_task(cfg, data.feat_dim, max_local, data.init)
    population = speaker_population(store, clients, seed=cfg.seed, max_local=max_local, **crops)
    public = data.public
    if public is None:
        raise ConfigError(
            "data.public", "no public speakers were prepared", "build the data with prepare(cfg)"
        )

    def panel_of(n: int) -> torch.Tensor:  # the first chunk of n devices spread over the list
        pick = spread(len(sources), n)
        return store["x"][[int(sources[c][0]) for c in pick]]

    panel, clusters = None, None
    extra_down = public.broadcast_bytes(task.emb_dim)
    if r.centre == "domain":
        panel = panel_of(r.centre_panel)
        extra_down += 4 * task.emb_dim
    if r.device_clusters:
        names = {"k": "device_clusters", "panel": "cluster_panel"}
        with toml_paths({k: f"federated.reconstruction.{v}" for k, v in names.items()}):
            clusters = DomainClusters(
                panel_of(r.cluster_panel), r.device_clusters, r.cluster_min_devices
            )
        extra_down += 4 * task.emb_dim * r.device_clusters
    # the simulator computes each version's broadcast as the server would (refreshed every
    # `broadcast_every` versions) and the devices' update receives it with the params
    update = received_broadcast_update(r.recon_config())
    broadcast = make_version_broadcast(task, public, centre_panel=panel, clusters=clusters)
    return task, population, update, extra_down, broadcast


def spread(n: int, k: int) -> np.ndarray:
    """min(k, n) distinct indices spread evenly over range(n) (a panel of devices)."""
    return np.linspace(0, n - 1, min(k, n)).astype(int)


def panel_split(
    clients: list[np.ndarray], r: ReconstructionSection
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(the devices the centre / cluster panels are drawn from, the devices that train).

    With panel = "training" both are every device; with "held_out" the panel devices (the
    cluster panel when there are clusters, else the centre panel, spread over the list) only
    release their panel embeddings and do not train: the training population, and so a DP
    run's accountant, is the rest."""
    used = r.device_clusters > 0 or r.centre == "domain"
    if r.panel == "training" or not used:
        return clients, clients
    size = r.cluster_panel if r.device_clusters else r.centre_panel
    held = set(spread(len(clients), size).tolist())
    if len(held) >= len(clients):
        raise ConfigError(
            "federated.reconstruction.panel",
            f"a held-out panel of {len(held)} devices leaves none of the {len(clients)} to train",
            'use a smaller cluster_panel / centre_panel, more devices, or panel = "training"',
        )
    panel = [c for i, c in enumerate(clients) if i in held]
    return panel, [c for i, c in enumerate(clients) if i not in held]


def _set_margin(task: nn.Module, margin: float) -> None:
    """The AAM margin of the schedule, wherever the task keeps it (FedAwS has none)."""
    if hasattr(task, "set_margin"):
        task.set_margin(margin)
    elif hasattr(task, "head") and hasattr(task.head, "set_margin"):
        task.head.set_margin(margin)


def _privacy_record(privacy: PrivacyPipeline, steps: int) -> dict[str, float | None]:
    """The (ε, δ) an evaluation record carries after `steps` server steps (none without DP)."""
    if not privacy.dp:
        return {}
    return {"epsilon": privacy.epsilon(steps), "delta": privacy.delta}


def _eval_record(
    sim: Simulator, privacy: PrivacyPipeline, metrics: dict, last: ServerStepRecord | None
) -> EvalRecord:
    """The held-out `metrics` of the current model with the clock, trips and bytes so far."""
    return EvalRecord(
        step=sim.server_step,
        trips=sim.counters["trips_completed"],
        virtual_time_s=sim.time,
        bytes_up=sim.counters["bytes_up"],
        bytes_down=sim.counters["bytes_down"],
        loss=None if last is None else last.loss,
        **metrics,
        **_privacy_record(privacy, sim.server_step),
    )


def run_federated(
    run: RunFolder, cfg: ExperimentConfig, data: PreparedData, resume: bool, progress: bool
) -> nn.Module:
    """Train to cfg.federated.server_steps, evaluating and checkpointing on the way.

    Logs go to metrics.jsonl (server steps, DP-FTRL epochs, evaluations) and trips.jsonl
    (every client trip), as the simulator's typed records in the order they happened.
    A checkpoint holds the simulator's whole state and the log lines written so far, so a
    run killed at any moment resumes to the same bits and the same logs.
    """
    f = cfg.federated
    assert f is not None
    set_determinism(cfg.train.threads, cfg.train.device)
    setup = build_setup(cfg, data)
    try:
        return _train(run, cfg, data, setup, resume, progress)
    finally:
        if setup.backend is not None:  # Ray actors give their CPUs back
            setup.backend.close()


def _train(
    run: RunFolder,
    cfg: ExperimentConfig,
    data: PreparedData,
    setup: FederatedSetup,
    resume: bool,
    progress: bool,
) -> nn.Module:
    """run_federated's loop over server steps, evaluations and checkpoints."""
    f = cfg.federated
    assert f is not None
    sim, task = setup.simulator, setup.task
    trips_path = run.path / TRIPS_FILE
    if resume and (found := run.load_latest_checkpoint()) is not None:
        _, ckpt = found
        sim.load_state_dict(ckpt["simulator"])
        truncate_lines(run.metrics_path, ckpt["log_lines"]["metrics"])
        truncate_lines(trips_path, ckpt["log_lines"]["trips"])
    else:
        setup.partition.save(run.path / PARTITION_FILE)
        if f.speakers == "local" and f.reconstruction.panel == "held_out":
            # the partition lists every device; the held-out panel's devices do not train
            run.update_manifest(training_devices=sim.population.num_clients)
        truncate_lines(run.metrics_path, 0)
        truncate_lines(trips_path, 0)
    t0 = time.perf_counter()
    with task_progress("federated", f.server_steps, enabled=progress) as tick:
        tick(sim.server_step)
        while sim.server_step < f.server_steps:
            step = sim.server_step
            nxt = min(
                f.server_steps,
                (step // f.eval_every + 1) * f.eval_every,
                (step // f.checkpoint_every + 1) * f.checkpoint_every,
            )
            _set_margin(
                task,
                margin_schedule(step / f.server_steps, cfg.model.margin, *cfg.model.margin_ramp),
            )
            sim.run(max_server_steps=nxt)
            if sim.server_step == step:  # nothing left to happen (e.g. everyone dropped out)
                break
            trips = [r for r in setup.records if isinstance(r, TripRecord)]
            metrics: list[Record] = [r for r in setup.records if not isinstance(r, TripRecord)]
            setup.records.clear()
            if sim.server_step % f.eval_every == 0 or sim.server_step == f.server_steps:
                task.load_params(sim.params)
                m = quick_eval(task.extractor, cfg, data, setup.backdoor_trials)
                steps = [r for r in metrics if isinstance(r, ServerStepRecord)]
                metrics.append(_eval_record(sim, setup.privacy, m, steps[-1] if steps else None))
            append_run_log(run.metrics_path, metrics)
            append_run_log(trips_path, trips)
            if sim.server_step % f.checkpoint_every == 0 or sim.server_step >= f.server_steps:
                run.save_checkpoint(
                    sim.server_step,
                    {
                        "simulator": sim.state_dict(),
                        "log_lines": {
                            "metrics": count_lines(run.metrics_path),
                            "trips": count_lines(trips_path),
                        },
                    },
                )
            tick(sim.server_step - step)
    task.load_params(sim.params)
    run.update_manifest(federated_seconds=round(time.perf_counter() - t0, 1))
    return task
