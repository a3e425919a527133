"""The evaluation settings of a run and the cheap held-out check used during training.

Glue between a run's config and `fedvox.eval.backend`, which fits the back ends and scores.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from fedvox.device import module_on
from fedvox.eval.backend import BackendConfig, evaluate_extractor
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


def quick_eval(extractor: nn.Module, cfg: ExperimentConfig, data: PreparedData) -> dict:
    """Held-out cosine metrics with at most 500 training utterances for the mean: cheap
    enough to run during training (centralised and federated alike), plus the held-out
    speakers' common offset (eval.backend.speaker_offset). Embeds on cfg.train.device."""
    settings = replace(
        backend_config(cfg.eval),
        backends=("cosine",),
        max_train_utts=min(500, cfg.eval.max_train_utts),
    )
    res, _ = evaluate_extractor(
        module_on(extractor, cfg.train.device),
        *data.backend_data(),
        data.test_feats,
        data.trials,
        settings,
        progress=False,
        test_speaker_of=data.test_corpus.speaker_of,
    )
    return {**res.metrics["cosine"].to_dict(), "offset": res.extra["offset"]}
