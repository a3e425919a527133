"""RECONEVAL on unseen speakers: a tiny Federated Reconstruction run, closed form vs SGD steps."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_corpus import TINY_DATA, TINY_EVAL
from typer.testing import CliRunner

from fedvox.cli import app
from fedvox.errors import FedvoxError
from fedvox.experiment.prepare import prepare, public_store
from fedvox.experiment.reconeval import (
    load_inputs,
    public_negatives,
    recon_eval_speakers,
    refine_prototypes,
    split_unseen,
    support_loss,
)
from fedvox.fl import ClientConfig, Population, ReconConfig
from fedvox.fl.local import GROUP_FIELD, split_client
from fedvox.fl.local.reconstruct import reconstruct_one
from fedvox.models.io import weights_hash
from fedvox.rng import Purpose, derived_rng
from fedvox.tasks.speakers import NEGATIVES, PROTOTYPES, SpeakerReconTask
from fedvox.training.chunks import fixed_chunks

runner = CliRunner()

CFG = (
    '\nname = "reconeval"\nseed = 0\n'
    + TINY_DATA
    + """[train]
threads = 1
"""
    + TINY_EVAL
    + """[federated]
speakers = "local"
algorithm = "fedavg"
concurrency = 4
server_steps = 2
eval_every = 2
checkpoint_every = 2
chunk_frames = 60
local_batch_size = 2
local_lr = 0.02
delay_mean_s = 30
[federated.reconstruction]
public_speakers = 4
"""
)

N_SPEAKERS, UTTS = 4, 3  # test speakers, utterances each: 2 support, 1 query


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("reconeval")
    cfg = root / "cfg.toml"
    cfg.write_text(CFG.format(cache=root / "cache"))
    res = runner.invoke(app, ["train", str(cfg), "--out", str(root / "r"), "-q"])
    assert res.exit_code == 0, res.output
    return root / "r"


def test_split_by_utterance_halves_each_speaker() -> None:
    utts = ["a-0", "a-1", "a-2", "a-3", "b-0", "b-1", "b-2"]
    owner = np.array([0, 0, 1, 2, 3, 4, 5, 5, 6])  # chunks -> utterance
    sp = split_unseen(utts, lambda u: u.split("-")[0], owner, 2, seed=0)
    assert sp.speakers == ("a", "b")
    for s, sup, qry in zip(sp.speakers, sp.support, sp.query, strict=True):
        mine = {u for u in utts if u.startswith(s)}
        assert set(sup) | set(qry) == mine and not set(sup) & set(qry)
        assert len(sup) == round(0.5 * len(mine))
    # the support rows are exactly the chunks of the support utterances
    for sup, rows in zip(sp.support, sp.support_rows, strict=True):
        assert sorted(rows.tolist()) == [j for j, o in enumerate(owner) if utts[o] in sup]
    with pytest.raises(FedvoxError, match="single utterance"):
        split_unseen(["a-0", "a-1", "b-0"], lambda u: u.split("-")[0], np.arange(3), 2, 0)


def test_reconeval_split_is_fl_local_split(run: Path) -> None:
    """RECONEVAL's support/query per held-out speaker are fl.local.split_client's for the same
    (seed, client): the training split with group = recording, half of them support."""
    inputs = load_inputs(run)
    data = prepare(inputs.cfg, progress=False)
    utts = sorted(data.test_feats)
    chunks = [fixed_chunks(data.test_feats[u], 60) for u in utts]
    owner = np.concatenate([np.full(len(c), i) for i, c in enumerate(chunks)])
    speaker = np.array([data.test_corpus.speaker_of(u) for u in utts])
    speakers = sorted(set(speaker))
    assert inputs.split.speakers == tuple(speakers)
    rows = [np.flatnonzero(speaker[owner] == s) for s in speakers]
    pop = Population({GROUP_FIELD: torch.from_numpy(owner)}, rows)
    recon = ReconConfig(split="groups", support_fraction=0.5)
    b = inputs.federated().local_batch_size
    x = torch.from_numpy(np.concatenate(chunks)).float()
    for c in range(len(speakers)):
        want = split_client(
            pop, c, derived_rng(inputs.cfg.seed, Purpose.RECON_EVAL, c), b, 1, recon
        )
        sup = np.concatenate(want.support)
        assert inputs.split.support[c] == tuple(utts[i] for i in np.unique(owner[sup]))
        qry = np.concatenate(want.query)
        assert inputs.split.query[c] == tuple(utts[i] for i in np.unique(owner[qry]))
        np.testing.assert_array_equal(inputs.split.support_rows[c], sup)
    # the support embeddings are the extractor on those chunks, in the split's order
    order = np.concatenate(inputs.split.support_rows)
    with torch.no_grad():
        direct = inputs.extractor(x[torch.from_numpy(order)])
    torch.testing.assert_close(inputs.support, direct, rtol=1e-5, atol=1e-6)


def test_reconeval_counts_and_files(run: Path) -> None:
    res = recon_eval_speakers(run, steps=(0, 1, 3))
    assert [r["steps"] for r in res["results"]] == [0, 1, 3]
    n_query = N_SPEAKERS * (UTTS // 2)
    assert res["n_speakers"] == N_SPEAKERS and res["n_query_utts"] == n_query
    assert res["public_speakers"] == 4 and res["lr"] == 0.1  # reconstruction.lr default
    assert all(np.isfinite(r["support_loss"]) for r in res["results"])
    for r in res["results"]:
        assert 0.0 <= r["eer"] <= 1.0 and 0.0 <= r["spread"] <= 2.0
        assert r["n_target"] == n_query
        assert r["n_nontarget"] == n_query * (N_SPEAKERS - 1)
    assert json.loads((run / "reconeval.json").read_text()) == res
    md = (run / "reconeval.md").read_text()
    assert md.count("| steps | EER |") == 1 and "| 3 |" in md
    recon_eval_speakers(run, steps=(0,), lr=0.5)  # a second call appends a section
    md2 = (run / "reconeval.md").read_text()
    assert md2.startswith(md.rstrip("\n")) and md2.count("| steps | EER |") == 2


def test_closed_form_matches_direct_enrollment_and_steps_move_it(run: Path) -> None:
    inputs = load_inputs(run)
    before = weights_hash(inputs.extractor)
    # direct: the extractor on each support utterance's 60-frame chunks, by speaker
    data = prepare(inputs.cfg, progress=False)
    ext = inputs.extractor
    expect = []
    for s in sorted({data.test_corpus.speaker_of(u) for u in data.test_feats}):
        assert s == inputs.split.speakers[len(expect)]
        chunks = [fixed_chunks(data.test_feats[u], 60) for u in inputs.split.support[len(expect)]]
        x = torch.from_numpy(np.concatenate(chunks))
        with torch.no_grad():
            e = F.normalize(ext(x.float()), dim=-1)
        expect.append(F.normalize(e.sum(0), dim=-1))
    base = inputs.closed_form()
    torch.testing.assert_close(base, torch.stack(expect), rtol=1e-5, atol=1e-6)

    neg = public_negatives(inputs, public_store(inputs.cfg))
    assert neg.shape == (4, base.shape[1])
    f = inputs.federated()
    args = (inputs.support, inputs.support_label, neg)
    p0 = refine_prototypes(base, *args, 0, 0.1, f.local_batch_size)
    p1 = refine_prototypes(base, *args, 1, 0.1, f.local_batch_size)
    p3 = refine_prototypes(base, *args, 3, 0.1, f.local_batch_size)
    torch.testing.assert_close(p0, base, rtol=0, atol=0)
    for p in (p1, p3):  # SGD moves every prototype off the closed form, differently per k
        assert (F.cosine_similarity(p, base, dim=-1) < 1 - 1e-7).all()
    assert not torch.equal(p1, p3)
    # the epochs descend the device objective: full-batch steps at a small lr lower it
    args_l = (inputs.support, inputs.support_label, neg, 30.0, 0.2)
    full = refine_prototypes(base, *args, 10, 0.02, len(inputs.support), 30.0, 0.2)
    assert support_loss(full, *args_l).sum() < support_loss(base, *args_l).sum()
    assert weights_hash(inputs.extractor) == before


def test_cli_reconeval_and_clean_error(run: Path, tmp_path: Path) -> None:
    res = runner.invoke(app, ["reconeval", str(run), "--steps", "0", "--steps", "2", "-q"])
    assert res.exit_code == 0, res.output
    assert "EER" in res.output and "unseen speakers" in res.output
    assert [r["steps"] for r in json.loads((run / "reconeval.json").read_text())["results"]] == [
        0,
        2,
    ]
    res = runner.invoke(app, ["reconeval", str(tmp_path)])
    assert isinstance(res.exception, FedvoxError)
    assert "not a fedvox run folder" in str(res.exception)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.toml").write_text((run / "config.toml").read_text())
    res = runner.invoke(app, ["reconeval", str(tmp_path / "half")])
    assert isinstance(res.exception, FedvoxError) and "no trained model" in str(res.exception)


CENTRAL = (
    '\nname = "central"\nseed = 0\n'
    + TINY_DATA
    + """[train]
steps = 2
batch_size = 8
chunk_frames = [60, 100]
checkpoint_every = 2
warmup_steps = 1
threads = 1
"""
    + TINY_EVAL
)


def test_centralised_run_uses_reconstruction_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(CENTRAL.format(cache=tmp_path / "cache"))
    res = runner.invoke(app, ["train", str(cfg), "--out", str(tmp_path / "r"), "-q"])
    assert res.exit_code == 0, res.output
    out = recon_eval_speakers(tmp_path / "r", steps=(0,))  # closed form: no public store
    assert out["speakers_mode"] == "centralised" and out["chunk_frames"] == 200
    assert out["public_speakers"] == 0 and out["results"][0]["n_target"] == N_SPEAKERS
    seen = {}

    class Stop(Exception):
        pass

    def fake_store(*args, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr("fedvox.experiment.prepare.public_speaker_store", fake_store)
    with pytest.raises(Stop):
        recon_eval_speakers(tmp_path / "r", steps=(0, 1))
    assert (seen["n_speakers"], seen["chunks_per_speaker"], seen["chunk_frames"]) == (100, 2, 200)


def test_refinement_is_the_devices_reconstruction() -> None:
    """RECONEVAL's SGD epochs are fl.local's reconstruction: the vectorised chunk it runs
    equals the one-client loop reference, speaker by speaker, and moves the prototypes."""
    gen = torch.Generator().manual_seed(0)
    support = torch.randn(7, 5, generator=gen)
    label = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    neg = F.normalize(torch.randn(3, 5, generator=gen), dim=-1)
    base = F.normalize(torch.randn(2, 5, generator=gen), dim=-1)
    got = refine_prototypes(base, support, label, neg, 2, 0.1, 2, 30.0, 0.1)
    task = SpeakerReconTask(torch.nn.Identity(), scale=30.0, margin=0.1, emb_dim=5)
    rows = [np.arange(3), np.arange(3, 7)]
    pop = Population({"x": support, "slot": torch.zeros(7, dtype=torch.long)}, rows)
    for s, r in enumerate(rows):
        want = reconstruct_one(
            task,
            pop,
            [r[i : i + 2] for i in range(0, len(r), 2)],
            {NEGATIVES: neg},
            {PROTOTYPES: base[s : s + 1]},
            ClientConfig(batch_size=2),
            ReconConfig(steps=2, lr=0.1),
        )
        torch.testing.assert_close(got[s], want[PROTOTYPES][0], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(got[s], base[s])
