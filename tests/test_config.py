"""Config validation: bad fields are refused at load with the field named."""

from pathlib import Path

import pytest

from fedvox.errors import ConfigError
from fedvox.experiment.config import (
    ExperimentConfig,
    config_from_dict,
    dump_toml,
    load_config,
    parse_override,
)


def test_defaults_roundtrip_through_toml(tmp_path: Path) -> None:
    cfg = ExperimentConfig()
    p = tmp_path / "c.toml"
    p.write_text(dump_toml(cfg))
    again = load_config(p)
    assert again == cfg
    assert again.hash() == cfg.hash()


@pytest.mark.parametrize(
    ("d", "field"),
    [
        ({"train": {"lr": -1}}, "train.lr"),
        ({"train": {"steps": 0}}, "train.steps"),
        ({"train": {"lrr": 1}}, "train.lrr"),
        ({"model": {"norm": "weird"}}, "model.norm"),
        ({"train": {"chunk_frames": [400, 200]}}, "train"),
        ({"data": {"synthetic": {"difficulty": "extreme"}}}, "data.synthetic.difficulty"),
        ({"data": {"train": "/some/dir"}}, "data"),
        ({"train": {"augment": {"speed_factors": [1.0]}}}, "train.augment"),
        ({"federated": {"chunk_hop": 0}}, "federated.chunk_hop"),
        ({"federated": {"chunk_hop": 300}}, "federated"),
        (
            {"federated": {"chunk_hop": 50, "reconstruction": {"split": "groups"}}},
            "federated",
        ),
    ],
)
def test_bad_fields_are_named(d: dict, field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        config_from_dict(d)
    assert f"field '{field}" in str(exc.value)
    assert "Fix:" in str(exc.value)


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text("[train\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"bad\.toml"):
        load_config(p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def test_overrides_apply_and_validate(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("name = 'x'\n[train]\nsteps = 10\n")
    cfg = load_config(
        p, dict([parse_override("train.steps=20"), parse_override("model.name=ecapa-small")])
    )
    assert cfg.train.steps == 20
    assert cfg.model.name == "ecapa-small"
    with pytest.raises(ConfigError, match=r"train\.steps"):
        load_config(p, dict([parse_override("train.steps=-3")]))


def test_hash_changes_with_any_field() -> None:
    a = ExperimentConfig()
    b = config_from_dict({"train": {"lr": 0.001}})
    assert a.hash() != b.hash()


def test_shipped_configs_validate() -> None:
    configs = sorted(Path(__file__).resolve().parents[1].joinpath("configs").glob("*.toml"))
    assert configs
    for p in configs:
        cfg = load_config(p)
        assert cfg.name == p.stem


@pytest.mark.parametrize(
    ("override", "path"),
    [
        ({"buffer_size": 20, "concurrency": 10, "algorithm": "fedbuff"}, "federated.buffer_size"),
        ({"delay": "uniform", "delay_mean_s": 1.0, "dropout": 0.2}, None),
    ],
)
def test_engine_rules_fail_at_load_under_the_toml_path(override: dict, path: str | None) -> None:
    d = {"federated": override}
    if path is None:
        config_from_dict(d)  # valid engine settings load
        return
    with pytest.raises(ConfigError) as err:
        config_from_dict(d, source="x.toml")
    assert err.value.field.startswith(path)
    assert "x.toml" in str(err.value)


def test_engine_error_is_renamed_to_the_key_the_user_wrote() -> None:
    from fedvox.experiment.config import FederatedSection

    section = FederatedSection.model_construct(**{**FederatedSection().__dict__, "local_lr": -1.0})
    with pytest.raises(ConfigError) as err:
        section.client_config()
    assert err.value.field == "federated.local_lr"  # the engine calls it client.lr
