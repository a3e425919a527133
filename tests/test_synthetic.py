"""Tests of the synthetic corpus generator: determinism, layout, trials and the cache."""

from __future__ import annotations

import json
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from fedvox.data import synthetic
from fedvox.data.synthetic import (
    GENERATOR_VERSION,
    SyntheticConfig,
    corpus_dir,
    ensure_corpus,
    generate_corpus,
    make_trials,
    sample_speaker,
    synthesize_utterance,
)
from fedvox.errors import ConfigError, DataError

TINY = SyntheticConfig(
    seed=7,
    n_train_speakers=3,
    n_test_speakers=3,
    train_utts_per_speaker=2,
    test_utts_per_speaker=2,
    min_duration_s=0.6,
    max_duration_s=1.0,
    difficulty="mild",
)


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_corpus(
        TINY, tmp_path_factory.mktemp("c1") / "corpus", workers=1, progress=False
    )


def test_same_seed_gives_identical_bytes_for_any_worker_count(corpus: Path, tmp_path: Path):
    again = generate_corpus(TINY, tmp_path / "corpus", workers=2, progress=False)
    a, b = _files(corpus), _files(again)
    assert a.keys() == b.keys()
    assert len([k for k in a if k.endswith(".wav")]) == 12
    assert all(a[k] == b[k] for k in a)


def test_one_utterance_regenerates_like_the_full_corpus(corpus: Path, tmp_path: Path):
    audio = synthesize_utterance(TINY, "test", 1, 1)
    sf.write(tmp_path / "one.wav", audio, 16000, subtype="PCM_16", format="WAV")
    assert (tmp_path / "one.wav").read_bytes() == (
        corpus / "test/wav/syn-test-00001/0001.wav"
    ).read_bytes()


def test_different_seed_or_difficulty_changes_audio():
    base = synthesize_utterance(TINY, "train", 0, 0)
    other_seed = synthesize_utterance(
        SyntheticConfig(**{**TINY.__dict__, "seed": 8}), "train", 0, 0
    )
    assert base.shape != other_seed.shape or not np.array_equal(base, other_seed)
    clean = SyntheticConfig(**{**TINY.__dict__, "difficulty": "clean"})
    hard = SyntheticConfig(**{**TINY.__dict__, "difficulty": "hard"})
    a, b = synthesize_utterance(clean, "train", 0, 0), synthesize_utterance(hard, "train", 0, 0)
    # Difficulty changes the channel only: same spoken content, so the same length.
    assert a.shape == b.shape == base.shape
    assert np.mean((a - b) ** 2) > 1e-3 * np.mean(a**2)
    assert not np.array_equal(base, a)


def test_audio_is_valid_pcm_in_range(corpus: Path):
    for p in corpus.glob("*/wav/*/*.wav"):
        info = sf.info(p)
        assert (info.samplerate, info.channels, info.subtype) == (16000, 1, "PCM_16")
        assert TINY.min_duration_s <= info.duration <= TINY.max_duration_s + 1e-3
    for split, spk in (("train", 0), ("test", 2)):
        x = synthesize_utterance(TINY, split, spk, 0)
        assert x.dtype == np.float32 and np.all(np.isfinite(x))
        assert np.max(np.abs(x)) <= 1.0
        assert np.sqrt(np.mean(x**2)) > 0.01  # not silent


def test_speaker_params_depend_on_seed_split_index_only():
    a = sample_speaker(3, "train", 5)
    assert a == sample_speaker(3, "train", 5)
    assert a != sample_speaker(3, "test", 5)
    assert a != sample_speaker(4, "train", 5)
    assert a.speaker_id == "syn-train-00005"
    # Unlimited speakers: a large index is just another draw.
    assert sample_speaker(3, "train", 10**6).speaker_id == "syn-train-1000000"


def _read_map(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()]


def test_kaldi_dirs_are_sorted_consistent_and_disjoint(corpus: Path):
    speakers = {}
    for split in ("train", "test"):
        d = corpus / split
        scp = _read_map(d / "wav.scp")
        u2s = _read_map(d / "utt2spk")
        s2u = _read_map(d / "spk2utt")
        assert [r[0] for r in scp] == sorted(r[0] for r in scp) == [r[0] for r in u2s]
        assert [r[0] for r in s2u] == sorted(r[0] for r in s2u)
        for _utt, rel in scp:
            assert not Path(rel).is_absolute() and (d / rel).is_file()
        for utt, spk in u2s:
            assert utt.startswith(spk + "-")
        assert {(u, r[0]) for r in s2u for u in r[1:]} == {(u, s) for u, s in u2s}
        speakers[split] = {s for _, s in u2s}
    assert speakers["train"] and speakers["test"]
    assert not speakers["train"] & speakers["test"]


def test_trials_are_well_formed_and_labelled_by_speaker(corpus: Path):
    test = corpus / "test"
    vox = _read_map(test / "trials.txt")
    kal = _read_map(test / "trials_kaldi.txt")
    utt2spk = dict(_read_map(test / "utt2spk"))
    assert len(vox) == len(kal)
    pairs = set()
    for (lab, p1, p2), (u1, u2, kind) in zip(vox, kal, strict=True):
        assert lab in ("0", "1") and kind in ("target", "nontarget")
        assert (test / "wav" / p1).is_file() and (test / "wav" / p2).is_file()
        assert u1 in utt2spk and u2 in utt2spk
        assert p1 == f"{utt2spk[u1]}/{u1[-4:]}.wav" and p2 == f"{utt2spk[u2]}/{u2[-4:]}.wav"
        same = utt2spk[u1] == utt2spk[u2]
        assert (lab == "1") == same == (kind == "target")
        pairs.add(frozenset((u1, u2)))
    assert len(pairs) == len(kal) and all(len(p) == 2 for p in pairs)
    n_target = sum(r[0] == "1" for r in vox)
    assert n_target == 3  # 3 speakers x C(2, 2)
    # 10 x 3 wanted, but only C(6, 2) - 3 = 12 distinct-speaker pairs exist.
    assert len(vox) - n_target == 12
    assert kal == sorted(kal)


def test_trials_follow_the_ratio_and_the_seed():
    cfg = SyntheticConfig(n_test_speakers=6, test_utts_per_speaker=3, nontarget_ratio=2)
    trials = make_trials(cfg)
    targets = [t for t in trials if t[0] == 1]
    assert len(targets) == 6 * 3
    assert len(trials) == 3 * len(targets)
    assert trials == make_trials(cfg)
    assert trials != make_trials(SyntheticConfig(**{**cfg.__dict__, "seed": 1}))
    all_pairs = {
        (a, b) for a, b in combinations(sorted({t[1] for t in trials} | {t[2] for t in trials}), 2)
    }
    assert {(t[1], t[2]) for t in trials} <= all_pairs


def test_config_json_and_key(corpus: Path):
    rec = json.loads((corpus / "config.json").read_text())
    assert rec["generator_version"] == GENERATOR_VERSION
    assert rec["key"] == TINY.key() and rec["seed"] == TINY.seed
    assert TINY.key() == SyntheticConfig(**TINY.__dict__).key()
    assert TINY.key() != SyntheticConfig(**{**TINY.__dict__, "nontarget_ratio": 5}).key()


def test_cache_reuses_and_separates_configs(tmp_path: Path):
    path = ensure_corpus(TINY, cache_root=tmp_path, workers=1, progress=False)
    assert path == corpus_dir(TINY, tmp_path) and path.parent == tmp_path.absolute()
    wav = path / "train/wav/syn-train-00000/0000.wav"
    stamp = (wav.stat().st_mtime_ns, (path / "config.json").stat().st_mtime_ns)
    assert ensure_corpus(TINY, cache_root=tmp_path, workers=1, progress=False) == path
    assert (wav.stat().st_mtime_ns, (path / "config.json").stat().st_mtime_ns) == stamp
    other = SyntheticConfig(
        **{**TINY.__dict__, "difficulty": "clean", "n_train_speakers": 1, "n_test_speakers": 2}
    )
    assert corpus_dir(other, tmp_path) != path


def test_killed_generation_leaves_no_complete_looking_corpus(tmp_path, monkeypatch):
    calls = []

    def dies(*args):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as if the run were killed mid-way
        return real(*args)

    real = synthetic._write_speaker
    monkeypatch.setattr(synthetic, "_write_speaker", dies)
    with pytest.raises(KeyboardInterrupt):
        ensure_corpus(TINY, cache_root=tmp_path, workers=1, progress=False)
    monkeypatch.setattr(synthetic, "_write_speaker", real)
    assert not corpus_dir(TINY, tmp_path).exists()
    assert list(tmp_path.iterdir()) == []  # the temp dir was removed too


def test_leftover_temp_dir_is_not_taken_for_a_corpus(tmp_path: Path):
    final = corpus_dir(TINY, tmp_path)
    # A SIGKILLed run leaves its temp dir behind, with a dead owner pid in its name.
    stale = tmp_path / f".{final.name}.tmp-999999999-abc"
    (stale / "train").mkdir(parents=True)
    (stale / "config.json").write_text(json.dumps({"key": TINY.key()}))
    path = ensure_corpus(TINY, cache_root=tmp_path, workers=1, progress=False)
    assert path == final and (path / "test/trials.txt").is_file()
    assert len(list(path.glob("*/wav/*/*.wav"))) == 12
    assert not stale.exists()


def test_half_written_final_dir_is_an_error_not_a_corpus(tmp_path: Path):
    final = corpus_dir(TINY, tmp_path)
    (final / "train").mkdir(parents=True)
    with pytest.raises(DataError, match=r"no matching config\.json"):
        ensure_corpus(TINY, cache_root=tmp_path, workers=1, progress=False)


def test_generate_refuses_a_non_empty_output_dir(tmp_path: Path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(DataError, match="not empty"):
        generate_corpus(TINY, tmp_path / "x", workers=1, progress=False)
    assert (tmp_path / "x" / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "field,value",
    [
        ("difficulty", "extreme"),
        ("test_utts_per_speaker", 1),
        ("max_duration_s", 0.1),
        ("sample_rate", 8000),
    ],
)
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        SyntheticConfig(**{field: value})


def test_bad_split_is_a_config_error():
    with pytest.raises(ConfigError, match="split"):
        sample_speaker(0, "dev", 0)


def test_speakers_differ_more_than_their_utterances():
    """Identity is a consistent signal: same-speaker log spectra correlate more."""

    def ltas(spk: int, utt: int) -> np.ndarray:
        cfg = SyntheticConfig(
            **{**TINY.__dict__, "difficulty": "clean", "min_duration_s": 2.0, "max_duration_s": 2.5}
        )
        x = synthesize_utterance(cfg, "train", spk, utt)
        frames = np.lib.stride_tricks.sliding_window_view(x, 512)[::256] * np.hanning(512)
        return np.log(np.mean(np.abs(np.fft.rfft(frames)) ** 2, axis=0) + 1e-10)

    spectra = {(s, u): ltas(s, u) for s in range(3) for u in range(2)}
    same = [np.mean((spectra[s, 0] - spectra[s, 1]) ** 2) for s in range(3)]
    diff = [
        np.mean((spectra[a, 0] - spectra[b, 1]) ** 2) for a in range(3) for b in range(3) if a != b
    ]
    assert np.mean(same) < np.mean(diff)
