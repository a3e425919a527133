"""Enrollment and verification with a trained run: speaker profiles from wav files.

A profile is the mean of length-normalised, mean-subtracted embeddings of the enrollment
utterances (the closed-form speaker reconstruction); verify scores one wav against it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fedvox.atomic import atomic_write_text
from fedvox.data.audio import read_audio
from fedvox.data.features import extract_features
from fedvox.errors import DataError, FedvoxError
from fedvox.eval.backend import Backend
from fedvox.eval.extract import embed_utterances
from fedvox.eval.scoring import length_normalize
from fedvox.experiment.config import ExperimentConfig
from fedvox.experiment.runfolder import RunFolder, load_run_model
from fedvox.models.io import weights_hash
from fedvox.tasks.speakers import enrollment_prototypes

PROFILE_VERSION = 1


def embed_wavs(extractor: nn.Module, cfg: ExperimentConfig, wavs: list[Path]) -> np.ndarray:
    """Embeddings [n, dim] of wav files through a run's front end and extractor."""
    fcfg = cfg.features.feature_config()
    feats = [extract_features(read_audio(Path(w), fcfg.fbank.sample_rate), fcfg) for w in wavs]
    for w, f in zip(wavs, feats, strict=True):
        if f.shape[0] < 10:
            raise DataError(
                w,
                f"too short for an embedding ({f.shape[0]} frames)",
                "use at least 0.2 s of speech",
            )
    return embed_utterances(extractor, feats)


@dataclass
class Profile:
    """A speaker profile: the enrolled vector and where it came from."""

    speaker: str
    vector: np.ndarray
    n_utterances: int
    run: str
    weights_sha256: str

    def save(self, path: Path) -> Path:
        blob = {
            "version": PROFILE_VERSION,
            "speaker": self.speaker,
            "vector": [float(x) for x in self.vector],
            "n_utterances": self.n_utterances,
            "run": self.run,
            "weights_sha256": self.weights_sha256,
        }
        return atomic_write_text(path, json.dumps(blob, indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Profile:
        try:
            blob = json.loads(Path(path).read_text())
            return cls(
                blob["speaker"],
                np.asarray(blob["vector"], dtype=np.float32),
                int(blob["n_utterances"]),
                blob["run"],
                blob["weights_sha256"],
            )
        except FileNotFoundError:
            raise DataError(
                path, "profile file does not exist", "create it with `fedvox enroll`"
            ) from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise DataError(
                path, f"not a fedvox speaker profile ({exc})", "re-create it with `fedvox enroll`"
            ) from None


def enroll(run_path: Path, wavs: list[Path], speaker: str) -> Profile:
    """Build a profile from enrollment wavs with a trained run."""
    if not wavs:
        raise FedvoxError("enroll needs at least one wav file. Fix: pass enrollment recordings")
    run = RunFolder.open(run_path)
    extractor, cfg = load_run_model(run)
    backend = Backend.load(run.path / "backend")
    # Enrollment is Federated Reconstruction's closed form (speakers as local parameters):
    # the normalised mean of the normalised embeddings, after the scoring mean is removed.
    emb = torch.from_numpy(embed_wavs(extractor, cfg, wavs) - backend.mean).float()
    vector = enrollment_prototypes(emb, torch.ones(len(emb), 1))[0].double().numpy()
    return Profile(speaker, vector, len(wavs), str(run.path.resolve()), weights_hash(extractor))


@dataclass
class Decision:
    score: float
    threshold: float
    accept: bool


def verify(
    profile: Profile, wav: Path, run_path: Path | None = None, threshold: float | None = None
) -> Decision:
    """Score a wav against a profile; accept iff score >= the run's calibrated threshold."""
    run = RunFolder.open(run_path or profile.run)
    extractor, cfg = load_run_model(run)
    if weights_hash(extractor) != profile.weights_sha256:
        raise FedvoxError(
            f"profile '{profile.speaker}' was enrolled with another model than {run.path}. "
            "Fix: enroll again with this run, or pass the run it was made with"
        )
    backend = Backend.load(run.path / "backend")
    if threshold is None:
        threshold = float(json.loads((run.path / "calibration.json").read_text())["threshold"])
    e = length_normalize(embed_wavs(extractor, cfg, [wav]) - backend.mean)[0]
    score = float(e @ profile.vector)
    return Decision(score, threshold, score >= threshold)
