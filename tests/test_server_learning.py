"""Public pre-training then federated fine-tuning: federated.init_from and server learning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kill import train_until_killed
from tiny_corpus import TINY_DATA, TINY_EVAL, write_kaldi_dir
from typer.testing import CliRunner

from fedvox.cli import app
from fedvox.errors import ConfigError
from fedvox.experiment.config import load_config
from fedvox.experiment.federated import build_setup
from fedvox.experiment.prepare import prepare
from fedvox.models import build_extractor
from fedvox.models.io import load_model, save_model, weights_hash
from fedvox.tasks.speakers import EXTRACTOR, ServerLearning

runner = CliRunner()

FED = """[train]
threads = 1
[federated]
algorithm = "{algorithm}"
speakers = "{speakers}"
concurrency = 4
buffer_size = 2
server_steps = {steps}
eval_every = 4
checkpoint_every = 2
chunk_frames = 60
local_batch_size = 4
local_lr = 0.02
delay_mean_s = 30
[federated.reconstruction]
public_speakers = 2
public_chunks = 1
"""

LEARN = """[federated.server_learning]
steps = 2
lr = 0.0005
batch_size = 8
momentum = 0.5
"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return tmp_path_factory.mktemp("slcache")


@pytest.fixture(scope="module")
def public_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("slpublic") / "kaldi"
    return write_kaldi_dir(root, {"pubA": 3, "pubB": 3, "pubC": 3, "pubD": 3})


def write_config(
    path: Path,
    cache: Path,
    algorithm: str = "fedbuff",
    speakers: str = "global_head",
    steps: int = 4,
    public: Path | None = None,
    init_from: Path | None = None,
    learn: bool = False,
) -> Path:
    text = 'name = "sl"\nseed = 0\n' + TINY_DATA.format(cache=cache) + TINY_EVAL
    text += FED.format(algorithm=algorithm, speakers=speakers, steps=steps)
    if public is not None:
        text = text.replace("[data]\n", f'[data]\npublic = "{public}"\n')
    if init_from is not None:
        text = text.replace("[federated]\n", f'[federated]\ninit_from = "{init_from}"\n')
    if learn:
        text += LEARN
    path.write_text(text)
    return path


def save_init(path: Path, feat_dim: int = 30, norm: str = "layer", seed: int = 123) -> Path:
    """A model file as a finished run writes it, with weights unlike any run's own init."""
    torch.manual_seed(seed)
    ext = build_extractor("xvector-small", feat_dim, norm=norm)
    return save_model(
        path, ext, model_name="xvector-small", feat_dim=feat_dim, norm=norm, embedding_layer=None
    )


def extractor_hash(params: dict) -> str:
    ext = build_extractor("xvector-small", 30, norm="layer")
    n = len(EXTRACTOR)
    ext.load_state_dict({k[n:]: v for k, v in params.items() if k.startswith(EXTRACTOR)})
    return weights_hash(ext)


@pytest.mark.parametrize("speakers", ["global_head", "local"])
def test_init_from_starts_at_the_saved_weights(tmp_path: Path, cache: Path, speakers: str) -> None:
    model = save_init(tmp_path / "public-run" / "model.pt")
    want = weights_hash(load_model(model))
    plain = build_setup(
        cfg := load_config(write_config(tmp_path / "a.toml", cache, speakers=speakers)),
        prepare(cfg, progress=False),
    )
    assert weights_hash(plain.task.extractor) != want
    for given in (tmp_path / "public-run", model):  # a run folder or its model file
        cfg = load_config(
            write_config(tmp_path / "b.toml", cache, speakers=speakers, init_from=given)
        )
        data = prepare(cfg, progress=False)
        assert data.init is not None and data.init.weights_sha256 == want
        setup = build_setup(cfg, data)
        assert weights_hash(setup.task.extractor) == want
        assert extractor_hash(setup.simulator.params) == want  # what step 0 broadcasts


def test_bad_or_incompatible_init_is_refused(tmp_path: Path, cache: Path) -> None:
    def fails(init: Path) -> str:
        cfg = load_config(write_config(tmp_path / "c.toml", cache, init_from=init))
        with pytest.raises(ConfigError) as e:
            prepare(cfg, progress=False)
        assert e.value.field == "federated.init_from"
        return str(e.value)

    (tmp_path / "unfinished").mkdir()
    assert "no model at" in fails(tmp_path / "unfinished") and "not finished" in fails(
        tmp_path / "unfinished"
    )
    assert "no model at" in fails(tmp_path / "nope.pt")
    msg = fails(save_init(tmp_path / "bn.pt", norm="batch"))
    assert "norm 'batch' (this run: 'layer')" in msg and 'model.norm = "layer"' in msg
    msg = fails(save_init(tmp_path / "f40.pt", feat_dim=40))
    assert "feat_dim 40 (this run: 30)" in msg


def test_server_learning_needs_a_public_corpus(tmp_path: Path, cache: Path) -> None:
    with pytest.raises(ConfigError, match=r"federated\.server_learning.*data\.public"):
        load_config(write_config(tmp_path / "d.toml", cache, learn=True))


@pytest.mark.parametrize(
    ("algorithm", "speakers"),
    [("fedavg", "global_head"), ("fedbuff", "local"), ("fedasync", "global_head")],
)
def test_server_learning_moves_only_the_extractor_deterministically(
    tmp_path: Path, cache: Path, public_dir: Path, algorithm: str, speakers: str
) -> None:
    cfg = load_config(
        write_config(tmp_path / "e.toml", cache, algorithm, speakers, public=public_dir, learn=True)
    )
    data = prepare(cfg, progress=False)
    assert data.public_train is not None and data.public_train.n_speakers == 4  # all of them
    alg = build_setup(cfg, data).simulator.algorithm
    assert isinstance(alg, ServerLearning)
    params = build_setup(cfg, data).simulator.params
    zero = {n: torch.zeros_like(t) for n, t in params.items()}
    args = (zero, 1.0, 1, [params], torch.zeros(1))
    new = alg.apply(params, *args)
    assert alg.taken == 2 and set(new) == set(params)  # the server head is never broadcast
    for n, t in params.items():
        assert torch.equal(new[n], t) != n.startswith(EXTRACTOR), n
    again = build_setup(cfg, data).simulator.algorithm.apply(params, *args)
    assert all(torch.equal(new[n], again[n]) for n in new)
    # resuming from its state continues identically
    other = build_setup(cfg, data).simulator.algorithm
    other.load_state_dict(alg.state_dict())
    a, b = alg.apply(new, *args), other.apply(new, *args)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_server_learning_descends_the_public_loss(
    tmp_path: Path, cache: Path, public_dir: Path
) -> None:
    cfg = load_config(write_config(tmp_path / "g.toml", cache, public=public_dir, learn=True))
    data = prepare(cfg, progress=False)
    alg = build_setup(cfg, data).simulator.algorithm
    params = build_setup(cfg, data).simulator.params
    pub = data.public_train
    assert pub is not None

    def public_loss(p: dict) -> float:
        w = {n: t for n, t in p.items() if n.startswith(EXTRACTOR)}
        with torch.no_grad():
            return float(
                alg.model.loss({**w, "head.weight": alg.head}, {"x": pub.x, "y": pub.y}).mean()
            )

    zero = {n: torch.zeros_like(t) for n, t in params.items()}
    before = public_loss(params)
    new = params
    for _ in range(10):
        new = alg.apply(new, zero, 1.0, 1, [new], torch.zeros(1))
    assert public_loss(new) < before


def test_fedbuff_with_init_and_server_learning_resumes_bit_identically(
    tmp_path: Path, cache: Path, public_dir: Path
) -> None:
    init = save_init(tmp_path / "pre" / "model.pt")
    cfg = write_config(
        tmp_path / "h.toml", cache, steps=8, public=public_dir, init_from=init.parent, learn=True
    )
    ref = runner.invoke(app, ["train", str(cfg), "--out", str(tmp_path / "ref"), "-q"])
    assert ref.exit_code == 0, ref.output
    manifest = json.loads((tmp_path / "ref" / "manifest.json").read_text())
    assert manifest["init_weights_sha256"] == weights_hash(load_model(init))
    plain = write_config(tmp_path / "p.toml", cache, steps=8, public=public_dir, init_from=init)
    res = runner.invoke(app, ["train", str(plain), "--out", str(tmp_path / "plain"), "-q"])
    assert res.exit_code == 0, res.output
    a = json.loads((tmp_path / "ref" / "metrics.json").read_text())
    p = json.loads((tmp_path / "plain" / "metrics.json").read_text())
    assert a["weights_sha256"] != p["weights_sha256"]  # server learning changed the model
    run = tmp_path / "killed"
    train_until_killed(cfg, run, checkpoint=4, timeout_s=180)
    res = runner.invoke(app, ["resume", str(run), "-q"])
    assert res.exit_code == 0, res.output
    b = json.loads((run / "metrics.json").read_text())
    assert a["weights_sha256"] == b["weights_sha256"]
    assert (tmp_path / "ref" / "metrics.jsonl").read_text() == (run / "metrics.jsonl").read_text()
    assert (tmp_path / "ref" / "trips.jsonl").read_text() == (run / "trips.jsonl").read_text()
