"""Reproduction studies (`fedvox repro STUDY`): several arms, same data, budget and seed.

Each arm is an ordinary run (a config = the study's base + the arm's overrides + the user's
--set) in its own folder under the study folder; a finished arm is reused and an
interrupted one resumed, so a study can be stopped and restarted. An arm may use another
arm's finished run folder: a value "{arm:NAME}" (e.g. federated.init_from) becomes that
arm's folder, and the study runs NAME first. The study writes study.md (the table), the
arms' compare plots, for dp-utility EER against ε and, where the study has both reference
arms (public-only and the pooled oracle), the fraction of the gap between them each arm
closes, and EER curves with the two references as horizontal lines.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fedvox.atomic import atomic_write, atomic_write_text
from fedvox.errors import ConfigError, DataError
from fedvox.experiment.config import ExperimentConfig, config_from_dict, set_dotted, strip_none
from fedvox.records import EvalRecord, ServerStepRecord, read_run_log

RESULT = "metrics.json"


@dataclass(frozen=True)
class Arm:
    """One configuration of a study: a name, dotted-key overrides, and what the server sees."""

    name: str
    overrides: dict[str, Any]
    server_sees: str = ""
    centralised: bool = False
    # settings computed from the merged ones (base ← overrides ← --set), applied last: e.g.
    # FedBuff's server steps from the FedAvg arms' budget, so --set cannot unbalance it
    derived: Mapping[str, Callable[[Mapping[str, Any]], Any]] = field(default_factory=dict)
    # columns a study's table reads (e.g. attack, fraction, defence), copied into the row
    labels: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Study:
    """A named set of arms on one shared base config."""

    name: str
    title: str
    base: dict[str, Any]
    arms: tuple[Arm, ...]
    table: str = "speakers"  # which table builder
    notes: tuple[str, ...] = field(default_factory=tuple)
    # (public-only arm, pooled-oracle arm): the two reference lines of "gap closed"
    references: tuple[str, str] | None = None
    # an arm whose model turned non-finite (its scores are NaN) is a row marked diverged,
    # not a failed study: an attack may destroy the model it attacks
    diverged_rows: bool = False


# Federated settings measured to learn with local speakers (docs/federated.md, "What
# learns"): plain server SGD, lr 1 decaying to 0.3, two local epochs of SGD at lr 0.05.
WHAT_LEARNS: dict[str, Any] = {
    "federated.server_optimizer": "sgd",
    "federated.server_lr": 1.0,
    "federated.server_final_lr": 0.3,
    "federated.local_epochs": 2,
    "federated.local_batch_size": 8,
    "federated.local_lr": 0.05,
}

# One budget for every federated arm: client trips (a trip = download, local training, upload).
# One speaker per device on the default corpus: 200 devices with ~20 fixed 2 s chunks each.
# Synchronous FedAvg, cohort 100, plain server SGD (lr 1 decaying to 0.3) over two local
# epochs of SGD: measured to learn steadily (docs/federated.md, "What learns"); server Adam
# with stale FedBuff updates did not.
FED_BASE: dict[str, Any] = {
    "train.threads": 1,
    "federated.algorithm": "fedavg",
    "federated.concurrency": 100,
    **WHAT_LEARNS,
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

# The two-domain world (fedvox.data.world): every arm trains and/or is evaluated on it.
# [data.world] with only the seed set takes WorldConfig()'s counts: 300 public speakers,
# 2,000 one-speaker training devices, 200 held-out test devices (the trial list).
WORLD_BASE: dict[str, Any] = {
    "train.threads": 1,
    "data.world.seed": 0,
    "data.train": "world:devices",
    "data.test": "world:test",
    "data.trials": "world:trials",
    "data.public": "world:public",
    # federated extractors use LayerNorm; the centralised arms use it too, so the public-only
    # model can start the fine-tuning arms (federated.init_from) and the references compare
    # the same architecture
    "model.norm": "layer",
    # the study-sized TDNN: a client trip of xvector-small costs ~0.8 s of FLOPs alone on
    # one core here (benchmarks/bench_world_trip.py), too slow for thousands of trips
    "model.name": "xvector-tiny",
}

# The reference arms of a world study: what the server reaches alone and the oracle.
PUBLIC_ONLY = Arm(
    "public-only",
    # trained on public speakers only; scored like every other arm, with the back end (the
    # cosine centring mean, PLDA) fit on the training devices' embeddings, so the reference
    # is not handicapped by an out-of-domain mean (for cosine only the mean is used: an
    # aggregate a deployment can collect by secure aggregation)
    {"data.train": "world:public", "data.backend": "world:devices", "federated": None},
    "nothing from devices: public data only (the server alone)",
    centralised=True,
)
POOLED_ORACLE = Arm(
    "pooled-oracle",
    {"federated": None},
    "all device audio, pooled (the privacy-violating oracle)",
    centralised=True,
)
# The oracle of the fine-tuning studies at 10,000 devices: trained from scratch on 10,000
# one-speaker devices the default recipe stayed at chance (loss ln 10,000 after 2,000 steps,
# 35.64 % EER against public-only's 18.35 %: docs/studies.md), so the oracle starts where
# every federated arm starts, the public-only model, with the head imprinted (each device
# speaker's mean embedding), and fine-tunes it on all the pooled device audio at a quarter
# of the from-scratch learning rate.
FINE_TUNED_ORACLE = Arm(
    "pooled-oracle",
    {
        "federated": None,
        "train.init_from": "{arm:public-only}",
        "train.lr": 5e-4,
        "train.final_lr": 5e-5,
    },
    "all device audio, pooled, fine-tuning the public-only model (the privacy-violating oracle)",
    centralised=True,
)

# One budget for every federated arm of federated-gain: GAIN_TRIPS client trips. FedAvg
# draws a cohort of GAIN_COHORT devices per round (GAIN_TRIPS / GAIN_COHORT rounds); FedBuff
# keeps GAIN_COHORT devices in flight and steps every GAIN_BUFFER updates (GAIN_TRIPS /
# GAIN_BUFFER steps). With the world's 2,000 devices that is ~1 trip per device (a pair of
# 4,000-trip arms did not fit a session on 2 cores; the local-speaker fine-tuning curve was
# flat from 200 to 400 trips: docs/studies.md). Settings
# from docs/federated.md, "What learns": FedAvg, server SGD lr 1 -> 0.3, two local epochs of
# SGD (lr 0.05, batch 8), split "all", and cohort 20 (faster per trip than 100 there).
GAIN_TRIPS = 2000
GAIN_COHORT = 20
GAIN_BUFFER = 10
GAIN_BASE: dict[str, Any] = {
    **WORLD_BASE,
    "federated.algorithm": "fedavg",
    "federated.speakers": "local",
    "federated.concurrency": GAIN_COHORT,
    "federated.server_steps": GAIN_TRIPS // GAIN_COHORT,
    "federated.eval_every": GAIN_TRIPS // GAIN_COHORT // 10,
    "federated.checkpoint_every": GAIN_TRIPS // GAIN_COHORT // 10,
    **WHAT_LEARNS,
    "federated.reconstruction.split": "all",
    # every public speaker of the world is a negative (more negatives learned faster there)
    "federated.reconstruction.public_speakers": 300,
    # the centralised references: at the default 700 steps the pooled oracle (2,000
    # speakers, ~22 crops each) was still improving fast (xvector-tiny: 13.74 % against
    # public-only 17.53 %); 2,000 steps = 64 crops per device speaker
    "train.steps": 2000,
}
# Local speakers learn without an AAM margin (a margin hurt them: docs/federated.md).
LOCAL: dict[str, Any] = {"federated.speakers": "local", "model.margin": 0.0}
# Fine-tuning from the public model: small steps, so the federated updates refine the public
# model instead of overwriting it. Measured from the 700-step public-only model (17.53 %,
# docs/studies.md): server lr 0.3 -> 0.1 with local lr 0.02 lost 2.7 points within 200 trips
# (local speakers and codewords alike); 0.05 -> 0.02 with local lr 0.01 held the level.
FINE_TUNE: dict[str, Any] = {
    "federated.init_from": "{arm:public-only}",
    "federated.server_lr": 0.05,
    "federated.server_final_lr": 0.02,
    "federated.local_lr": 0.01,
}
# Device-domain negatives without voiceprints: domain centring plus the centroids of a
# spherical k-means of 1,000 panel devices' embeddings (32 clusters, each of >= 10 devices;
# federated k-means needs only secure-aggregated per-cluster sums), so a direction shared by
# devices that do not share a speaker (a device model's channel) is penalised.
DEVICE_CLUSTERS: dict[str, Any] = {
    "federated.reconstruction.centre": "domain",
    "federated.reconstruction.device_clusters": 32,
    "federated.reconstruction.cluster_panel": 1000,
}
# FedBuff from the public model: K = GAIN_BUFFER, GAIN_COHORT in flight (staleness ~C/K = 2).
# Twice FedAvg's server steps over the same trips (K = 10 against a cohort of 20), so half
# its server lr: the same step length per client trip.
FT_FEDBUFF: dict[str, Any] = {
    "federated.algorithm": "fedbuff",
    "federated.buffer_size": GAIN_BUFFER,
    "federated.server_lr": 0.025,
    "federated.server_final_lr": 0.01,
}


def _per_buffer(key: str) -> Callable[[Mapping[str, Any]], int]:
    """A FedAvg count of rounds (server_steps, eval_every...) as FedBuff steps of the same
    client trips: rounds x cohort / K (so the budget follows any --set of the FedAvg one)."""

    def rule(s: Mapping[str, Any]) -> int:
        trips = s[key] * s["federated.concurrency"]
        return max(1, trips // s["federated.buffer_size"])

    return rule


# FedBuff arms spend the FedAvg arms' client trips.
SAME_TRIPS_AS_FEDAVG = {
    k: _per_buffer(k)
    for k in ("federated.server_steps", "federated.eval_every", "federated.checkpoint_every")
}
_LOCAL_SEES = "the extractor update only; prototypes never leave the device"

# robustness: hostile devices against the robust rules, on the embedded corpus (FED_BASE's
# local-speaker settings) at a small budget: cohort ROBUST_COHORT of the 200 devices over
# ROBUST_ROUNDS rounds. Defences are set for up to 20 % hostile updates per step: trimmed
# mean cuts 20 % per side, Krum tolerates f = 20 % of the cohort. Norm bound: honest update
# norms were 1.3–2.5 in the first round and 0.28–0.58 (median 0.42) in the next two (smoke
# run: 24 devices of the default per-device data, cohort 12), so 0.5 bounds the top quarter.
ROBUST_COHORT = 20
ROBUST_ROUNDS = 15
ROBUST_NORM_BOUND = 0.5
ROBUST_BASE: dict[str, Any] = {
    **FED_BASE,
    **LOCAL,
    "federated.concurrency": ROBUST_COHORT,
    "federated.server_steps": ROBUST_ROUNDS,
    "federated.eval_every": 5,
    "federated.checkpoint_every": 5,
    "eval.backends": ["cosine"],  # the table reads cosine; the others only cost time
    "federated.attack.scale": 10.0,
    "federated.attack.sigma": 10.0,
}
DEFENCES: dict[str, dict[str, Any]] = {
    "none": {},
    "norm-bound": {"federated.robust.norm_bound": ROBUST_NORM_BOUND},
    "median": {"federated.robust.rule": "median"},
    "trimmed-mean": {"federated.robust.rule": "trimmed_mean", "federated.robust.trim": 0.2},
    "krum": {"federated.robust.rule": "krum", "federated.robust.byzantine": ROBUST_COHORT // 5},
}
ATTACKS = {
    "sign-flip": "sign_flip",
    "scale": "scale",
    "gaussian": "gaussian",
    "nan": "nan",
    "backdoor": "backdoor",
}
# backdoor devices send 10 × their backdoored update (model replacement against a cohort of
# 20), each working on one of 2 (impostor, target) pairs of held-out speakers: 2 × 4 probes
# × 3 enrollment utterances = 24 attack trials on the embedded corpus
ROBUST_BACKDOOR: dict[str, Any] = {
    "federated.attack.boost": 10.0,
    "federated.attack.backdoor_pairs": 2,
}


def _robust_arm(attack: str | None, percent: int, defence: str) -> Arm:
    """One robustness arm: `percent` % of devices run `attack` (None: nobody), `defence`."""
    over: dict[str, Any] = dict(DEFENCES[defence])
    if attack is not None:
        over |= {
            "federated.attack.kind": ATTACKS[attack],
            "federated.attack.fraction": percent / 100,
        }
    if attack == "backdoor":
        over |= ROBUST_BACKDOOR
    name = f"clean-{defence}" if attack is None else f"{attack}-{percent}-{defence}"
    labels = {"attack": ATTACKS.get(attack or "", "none"), "percent": percent, "defence": defence}
    return Arm(name, over, _LOCAL_SEES, labels=labels)


ROBUST_ARMS = (
    *(_robust_arm(None, 0, d) for d in DEFENCES),
    *(_robust_arm(a, p, d) for a in ("sign-flip", "scale") for p in (5, 20) for d in DEFENCES),
    _robust_arm("gaussian", 20, "none"),
    _robust_arm("nan", 20, "none"),
    *(_robust_arm("backdoor", p, d) for p in (5, 20) for d in DEFENCES),
)
_VOICEPRINT_SEES = "the extractor update and every device's {what} (a voiceprint)"

STUDIES: dict[str, Study] = {
    "federated-gain": Study(
        name="federated-gain",
        title="Does federation earn its place? Device-domain EER between the server alone "
        "(public data) and the pooled-device oracle",
        base=GAIN_BASE,
        arms=(
            PUBLIC_ONLY,
            POOLED_ORACLE,
            Arm("fed-scratch", LOCAL, _LOCAL_SEES),
            Arm("ft-fedavg", {**LOCAL, **FINE_TUNE}, _LOCAL_SEES),
            Arm(
                "ft-fedbuff",
                {**LOCAL, **FINE_TUNE, **FT_FEDBUFF},
                _LOCAL_SEES,
                derived=SAME_TRIPS_AS_FEDAVG,
            ),
            Arm(
                "ft-fedavg-centred",
                {**LOCAL, **FINE_TUNE, "federated.reconstruction.centre": "domain"},
                _LOCAL_SEES + " (and the mean embedding of a 200-device panel, aggregated)",
            ),
            Arm(
                "ft-fedavg-clusters",
                {**LOCAL, **FINE_TUNE, **DEVICE_CLUSTERS},
                _LOCAL_SEES + " (and the centroids of 32 clusters of >= 10 panel devices, "
                "each a secure-aggregated sum, and the panel's mean)",
            ),
            Arm(
                "ft-fedbuff-clusters",
                {**LOCAL, **FINE_TUNE, **FT_FEDBUFF, **DEVICE_CLUSTERS},
                _LOCAL_SEES + " (and the centroids of 32 clusters of >= 10 panel devices, "
                "each a secure-aggregated sum, and the panel's mean)",
                derived=SAME_TRIPS_AS_FEDAVG,
            ),
            Arm(
                "ft-fedavg-server-learning",
                {**LOCAL, **FINE_TUNE, "federated.server_learning.steps": 1},
                _LOCAL_SEES + " (the server also trains on its public corpus)",
            ),
            Arm(
                "ft-global-head",
                {**FINE_TUNE, "federated.speakers": "global_head"},
                _VOICEPRINT_SEES.format(what="speaker row"),
            ),
            Arm(
                "ft-codewords",
                {**FINE_TUNE, "federated.speakers": "codewords"},
                "the extractor update only; head rows are fixed random codewords (no voice)",
            ),
            Arm(
                "ft-fedaws",
                {**FINE_TUNE, "federated.speakers": "fedaws"},
                _VOICEPRINT_SEES.format(what="class vector"),
            ),
        ),
        table="gain",
        references=("public-only", "pooled-oracle"),
        notes=(
            "One two-domain world (fedvox.data.world, seed 0: 300 public speakers, 2,000 "
            "training devices, 200 held-out devices), one seed. Every federated arm: "
            f"{GAIN_TRIPS:,} client trips (FedAvg: cohort {GAIN_COHORT} over "
            f"{GAIN_TRIPS // GAIN_COHORT} rounds; FedBuff: C = {GAIN_COHORT}, "
            f"K = {GAIN_BUFFER}, {GAIN_TRIPS // GAIN_BUFFER} steps), server SGD, two local "
            "epochs; local speakers with the world's public speakers as negatives. ft-* arms "
            "start from the public-only model (federated.init_from; their manifests record its "
            "weights hash) with small learning rates (server SGD 0.05 -> 0.02, FedBuff half that, "
            "local SGD 0.01). *-clusters arms add device-domain negatives: domain centring "
            "and the centroids of a k-means (k = 32) of 1,000 panel devices' embeddings, each "
            "cluster of >= 10 devices (federated.reconstruction.device_clusters). Centralised "
            "arms: the default trainer (2,000 steps of 64 random 2–3 s crops).",
            "Gap closed = (EER_public-only − EER_arm) / (EER_public-only − EER_oracle): 0 is "
            "what the server reaches alone, 1 the pooled-device oracle; below 0 the arm is "
            "worse than not federating at all. Offset: the mean cosine between different "
            "held-out speakers' un-centred prototypes (near 0: speakers spread around the "
            "origin; near 1: one direction common to every embedding).",
        ),
    ),
    "fedrecon-speakers": Study(
        name="fedrecon-speakers",
        title="Speakers as local parameters vs a global head, FedAwS and centralised training",
        base=FED_BASE,
        arms=(
            Arm(
                "public-only",
                {"data.train": "synthetic:public", "federated": None},
                "nothing from devices: the generator's public voices (the server alone)",
                centralised=True,
            ),
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
            "and seed; centralised: the default trainer (700 steps of 64 random 2–3 s crops). "
            "public-only: the same trainer on the generator's public voices (the seed the "
            "local speakers' negatives come from, as many speakers and utterances as the "
            "devices hold): in this world the server alone needs no device.",
        ),
        table="gain",
        references=("public-only", "centralised"),
    ),
    "dp-utility": Study(
        name="dp-utility",
        title="Unseen-speaker EER against ε: FedAvg (Gaussian DP) and FedBuff (DP-FTRL)",
        base={
            **DP_BASE,
            **WORLD_BASE,
            "federated.speakers": "local",
            "federated.weighting": "uniform",
            "federated.concurrency": 20,
            "federated.server_steps": 60,
            "federated.server_warmup_steps": 6,
            "federated.eval_every": 20,
            "federated.checkpoint_every": 20,
            "federated.privacy.delta": 1e-4,  # < 1/n for the world's n = 2,000 devices
            "federated.privacy.clip_norm": 0.3,
        },
        arms=(
            PUBLIC_ONLY,
            POOLED_ORACLE,
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
        references=("public-only", "pooled-oracle"),
        notes=(
            "On the two-domain world (seed 0: 2,000 training devices, 200 held-out devices; "
            "the public domain's speakers are the local speakers' negatives). Local speakers "
            "(Federated Reconstruction), 600 client trips per arm, clip norm S = 0.3 (fixed; "
            "update norms were 0.28–0.57 at initialisation on the embedded corpus), δ = 1e-4 "
            "(< 1/n for n = 2,000 devices), RDP accounting. FedAvg samples 20 of the 2,000 "
            "devices per round without replacement; FedBuff (C = 20, K = 10) + DP-FTRL lets "
            "each device train at most once per tree (an epoch of the population). "
            "public-only and pooled-oracle: the default centralised trainer on the public "
            "speakers and on the pooled devices, evaluated on the same device trials.",
        ),
    ),
    "robustness": Study(
        name="robustness",
        title="Hostile devices against the robust rules: EER under sign-flip, scaling, noise "
        "and NaN attackers at 5 % and 20 % of the devices",
        base=ROBUST_BASE,
        arms=ROBUST_ARMS,
        table="robustness",
        diverged_rows=True,
        notes=(
            "The embedded corpus (200 one-speaker training devices, 40 held-out speakers), "
            "local speakers (Federated Reconstruction), FED_BASE's settings (server SGD lr 1 "
            "-> 0.3, two local epochs of SGD at lr 0.05, batch 8), one seed. Budget per arm: "
            f"FedAvg, cohort {ROBUST_COHORT} over {ROBUST_ROUNDS} rounds = "
            f"{ROBUST_COHORT * ROBUST_ROUNDS} client trips ({len(ROBUST_ARMS)} arms, "
            f"{len(ROBUST_ARMS) * ROBUST_COHORT * ROBUST_ROUNDS:,} trips in all: about an hour "
            "on 2 cores as two --arm lists side by side, at the ~0.5 s per trip FED_BASE "
            "measured). Far from converged: the clean EER is a short run's.",
            "Attackers: a fixed seeded set of devices (the same in every arm; the 5 % are among "
            "the 20 %) trains honestly, then sends −10·Δ (sign-flip), 10·Δ (scale), noise of 10× "
            "its update's rms (gaussian) or NaN/Inf (nan). Defences: norm bound "
            f"{ROBUST_NORM_BOUND}, coordinate median, trimmed mean (20 % per side), Krum "
            f"(f = {ROBUST_COHORT // 5}). Damage = EER − the attack-free EER with the same "
            "defence (points; what the attack did, not what the defence costs); × clean = EER "
            "/ the attack-free, undefended EER (clean-none). Malicious updates: what the "
            "server steps received from attackers (server records' `malicious`).",
        ),
    ),
}


# fedbuff-concurrency: FedAvgM, FedBuff and FedAsync from C = 10 to 1,000 on a world of
# CONC_DEVICES devices (issue 15; the FedBuff paper's Figure 1). Devices hold 3-12
# recordings (log-uniform; phones that recorded a handful of utterances): the world's
# 10,000 devices then fit in memory and a client trip costs ~0.05 s (docs/benchmarks.md).
# Every arm fine-tunes the public model with local speakers and device-domain cluster
# negatives (one local epoch, packed cohorts). Budget: the base's server_steps / eval_every /
# checkpoint_every count CLIENT TRIPS; each arm divides them by the updates a server step
# takes (C for FedAvg, K for FedBuff, 1 for FedAsync), so --set federated.server_steps=N
# gives every arm N trips.
CONC_DEVICES = 10_000
# half a trip per device: the fine-tuning lines separate within ~2,000 trips (stop 25's
# sweep on a 1,000-device world), and FedAvgM at C = 1,000 gets 5 rounds, where the paper's
# claim says it is slow (an arm that does not reach the target is reported as such)
CONC_TRIPS = 5_000
CONC_EVALS = 20
CONC_LEVELS = (10, 100, 1000)
CONC_BUFFER = 10
CONC_MOMENTUM = 0.9
# FedAvgM's server lr, swept per concurrency (the study records every point; the line of
# Figure 1 takes the best per C). With momentum 0.9 a step moves ~10x its lr; 0.01 learned
# at C = 100 in the sweep (18.25 -> 16.79 % in 2,000 trips, still falling), so points
# above it; an average of C updates is less noisy and at C = 1,000 the budget is 5 rounds,
# so that grid moves up one point (0.1 was still the best of 0.03 / 0.1 there, at its edge).
CONC_FEDAVGM_LRS: dict[int, tuple[float, ...]] = {
    10: (0.01, 0.03, 0.1),
    100: (0.01, 0.03, 0.1),
    # 1.0 added at stop 26: 0.3 was the best and the top of the grid at stop 25
    1000: (0.03, 0.1, 0.3, 1.0),
}
# FedBuff: plain server SGD at lr CONC_FEDBUFF_LR per K = 10 updates (0.005 per update: the
# federated-gain study's gain-clusters-hi step, 0.1 per cohort of 20); the K sweep keeps
# that step per update (lr x K / 10).
CONC_FEDBUFF_LR = 0.05
# FedBuff's own lr sweep where FedAvgM's needed one (added at stop 26: with lr 1.0 FedAvgM
# reached the target in its first round at C = 1,000, against FedBuff's single lr): its
# Figure-1 line takes the best lr per C, as FedAvgM's does
CONC_FEDBUFF_EXTRA_LRS: dict[int, tuple[float, ...]] = {1000: (0.15,)}
# FedAsync: one update per step mixed in at CONC_ASYNC_ALPHA (the same step per update).
CONC_ASYNC_ALPHA = 0.005
# client trips between two computations of the broadcast, in every arm (FedAvg at C >= 100:
# every round; FedBuff K = 10: every 10th version; FedAsync: every 100th)
CONC_BROADCAST_TRIPS = 100
# the common target: this share of the way from public-only's EER to the best line's best
CONC_TARGET_SHARE = 0.5
CONC_BASE: dict[str, Any] = {
    **WORLD_BASE,
    "data.world.train_devices": CONC_DEVICES,
    "data.world.device_utts": [3, 12],
    **LOCAL,
    **FINE_TUNE,
    # device-domain negatives (domain centring + 32 cluster centroids of 1,000 panel
    # devices): without them no arm moved the public model in stop 24's quick look (best
    # 18.20 % against 18.33 %); with them and local lr 0.02, FedBuff K = 10 at C = 100 went
    # 18.25 -> 16.29 % in 2,000 trips (docs/studies.md)
    **DEVICE_CLUSTERS,
    "federated.local_lr": 0.02,
    "federated.local_epochs": 1,
    "federated.local_batch_size": 8,
    "federated.pack_clients": True,
    "federated.delay": "half_normal",
    "federated.reconstruction.split": "all",
    # the server recomputes the broadcast (public negatives, domain centre, centroids) once
    # every CONC_BROADCAST_TRIPS client trips in every arm (a count of trips, turned into
    # versions per arm), not per model version: FedAsync makes a version per trip
    "federated.reconstruction.public_speakers": 100,
    "federated.reconstruction.public_chunks": 1,
    "federated.reconstruction.broadcast_every": CONC_BROADCAST_TRIPS,
    "federated.server_steps": CONC_TRIPS,
    "federated.eval_every": CONC_TRIPS // CONC_EVALS,
    "federated.checkpoint_every": CONC_TRIPS // CONC_EVALS,
    "train.steps": 2000,
}


def _trips_per_step(s: Mapping[str, Any]) -> int:
    """Client updates one server step of the arm takes."""
    algorithm = s["federated.algorithm"]
    if algorithm == "fedavg":
        return int(s["federated.concurrency"])
    if algorithm == "fedbuff":
        return int(s["federated.buffer_size"])
    return 1


def _trips_rule(key: str) -> Callable[[Mapping[str, Any]], int]:
    """A count of client trips in the base (server_steps, eval_every...) as the arm's steps."""

    def rule(s: Mapping[str, Any]) -> int:
        return max(1, int(s[key]) // _trips_per_step(s))

    return rule


TRIPS_TO_STEPS = {
    k: _trips_rule(k)
    for k in (
        "federated.server_steps",
        "federated.eval_every",
        "federated.checkpoint_every",
        "federated.reconstruction.broadcast_every",
    )
}


def _conc_arm(algorithm: str, c: int, lr: float | None = None, k: int = CONC_BUFFER) -> Arm:
    """One arm of fedbuff-concurrency: FedAvgM at server lr `lr`, FedBuff with buffer `k`, or
    FedAsync, with C = `c` devices in flight."""
    o: dict[str, Any] = {"federated.concurrency": c}
    labels: dict[str, Any] = {"algorithm": algorithm, "concurrency": c}
    if algorithm == "fedavgm":
        assert lr is not None
        name = f"fedavgm-c{c}-lr{lr:g}"
        o |= {
            "federated.algorithm": "fedavg",
            "federated.server_momentum": CONC_MOMENTUM,
            "federated.server_lr": lr,
            "federated.server_final_lr": 0.4 * lr,
        }
        labels["server_lr"] = lr
    elif algorithm == "fedbuff":
        name = f"fedbuff-c{c}" + ("" if k == CONC_BUFFER else f"-k{k}")
        if lr is not None:  # a point of FedBuff's own lr sweep
            name += f"-lr{lr:g}"
        else:
            lr = CONC_FEDBUFF_LR * k / CONC_BUFFER
        o |= {
            "federated.algorithm": "fedbuff",
            "federated.buffer_size": k,
            "federated.server_lr": lr,
            "federated.server_final_lr": 0.4 * lr,
        }
        labels |= {"buffer": k, "server_lr": lr}
    else:
        name = f"fedasync-c{c}"
        o |= {"federated.algorithm": "fedasync", "federated.async_alpha": CONC_ASYNC_ALPHA}
        labels["server_lr"] = CONC_ASYNC_ALPHA
    return Arm(name, o, _LOCAL_SEES, derived=TRIPS_TO_STEPS, labels=labels)


CONC_ARMS = (
    PUBLIC_ONLY,
    FINE_TUNED_ORACLE,
    *(
        arm
        for c in CONC_LEVELS
        for arm in (
            *(_conc_arm("fedavgm", c, lr) for lr in CONC_FEDAVGM_LRS[c]),
            _conc_arm("fedbuff", c),
            _conc_arm("fedasync", c),
        )
    ),
    *(_conc_arm("fedbuff", CONC_LEVELS[-1], k=k) for k in (1, 100)),
    *(_conc_arm("fedbuff", c, lr) for c, lrs in CONC_FEDBUFF_EXTRA_LRS.items() for lr in lrs),
)
STUDIES["fedbuff-concurrency"] = Study(
    name="fedbuff-concurrency",
    title="FedBuff's concurrency claim: client trips to a common target EER for FedAvgM, "
    "FedBuff (K = 10) and FedAsync at C = 10, 100 and 1,000 devices in flight",
    base=CONC_BASE,
    arms=CONC_ARMS,
    table="concurrency",
    references=("public-only", "pooled-oracle"),
    notes=(
        f"The two-domain world with {CONC_DEVICES:,} training devices (3-12 recordings "
        "each), 200 held-out devices (the trials), 300 public speakers (100 of them, one "
        "chunk each, are the local speakers' negatives, with domain centring and 32 "
        "device-cluster centroids of 1,000 panel devices, recomputed every "
        f"{CONC_BROADCAST_TRIPS} trips). Every federated arm "
        "fine-tunes the public-only model with local speakers (one local epoch of SGD at lr "
        f"0.02, batch 8) for {CONC_TRIPS:,} client trips, with half-normal trip delays (mean "
        "60 virtual s). FedAvgM: server SGD with momentum 0.9, lr swept over "
        + "; ".join(
            f"{', '.join(f'{x:g}' for x in lrs)} at C = {c:,}"
            for c, lrs in CONC_FEDAVGM_LRS.items()
        )
        + " (decaying to 0.4x); FedBuff: "
        f"K = {CONC_BUFFER}, plain server SGD lr {CONC_FEDBUFF_LR:g}"
        + "".join(
            f" (also {', '.join(f'{x:g}' for x in lrs)} at C = {c:,})"
            for c, lrs in CONC_FEDBUFF_EXTRA_LRS.items()
        )
        + f" (x K / 10 in the K sweep); FedAsync: mixing weight {CONC_ASYNC_ALPHA:g}, sqrt "
        f"staleness. Target: {CONC_TARGET_SHARE:g} of the way from public-only's EER to the "
        "best line's best (each line: FedAsync, and FedAvgM and FedBuff at their best lr per "
        "C); an arm that does not reach it within the budget has no trips to target.",
        "A quick look on a small world: --set data.world.train_devices=1000 --set "
        "federated.server_steps=2000 --set federated.eval_every=200 --set "
        "federated.checkpoint_every=200 (and --arm to pick arms).",
    ),
)


# dp-scale: user-level DP where it means something (issue 15, item 3): the concurrency
# study's world of CONC_DEVICES devices, FedAvg with Gaussian DP over fixed-size cohorts and
# FedBuff with DP-FTRL, at ε ∈ DP_SCALE_EPSILONS (∞: no noise), δ = 1 / N^1.1. Every DP
# arm's noise multiplier is the least that keeps its planned ε within the target
# (experiment.privacy.planned_epsilon, ±0.5 %), computed from the arm's own settings, so a
# --set of the world or the budget recalibrates it; FedAvg arms also set target_epsilon,
# so the run itself refuses to overspend.
DP_SCALE_EPSILONS = (8.0, 4.0)
DP_SCALE_COHORT = 100
# FedAvg's server: momentum 0.9 at the lr that reached the target first at C = 100 in the
# concurrency study (server momentum is post-processing of the noised average: no ε cost)
DP_SCALE_FEDAVGM_LR = 0.03
# the concurrency study's budget: 20,000 trips an arm (~4 h for the six) did not fit a session
DP_SCALE_TRIPS = CONC_TRIPS
DP_SCALE_BASE: dict[str, Any] = {
    **CONC_BASE,
    # the panel statistics (domain centre, cluster centroids) come from 1,000 opt-in devices
    # held out of training (they release a first-chunk embedding each, secure-aggregated, and
    # do not train): the accountant covers the 9,000 that train. Without panel statistics
    # nothing learned: FedBuff with no noise ended at 18.28 % against public-only's 18.35 %
    # in 5,000 trips (stop 26, docs/studies.md)
    "federated.reconstruction.panel": "held_out",
    "federated.server_steps": DP_SCALE_TRIPS,
    "federated.eval_every": DP_SCALE_TRIPS // CONC_EVALS,
    "federated.checkpoint_every": DP_SCALE_TRIPS // CONC_EVALS,
    "federated.weighting": "uniform",
    "federated.concurrency": DP_SCALE_COHORT,
    "federated.privacy.clip_norm": 0.3,
}


def dp_devices(s: Mapping[str, Any]) -> int:
    """The arm's N: the world's training devices, less a held-out panel (which trains not)."""
    n = int(s["data.world.train_devices"])
    if s.get("federated.reconstruction.panel", "training") != "held_out":
        return n
    if s.get("federated.reconstruction.device_clusters", 0):
        return n - min(n, int(s.get("federated.reconstruction.cluster_panel", 1000)))
    if s.get("federated.reconstruction.centre", "none") == "domain":
        return n - min(n, int(s.get("federated.reconstruction.centre_panel", 200)))
    return n


def _dp_delta(s: Mapping[str, Any]) -> float:
    """δ = 1 / N^1.1 for the arm's N training devices."""
    return float(dp_devices(s)) ** -1.1


def _least_z(mechanism: str, target: float) -> Callable[[Mapping[str, Any]], float]:
    """The arm's noise multiplier: the least z whose planned ε (at the arm's δ, steps and
    sampling) is within `target`, rounded UP to 3 significant digits (still within)."""

    def rule(s: Mapping[str, Any]) -> float:
        from fedvox.experiment.privacy import least_noise_multiplier, planned_epsilon

        n = dp_devices(s)
        steps = max(1, int(s["federated.server_steps"]) // _trips_per_step(s))
        cohort = _trips_per_step(s)
        delta = _dp_delta(s)
        z = least_noise_multiplier(
            lambda z: planned_epsilon(mechanism, delta, z, steps, cohort, n), target
        )
        step = 10.0 ** (math.floor(math.log10(z)) - 2)  # 3 significant digits, rounded up
        return round(math.ceil(z / step) * step, 12)

    return rule


def _dp_scale_arm(algorithm: str, epsilon: float | None) -> Arm:
    """FedAvg (Gaussian, fixed-size cohorts) or FedBuff (DP-FTRL) at `epsilon` (None: no DP)."""
    mechanism = "gaussian" if algorithm == "fedavg" else "dp_ftrl"
    o: dict[str, Any] = {"federated.algorithm": algorithm}
    if algorithm == "fedavg":  # FedAvgM as the concurrency study tuned it at C = 100
        o |= {
            "federated.server_momentum": CONC_MOMENTUM,
            "federated.server_lr": DP_SCALE_FEDAVGM_LR,
            "federated.server_final_lr": 0.4 * DP_SCALE_FEDAVGM_LR,
        }
    if algorithm == "fedbuff":
        o |= {
            "federated.buffer_size": CONC_BUFFER,
            "federated.server_lr": CONC_FEDBUFF_LR,
            "federated.server_final_lr": 0.4 * CONC_FEDBUFF_LR,
        }
    derived: dict[str, Callable[[Mapping[str, Any]], Any]] = {
        **TRIPS_TO_STEPS,
        "federated.privacy.delta": _dp_delta,
    }
    if epsilon is None:
        return Arm(f"{algorithm}-nodp", o, _LOCAL_SEES, derived=derived)
    o["federated.privacy.mechanism"] = mechanism
    if mechanism == "gaussian":
        o["federated.privacy.target_epsilon"] = epsilon
    derived["federated.privacy.noise_multiplier"] = _least_z(mechanism, epsilon)
    return Arm(
        f"{algorithm}-{'gaussian' if mechanism == 'gaussian' else 'dpftrl'}-eps{epsilon:g}",
        o,
        _LOCAL_SEES + f" (clipped and noised: ε = {epsilon:g})",
        derived=derived,
    )


STUDIES["dp-scale"] = Study(
    name="dp-scale",
    title="User-level DP at 10,000 devices: device EER and gap closed at ε = ∞, 8 and 4 for "
    "FedAvg (Gaussian DP) and FedBuff (DP-FTRL)",
    base=DP_SCALE_BASE,
    arms=(
        PUBLIC_ONLY,
        FINE_TUNED_ORACLE,
        *(_dp_scale_arm(a, e) for a in ("fedavg", "fedbuff") for e in (None, *DP_SCALE_EPSILONS)),
    ),
    table="dp",
    references=("public-only", "pooled-oracle"),
    notes=(
        f"The fedbuff-concurrency world ({CONC_DEVICES:,} devices with 3-12 recordings) and "
        "recipe: 1,000 of the devices are an opt-in panel held out of training (their "
        "first-chunk embeddings give the domain centre and 32 cluster centroids, "
        "secure-aggregated, outside the guarantee), the other N = 9,000 train and are what ε "
        f"covers, fine-tuning the public-only model with local speakers for {DP_SCALE_TRIPS:,} client "
        f"trips. FedAvg: cohorts of {DP_SCALE_COHORT} drawn without replacement (RDP "
        "accounting of fixed-size sampling, replace-one neighbours), server SGD with "
        f"momentum {CONC_MOMENTUM:g} at lr {DP_SCALE_FEDAVGM_LR:g} (decaying to 0.4x); FedBuff: "
        f"C = {DP_SCALE_COHORT}, K = {CONC_BUFFER}, DP-FTRL with each device at most once per "
        "tree (an epoch of the N devices; the plan assumes trees of N / K steps, the run "
        "reports the ε of the trees it formed). Clip norm 0.3 (fixed), δ = 1 / N^1.1, "
        "uniform weighting. Noise multipliers: the least within each ε (see the arms' "
        "config.toml).",
    ),
)


ARM_REF = re.compile(r"\{arm:([^{}]+)\}")  # "{arm:NAME}": that arm's finished run folder


def _arm_settings(study: Study, arm: Arm, sets: Mapping[str, Any]) -> dict[str, Any]:
    """The dotted settings of an arm: study base ← arm overrides ← the user's --set (a
    centralised arm drops every federated.* key)."""
    out: dict[str, Any] = {}
    for key, value in {**study.base, **arm.overrides, **sets}.items():
        if key == "federated" and value is None:
            continue
        if arm.centralised and key.startswith("federated."):
            continue
        out[key] = value
    merged = dict(out)
    for key, rule in arm.derived.items():
        out[key] = rule(merged)
    return out


def _refs(value: Any) -> list[str]:
    """Names of the arms that "{arm:NAME}" placeholders in a (nested) value refer to."""
    if isinstance(value, str):
        return ARM_REF.findall(value)
    if isinstance(value, dict):
        return [n for v in value.values() for n in _refs(v)]
    if isinstance(value, list | tuple):
        return [n for v in value for n in _refs(v)]
    return []


def _substitute(value: Any, folders: Mapping[str, Path]) -> Any:
    if isinstance(value, str):
        return ARM_REF.sub(lambda m: str(folders[m.group(1)]), value)
    if isinstance(value, dict):
        return {k: _substitute(v, folders) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_substitute(v, folders) for v in value)
    return value


def arm_dependencies(study: Study, arm: Arm, sets: Mapping[str, Any]) -> list[str]:
    """The arms whose run folders this arm's settings use ("{arm:NAME}"), checked to exist."""
    names = {a.name for a in study.arms}
    deps: list[str] = []
    for key, value in _arm_settings(study, arm, sets).items():
        for dep in _refs(value):
            if dep not in names or dep == arm.name:
                problem = (
                    f"arm {arm.name} uses its own run folder"
                    if dep == arm.name
                    else f"arm {arm.name} refers to {{arm:{dep}}} and study {study.name} "
                    "has no such arm"
                )
                raise ConfigError(
                    key, problem, f"refer to another arm: {sorted(names - {arm.name})}"
                )
            if dep not in deps:
                deps.append(dep)
    return deps


def study_order(study: Study, chosen: list[Arm], sets: Mapping[str, Any]) -> list[Arm]:
    """The chosen arms plus every arm they depend on, each after its dependencies (otherwise
    in the study's order); a dependency cycle is refused."""
    by_name = {a.name: a for a in study.arms}
    order: list[Arm] = []
    state: dict[str, str] = {}  # "visiting" | "done"

    def visit(arm: Arm, path: list[str]) -> None:
        if state.get(arm.name) == "done":
            return
        if state.get(arm.name) == "visiting":
            cycle = " -> ".join([*path[path.index(arm.name) :], arm.name])
            raise ConfigError(
                "{arm:...}", f"arms depend on each other in a cycle: {cycle}", "break the cycle"
            )
        state[arm.name] = "visiting"
        for dep in arm_dependencies(study, arm, sets):
            visit(by_name[dep], [*path, arm.name])
        state[arm.name] = "done"
        order.append(arm)

    for arm in study.arms:  # the study's order, restricted to what is needed
        if arm in chosen:
            visit(arm, [])
    return order


def arm_config(
    study: Study,
    arm: Arm,
    sets: Mapping[str, Any],
    folders: Mapping[str, Path] | None = None,
) -> ExperimentConfig:
    """The arm's resolved config: defaults ← study base ← arm overrides ← the user's --set,
    with "{arm:NAME}" replaced by NAME's run folder from `folders` (left as written without)."""
    deps = arm_dependencies(study, arm, sets)
    d = strip_none(ExperimentConfig().to_dict())  # absent tables (data.world) can be set
    d["name"] = f"{study.name}-{arm.name}"
    d.pop("federated", None)
    for key, value in _arm_settings(study, arm, sets).items():
        if folders is not None and deps:
            value = _substitute(value, folders)
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
        "delta": result.get("privacy", {}).get("delta"),
        "noise_multiplier": result.get("privacy", {}).get("noise_multiplier"),
        "offset": result.get("test_speaker_offset"),
        "folder": str(folder),
        **arm.labels,
    }
    if arm.labels:
        steps = read_run_log(folder / "metrics.jsonl", (ServerStepRecord,))
        counts = [r.malicious for r in steps if r.malicious is not None]
        row["malicious_updates"] = sum(counts) if counts else 0
        row["attack_success"] = None if last is None else last.attack_success
    return row


def _diverged_row(arm: Arm, folder: Path, why: str) -> dict[str, Any]:
    """The row of an arm whose model scored non-finite: no EER, the server records it has."""
    steps = read_run_log(folder / "metrics.jsonl", (ServerStepRecord,))
    counts = [r.malicious for r in steps if r.malicious is not None]
    return {
        "arm": arm.name,
        "eer": math.nan,
        "min_dcf_01": math.nan,
        "trips": steps[-1].trips if steps else None,
        "mb_up_per_trip": None,
        "mb_down_per_trip": None,
        "server_sees": arm.server_sees,
        "epsilon": None,
        "offset": None,
        "folder": str(folder),
        "diverged": why,
        "hours": None,
        **arm.labels,
        "malicious_updates": sum(counts) if counts else 0,
    }


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
    gap = any("gap_closed" in r for r in rows)
    out = [
        "| arm | ε | δ | noise z | device EER | minDCF (p=0.01) |"
        + (" gap closed |" if gap else ""),
        "|---|---|---|---|---|---|" + ("---|" if gap else ""),
    ]
    for r in rows:
        eps = "∞ (no DP)" if r["epsilon"] is None else f"{r['epsilon']:.2f}"
        if r["trips"] is None:
            eps = "— (centralised)"
        delta = "—" if r.get("delta") is None else f"{r['delta']:.3g}"
        gap_cell = f" {_num(r.get('gap_closed'), '.2f')} |" if gap else ""
        out.append(
            f"| {r['arm']} | {eps} | {delta} | {_num(r.get('noise_multiplier'), 'g')} "
            f"| {100 * r['eer']:.2f}% | {r['min_dcf_01']:.3f} |{gap_cell}"
        )
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
    ax.set_xlabel("ε (δ = 1e-4)")
    ax.set_ylabel("unseen-speaker EER (%)")
    ax.legend()
    fig.tight_layout()
    return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))


def _virtual_hours(folder: Path) -> float | None:
    """Virtual hours at the last evaluation of a federated run; None for a centralised one."""
    evals = read_run_log(folder / "metrics.jsonl", (EvalRecord,))
    seconds = evals[-1].virtual_time_s if evals else None
    return None if seconds is None else seconds / 3600.0


def gap_closed(eer: float, eer_public: float, eer_oracle: float) -> float | None:
    """(EER_public − EER) / (EER_public − EER_oracle): 0 at the public-only model, 1 at the
    pooled oracle; None when the oracle is not better (no gap to close: a ratio would say
    the opposite of what happened)."""
    span = eer_public - eer_oracle
    return None if span <= 0 else (eer_public - eer) / span


def add_gap_closed(rows: list[dict], references: tuple[str, str] | None) -> bool:
    """Give every row its "gap_closed" when both reference arms are among the rows."""
    by_arm = {r["arm"]: r for r in rows}
    if references is None or not all(n in by_arm for n in references):
        return False
    public, oracle = (by_arm[n]["eer"] for n in references)
    for r in rows:
        r["gap_closed"] = gap_closed(r["eer"], public, oracle)
    return True


def _num(x: float | None, spec: str) -> str:
    return "—" if x is None or not math.isfinite(x) else format(x, spec)


def _gain_table(rows: list[dict]) -> list[str]:
    gap = any("gap_closed" in r for r in rows)
    out = [
        "| arm | device EER | minDCF (p=0.01) |"
        + (" gap closed |" if gap else "")
        + " client trips | virtual hours | MB up / trip | MB down / trip | offset "
        "| what the server sees |",
        "|---|---|---|" + ("---|" if gap else "") + "---|---|---|---|---|---|",
    ]
    for r in rows:
        gap_cell = f" {_num(r.get('gap_closed'), '.2f')} |" if gap else ""
        out.append(
            f"| {r['arm']} | {100 * r['eer']:.2f}% | {r['min_dcf_01']:.3f} |{gap_cell} "
            f"{_num(r['trips'], 'd')} | {_num(r.get('hours'), '.2f')} "
            f"| {_num(r['mb_up_per_trip'], '.2f')} | {_num(r['mb_down_per_trip'], '.2f')} "
            f"| {_num(r.get('offset'), '.3f')} | {r['server_sees']} |"
        )
    return out


def _plot_references(
    rows: list[dict], references: tuple[str, str], x_of: str, xlabel: str, path: Path
) -> Path:
    """EER against trips or virtual hours, one line per federated arm (compare's curves),
    with the public-only and pooled-oracle EERs as horizontal lines."""
    from fedvox.experiment.compare import load_curve

    fig = Figure(figsize=(6.4, 4.4), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for r in rows:
        if r["trips"] is None:
            continue
        curve = load_curve(r["folder"])
        ax.plot(getattr(curve, x_of), 100 * curve.eer, marker="o", ms=3, lw=1.5, label=r["arm"])
    by_arm = {r["arm"]: r for r in rows}
    for name, style in zip(references, ("--", ":"), strict=True):
        eer = 100 * by_arm[name]["eer"]
        ax.axhline(eer, ls=style, lw=1.2, color="black", label=f"{name} {eer:.2f}%")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("device-domain EER (%)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return atomic_write(path, lambda f: fig.savefig(f, format="png"))


def add_attack_damage(rows: list[dict]) -> None:
    """Give every attack row its damage (EER − the clean EER with the same defence) and
    ratio to the clean, undefended EER, where those clean arms are among the rows."""
    clean = {r["defence"]: r["eer"] for r in rows if r.get("attack") == "none"}
    for r in rows:
        if "attack" not in r:
            continue
        same = clean.get(r["defence"])
        finite = math.isfinite(r["eer"])  # a diverged arm has no EER
        r["damage"] = r["eer"] - same if finite and same is not None else None
        base = clean.get("none")  # None, or a zero EER: no ratio
        r["ratio_to_clean"] = r["eer"] / base if finite and base else None


def _robustness_table(rows: list[dict]) -> list[str]:
    add_attack_damage(rows)
    out = [
        "| arm | attack | malicious devices | defence | unseen-speaker EER "
        "| damage (points) | × clean | malicious updates received | attack success |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        damage = r.get("damage")
        success = r.get("attack_success")  # a backdoor's; "—" for the other attacks
        eer = "diverged (non-finite model)" if r.get("diverged") else f"{100 * r['eer']:.2f}%"
        out.append(
            f"| {r['arm']} | {r.get('attack', '—')} | {r.get('percent', 0)} % "
            f"| {r.get('defence', '—')} | {eer} "
            f"| {_num(None if damage is None else 100 * damage, '+.2f')} "
            f"| {_num(r.get('ratio_to_clean'), '.2f')} | {_num(r.get('malicious_updates'), 'd')} "
            f"| {_num(None if success is None else 100 * success, '.1f')}"
            f"{'' if success is None else ' %'} |"
        )
    return out


def add_trips_to_target(rows: list[dict]) -> float | None:
    """Give every federated row of fedbuff-concurrency its best EER and its client trips and
    virtual hours to the common target; mark the rows on Figure 1's lines (FedBuff K = 10,
    FedAsync, FedAvgM at its best lr per C). Returns the target (None without federated
    rows): CONC_TARGET_SHARE of the way from public-only's EER to the best line's best EER,
    so it is past the evaluation's noise and a line that does not get there within the
    budget says so; without a public-only row below which some line went, the worst of the
    lines' best EERs (every line reaches it)."""
    from fedvox.experiment.compare import load_curve, to_target

    fed = [r for r in rows if r.get("algorithm") and r["trips"] is not None]
    curves = {r["arm"]: load_curve(r["folder"]) for r in fed}
    for r in fed:
        r["best_eer"] = float(curves[r["arm"]].eer.min())
    best_lr: dict[tuple[str, int], dict] = {}  # FedAvgM and FedBuff K = 10: best lr per C
    for r in fed:
        key = (r["algorithm"], r["concurrency"])
        swept = r["algorithm"] == "fedavgm" or (
            r["algorithm"] == "fedbuff" and r.get("buffer") == CONC_BUFFER
        )
        if swept and (key not in best_lr or r["best_eer"] < best_lr[key]["best_eer"]):
            best_lr[key] = r
    for r in fed:
        r["on_line"] = (
            r is best_lr.get((r["algorithm"], r["concurrency"])) or r["algorithm"] == "fedasync"
        )
    line = [r for r in fed if r["on_line"]]
    if not line:
        return None
    target = max(r["best_eer"] for r in line)
    start = next((r["eer"] for r in rows if r.get("arm") == "public-only"), None)
    best = min(r["best_eer"] for r in line)
    if start is not None and best < start:
        target = start - CONC_TARGET_SHARE * (start - best)
    for r in fed:
        r["target_eer"] = target
        r["trips_to_target"], r["hours_to_target"] = to_target(curves[r["arm"]], target)
    return target


def _concurrency_table(rows: list[dict]) -> list[str]:
    target = add_trips_to_target(rows)
    out = [] if target is None else [f"Common target EER: **{100 * target:.2f}%**.", ""]
    gap = any("gap_closed" in r for r in rows)
    out += [
        "| arm | algorithm | C | K | server lr | final EER | best EER |"
        + (" gap closed |" if gap else "")
        + " trips to target | virtual h to target | on Figure 1 |",
        "|---|---|---|---|---|---|---|" + ("---|" if gap else "") + "---|---|---|",
    ]
    for r in rows:
        best = r.get("best_eer")
        gap_cell = f" {_num(r.get('gap_closed'), '.2f')} |" if gap else ""
        trips = r.get("trips_to_target")
        out.append(
            f"| {r['arm']} | {r.get('algorithm', 'centralised')} | {r.get('concurrency', '—')} "
            f"| {r.get('buffer', '—')} | {_num(r.get('server_lr'), 'g')} "
            f"| {100 * r['eer']:.2f}% | {_num(None if best is None else 100 * best, '.2f')}"
            f"{'' if best is None else '%'} |{gap_cell} {_num(trips, ',.0f')} "
            f"| {_num(r.get('hours_to_target'), '.2f')} | {'yes' if r.get('on_line') else ''} |"
        )
    ratios = _fedbuff_ratios(rows)
    if ratios:
        out += ["", "FedAvgM (best lr) trips to target / FedBuff's, per C: " + ratios]
    out += _target_sensitivity(rows)
    return out


CONC_SENSITIVITY_SHARES = (0.25, 0.5, 0.75)


def _target_sensitivity(rows: list[dict]) -> list[str]:
    """FedAvgM / FedBuff (K = 10) trips to target per C at targets CONC_SENSITIVITY_SHARES of
    the way from public-only to the best line's best: whether the ratio holds beyond the one
    target. Each takes, per target, its fewest trips over its lrs; ">x": no FedAvgM lr got
    there (its budget over FedBuff's trips), "—": FedBuff did not."""
    from fedvox.experiment.compare import load_curve, to_target

    start = next((r["eer"] for r in rows if r.get("arm") == "public-only"), None)
    line = [r for r in rows if r.get("on_line")]
    if start is None or not line:
        return []
    best = min(r["best_eer"] for r in line)
    if best >= start:
        return []
    levels = sorted({r["concurrency"] for r in line})
    curves = {
        r["arm"]: load_curve(r["folder"])
        for r in rows
        if r.get("algorithm") in ("fedavgm", "fedbuff") and r.get("trips")
    }
    out = [
        "",
        "FedAvgM / FedBuff (K = 10) trips to target (each its fewest over its lrs), at other "
        "targets:",
        "",
        "| share of the way | target EER | " + " | ".join(f"C = {c:,}" for c in levels) + " |",
        "|---|---|" + "---|" * len(levels),
    ]
    for share in CONC_SENSITIVITY_SHARES:
        target = start - share * (start - best)
        cells = []
        for c in levels:
            at_c = [r for r in rows if r["arm"] in curves and r["concurrency"] == c]
            buffs = [r for r in at_c if r["algorithm"] == "fedbuff" and r["buffer"] == CONC_BUFFER]
            reached = [
                t for r in buffs if (t := to_target(curves[r["arm"]], target)[0]) is not None
            ]
            b = min(reached) if reached else None
            avg = [r for r in at_c if r["algorithm"] == "fedavgm"]
            a = [t for r in avg if (t := to_target(curves[r["arm"]], target)[0]) is not None]
            if not b or not avg:
                cells.append("—")
            elif a:
                cells.append(f"{min(a) / b:.2f}x")
            else:
                cells.append(f">{max(r['trips'] for r in avg) / b:.2f}x")
        out.append(f"| {share:g} | {100 * target:.2f}% | " + " | ".join(cells) + " |")
    return out


def _fedbuff_ratios(rows: list[dict]) -> str:
    """ "C=10: 1.20x, ..." from the Figure-1 rows that reached the target (">3.10x": FedAvgM
    did not within its budget of trips)."""
    parts = []
    for c in sorted({r["concurrency"] for r in rows if r.get("on_line")}):
        at = {r["algorithm"]: r for r in rows if r.get("on_line") and r["concurrency"] == c}
        avg, buff = at.get("fedavgm"), at.get("fedbuff")
        if not (avg and buff and buff.get("trips_to_target")):
            continue
        if avg.get("trips_to_target"):
            parts.append(f"C={c}: {avg['trips_to_target'] / buff['trips_to_target']:.2f}x")
        elif avg.get("trips"):  # FedAvgM never got there: its whole budget is a lower bound
            parts.append(f"C={c}: >{avg['trips'] / buff['trips_to_target']:.2f}x")
    return ", ".join(parts)


def _plot_concurrency(rows: list[dict], path: Path) -> Path:
    """The FedBuff paper's Figure 1: client trips to the target against concurrency, one
    line per algorithm (FedAvgM at its best lr per C)."""
    fig = Figure(figsize=(6, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for algo, colour in (("fedavgm", "#1f77b4"), ("fedbuff", "#d62728"), ("fedasync", "#2ca02c")):
        pts = sorted(
            (r["concurrency"], r["trips_to_target"])
            for r in rows
            if r.get("on_line") and r["algorithm"] == algo and r.get("trips_to_target")
        )
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colour, label=algo)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("concurrency C (devices training at once)")
    ax.set_ylabel("client trips to the target EER")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))


TABLES: dict[str, Callable[[list[dict]], list[str]]] = {
    "speakers": _speakers_table,
    "dp": _dp_table,
    "gain": _gain_table,
    "robustness": _robustness_table,
    "concurrency": _concurrency_table,
}


def run_study(
    name: str,
    out: Path,
    sets: dict[str, Any] | None = None,
    arms: list[str] | None = None,
    progress: bool = True,
) -> Path:
    """Run every arm of study `name` (or the `arms` chosen, plus the arms they depend on,
    dependencies first) into `out/<arm>` and write `out/study.md`."""
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
    sets = sets or {}
    order = study_order(study, chosen, sets)  # dependencies first
    folders = {a.name: (out / a.name).resolve() for a in order}
    configs = {a.name: arm_config(study, a, sets, folders) for a in order}  # refuse early
    diverged: dict[str, str] = {}
    for arm in order:
        try:
            run_arm(configs[arm.name], folders[arm.name], progress)
        except DataError as err:
            if not (study.diverged_rows and "not finite" in err.problem):
                raise
            diverged[arm.name] = err.problem
    rows = []
    for arm in order:
        if arm.name in diverged:
            rows.append(_diverged_row(arm, folders[arm.name], diverged[arm.name]))
            continue
        row = _arm_row(arm, folders[arm.name])
        row["hours"] = _virtual_hours(folders[arm.name])
        rows.append(row)
    trained = [r["folder"] for r in rows if not r.get("diverged")]
    if trained:
        compare_runs(trained, out)
    refs = study.references if add_gap_closed(rows, study.references) else None
    lines = [f"# fedvox repro {name}", "", study.title, "", *TABLES[study.table](rows), ""]
    if study.table == "dp":
        _plot_dp(rows, out / "eer_vs_epsilon.png")
        lines += ["![EER vs ε](eer_vs_epsilon.png)", ""]
    if study.table == "concurrency":
        _plot_concurrency(rows, out / "trips_vs_concurrency.png")
        lines += ["![client trips to target vs concurrency](trips_vs_concurrency.png)", ""]
    if refs is not None:
        public, oracle = (next(r for r in rows if r["arm"] == n) for n in refs)
        if oracle["eer"] >= public["eer"]:
            lines += [
                f"Note: the oracle ({oracle['arm']}) is not better than {public['arm']} here, "
                "so there is no gap to close and the gap-closed column is left empty.",
                "",
            ]
        _plot_references(rows, refs, "trips", "client trips", out / "gain_vs_trips.png")
        _plot_references(rows, refs, "hours", "virtual hours", out / "gain_vs_hours.png")
        lines += [
            "![EER vs client trips, with the references](gain_vs_trips.png)",
            "",
            "![EER vs virtual hours, with the references](gain_vs_hours.png)",
            "",
        ]
    elif trained:
        lines += ["![EER vs client trips](eer_vs_trips.png)", ""]
    lines += [*study.notes, ""]
    lines += ["Arms (each an ordinary run folder):", *(f"- `{r['folder']}`" for r in rows), ""]
    atomic_write_text(out / "rows.json", json.dumps(rows, indent=1) + "\n")
    return atomic_write_text(out / "study.md", "\n".join(lines))
