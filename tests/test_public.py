"""The server's public corpus: built by prepare(), from the generator or from data.public."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_corpus import TINY_DATA, write_kaldi_dir

from fedvox.data.corpus import load_kaldi_dir
from fedvox.data.store import FeatureStore, extract_corpus
from fedvox.errors import ConfigError
from fedvox.experiment.config import config_from_dict, load_config
from fedvox.experiment.federated import build_setup
from fedvox.experiment.prepare import prepare
from fedvox.tasks.speakers import public_speaker_store
from fedvox.training.chunks import fixed_chunks

FED = """[train]
threads = 1
[federated]
speakers = "{speakers}"
concurrency = 4
server_steps = 2
chunk_frames = 60
local_batch_size = 4
[federated.reconstruction]
public_speakers = {p}
public_chunks = 2
"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return tmp_path_factory.mktemp("publiccache")


@pytest.fixture(scope="module")
def public_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("public") / "kaldi"
    return write_kaldi_dir(root, {"pubC": 2, "pubA": 3, "pubB": 2})


def config(tmp: Path, cache: Path, speakers: str = "local", p: int = 2, public: Path | None = None):
    text = TINY_DATA.format(cache=cache) + FED.format(speakers=speakers, p=p)
    if public is not None:
        text = text.replace("[data]\n", f'[data]\npublic = "{public}"\n')
    (tmp / "c.toml").write_text(text)
    return load_config(tmp / "c.toml")


def test_default_public_is_the_generators_other_seed_speakers(tmp_path: Path, cache: Path) -> None:
    cfg = config(tmp_path, cache, p=3)
    data = prepare(cfg, progress=False)
    want = public_speaker_store(
        cfg.data.synthetic.generator_config(),
        cfg.features.feature_config(),
        n_speakers=3,
        chunks_per_speaker=2,
        chunk_frames=60,
        cache_root=cache / "corpora",
        feature_store=FeatureStore(cache / "features"),
    )
    assert data.public is not None and data.public.speakers == want.speakers
    assert torch.equal(data.public.x, want.x) and torch.equal(data.public.y, want.y)
    assert prepare(config(tmp_path, cache, "global_head"), progress=False).public is None


def test_public_from_a_kaldi_dir_first_speakers_and_chunks(
    tmp_path: Path, cache: Path, public_dir: Path
) -> None:
    cfg = config(tmp_path, cache, p=2, public=public_dir)
    data = prepare(cfg, progress=False)
    pub = data.public
    assert pub is not None and pub.speakers == ("pubA", "pubB")  # first two, sorted
    corpus = load_kaldi_dir(public_dir)
    feats = extract_corpus(corpus, cfg.features.feature_config(), None, progress=False)
    want = []
    for s in ("pubA", "pubB"):
        utts = sorted(u for u in feats if corpus.speaker_of(u) == s)
        want.append(np.concatenate([fixed_chunks(feats[u], 60) for u in utts])[:2])
    assert torch.equal(pub.x, torch.from_numpy(np.concatenate(want)))
    assert pub.y.tolist() == [0, 0, 1, 1]


def test_too_few_public_speakers_names_the_field_and_fix(
    tmp_path: Path, cache: Path, public_dir: Path
) -> None:
    with pytest.raises(ConfigError, match=r"data\.public.*holds 3 speakers.*asks for 4") as e:
        prepare(config(tmp_path, cache, p=4, public=public_dir), progress=False)
    assert "public_speakers <= 3" in str(e.value)
    with pytest.raises(ConfigError, match=r"data\.public.*does not exist"):
        prepare(config(tmp_path, cache, public=tmp_path / "nope"), progress=False)


def test_wiring_a_run_does_no_io(
    tmp_path: Path, cache: Path, public_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config(tmp_path, cache, p=2, public=public_dir)
    data = prepare(cfg, progress=False)

    def no_io(*args, **kw):
        raise AssertionError("I/O while wiring the run")

    for name in ("ensure_corpus", "extract_corpus", "load_kaldi_dir"):
        monkeypatch.setattr(f"fedvox.tasks.speakers.public.{name}", no_io)
    for name in ("extract_corpus", "load_corpus", "public_speaker_store"):
        monkeypatch.setattr(f"fedvox.experiment.prepare.{name}", no_io)
    setup = build_setup(cfg, data)
    sim = setup.simulator  # the broadcast carries P = 2 public negatives
    assert sim.bytes_down_per_trip - sim.bytes_per_trip == 4 * 2 * setup.task.emb_dim


def test_data_public_is_optional_in_the_schema() -> None:
    assert config_from_dict({}).data.public is None
    assert config_from_dict({"data": {"public": "x"}}).data.public == "x"
