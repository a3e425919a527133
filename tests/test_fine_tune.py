"""Centralised fine-tuning: train.init_from and the imprinted head (the fine-tuned pooled
oracle of the world studies)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_corpus import TINY_DATA, TINY_EVAL

from fedvox.errors import ConfigError
from fedvox.experiment.config import load_config
from fedvox.experiment.prepare import prepare
from fedvox.experiment.runner import _fresh_training, run_experiment
from fedvox.models import build_extractor
from fedvox.models.heads import AAMSoftmax
from fedvox.models.io import load_model, save_model, weights_hash
from fedvox.training.centralised import imprint_head

TRAIN = """[model]
name = "xvector-tiny"
norm = "layer"
[train]
threads = 1
steps = 4
batch_size = 8
chunk_frames = [40, 60]
warmup_steps = 1
checkpoint_every = 2
"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return tmp_path_factory.mktemp("ftcache")


def write_config(path: Path, cache: Path, init_from: Path | None = None, fed: bool = False) -> Path:
    text = 'name = "ft"\nseed = 0\n' + TINY_DATA.format(cache=cache) + TINY_EVAL + TRAIN
    if init_from is not None:
        text = text.replace("[train]\n", f'[train]\ninit_from = "{init_from}"\n')
    if fed:
        text += "[federated]\nserver_steps = 2\n"
    path.write_text(text)
    return path


def save_init(path: Path, norm: str = "layer", seed: int = 7) -> Path:
    torch.manual_seed(seed)
    ext = build_extractor("xvector-tiny", 30, norm=norm)
    return save_model(
        path, ext, model_name="xvector-tiny", feat_dim=30, norm=norm, embedding_layer=None
    )


def test_imprinted_class_vectors_are_the_speakers_mean_unit_embeddings() -> None:
    torch.manual_seed(0)
    ext = build_extractor("xvector-tiny", 30, norm="layer")
    rng = np.random.default_rng(0)
    feats = [rng.standard_normal((int(n), 30)).astype(np.float32) for n in (50, 80, 70, 90, 60)]
    labels = np.array([0, 1, 0, 2, 1])
    head = AAMSoftmax(ext(torch.zeros(2, 50, 30)).shape[1], 3)
    imprint_head(head, ext, feats, labels, max_frames=64)
    ext.eval()
    with torch.no_grad():
        emb = [
            torch.nn.functional.normalize(ext(torch.from_numpy(f[:64])[None])[0], dim=0)
            for f in feats
        ]
    for c in range(3):
        mean = torch.stack([e for e, y in zip(emb, labels, strict=True) if y == c]).mean(0)
        want = torch.nn.functional.normalize(mean, dim=0)
        torch.testing.assert_close(head.weight[c], want, atol=1e-5, rtol=1e-5)
    # every utterance scores highest against its own speaker's vector here
    logits = head(torch.stack(emb))
    assert (logits.argmax(1).numpy() == labels).all()
    with pytest.raises(ValueError, match="1 classes have no utterances"):
        imprint_head(AAMSoftmax(head.emb_dim, 4), ext, feats, labels, max_frames=64)


def test_train_init_from_starts_at_the_weights_with_an_imprinted_head(
    tmp_path: Path, cache: Path
) -> None:
    model = save_init(tmp_path / "public-run" / "model.pt")
    cfg = load_config(write_config(tmp_path / "a.toml", cache, init_from=tmp_path / "public-run"))
    data = prepare(cfg, progress=False)
    assert data.init is not None
    state = _fresh_training(cfg, data)
    assert weights_hash(state.extractor) == data.init.weights_sha256
    plain_cfg = load_config(write_config(tmp_path / "b.toml", cache))
    plain = _fresh_training(plain_cfg, prepare(plain_cfg, progress=False))
    assert weights_hash(plain.extractor) != data.init.weights_sha256
    assert not torch.equal(plain.head.weight, state.head.weight)
    torch.testing.assert_close(state.head.weight.norm(dim=1), torch.ones(8))
    # the run trains from there and says where it started; the same config, the same bits
    _ = [run_experiment(cfg, tmp_path / f"run{i}", progress=False) for i in (1, 2)]
    manifest = json.loads((tmp_path / "run1" / "manifest.json").read_text())
    assert manifest["init_from"] == str(model)
    assert manifest["init_weights_sha256"] == data.init.weights_sha256
    a, b = (
        weights_hash(load_model(o / "model.pt")) for o in (tmp_path / "run1", tmp_path / "run2")
    )
    assert a == b and a != data.init.weights_sha256


def test_train_init_from_refusals(tmp_path: Path, cache: Path) -> None:
    bn = save_init(tmp_path / "bn.pt", norm="batch")
    cfg = load_config(write_config(tmp_path / "c.toml", cache, init_from=bn))
    with pytest.raises(ConfigError) as e:
        prepare(cfg, progress=False)
    assert e.value.field == "train.init_from" and "norm 'batch' (this run: 'layer')" in str(e.value)
    cfg = load_config(write_config(tmp_path / "d.toml", cache, init_from=tmp_path / "nothing"))
    with pytest.raises(ConfigError, match="no model at") as e:
        prepare(cfg, progress=False)
    assert e.value.field == "train.init_from"
    with pytest.raises(ConfigError, match=r"federated\.init_from") as e:
        load_config(write_config(tmp_path / "e.toml", cache, init_from=bn, fed=True))
    assert e.value.field == "train.init_from"
