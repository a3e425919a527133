"""The evaluation settings of a run and the cheap held-out check used during training.

Glue between a run's config and `fedvox.eval.backend`, which fits the back ends and scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from torch import nn

from fedvox.device import module_on
from fedvox.eval.backend import BackendConfig, evaluate_extractor
from fedvox.eval.extract import embed_dict
from fedvox.eval.metrics import acceptance_rate
from fedvox.eval.scoring import score_trials
from fedvox.experiment.config import EvalSection, ExperimentConfig
from fedvox.experiment.prepare import PreparedData


def backend_config(section: EvalSection) -> BackendConfig:
    """The scoring layer's BackendConfig for a config's [eval] table."""
    return BackendConfig(
        backends=tuple(section.backends),
        asnorm_top_n=section.asnorm_top_n,
        lda_dim=section.lda_dim,
        max_train_utts=section.max_train_utts,
    )


def quick_eval(
    extractor: nn.Module,
    cfg: ExperimentConfig,
    data: PreparedData,
    attack_trials: Sequence[tuple[str, str]] = (),
) -> dict:
    """Held-out cosine metrics with at most 500 training utterances for the mean: cheap
    enough to run during training (centralised and federated alike), plus the held-out
    speakers' common offset (eval.backend.speaker_offset). With `attack_trials` ((enroll,
    test) utterances of the test set), "attack_success": the fraction of them accepted at
    the cosine EER threshold, scored like the trial list (same mean). Embeds on
    cfg.train.device."""
    settings = replace(
        backend_config(cfg.eval),
        backends=("cosine",),
        max_train_utts=min(500, cfg.eval.max_train_utts),
    )
    placed = module_on(extractor, cfg.train.device)
    res, backend = evaluate_extractor(
        placed,
        *data.backend_data(),
        data.test_feats,
        data.trials,
        settings,
        progress=False,
        test_speaker_of=data.test_corpus.speaker_of,
    )
    out = {**res.metrics["cosine"].to_dict(), "offset": res.extra["offset"]}
    if attack_trials:
        utts = sorted({u for t in attack_trials for u in t})
        emb = embed_dict(placed, data.test_feats, utts, "embed attack trials", False)
        enroll, test = zip(*attack_trials, strict=True)
        s = score_trials(emb, list(enroll), list(test), "cosine", mean=backend.mean)
        out["attack_success"] = acceptance_rate(s, out["eer_threshold"])
    return out
