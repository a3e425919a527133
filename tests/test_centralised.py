"""Centralised training's settings: built from a run's config, and its learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import fields

from fedvox.experiment.config import config_from_dict
from fedvox.experiment.runner import centralised_config
from fedvox.training.centralised import TrainConfig, lr_at


def test_centralised_config_carries_every_field_it_names_from_the_run_config() -> None:
    cfg = config_from_dict(
        {"seed": 11, "model": {"margin": 0.3}, "train": {"steps": 50, "lr": 3e-3, "threads": 1}}
    )
    got = centralised_config(cfg)
    assert got.seed == 11
    for f in fields(got.train):
        assert getattr(got.train, f.name) == getattr(cfg.train, f.name), f.name
    for f in fields(got.model):
        want = cfg.model_norm() if f.name == "norm" else getattr(cfg.model, f.name)
        assert getattr(got.model, f.name) == want, f.name
    fed = centralised_config(config_from_dict({"federated": {}}))
    assert fed.model.norm == "layer"  # the federated default, resolved by the caller


def test_lr_warms_up_linearly_then_decays_to_the_final_rate() -> None:
    t = TrainConfig(
        steps=100,
        batch_size=8,
        chunk_frames=(50, 60),
        optimizer="adam",
        lr=1e-2,
        final_lr=1e-4,
        warmup_steps=10,
        weight_decay=0.0,
        max_grad_norm=None,
        threads=1,
    )
    assert math.isclose(lr_at(0, t), 1e-3) and math.isclose(lr_at(9, t), 1e-2)
    assert math.isclose(lr_at(10, t), 1e-2) and math.isclose(lr_at(100, t), 1e-4)
    assert math.isclose(lr_at(55, t), 1e-3)  # halfway through the decay: the geometric mean
