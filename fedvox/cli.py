"""The one entry point: `fedvox <command>`. Parses options, calls the experiment layer.

Every user mistake surfaces as a FedvoxError message (file, field, fix), never a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from fedvox.errors import FedvoxError

app = typer.Typer(
    name="fedvox",
    help=(
        "Federated x-vector speaker verification, reproducible to the bit.\n\n"
        "Start with `fedvox demo`: it generates the embedded synthetic corpus, trains an "
        "x-vector, evaluates it on held-out speakers and writes a run folder with a report."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
console = Console(stderr=True)
out = Console()

SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help='Override a config field, e.g. --set train.steps=500 --set model.name="ecapa-small" '
        "(value in TOML syntax; repeatable).",
    ),
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars.")]
DeviceOpt = Annotated[
    str | None,
    typer.Option(
        "--device",
        help='Where to train and embed: "cpu", "cuda" or "cuda:N" (same as --set '
        'train.device="cuda"; the federated server stays on the CPU).',
    ),
]


def _config(
    path: Path | None, sets: list[str] | None, name: str | None = None, device: str | None = None
):
    from fedvox.experiment.config import (
        ExperimentConfig,
        config_from_dict,
        load_config,
        parse_override,
        set_dotted,
        strip_none,
    )

    overrides = dict(parse_override(s) for s in (sets or []))
    if device is not None:
        overrides["train.device"] = device
    if path is not None:
        cfg = load_config(path, overrides)
    else:
        d = strip_none(ExperimentConfig().to_dict())  # so --set data.world.seed=0 can add it
        for k, v in overrides.items():
            set_dotted(d, k, v)
        cfg = config_from_dict(strip_none(d), source="defaults + --set")
    if name is not None and path is None:
        cfg = cfg.model_copy(update={"name": name})
    return cfg


def _free_run_dir(base: Path) -> Path:
    """`base`, or `base-2`, `base-3`… — a demo never overwrites an earlier run."""
    if not base.exists() or not any(base.iterdir()):
        return base
    i = 2
    while (p := base.with_name(f"{base.name}-{i}")).exists():
        i += 1
    return p


def _print_outcome(outcome) -> None:
    t = Table(title=f"held-out speakers — {outcome.run.path}")
    for col in ("system", "EER", "minDCF p=0.01", "minDCF p=0.05"):
        t.add_column(col)
    for name, m in outcome.result.metrics.items():
        t.add_row(
            f"x-vector + {name}",
            f"{100 * m.eer:.2f}%",
            f"{m.min_dcf_01:.3f}",
            f"{m.min_dcf_05:.3f}",
        )
    if outcome.curve:
        c = outcome.curve[0]
        t.add_row(
            f"barely trained (step {c.step})",
            f"{100 * c.eer:.2f}%",
            f"{c.min_dcf_01:.3f}",
            f"{c.min_dcf_05:.3f}",
        )
    if outcome.baseline:
        b = outcome.baseline
        t.add_row(
            "non-learned baseline",
            f"{100 * b['eer']:.2f}%",
            f"{b['min_dcf_01']:.3f}",
            f"{b['min_dcf_05']:.3f}",
        )
    out.print(t)
    out.print(f"report: {outcome.run.report_path}   ({outcome.seconds:.0f} s)")


@app.command()
def demo(
    out_dir: Annotated[
        Path, typer.Option("--out", help="Run folder (a free name is chosen if it exists).")
    ] = Path("runs/demo"),
    sets: SetOpt = None,
    quiet: QuietOpt = False,
    results: Annotated[
        Path | None,
        typer.Option(
            help="Also write the printed numbers, wall time and machine as JSON here "
            "(`make numbers` writes docs/results/demo.json, which the README quotes)."
        ),
    ] = None,
    device: DeviceOpt = None,
) -> None:
    """Generate the embedded corpus if absent, extract features, train, evaluate, report.

    Uses the default config (print it with `fedvox config`); change any field with --set.
    Prints EER and minDCF of the trained x-vector, a barely trained one and the non-learned
    baseline on held-out speakers.
    """
    import time

    from fedvox.experiment.runner import run_experiment, write_demo_results

    t0 = time.perf_counter()
    cfg = _config(None, sets, name="demo", device=device)
    outcome = run_experiment(cfg, _free_run_dir(out_dir), progress=not quiet)
    _print_outcome(outcome)
    if results is not None:
        write_demo_results(outcome, results, wall_s=time.perf_counter() - t0)
        out.print(f"results: {results}")


@app.command()
def prepare(
    config: Annotated[
        Path | None, typer.Argument(help="Config TOML (default: the built-in demo config).")
    ] = None,
    sets: SetOpt = None,
    baseline: Annotated[
        bool, typer.Option(help="Also score the non-learned baseline (fbank mean+std, cosine).")
    ] = False,
    quiet: QuietOpt = False,
) -> None:
    """Generate or load the corpora and cache their features; print a summary.

    With the default config this builds the embedded synthetic corpus (cached under
    data.cache_dir, keyed by its settings) and its trial list.
    """
    from fedvox.eval.backend import evaluate_baseline
    from fedvox.experiment.prepare import prepare as do_prepare

    cfg = _config(config, sets)
    data = do_prepare(cfg, progress=not quiet)
    dur = sum(f.shape[0] for f in data.train_feats.values()) / 100 / 3600
    t = Table(title="prepared data")
    t.add_column("")
    t.add_column("value")
    t.add_row("corpus", str(data.corpus_dir or cfg.data.train))
    t.add_row(
        "train speakers / utterances", f"{len(data.train_speakers())} / {len(data.train_feats)}"
    )
    t.add_row("train speech after VAD", f"{dur:.2f} h")
    t.add_row(
        "test speakers / utterances", f"{len(data.test_corpus.speakers())} / {len(data.test_feats)}"
    )
    labels = data.trials.labels()
    t.add_row("trials (target / nontarget)", f"{int(labels.sum())} / {int((~labels).sum())}")
    t.add_row(
        "features", f"{data.feat_dim}-dim log-mel, VAD {cfg.features.vad}, CMN {cfg.features.cmn}"
    )
    if baseline:
        m = evaluate_baseline(data.train_feats, data.test_feats, data.trials)
        t.add_row("baseline EER / minDCF(0.01)", f"{100 * m.eer:.2f}% / {m.min_dcf_01:.3f}")
    out.print(t)


@app.command()
def train(
    config: Annotated[
        Path, typer.Argument(help="Experiment config (TOML). `fedvox config` prints the defaults.")
    ],
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Run folder (default runs/<config name>).")
    ] = None,
    sets: SetOpt = None,
    overwrite: Annotated[bool, typer.Option(help="Reuse an existing run folder.")] = False,
    quiet: QuietOpt = False,
    device: DeviceOpt = None,
) -> None:
    """Train an extractor centrally on a config and evaluate it; writes a run folder.

    The folder holds config.toml (resolved), manifest.json, metrics.jsonl, checkpoints/,
    model.pt, backend/, metrics.json, det.png and report.md. Same config + seed → same bits.
    With train.workers = N > 1 (`--set train.workers=2`) it starts N data-parallel processes
    through torchrun (DDP; each trains batch_size / N examples a step); bits then repeat for
    the same N only.
    """
    from fedvox.experiment.launch import launch_workers, under_launcher, worker_rank
    from fedvox.experiment.runner import run_experiment, train_worker

    cfg = _config(config, sets, device=device)
    out_dir = out_dir or Path("runs") / cfg.name
    if cfg.train.workers > 1 and not under_launcher():  # train.workers processes (torchrun)
        flags = [*(["--overwrite"] if overwrite else []), *(["--quiet"] if quiet else [])]
        raise typer.Exit(launch_workers(cfg, ["train", "{config}", "--out", str(out_dir), *flags]))
    if worker_rank() > 0:
        train_worker(cfg)
        return
    outcome = run_experiment(cfg, out_dir, progress=not quiet, overwrite=overwrite)
    _print_outcome(outcome)


@app.command()
def resume(
    run: Annotated[
        Path, typer.Argument(help="Run folder of an interrupted `fedvox train`/`demo`.")
    ],
    quiet: QuietOpt = False,
) -> None:
    """Continue an interrupted run from its newest valid checkpoint.

    Ends with the same weights an uninterrupted run would have; a torn checkpoint is
    skipped with a warning. A deployed run resumes with `fedvox deploy resume`.
    """
    from fedvox.experiment.deployment import is_deployed
    from fedvox.experiment.launch import launch_workers, under_launcher, worker_rank
    from fedvox.experiment.runfolder import RunFolder
    from fedvox.experiment.runner import resume_experiment, train_worker

    if is_deployed(RunFolder.open(run)):
        raise FedvoxError(
            f"{run} is a deployed run (a Flower app folder in {run / 'deploy'}). "
            f"Fix: `fedvox deploy resume {run}`"
        )
    cfg = RunFolder.open(run).config()
    if cfg.train.workers > 1 and not under_launcher():  # as many processes as it trained on
        raise typer.Exit(launch_workers(cfg, ["resume", str(run), *(["--quiet"] if quiet else [])]))
    if worker_rank() > 0:
        train_worker(cfg, resume_from=run)
        return
    _print_outcome(resume_experiment(run, progress=not quiet))


@app.command("eval")
def eval_cmd(
    run: Annotated[Path, typer.Argument(help="Trained run folder.")],
    data: Annotated[
        Path,
        typer.Option(
            "--data",
            help="Evaluation data: Kaldi data dir, VoxCeleb or LibriSpeech folder, or raw.list.",
        ),
    ],
    trials: Annotated[
        Path,
        typer.Option(
            "--trials",
            help="Trial list: VoxCeleb '1 a.wav b.wav' or Kaldi 'utt1 utt2 target|nontarget'.",
        ),
    ],
    out_dir: Annotated[
        Path | None,
        typer.Option("--out", help="Where to write metrics/report (default RUN/eval/<data name>)."),
    ] = None,
    backend: Annotated[
        list[str] | None,
        typer.Option(help="Back ends: cosine, asnorm, plda (repeatable; default: the run's)."),
    ] = None,
    quiet: QuietOpt = False,
) -> None:
    """Score a trial list on any data dir with a trained run (EER, minDCF, DET plot)."""
    from fedvox.experiment.runner import evaluate_run

    result, where = evaluate_run(
        run, data, trials, out_dir, tuple(backend) if backend else None, progress=not quiet
    )
    t = Table(title=f"{data} — {len(result.labels)} trials")
    for col in ("back end", "EER", "minDCF p=0.01", "minDCF p=0.05"):
        t.add_column(col)
    for name, m in result.metrics.items():
        t.add_row(name, f"{100 * m.eer:.2f}%", f"{m.min_dcf_01:.3f}", f"{m.min_dcf_05:.3f}")
    out.print(t)
    out.print(f"report: {where / 'report.md'}")


@app.command()
def enroll(
    run: Annotated[Path, typer.Argument(help="Trained run folder.")],
    wavs: Annotated[
        list[Path], typer.Argument(help="Enrollment recordings of one speaker (16 kHz mono wav).")
    ],
    speaker: Annotated[str, typer.Option(help="Name stored in the profile.")] = "speaker",
    out_path: Annotated[Path, typer.Option("--out", help="Profile file to write (JSON).")] = Path(
        "profile.json"
    ),
) -> None:
    """Make a speaker profile from enrollment wavs (mean of normalised embeddings)."""
    from fedvox.experiment.enroll import enroll as do_enroll

    profile = do_enroll(run, wavs, speaker)
    profile.save(out_path)
    out.print(f"enrolled '{speaker}' from {len(wavs)} recording(s) → {out_path}")


@app.command()
def verify(
    profile: Annotated[Path, typer.Argument(help="Profile written by `fedvox enroll`.")],
    wav: Annotated[Path, typer.Argument(help="Test recording (16 kHz mono wav).")],
    run: Annotated[
        Path | None, typer.Option(help="Run folder (default: the one the profile was made with).")
    ] = None,
    threshold: Annotated[
        float | None, typer.Option(help="Override the calibrated threshold (cosine score).")
    ] = None,
) -> None:
    """Score a wav against a profile: accept or reject at the run's calibrated threshold.

    The threshold is the EER operating point measured on the run's evaluation trials.
    Exit status 0 = accepted, 1 = rejected.
    """
    from fedvox.experiment.enroll import Profile
    from fedvox.experiment.enroll import verify as do_verify

    p = Profile.load(profile)
    d = do_verify(p, wav, run, threshold)
    verdict = "ACCEPT" if d.accept else "REJECT"
    out.print(
        f"{verdict}  score {d.score:.4f}  threshold {d.threshold:.4f}  ('{p.speaker}' vs {wav})"
    )
    raise typer.Exit(0 if d.accept else 1)


@app.command()
def export(
    run: Annotated[Path, typer.Argument(help="Trained run folder.")],
    out_path: Annotated[Path, typer.Option("--out", help="File to write.")] = Path("extractor.pt"),
    fmt: Annotated[
        str,
        typer.Option(
            "--format", help="torchscript (torch.jit.load) or onnx (dynamic batch and frame axes)."
        ),
    ] = "torchscript",
) -> None:
    """Export the extractor (input: features, batch x frames x bins) for use without fedvox.

    Features must be computed as the run's config says (fbank, sliding CMN, VAD); the
    exported model maps them to embeddings. The export is checked against the eager model.
    """
    from fedvox.experiment.export import export_onnx, export_torchscript

    if fmt not in ("torchscript", "onnx"):
        raise FedvoxError(
            f"unknown export format '{fmt}'. Fix: use --format torchscript or --format onnx"
        )
    path, diff = (export_onnx if fmt == "onnx" else export_torchscript)(run, out_path)
    out.print(f"exported {fmt} extractor → {path} (max |diff| vs eager {diff:.2e})")


@app.command()
def compare(
    runs: Annotated[
        list[Path], typer.Argument(help="Run folders to compare (federated and centralised).")
    ],
    out_dir: Annotated[
        Path, typer.Option("--out", help="Folder for compare.md and the plots.")
    ] = Path("runs/compare"),
    target: Annotated[
        float | None,
        typer.Option(
            help="Target EER as a fraction (e.g. 0.1); default: the worst of the federated runs' best EERs."
        ),
    ] = None,
    x: Annotated[
        list[str] | None,
        typer.Option(
            "--x",
            help="X-axis to plot EER against (repeatable): trips, hours, mb_up (MB uploaded, "
            "e.g. compression arms); default: trips and hours.",
        ),
    ] = None,
) -> None:
    """Compare runs: EER vs client trips and vs virtual hours (or MB uploaded, --x mb_up), and
    a table of what each run needs to reach a target EER. Runs are labelled by folder name."""
    from fedvox.experiment.compare import compare_runs

    axes = x or ["trips", "hours"]
    path = compare_runs(runs, out_dir, target, axes)
    out.print(path.read_text())
    plots = ", ".join(str(out_dir / f"eer_vs_{a}.png") for a in dict.fromkeys(axes))
    out.print(f"written: {path}, {plots}")


@app.command()
def repro(
    study: Annotated[
        str,
        typer.Argument(
            help="federated-gain | fedrecon-speakers | dp-utility | robustness | "
            "fedbuff-concurrency | dp-scale (see docs/studies.md)."
        ),
    ],
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Study folder (default runs/<study>).")
    ] = None,
    sets: SetOpt = None,
    arms: Annotated[
        list[str] | None, typer.Option("--arm", help="Run only these arms (repeatable).")
    ] = None,
    quiet: QuietOpt = False,
) -> None:
    """Run a reproduction study: every arm on the same data, budget and
    seed, then a table (study.md) and plots. Finished arms are reused and
    interrupted ones resumed, so rerunning the command continues a study.
    --set applies to every arm (e.g. --set seed=1).

    federated-gain asks whether federation earns its place on the
    two-domain world: each federated arm is placed between public-only
    (the server alone: centralised on its public speakers) and
    pooled-oracle (centralised on all device audio) as the fraction of
    that gap it closes, on the same device test trials. An arm may use
    another arm's run folder ("{arm:NAME}", e.g. the fine-tuning arms'
    federated.init_from); the study runs that arm first, also under --arm.

      fedvox repro federated-gain
      fedvox repro federated-gain --arm ft-fedavg   (public-only first)
      fedvox repro federated-gain --set data.world.train_devices=500

    fedbuff-concurrency counts client trips to a common target EER for
    FedAvgM, FedBuff (K = 10) and FedAsync at 10, 100 and 1,000 devices in
    flight on a 10,000-device world (the FedBuff paper's Figure 1);
    dp-scale puts ε = 8 and 4 on the same world (1,000 opt-in devices held
    out as the centroid panel, ε covering the 9,000 that train). The first
    takes about 2 h 15 min with two arms side by side on two cores (the world
    ~15 min), dp-scale about 1 h 30 min for its six arms (references shared:
    link runs/dp/public-only and pooled-oracle to the concurrency study's);
    a quick look on a small world, about 5 minutes an arm (C = 1,000 needs
    the full world):

      fedvox repro fedbuff-concurrency --set data.world.train_devices=1000
        --set federated.server_steps=2000 --set federated.eval_every=200
        --set federated.checkpoint_every=200 --arm fedbuff-c100 ...
    """
    from fedvox.experiment.config import parse_override
    from fedvox.experiment.repro import run_study

    overrides = dict(parse_override(s) for s in (sets or []))
    path = run_study(study, out_dir or Path("runs") / study, overrides, arms, not quiet)
    out.print(path.read_text())
    out.print(f"written: {path}")


@app.command()
def reconeval(
    run: Annotated[Path, typer.Argument(help="Finished run folder (any `speakers` mode).")],
    steps: Annotated[
        list[int] | None,
        typer.Option(
            "--steps", help="Reconstruction SGD epochs to compare (repeatable; default 0 1 5)."
        ),
    ] = None,
    lr: Annotated[
        float | None,
        typer.Option(help="Learning rate of those epochs (default: reconstruction.lr)."),
    ] = None,
    quiet: QuietOpt = False,
) -> None:
    """RECONEVAL on the held-out speakers: each is a device that enrolls its prototype on half
    its utterances (closed form, then k SGD epochs against public negatives) and is scored on
    the other half. Writes reconeval.json and reconeval.md into the run folder."""
    from fedvox.experiment.reconeval import recon_eval_speakers

    res = recon_eval_speakers(run, tuple(steps) if steps else (0, 1, 5), lr, progress=not quiet)
    t = Table(
        title=f"{run}: {res['n_speakers']} unseen speakers, lr {res['lr']:g}, "
        f"{res['public_speakers']} public negatives"
    )
    for col in ("steps", "EER", "minDCF p=0.01", "spread", "target", "nontarget"):
        t.add_column(col)
    for r in res["results"]:
        t.add_row(
            str(r["steps"]),
            f"{100 * r['eer']:.2f}%",
            f"{r['min_dcf_01']:.3f}",
            f"{r['spread']:.4f}",
            str(r["n_target"]),
            str(r["n_nontarget"]),
        )
    out.print(t)
    out.print(f"written: {Path(run) / 'reconeval.json'}, {Path(run) / 'reconeval.md'}")


@app.command()
def world(
    seed: Annotated[int, typer.Option(help="World seed: same seed and settings, same bits.")] = 0,
    public_speakers: Annotated[
        int, typer.Option(help="Labelled speakers of the public/server domain (studio).")
    ] = 300,
    train_devices: Annotated[int, typer.Option(help="One-speaker training devices.")] = 2000,
    test_devices: Annotated[
        int, typer.Option(help="Held-out devices: the test speakers of the trial list.")
    ] = 200,
    cache_dir: Annotated[
        Path, typer.Option(help="Cache root (as data.cache_dir); parts go under corpora/.")
    ] = Path(".cache/fedvox"),
    workers: Annotated[int, typer.Option(help="Generation processes (bytes do not depend).")] = 2,
    quiet: QuietOpt = False,
) -> None:
    """Generate (or find cached) the two-domain world and print its data dirs and trial list.

    The public domain is what a server holds: labelled speakers, studio channel, many long
    utterances. The device domain is what phones, earbuds and smart speakers hold: one speaker
    each, another accent and a conversational style, 4-40 short recordings, and a persistent
    channel (a device model from a catalogue plus the owner's rooms). Held-out devices are
    the test speakers; their nontarget trials include pairs of one device model.

    Each part is cached on its own, keyed by its settings. Use the printed paths with any
    experiment, e.g. the server-only reference line:

      fedvox train configs/x.toml --set data.train=PUBLIC --set data.test=TEST
      --set data.trials=TRIALS

    and data.train=DEVICES for the pooled-device oracle. Domains beyond these counts (accent,
    style, catalogue severity) are set in Python: fedvox.data.world.WorldConfig.
    See docs/synthetic.md, "Two-domain world".
    """
    from fedvox.data.world import WorldConfig, ensure_world

    cfg = WorldConfig(
        seed=seed,
        public_speakers=public_speakers,
        train_devices=train_devices,
        test_devices=test_devices,
    )
    if workers < 1:
        from fedvox.errors import ConfigError

        raise ConfigError("--workers", f"got {workers}", "use 1 or more")
    paths = ensure_world(cfg, Path(cache_dir) / "corpora", workers=workers, progress=not quiet)
    print(f"public   {paths.public}")
    print(f"devices  {paths.devices}")
    print(f"test     {paths.test}")
    print(f"trials   {paths.trials}")


@app.command()
def config(
    out_path: Annotated[
        Path | None, typer.Option("--out", help="Write to a file instead of printing.")
    ] = None,
) -> None:
    """Print the default experiment config (TOML) — a starting point for `fedvox train`."""
    from fedvox.atomic import atomic_write_text
    from fedvox.experiment.config import ExperimentConfig, dump_toml

    text = dump_toml(ExperimentConfig())
    if out_path:
        atomic_write_text(out_path, text)
        out.print(f"wrote {out_path}")
    else:
        print(text, end="")


deploy_app = typer.Typer(
    help=(
        "Run a federated config as a real federation on Flower's runtime (the `deploy` "
        "extra): keys, a local federation on loopback, the commands for separate machines, "
        "and resuming an interrupted run from its checkpoint."
    ),
    no_args_is_help=True,
)
app.add_typer(deploy_app, name="deploy")

InsecureOpt = Annotated[
    bool,
    typer.Option(
        "--insecure",
        help="No TLS and no node authentication: anyone on the network can read updates and "
        "join as a node. For debugging only.",
    ),
]


def _warn_insecure() -> None:
    console.print(
        "[bold red]WARNING: --insecure: no TLS, no node authentication. Updates travel in "
        "clear text and any process can join as a node. Debugging only.[/]",
        highlight=False,
    )


@deploy_app.command("keys")
def deploy_keys(
    out_dir: Annotated[Path, typer.Argument(help="Folder for the CA, certificate and keys.")],
    hosts: Annotated[
        list[str] | None,
        typer.Option(
            "--host",
            help="Name or IP the nodes dial for the SuperLink (repeatable; default "
            "localhost and 127.0.0.1).",
        ),
    ] = None,
    nodes: Annotated[int, typer.Option(help="Node key pairs to make.")] = 4,
    overwrite: Annotated[bool, typer.Option(help="Replace keys already in OUT.")] = False,
) -> None:
    """Make a CA, the SuperLink's TLS certificate and N node EC key pairs (private keys 0600).

    ca.pem goes to every node; superlink.pem/.key stay on the SuperLink; nodes/node-i.key
    goes to node i only; nodes/node-i.pub is what the SuperLink registers.
    """
    from fedvox.deploy.keys import write_keys

    layout = write_keys(out_dir, hosts or ["localhost", "127.0.0.1"], nodes, overwrite)
    out.print(f"wrote a CA, the SuperLink certificate and {nodes} node key pairs in {layout.root}")


def _local_settings(nodes, insecure, keys, reply_timeout, timeout=3600.0, own_data=False):
    from fedvox.experiment.deployment import LocalSettings

    return LocalSettings(
        nodes=nodes,
        insecure=insecure,
        keys=keys,
        reply_timeout=reply_timeout,
        timeout_s=timeout,
        own_data=own_data,
    )


NodesOpt = Annotated[
    int | None,
    typer.Option(help="Nodes (one client each); default: the clients of the config's partition."),
]
ReplyTimeoutOpt = Annotated[
    float | None,
    typer.Option(
        "--reply-timeout",
        help="Seconds a synchronous round waits for its updates (missing ones are dropouts); "
        "asynchronous: seconds without any reply before the run stops.",
    ),
]


@deploy_app.command("prepare")
def deploy_prepare(
    config: Annotated[Path, typer.Argument(help="Federated experiment config (TOML).")],
    out_dir: Annotated[Path, typer.Option("--out", help="Run folder.")],
    nodes: NodesOpt = None,
    reply_timeout: ReplyTimeoutOpt = None,
    sets: SetOpt = None,
    overwrite: Annotated[bool, typer.Option(help="Reuse an existing run folder.")] = False,
    own_data: Annotated[
        bool,
        typer.Option(
            "--own-data",
            help="Nodes train on their own data folders (kaldi-dir/voxceleb-dir in their node "
            'config; needs federated.speakers = "local" and --nodes): no shards are written.',
        ),
    ] = False,
) -> None:
    """Write a run folder, one data shard per node and the Flower app folder (no processes).

    Then `fedvox deploy print-commands RUN` says what to start where.
    """
    from fedvox.experiment.deployment import prepare_deployed_run

    cfg = _config(config, sets)
    settings = _local_settings(nodes, True, None, reply_timeout, own_data=own_data)
    run, shards, _ = prepare_deployed_run(cfg, out_dir, settings, overwrite)
    if own_data:
        out.print(f"prepared {run.path} for {nodes} nodes on their own data")
    else:
        out.print(f"prepared {run.path}: {len(shards)} node shards in {shards[0].parent}")


@deploy_app.command("print-commands")
def deploy_print_commands(
    run: Annotated[Path, typer.Argument(help="Run folder of `fedvox deploy prepare`.")],
    host: Annotated[str, typer.Option(help="Name or IP of the SuperLink machine.")],
    keys: Annotated[
        Path | None, typer.Option(help="Folder of `fedvox deploy keys` (made for --host).")
    ] = None,
    port: Annotated[int, typer.Option(help="The SuperLink's port.")] = 9092,
    node_dir: Annotated[
        str, typer.Option(help="Folder on each node machine holding its files.")
    ] = "/opt/fedvox-node",
    node_layout: Annotated[
        str,
        typer.Option(
            help="Nodes on their own data (`prepare --own-data`): their folder NODE_DIR/data "
            "is a Kaldi dir (kaldi) or a VoxCeleb tree (voxceleb)."
        ),
    ] = "kaldi",
    insecure: InsecureOpt = False,
) -> None:
    """Print the exact commands that run a prepared run on separate machines."""
    from fedvox.experiment.deployment import print_commands
    from fedvox.experiment.runfolder import RunFolder

    if insecure:
        _warn_insecure()
    elif keys is None:
        raise FedvoxError(
            "--keys: missing. Fix: give the folder of `fedvox deploy keys`, or --insecure"
        )
    layout_key = f"{node_layout}-dir"
    for line in print_commands(
        RunFolder.open(run), host, port, None if insecure else keys, node_dir, layout_key
    ):
        print(line)


@deploy_app.command("local")
def deploy_local_cmd(
    config: Annotated[Path, typer.Argument(help="Federated experiment config (TOML).")],
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Run folder (default runs/<name>-deployed).")
    ] = None,
    nodes: NodesOpt = None,
    keys: Annotated[
        Path | None,
        typer.Option(help="Keys of `fedvox deploy keys` (default: fresh ones in the run folder)."),
    ] = None,
    reply_timeout: ReplyTimeoutOpt = None,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 3600.0,
    insecure: InsecureOpt = False,
    sets: SetOpt = None,
    overwrite: Annotated[bool, typer.Option(help="Reuse an existing run folder.")] = False,
) -> None:
    """Run a federated config on loopback: one SuperLink and a SuperNode per client with TLS
    and node authentication, each holding its shard; writes a normal run folder and report.

    Every process it starts is stopped by its PID at the end, on an error and on Ctrl-C.
    """
    from fedvox.experiment.deployment import deploy_local

    if insecure:
        _warn_insecure()
    cfg = _config(config, sets)
    settings = _local_settings(nodes, insecure, keys, reply_timeout, timeout)
    path = out_dir or Path("runs") / f"{cfg.name}-deployed"
    status = deploy_local(cfg, path, settings, overwrite)
    traffic = status.get("flower", {})
    out.print(
        f"{path}: {status['steps']} server steps in {status['seconds']:.1f} s on "
        f"{'TLS + node authentication' if status['tls'] else 'INSECURE transport'}; "
        f"Flower moved {traffic.get('total-bytes', 0) / 1e6:.1f} MB; report {path / 'report.md'}"
    )


@deploy_app.command("resume")
def deploy_resume_cmd(
    run: Annotated[
        Path,
        typer.Argument(help="Run folder of an interrupted `fedvox deploy local` or prepared run."),
    ],
    keys: Annotated[
        Path | None,
        typer.Option(help="Keys the run used (default: RUN/deploy/keys, as `deploy local` made)."),
    ] = None,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 3600.0,
    insecure: InsecureOpt = False,
    command_only: Annotated[
        bool,
        typer.Option(
            "--command-only",
            help="Start nothing: check the run and print the `flwr run` that resumes it on a "
            "federation started by hand (`deploy print-commands`).",
        ),
    ] = False,
) -> None:
    """Continue a deployed run from its newest checkpoint (one every
    federated.checkpoint_every server steps).

    Starts a SuperLink and a SuperNode per shard on loopback (as `deploy local`)
    and submits the run again with resume = true: the server loads the
    checkpoint, cuts metrics.jsonl, trips.jsonl and arrivals.jsonl back to it,
    sends the trips that were in flight again and trains to the end.

    Replies arriving in the same order, it ends on the bits of an uninterrupted
    run. A step in progress (secure aggregation included) is redone. Refuses,
    naming the file or field, a folder that is not a deployed run, has no
    checkpoint, completed, or whose config changed.
    """
    from fedvox.experiment.deployment import resume_commands, resume_local
    from fedvox.experiment.runfolder import RunFolder

    if command_only:
        for line in resume_commands(RunFolder.open(run)):
            print(line)
        return
    if insecure:
        _warn_insecure()
    settings = _local_settings(None, insecure, keys, None, timeout)
    status = resume_local(run, settings)
    traffic = status.get("flower", {})
    out.print(
        f"{run}: resumed from server step {status['resumed_from_step']}, now at step "
        f"{status['steps']} ({status['seconds']:.1f} s) on "
        f"{'TLS + node authentication' if status['tls'] else 'INSECURE transport'}; "
        f"Flower moved {traffic.get('total-bytes', 0) / 1e6:.1f} MB; report {run / 'report.md'}"
    )


def main() -> None:
    """Console entry point: user errors become one clear line and exit status 2."""
    try:
        app()
    except FedvoxError as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False)
        sys.exit(2)
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
