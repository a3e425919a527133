"""Run an experiment end to end: prepare → train (centralised or federated) → evaluate → report.

Used by `fedvox train`, `fedvox demo` and `fedvox resume`; everything lands in a run folder.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path

from torch import nn

from fedvox.atomic import atomic_write_text
from fedvox.device import module_on, resolve_device
from fedvox.eval.backend import (
    Backend,
    EvalResult,
    eer_threshold,
    evaluate_baseline,
    evaluate_extractor,
    score_with_backend,
)
from fedvox.eval.extract import embed_dict
from fedvox.eval.plots import plot_det
from fedvox.experiment.config import ExperimentConfig
from fedvox.experiment.evaluate import backend_config, quick_eval
from fedvox.experiment.fedstats import write_fed_stats
from fedvox.experiment.prepare import PreparedData, prepare
from fedvox.experiment.report import write_report
from fedvox.experiment.runfolder import RunFolder, load_run_model
from fedvox.models.io import save_model, weights_hash
from fedvox.records import EvalRecord, ServerStepRecord, TrainRecord, read_run_log
from fedvox.training.centralised import (
    CentralisedConfig,
    ModelConfig,
    TrainConfig,
    TrainState,
    init_training,
    set_determinism,
    train,
)
from fedvox.training.distributed import Workers, barrier, init_workers, shutdown


def total_steps(cfg: ExperimentConfig) -> int:
    """Optimiser steps of a run: centralised steps or federated server steps."""
    return cfg.federated.server_steps if cfg.federated is not None else cfg.train.steps


def centralised_config(cfg: ExperimentConfig) -> CentralisedConfig:
    """What the centralised trainer reads from a run's config (normalisation resolved).

    Each field is taken by name from [model] and [train], so the two cannot drift apart.
    """
    model = {f.name: getattr(cfg.model, f.name) for f in fields(ModelConfig)}
    train = {f.name: getattr(cfg.train, f.name) for f in fields(TrainConfig)}
    return CentralisedConfig(
        seed=cfg.seed,
        model=ModelConfig(**{**model, "norm": cfg.model_norm()}),
        train=TrainConfig(**train),
    )


def eval_points(steps: int) -> list[int]:
    """Steps with a quick cosine evaluation: a barely trained point (1%), then quarters."""
    pts = {max(1, steps // 100), steps // 4, steps // 2, 3 * steps // 4}
    return sorted(p for p in pts if 0 < p < steps)


@dataclass
class RunOutcome:
    """What a finished run produced (also on disk in its folder)."""

    run: RunFolder
    result: EvalResult
    baseline: dict
    curve: list[EvalRecord]
    weights_sha256: str
    seconds: float


def _train_and_finish(
    run: RunFolder,
    cfg: ExperimentConfig,
    data: PreparedData,
    state: TrainState,
    progress: bool,
    workers: Workers | None = None,
) -> RunOutcome:
    t0 = time.perf_counter()
    points = set(eval_points(cfg.train.steps))

    def on_step(st: TrainState, rec: dict) -> None:
        if st.step % 10 == 0 or st.step == cfg.train.steps:
            run.log_metrics(TrainRecord(**rec))
        if st.step in points:
            m = quick_eval(st.extractor, cfg, data)
            run.log_metrics(EvalRecord(step=st.step, loss=rec["loss"], **m))
        if st.step % cfg.train.checkpoint_every == 0 or st.step == cfg.train.steps:
            run.save_checkpoint(st.step, st.to_checkpoint())

    train(state, centralised_config(cfg), on_step=on_step, progress=progress, workers=workers)
    outcome = _evaluate_and_finish(run, cfg, data, state.extractor, t0, progress)
    if workers is not None:
        shutdown(workers)
    return outcome


def _evaluate_and_finish(
    run: RunFolder,
    cfg: ExperimentConfig,
    data: PreparedData,
    extractor: nn.Module,
    t0: float,
    progress: bool,
) -> RunOutcome:
    """Save the trained extractor, evaluate it with every back end and the baseline, report.
    The model file is written from the CPU; embeddings are extracted on cfg.train.device."""
    extractor = extractor.cpu()
    save_model(
        run.model_path,
        extractor,
        model_name=cfg.model.name,
        feat_dim=data.feat_dim,
        norm=cfg.model_norm(),
        embedding_layer=cfg.model.embedding_layer,
    )
    backend_feats, backend_speaker_of = data.backend_data()
    result, backend = evaluate_extractor(
        module_on(extractor, cfg.train.device),
        backend_feats,
        backend_speaker_of,
        data.test_feats,
        data.trials,
        backend_config(cfg.eval),
        progress=progress,
        test_speaker_of=data.test_corpus.speaker_of,
    )
    baseline = evaluate_baseline(backend_feats, data.test_feats, data.trials).to_dict()
    return finish_run(run, cfg, result, backend, baseline, time.perf_counter() - t0, extractor)


def _privacy_note(
    cfg: ExperimentConfig, curve: list[EvalRecord], steps: list[ServerStepRecord] | None = None
) -> tuple[str, dict] | None:
    """The privacy line of the report and its JSON, for federated runs with DP or SecAgg;
    `steps` (the server-step records) give the count of secure sums skipped after an abort."""
    if cfg.federated is None:
        return None
    p = cfg.federated.privacy
    if p.mechanism == "none" and not p.secure_aggregation:
        return None
    eps = next((r.epsilon for r in reversed(curve) if r.epsilon is not None), None)
    info = {
        "mechanism": p.mechanism,
        "noise_multiplier": p.noise_multiplier if p.mechanism != "none" else None,
        "clip": p.clip if p.mechanism != "none" else None,
        "epsilon": eps,
        "delta": p.delta if p.mechanism != "none" else None,
        "accounting": p.accounting if p.mechanism != "none" else None,
        "secure_aggregation": p.secure_aggregation,
    }
    skipped = sum(int(r.agg.get("secagg_aborted", 0)) for r in steps or [])
    if p.secure_aggregation:
        info["secagg_on_abort"] = p.secagg_on_abort
        info["secagg_consistency_check"] = p.secagg_consistency_check
        info["secagg_aborted_steps"] = skipped
    parts = []
    if p.mechanism != "none":
        parts.append(
            f"user-level DP ({p.mechanism}, z={p.noise_multiplier}, {p.clip} clip): "
            f"(ε, δ) = ({eps:.3g}, {p.delta:g}) by {p.accounting.upper()} accounting"
            if eps is not None
            else f"user-level DP ({p.mechanism}): no server step yet"
        )
    if p.secure_aggregation:
        note = "secure aggregation: the server saw only masked updates and their sum"
        if p.secagg_consistency_check:
            note += " (signed keys and consistency check against a malicious server)"
        if skipped:
            note += (
                f"; {skipped} of {len(steps or [])} server steps skipped (fewer survivors than "
                "the threshold; model unchanged)"
            )
        parts.append(note)
    return "privacy: " + "; ".join(parts), info


def finish_run(
    run: RunFolder,
    cfg: ExperimentConfig,
    result: EvalResult,
    backend: Backend,
    baseline: dict | None,
    seconds: float,
    extractor: nn.Module,
) -> RunOutcome:
    """Write metrics.json, calibration, back end, DET plot and report.md."""
    backend.save(run.path / "backend")
    calib = {
        "backend": "cosine",
        "threshold": eer_threshold(result, "cosine"),
        "operating_point": "EER on the evaluation trials",
    }
    atomic_write_text(run.path / "calibration.json", json.dumps(calib, indent=2) + "\n")
    summary = {"backends": result.summary(), "baseline_stats_cosine": baseline}
    if "offset" in result.extra:
        summary["test_speaker_offset"] = result.extra["offset"]
    whash = weights_hash(extractor)
    summary["weights_sha256"] = whash
    curve = read_run_log(run.metrics_path, (EvalRecord,))
    secagg = cfg.federated is not None and cfg.federated.privacy.secure_aggregation
    steps = read_run_log(run.metrics_path, (ServerStepRecord,)) if secagg else []
    privacy_note = _privacy_note(cfg, curve, steps)
    if privacy_note is not None:
        summary["privacy"] = privacy_note[1]
    atomic_write_text(
        run.path / "metrics.json", json.dumps(summary, indent=2, sort_keys=True) + "\n"
    )
    curves = {name: (s[result.labels], s[~result.labels]) for name, s in result.scores.items()}
    plot_det(curves, run.path / "det.png", title=f"DET — {cfg.name}")
    system = cfg.model.name
    fed_section: list[str] = []
    if cfg.federated is not None and (stats := write_fed_stats(run.path, cfg.name)) is not None:
        fed_section = [
            "## Client trips",
            "",
            "Staleness of the aggregated updates (server steps between download and upload):",
            "",
            "![staleness](staleness.png)",
            "",
            f"Per virtual hour ({stats['hours']} h): trips by outcome, server steps, mean "
            "staleness and concurrency, MB up and down — `hourly.csv`.",
            "",
        ]
    if cfg.federated is not None:
        f = cfg.federated
        system += f", federated {f.algorithm} C={f.concurrency}"
        system += f" K={f.buffer_size}" if f.algorithm == "fedbuff" else ""
    rows = [(f"x-vector ({system}) + {name}", m.to_dict()) for name, m in result.metrics.items()]
    if curve:
        first = curve[0]
        rows.append(
            (
                f"barely trained (step {first.step} of {total_steps(cfg)}) + cosine",
                first.verification(),
            )
        )
    if baseline is not None:
        rows.append(("non-learned baseline (fbank mean+std, cosine)", baseline))
    write_report(
        run.report_path,
        f"fedvox run: {cfg.name}",
        run.manifest(),
        rows,
        curve,
        "det.png",
        extra=fed_section,
        notes=[
            f"training + evaluation took {seconds:.0f} s",
            f"verify threshold (cosine, EER point): {calib['threshold']:.4f}",
            *([privacy_note[0]] if privacy_note else []),
        ],
    )
    return RunOutcome(run, result, baseline or {}, curve, whash, seconds)


def run_experiment(
    cfg: ExperimentConfig, out: Path, progress: bool = True, overwrite: bool = False
) -> RunOutcome:
    """A fresh run of `cfg` into folder `out`."""
    resolve_device(cfg.train.device)  # a GPU asked for but absent fails before any work
    workers = init_workers(cfg.train.workers, cfg.train.device)
    run = RunFolder.create(out, cfg, overwrite=overwrite)
    data = prepare(cfg, progress=progress)
    barrier(workers)  # the other workers prepare from the cache rank 0 just filled
    run.update_manifest(
        n_train_speakers=len(data.train_speakers()),
        n_train_utts=len(data.train_feats),
        n_test_utts=len(data.test_feats),
        n_trials=len(data.trials),
        corpus_dir=str(data.corpus_dir) if data.corpus_dir else None,
    )
    if data.init is not None:  # federated/train.init_from: which weights the run started from
        run.update_manifest(
            init_from=str(data.init.path), init_weights_sha256=data.init.weights_sha256
        )
    if workers.distributed:
        run.update_manifest(train_workers=workers.world_size)
    if cfg.federated is not None:
        return _federated_and_finish(run, cfg, data, resume=False, progress=progress)
    state = _fresh_training(cfg, data, progress and workers.is_main)
    return _train_and_finish(run, cfg, data, state, progress, workers)


def train_worker(cfg: ExperimentConfig, resume_from: Path | None = None) -> None:
    """A data-parallel worker of rank > 0: trains its slice of every batch beside rank 0's
    run_experiment / resume_experiment, and writes nothing (rank 0 owns the run folder)."""
    workers = init_workers(cfg.train.workers, cfg.train.device)
    barrier(workers)  # rank 0 has prepared the data (and, resuming, found its checkpoint)
    data = prepare(cfg, progress=False)
    state = _fresh_training(cfg, data)
    if resume_from is not None:
        found = RunFolder.open(resume_from).load_latest_checkpoint()
        if found is not None:
            state.load_checkpoint(found[1])
            set_determinism(cfg.train.threads, cfg.train.device)
    train(state, centralised_config(cfg), progress=False, workers=workers)
    shutdown(workers)
    # A worker writes nothing, so nothing is left to flush but stdio; leaving without the
    # interpreter's teardown skips the C++ destructors that aborted rank 1 in CI after the
    # group was left ("terminate called without an active exception": a joinable thread
    # destroyed at exit), failing a run whose rank 0 had finished.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _fresh_training(
    cfg: ExperimentConfig, data: PreparedData, progress: bool = False
) -> TrainState:
    """Models, optimiser and chunk sampler over the prepared training features (the extractor
    from train.init_from, the head imprinted, when the config names one)."""
    utts, labels = data.train_labels()
    feats = [data.train_feats[u] for u in utts]
    init = None if data.init is None else data.init.extractor
    return init_training(
        centralised_config(cfg), feats, labels, len(data.train_speakers()), init, progress
    )


def _federated_and_finish(
    run: RunFolder, cfg: ExperimentConfig, data: PreparedData, resume: bool, progress: bool
) -> RunOutcome:
    from fedvox.experiment.federated import run_federated

    t0 = time.perf_counter()
    task = run_federated(run, cfg, data, resume=resume, progress=progress)
    return _evaluate_and_finish(run, cfg, data, task.extractor, t0, progress)


def resume_experiment(path: Path, progress: bool = True) -> RunOutcome:
    """Continue a run from its newest valid checkpoint; ends where an uninterrupted run would."""
    run = RunFolder.open(path)
    cfg = run.config()
    resolve_device(cfg.train.device)
    workers = init_workers(cfg.train.workers, cfg.train.device)
    data = prepare(cfg, progress=progress)
    if cfg.federated is not None:
        return _federated_and_finish(run, cfg, data, resume=True, progress=progress)
    state = _fresh_training(cfg, data)
    found = run.load_latest_checkpoint()
    barrier(workers)  # the others load this same checkpoint before the first step
    if found is not None:
        step, ckpt = found
        state.load_checkpoint(ckpt)
        set_determinism(cfg.train.threads, cfg.train.device)
        run.truncate_metrics(step)
    else:
        run.truncate_metrics(0)
    return _train_and_finish(run, cfg, data, state, progress, workers)


def evaluate_run(
    run_path: Path,
    data_dir: Path,
    trials_path: Path,
    out: Path | None = None,
    backends: tuple[str, ...] | None = None,
    progress: bool = True,
) -> tuple[EvalResult, Path]:
    """Score any data dir + trial list with a trained run and its fitted back end.

    Writes metrics.json, det.png and report.md into `out` (default RUN/eval/<data dir name>).
    """
    from fedvox.data.corpus import load_corpus
    from fedvox.data.store import FeatureStore, extract_corpus
    from fedvox.data.trials import read_trials

    run = RunFolder.open(run_path)
    extractor, cfg = load_run_model(run)
    backend = Backend.load(run.path / "backend")
    corpus = load_corpus(Path(data_dir))
    trials = read_trials(Path(trials_path), corpus)
    sub = corpus.subset(utt_ids=trials.utt_ids())
    sub.validate()
    store = FeatureStore(Path(cfg.data.cache_dir) / "features")
    feats = extract_corpus(
        sub, cfg.features.feature_config(), store, workers=cfg.data.workers, progress=progress
    )
    emb = embed_dict(extractor, feats, trials.utt_ids(), "embed", progress)
    backends = backends or cfg.eval.backends
    result = score_with_backend(emb, trials, backend, tuple(backends), cfg.eval.asnorm_top_n)
    out = Path(out) if out else run.path / "eval" / Path(data_dir).resolve().name
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(
        out / "metrics.json", json.dumps(result.summary(), indent=2, sort_keys=True) + "\n"
    )
    plot_det(
        {n: (s[result.labels], s[~result.labels]) for n, s in result.scores.items()},
        out / "det.png",
    )
    write_report(
        out / "report.md",
        f"fedvox eval: {run.path.name} on {Path(data_dir).name}",
        run.manifest(),
        [(f"{cfg.model.name} + {n}", m.to_dict()) for n, m in result.metrics.items()],
        [],
        "det.png",
        notes=[f"data: {Path(data_dir).resolve()}", f"trials: {Path(trials_path).resolve()}"],
    )
    return result, out


def demo_summary(outcome: RunOutcome, wall_s: float) -> dict:
    """The numbers `fedvox demo` prints (EER in %, minDCF), with the run's provenance."""

    def row(m: dict) -> dict:
        return {
            "eer_pct": round(100 * m["eer"], 2),
            "min_dcf_01": round(m["min_dcf_01"], 3),
            "min_dcf_05": round(m["min_dcf_05"], 3),
        }

    systems = {name: row(m) for name, m in outcome.result.summary().items()}
    if outcome.curve:
        first = outcome.curve[0]
        systems["barely_trained"] = row(vars(first)) | {"step": first.step}
    if outcome.baseline:
        systems["baseline"] = row(outcome.baseline)
    manifest = outcome.run.manifest()
    return {
        "systems": systems,
        "wall_s": round(wall_s, 1),
        "weights_sha256": outcome.weights_sha256,
        "config_hash": manifest["config_hash"],
        "git": manifest["git"],
        "cpu_model": manifest.get("cpu_model"),
        "cpu_isa": manifest.get("cpu_isa"),
        "torch_threads": manifest["torch_threads"],
    }


def write_demo_results(outcome: RunOutcome, path: Path, wall_s: float) -> Path:
    """Write demo_summary as JSON (atomic): the file the README's demo numbers quote."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(demo_summary(outcome, wall_s), indent=2, sort_keys=True) + "\n"
    return atomic_write_text(path, text)
