"""[data.world] and the symbolic corpus names "world:public|devices|test|trials"."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedvox.data.world import WorldConfig, ensure_world
from fedvox.errors import ConfigError
from fedvox.experiment.config import config_from_dict
from fedvox.experiment.prepare import prepare

# A world of a few short recordings: seconds to generate.
TINY_WORLD = {
    "seed": 3,
    "public_speakers": 3,
    "train_devices": 4,
    "test_devices": 8,
    "public_utts": [3, 3],
    "public_duration_s": [1.0, 1.4],
    "device_utts": [3, 4],
    "device_duration_s": [1.0, 1.4],
}


def _data(**kw) -> dict:
    return {
        "world": TINY_WORLD,
        "train": "world:devices",
        "test": "world:test",
        "trials": "world:trials",
        "workers": 1,
        **kw,
    }


def test_world_defaults_are_the_generators() -> None:
    cfg = config_from_dict({"data": _data(world={})})
    w = cfg.data.world
    ref = WorldConfig()
    assert (w.seed, w.public_speakers, w.train_devices, w.test_devices) == (
        ref.seed,
        ref.public_speakers,
        ref.train_devices,
        ref.test_devices,
    )
    assert w.world_config() == ref
    # the resolved config (what config.toml records) spells the counts out
    assert cfg.to_dict()["data"]["world"]["train_devices"] == ref.train_devices


@pytest.mark.parametrize(
    ("data", "field", "words"),
    [
        (
            {"train": "world:devices", "test": "world:test", "trials": "world:trials"},
            "data",
            "[data.world] is unset",
        ),
        (_data(train="world:tests"), "data", '"world:public" or "world:devices"'),
        (_data(train="world:test"), "data", "seen voices"),
        (_data(public="world:trials"), "data", "data.public"),
        (_data(backend="world:test"), "data", "seen voices"),
        (_data(test="world:devices"), "data", '"world:test"'),
        (_data(trials="/some/trials.txt"), "data", 'data.trials = "world:trials"'),
        (_data(test=None, trials=None), "data", 'data.test = "world:test"'),
        (
            _data(world={**TINY_WORLD, "public_duration_s": [2.0, 1.0]}),
            "data.world",
            "data.world.public_duration_s",
        ),
        (
            _data(world={**TINY_WORLD, "test_devices": 1}),
            "data.world.test_devices",
            "greater than or equal to 2",
        ),
        (_data(world={**TINY_WORLD, "devices": 3}), "data.world.devices", "unknown field"),
    ],
)
def test_world_names_errors_name_the_field_and_fix(data: dict, field: str, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        config_from_dict({"data": data})
    assert e.value.field == field and words in str(e.value)


def test_prepare_resolves_world_parts_through_the_cache(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    cache = tmp_path / "cache"
    cfg = config_from_dict(
        {
            "data": _data(cache_dir=str(cache), public="world:public"),
            "federated": {
                "speakers": "local",
                "concurrency": 2,
                "chunk_frames": 40,
                "reconstruction": {"public_speakers": 3, "public_chunks": 1},
            },
        }
    )
    data = prepare(cfg, progress=False)
    paths = ensure_world(
        cfg.data.world.world_config(), cache / "corpora", workers=1, progress=False
    )
    assert data.train_speakers() == [f"dev-{i:06d}" for i in range(4)]
    assert {data.test_corpus.speaker_of(u) for u in data.test_feats} == {
        f"tst-{i:05d}" for i in range(8)
    }
    assert len(data.trials) > 0 and data.public is not None
    assert data.public.speakers == ("pub-00000", "pub-00001", "pub-00002")
    assert data.test_corpus.root == paths.test  # the generated parts, reused, not regenerated


def test_backend_data_is_fit_on_the_named_corpus(tmp_path: Path) -> None:
    """data.backend: the scoring back end sees that corpus, training still its own."""
    torch.set_num_threads(1)
    cache = str(tmp_path / "cache")
    cfg = config_from_dict(
        {"data": _data(cache_dir=cache, train="world:public", backend="world:devices")}
    )
    data = prepare(cfg, progress=False)
    feats, speaker_of = data.backend_data()
    assert {speaker_of(u) for u in feats} == {f"dev-{i:06d}" for i in range(4)}
    assert data.train_speakers() == ["pub-00000", "pub-00001", "pub-00002"]
    plain = prepare(config_from_dict({"data": _data(cache_dir=cache)}), progress=False)
    assert plain.backend_feats is None and plain.backend_data()[0] is plain.train_feats


def test_generation_errors_name_the_world_key(tmp_path: Path) -> None:
    world = {**TINY_WORLD, "test_devices": 2}  # at seed 3 the two devices have different models
    cfg = config_from_dict({"data": _data(world=world, cache_dir=str(tmp_path))})
    with pytest.raises(ConfigError) as e:
        prepare(cfg, progress=False)
    assert e.value.field == "data.world.test_devices" and "more test devices" in str(e.value)
