"""Tests for trial lists: VoxCeleb and Kaldi formats, resolution against a corpus, bad input.

Fixture corpora are tiny wav trees in tmp_path; every bad-input case checks file:line and the fix.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from fedvox.data.corpus import Corpus, load_kaldi_dir, load_voxceleb
from fedvox.data.trials import Trial, TrialList, read_trials, write_trials
from fedvox.errors import ConfigError, DataError

VOX = [
    "id10270/x6uYqmx31kE/00001.wav",
    "id10270/8jEAjG6SegY/00008.wav",
    "id10271/1gtz-CUIygI/00001.wav",
    "id10271/1gtz-CUIygI/00002.wav",
]


def vox_corpus(tmp_path: Path) -> Corpus:
    for rel in VOX:
        p = tmp_path / "vox" / "wav" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        sf.write(p, np.zeros(800, dtype=np.float32), 16000, subtype="PCM_16")
    return load_voxceleb(tmp_path / "vox")


def kaldi_corpus_of_vox(tmp_path: Path) -> Corpus:
    """A Kaldi dir over the VoxCeleb files with Kaldi-style ids (spk-yt-n)."""
    vox = vox_corpus(tmp_path)
    d = tmp_path / "kaldi"
    d.mkdir()
    ids = {u.utt_id: u.utt_id.replace("/", "-").removesuffix(".wav") for u in vox.utterances}
    (d / "wav.scp").write_text("".join(f"{ids[u.utt_id]} {u.path}\n" for u in vox.utterances))
    (d / "utt2spk").write_text("".join(f"{ids[u.utt_id]} {u.speaker}\n" for u in vox.utterances))
    return load_kaldi_dir(d)


def trials_file(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "trials.txt"
    p.write_text(text)
    return p


def located(exc: pytest.ExceptionInfo, file: Path, line: int | None) -> str:
    msg = str(exc.value)
    assert (f"{file}:{line}:" if line is not None else f"{file}:") in msg, msg
    assert "Fix:" in msg, msg
    return msg


def test_voxceleb_format(tmp_path):
    c = vox_corpus(tmp_path)
    p = trials_file(
        tmp_path,
        f"# VoxCeleb-style list\n1 {VOX[0]} {VOX[1]}\n\n0 {VOX[0]} {VOX[2]}\n1 {VOX[2]} {VOX[3]}\n",
    )
    tl = read_trials(p, c)
    assert tl.trials == [
        Trial(VOX[0], VOX[1], True),
        Trial(VOX[0], VOX[2], False),
        Trial(VOX[2], VOX[3], True),
    ]
    assert tl.labels().dtype == bool and tl.labels().tolist() == [True, False, True]
    assert tl.utt_ids() == sorted(VOX)
    assert len(tl) == 3 and tl.source == p


def test_kaldi_format_and_vox_tokens_on_kaldi_ids(tmp_path):
    c = kaldi_corpus_of_vox(tmp_path)
    p = trials_file(
        tmp_path,
        "id10270-x6uYqmx31kE-00001 id10270-8jEAjG6SegY-00008 target\n"
        "id10270-x6uYqmx31kE-00001 id10271-1gtz-CUIygI-00001 nontarget\n",
    )
    assert read_trials(p, c).labels().tolist() == [True, False]
    # The official VoxCeleb list works on a Kaldi dir whose ids differ: tokens match by path.
    p2 = trials_file(tmp_path, f"1 {VOX[0]} {VOX[1]}\n0 {VOX[0]} {VOX[2]}\n")
    tl = read_trials(p2, c)
    assert tl.trials[1] == Trial("id10270-x6uYqmx31kE-00001", "id10271-1gtz-CUIygI-00001", False)


def test_unknown_utterance(tmp_path):
    c = vox_corpus(tmp_path)
    p = trials_file(tmp_path, f"1 {VOX[0]} {VOX[1]}\n0 {VOX[0]} id10270/abc/00009.wav\n")
    with pytest.raises(
        DataError, match=r"utterance 'id10270/abc/00009\.wav' is not in corpus"
    ) as e:
        read_trials(p, c)
    msg = located(e, p, 2)
    assert "(4 utterances)" in msg and "belongs to this data dir" in msg


@pytest.mark.parametrize(
    ("text", "line", "pattern"),
    [
        (f"1 {VOX[0]} {VOX[1]}\n2 {VOX[0]} {VOX[2]}\n", 2, "label '2' is not 1 .target. or 0"),
        (f"{VOX[0]} {VOX[1]} target\n{VOX[0]} {VOX[2]} yes\n", 2, "label 'yes' is not 'target'"),
        (f"{VOX[0]} {VOX[1]} same\n", 1, "no valid label"),
        (f"1 {VOX[0]} {VOX[1]}\n{VOX[0]} {VOX[2]} nontarget\n", 2, "mixed formats"),
        (f"{VOX[0]} {VOX[1]} target\n0 {VOX[0]} {VOX[2]}\n", 2, "mixed formats"),
        (f"1 {VOX[0]} {VOX[1]}\n0 {VOX[0]}\n", 2, "expected 3 fields, got 2"),
        (f"1 {VOX[0]} {VOX[1]} extra\n", 1, "expected 3 fields, got 4"),
    ],
)
def test_bad_trial_lines(tmp_path, text, line, pattern):
    p = trials_file(tmp_path, text)
    with pytest.raises(DataError, match=pattern) as exc:
        read_trials(p, vox_corpus(tmp_path))
    located(exc, p, line)


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("", "no trials"),
        ("# only a comment\n\n", "no trials"),
        (f"0 {VOX[0]} {VOX[2]}\n0 {VOX[1]} {VOX[3]}\n", "no target trials, so EER is undefined"),
        (f"1 {VOX[0]} {VOX[1]}\n", "no nontarget trials, so EER is undefined"),
    ],
)
def test_unusable_trial_lists(tmp_path, text, pattern):
    p = trials_file(tmp_path, text)
    with pytest.raises(DataError, match=pattern) as exc:
        read_trials(p, vox_corpus(tmp_path))
    located(exc, p, None)


def test_missing_trial_file(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_trials(tmp_path / "none.txt", vox_corpus(tmp_path))


def test_write_read_roundtrip_both_formats(tmp_path):
    c = kaldi_corpus_of_vox(tmp_path)
    ids = c.utt_ids()
    tl = TrialList([Trial(ids[0], ids[1], True), Trial(ids[0], ids[2], False)])
    write_trials(tmp_path / "k.txt", tl, c, fmt="kaldi")
    assert (tmp_path / "k.txt").read_text().splitlines()[1] == f"{ids[0]} {ids[2]} nontarget"
    write_trials(tmp_path / "v.txt", tl, c, fmt="voxceleb")
    first = (tmp_path / "v.txt").read_text().splitlines()[0].split()
    assert first[0] == "1" and first[1].count("/") == 2 and first[1].endswith(".wav")
    for name in ("k.txt", "v.txt"):
        assert read_trials(tmp_path / name, c).trials == tl.trials
    assert sorted(x.name for x in tmp_path.iterdir() if x.suffix == ".tmp") == []


def test_write_voxceleb_paths_relative_to_wav_dir(tmp_path):
    c = vox_corpus(tmp_path)
    tl = TrialList([Trial(VOX[0], VOX[1], True), Trial(VOX[2], VOX[0], False)])
    write_trials(tmp_path / "v.txt", tl, c, fmt="voxceleb")
    assert (tmp_path / "v.txt").read_text() == f"1 {VOX[0]} {VOX[1]}\n0 {VOX[2]} {VOX[0]}\n"
    write_trials(tmp_path / "n.txt", tl, None, fmt="voxceleb")
    assert read_trials(tmp_path / "n.txt", c).trials == tl.trials
    with pytest.raises(ConfigError, match="fmt"):
        write_trials(tmp_path / "x.txt", tl, c, fmt="csv")
