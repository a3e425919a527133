"""Reproduction studies (`fedvox repro STUDY`): several arms, same data, budget and seed.

Each arm is an ordinary run (a config = the study's base + the arm's overrides + the user's
--set) in its own folder under the study folder; a finished arm is reused and an
interrupted one resumed, so a study can be stopped and restarted. The study writes
study.md (the table), the arms' compare plots and, for dp-utility, EER against ε.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fedvox.atomic import atomic_write, atomic_write_text
from fedvox.errors import ConfigError
from fedvox.experiment.config import ExperimentConfig, config_from_dict, set_dotted, strip_none
from fedvox.records import EvalRecord, read_run_log

RESULT = "metrics.json"


@dataclass(frozen=True)
class Arm:
    """One configuration of a study: a name, dotted-key overrides, and what the server sees."""

    name: str
    overrides: dict[str, Any]
    server_sees: str = ""
    centralised: bool = False


@dataclass(frozen=True)
class Study:
    """A named set of arms on one shared base config."""

    name: str
    title: str
    base: dict[str, Any]
    arms: tuple[Arm, ...]
    table: str = "speakers"  # which table builder
    notes: tuple[str, ...] = field(default_factory=tuple)


# One budget for every federated arm: client trips (a trip = download, local training, upload).
# One speaker per device on the default corpus: 200 devices with ~20 fixed 2 s chunks each.
# Synchronous FedAvg, cohort 100, plain server SGD (lr 1 decaying to 0.3) over two local
# epochs of SGD: measured to learn steadily (docs/federated.md, "What learns"); server Adam
# with stale FedBuff updates did not.
FED_BASE: dict[str, Any] = {
    "train.threads": 1,
    "federated.algorithm": "fedavg",
    "federated.concurrency": 100,
    "federated.server_optimizer": "sgd",
    "federated.server_lr": 1.0,
    "federated.server_final_lr": 0.3,
    "federated.local_epochs": 2,
    "federated.local_batch_size": 8,
    "federated.local_lr": 0.05,
    "federated.server_steps": 40,
    "federated.eval_every": 4,
    "federated.checkpoint_every": 4,
    "federated.reconstruction.split": "all",
}

# The base the dp-utility table was measured with (FedBuff C = 100 / FedAvg, server Adam).
DP_BASE: dict[str, Any] = {
    "train.threads": 1,
    "federated.algorithm": "fedbuff",
    "federated.concurrency": 100,
    "federated.buffer_size": 10,
    "federated.server_optimizer": "adam",
    "federated.server_lr": 2e-3,
    "federated.server_tau": 1e-6,
    "federated.server_warmup_steps": 20,
    "federated.server_final_lr": 1e-4,
    "federated.local_batch_size": 64,
    "federated.local_lr": 0.01,
    "federated.server_steps": 200,
    "federated.eval_every": 20,
    "federated.checkpoint_every": 20,
    "federated.reconstruction.split": "fraction",
}

DP_Z = (0.1, 0.3, 1.0)  # noise multipliers of the dp-utility arms
# FedAvg arms of dp-utility: cohort 20, 30 rounds = the FedBuff arms' 600 trips
FEDAVG_DP: dict[str, Any] = {
    "federated.algorithm": "fedavg",
    "federated.server_steps": 30,
    "federated.server_warmup_steps": 3,
    "federated.eval_every": 10,
    "federated.checkpoint_every": 10,
}

STUDIES: dict[str, Study] = {
    "fedrecon-speakers": Study(
        name="fedrecon-speakers",
        title="Speakers as local parameters vs a global head, FedAwS and centralised training",
        base=FED_BASE,
        arms=(
            Arm(
                "centralised",
                {"federated": None},
                "all training audio (pooled)",
                centralised=True,
            ),
            Arm(
                "fedrecon-local-speakers",
                {"federated.speakers": "local", "model.margin": 0.0},
                "the extractor update only; prototypes never leave the device",
            ),
            Arm(
                "fedavg-global-head",
                {"federated.speakers": "global_head"},
                "the extractor update and every device's speaker row (a voiceprint)",
            ),
            Arm(
                "fedaws",
                {"federated.speakers": "fedaws"},
                "the extractor update and every device's class vector (a voiceprint)",
            ),
            Arm(
                "fedavg-codewords",
                {"federated.speakers": "codewords"},
                "the extractor update only; head rows are fixed random codewords (no voice)",
            ),
        ),
        notes=(
            "Federated arms: FedAvg (cohort 100 of 200 devices, 40 rounds = 4,000 client "
            "trips), server SGD, two local epochs, one speaker per device, the same budget "
            "and seed; centralised: the default trainer (700 steps of 64 random 2–3 s crops).",
        ),
    ),
    "dp-utility": Study(
        name="dp-utility",
        title="Unseen-speaker EER against ε: FedAvg (Gaussian DP) and FedBuff (DP-FTRL)",
        base={
            **DP_BASE,
            "federated.speakers": "local",
            "federated.weighting": "uniform",
            "federated.concurrency": 20,
            "federated.server_steps": 60,
            "federated.server_warmup_steps": 6,
            "federated.eval_every": 20,
            "federated.checkpoint_every": 20,
            "federated.privacy.delta": 1e-3,
            "federated.privacy.clip_norm": 0.3,
        },
        arms=(
            Arm("fedavg-nodp", FEDAVG_DP),
            *(
                Arm(
                    f"fedavg-z{z}",
                    {
                        **FEDAVG_DP,
                        "federated.privacy.mechanism": "gaussian",
                        "federated.privacy.noise_multiplier": z,
                    },
                )
                for z in DP_Z
            ),
            Arm("fedbuff-nodp", {}),
            *(
                Arm(
                    f"fedbuff-dpftrl-z{z}",
                    {
                        "federated.privacy.mechanism": "dp_ftrl",
                        "federated.privacy.noise_multiplier": z,
                    },
                )
                for z in DP_Z
            ),
        ),
        table="dp",
        notes=(
            "Local speakers (Federated Reconstruction), 600 client trips per arm, clip norm "
            "S = 0.3 (fixed; update norms were 0.28–0.57 at initialisation), δ = 1e-3 "
            "(< 1/n for n = 200 devices), RDP accounting. FedAvg samples 20 of 200 devices "
            "per round without replacement; FedBuff (C = 20, K = 10) + DP-FTRL lets each "
            "device train at most once per tree (an epoch of the population).",
        ),
    ),
}


def arm_config(study: Study, arm: Arm, sets: dict[str, Any]) -> ExperimentConfig:
    """The arm's resolved config: defaults ← study base ← arm overrides ← the user's --set."""
    d = ExperimentConfig().to_dict()
    d["name"] = f"{study.name}-{arm.name}"
    d.pop("federated", None)
    for key, value in {**study.base, **arm.overrides, **sets}.items():
        if key == "federated" and value is None:
            continue
        if arm.centralised and key.startswith("federated."):
            continue
        set_dotted(d, key, copy.deepcopy(value))
    return config_from_dict(strip_none(d), source=f"study {study.name}, arm {arm.name}")


def run_arm(cfg: ExperimentConfig, folder: Path, progress: bool) -> Path:
    """Run (or resume, or reuse) one arm into `folder`."""
    from fedvox.experiment.runner import resume_experiment, run_experiment

    if (folder / RESULT).is_file():
        return folder
    if (folder / "config.toml").is_file():
        resume_experiment(folder, progress=progress)
    else:
        run_experiment(cfg, folder, progress=progress)
    return folder


def _arm_row(arm: Arm, folder: Path) -> dict[str, Any]:
    result = json.loads((folder / RESULT).read_text())
    cosine = result["backends"]["cosine"]
    evals = read_run_log(folder / "metrics.jsonl", (EvalRecord,))
    last = evals[-1] if evals else None
    trips = None if last is None else last.trips
    up = None if last is None else last.bytes_up
    down = None if last is None else last.bytes_down
    row = {
        "arm": arm.name,
        "eer": cosine["eer"],
        "min_dcf_01": cosine["min_dcf_01"],
        "trips": trips,
        "mb_up_per_trip": up / trips / 1e6 if trips and up is not None else None,
        "mb_down_per_trip": down / trips / 1e6 if trips and down is not None else None,
        "server_sees": arm.server_sees,
        "epsilon": result.get("privacy", {}).get("epsilon"),
        "folder": str(folder),
    }
    return row


def _speakers_table(rows: list[dict]) -> list[str]:
    out = [
        "| arm | unseen-speaker EER | minDCF (p=0.01) | client trips | MB up / trip "
        "| MB down / trip | what the server can see |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        up = "—" if r["mb_up_per_trip"] is None else f"{r['mb_up_per_trip']:.2f}"
        down = "—" if r["mb_down_per_trip"] is None else f"{r['mb_down_per_trip']:.2f}"
        trips = "—" if r["trips"] is None else str(r["trips"])
        out.append(
            f"| {r['arm']} | {100 * r['eer']:.2f}% | {r['min_dcf_01']:.3f} | {trips} | {up} "
            f"| {down} | {r['server_sees']} |"
        )
    return out


def _dp_table(rows: list[dict]) -> list[str]:
    out = ["| arm | ε (δ = 1e-3) | unseen-speaker EER | minDCF (p=0.01) |", "|---|---|---|---|"]
    for r in rows:
        eps = "∞ (no DP)" if r["epsilon"] is None else f"{r['epsilon']:.2f}"
        out.append(f"| {r['arm']} | {eps} | {100 * r['eer']:.2f}% | {r['min_dcf_01']:.3f} |")
    return out


def _plot_dp(rows: list[dict], path: Path) -> Path:
    """EER against ε, one line per algorithm (no-DP runs drawn as dashed levels)."""
    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for algo, colour in (("fedavg", "#1f77b4"), ("fedbuff", "#d62728")):
        pts = sorted(
            (r["epsilon"], r["eer"])
            for r in rows
            if r["arm"].startswith(algo) and r["epsilon"] is not None
        )
        if pts:
            ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], "o-", color=colour, label=algo)
        for r in rows:
            if r["arm"].startswith(algo) and r["epsilon"] is None:
                ax.axhline(100 * r["eer"], color=colour, ls="--", lw=1, label=f"{algo}, no DP")
    ax.set_xscale("log")
    ax.set_xlabel("ε (δ = 1e-3)")
    ax.set_ylabel("unseen-speaker EER (%)")
    ax.legend()
    fig.tight_layout()
    return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))


TABLES: dict[str, Callable[[list[dict]], list[str]]] = {
    "speakers": _speakers_table,
    "dp": _dp_table,
}


def run_study(
    name: str,
    out: Path,
    sets: dict[str, Any] | None = None,
    arms: list[str] | None = None,
    progress: bool = True,
) -> Path:
    """Run every arm of study `name` into `out/<arm>` and write `out/study.md`."""
    from fedvox.experiment.compare import compare_runs

    if name not in STUDIES:
        raise ConfigError("study", f"unknown study {name!r}", f"use one of {', '.join(STUDIES)}")
    study = STUDIES[name]
    chosen = [a for a in study.arms if arms is None or a.name in arms]
    unknown = set(arms or []) - {a.name for a in study.arms}
    if unknown:
        raise ConfigError(
            "--arm", f"unknown arm(s) {sorted(unknown)}", f"use {[a.name for a in study.arms]}"
        )
    configs = [(a, arm_config(study, a, sets or {})) for a in chosen]  # refuse early
    rows = []
    for arm, cfg in configs:
        folder = run_arm(cfg, out / arm.name, progress)
        rows.append(_arm_row(arm, folder))
    compare_runs([r["folder"] for r in rows], out)
    lines = [f"# fedvox repro {name}", "", study.title, "", *TABLES[study.table](rows), ""]
    if study.table == "dp":
        _plot_dp(rows, out / "eer_vs_epsilon.png")
        lines += ["![EER vs ε](eer_vs_epsilon.png)", ""]
    lines += ["![EER vs client trips](eer_vs_trips.png)", "", *study.notes, ""]
    lines += ["Arms (each an ordinary run folder):", *(f"- `{r['folder']}`" for r in rows), ""]
    atomic_write_text(out / "rows.json", json.dumps(rows, indent=1) + "\n")
    return atomic_write_text(out / "study.md", "\n".join(lines))
