"""Tests for fedvox.data.store: cache keys, hits, corruption recovery, concurrent writers."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import numpy as np
import pytest

from fedvox.data import store as store_mod
from fedvox.data.features import CmnConfig, FbankConfig, FeatureConfig, extract_features
from fedvox.data.store import FeatureStore, extract_corpus
from fedvox.errors import ConfigError, DataError

SR = 16000


def wave_for(seed: int, seconds: float = 0.5) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(seconds * SR)
    t = np.arange(n) / SR
    env = (np.sin(2 * np.pi * 2 * t) > 0).astype(np.float32)
    return (
        0.2 * np.sin(2 * np.pi * (150 + seed) * t) * env + 1e-3 * rng.standard_normal(n)
    ).astype(np.float32)


class ToyCorpus:
    """Deterministic synthetic corpus: utterance i is wave_for(i)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def utt_ids(self) -> list[str]:
        return [f"utt{i:03d}" for i in range(self.n)]

    def load(self, utt_id: str) -> np.ndarray:
        return wave_for(int(utt_id[3:]), 0.3 + 0.01 * int(utt_id[3:]))


class CountingExtract:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, wave, cfg, rng=None):
        self.calls += 1
        return extract_features(wave, cfg, rng)


@pytest.fixture
def counting(monkeypatch) -> CountingExtract:
    counter = CountingExtract()
    monkeypatch.setattr(store_mod, "extract_features", counter)
    return counter


def test_key_depends_on_audio_dtype_and_config(tmp_path):
    st = FeatureStore(tmp_path)
    w = wave_for(1)
    cfg = FeatureConfig()
    k = st.key(w, cfg)
    assert len(k) == 64 and k == st.key(w.copy(), FeatureConfig())
    assert k != st.key(w[:-1], cfg)
    assert k != st.key(w.astype(np.float64), cfg)
    w2 = w.copy()
    w2[100] += 1e-6
    assert k != st.key(w2, cfg)
    assert k != st.key(w, FeatureConfig(cmn=CmnConfig(window=301)))
    assert k != st.key(w, FeatureConfig(fbank=FbankConfig(num_mel_bins=30)))


def test_cache_hit_and_never_stale(tmp_path, counting):
    st = FeatureStore(tmp_path)
    w = wave_for(2)
    cfg80 = FeatureConfig()
    a = st.get_or_compute(w, cfg80)
    b = st.get_or_compute(w.copy(), cfg80)
    assert counting.calls == 1 and st.stats.hits == 1
    assert np.array_equal(a, b) and b.dtype == np.float32
    # A changed config is a different key: recomputed, never the 80-bin features.
    cfg30 = FeatureConfig(fbank=FbankConfig(num_mel_bins=30))
    c = st.get_or_compute(w, cfg30)
    assert counting.calls == 2 and c.shape[1] == 30
    assert np.array_equal(c, extract_features(w, cfg30))
    assert np.array_equal(st.get_or_compute(w, cfg80), a) and counting.calls == 2
    # A fresh store object on the same folder sees the cache.
    assert np.array_equal(FeatureStore(tmp_path).get(st.key(w, cfg80)), a)


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_corrupt_file_is_recomputed(tmp_path, counting, damage):
    st = FeatureStore(tmp_path)
    w, cfg = wave_for(3), FeatureConfig()
    good = st.get_or_compute(w, cfg)
    path = st.path(st.key(w, cfg))
    blob = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(blob[: len(blob) // 2])
    elif damage == "flip":  # a valid-looking npy whose data changed: only the checksum sees it
        path.write_bytes(blob[:-5] + bytes([blob[-5] ^ 0x40]) + blob[-4:])
    elif damage == "garbage":
        path.write_bytes(np.random.default_rng(0).bytes(len(blob)))
    else:
        path.write_bytes(b"")
    with pytest.warns(UserWarning, match="corrupt"):
        assert st.get(st.key(w, cfg)) is None
    with pytest.warns(UserWarning, match="corrupt"):
        again = st.get_or_compute(w, cfg)
    assert np.array_equal(again, good) and counting.calls == 2
    assert np.array_equal(st.get(st.key(w, cfg)), good)  # repaired on disk


def test_layout_and_bad_keys(tmp_path):
    st = FeatureStore(tmp_path)
    key = "ab" + "0" * 62
    st.put(key, np.ones((3, 2), np.float32))
    assert (tmp_path / "ab" / f"{key}.fvx").is_file()
    assert st.get("cd" + "0" * 62) is None
    for bad in ("../../etc/passwd", "AB" + "0" * 62, "ab"):
        with pytest.raises(DataError, match="invalid feature-store key"):
            st.get(bad)


def _writer(root: str, worker: int, rounds: int) -> None:
    st = FeatureStore(root)
    shared = "ff" + "e" * 62
    for r in range(rounds):
        # Large enough that a torn write would be visible; content identifies the writer.
        st.put(shared, np.full((400, 80), worker, np.float32))
        own = f"{worker:02x}" + f"{r:062x}"
        st.put(own, np.full((50, 80), worker * 1000 + r, np.float32))


def _reader(root: str, rounds: int) -> int:
    st = FeatureStore(root)
    shared = "ff" + "e" * 62
    bad = 0
    for _ in range(rounds):
        got = st.get(shared)
        if got is not None and not (got.shape == (400, 80) and np.all(got == got[0, 0])):
            bad += 1
    return bad + st.stats.corrupt


def test_concurrent_writers_leave_only_valid_files(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    n_writers, rounds = 4, 25
    with ctx.Pool(n_writers + 1) as pool:
        jobs = [pool.apply_async(_writer, (str(tmp_path), w, rounds)) for w in range(n_writers)]
        reader = pool.apply_async(_reader, (str(tmp_path), 300))
        for j in jobs:
            j.get(timeout=120)
        assert reader.get(timeout=120) == 0
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert not [p for p in files if p.name.startswith(".tmp-")]
    assert len(files) == 1 + n_writers * rounds
    st = FeatureStore(tmp_path)
    for p in files:
        assert st.get(p.stem) is not None, p
    shared = st.get("ff" + "e" * 62)
    assert shared.shape == (400, 80) and shared[0, 0] in range(n_writers)
    assert np.all(shared == shared[0, 0])
    assert st.stats.corrupt == 0


def test_extract_corpus_serial_parallel_and_cached(tmp_path):
    corpus = ToyCorpus(12)
    cfg = FeatureConfig(fbank=FbankConfig(num_mel_bins=30))
    plain = extract_corpus(corpus, cfg, None, workers=1, progress=False)
    assert list(plain) == corpus.utt_ids()
    for utt, feats in plain.items():
        assert np.array_equal(feats, extract_features(corpus.load(utt), cfg))
    st = FeatureStore(tmp_path)
    parallel = extract_corpus(corpus, cfg, st, workers=2, progress=False)
    assert list(parallel) == list(plain)
    assert all(parallel[u].tobytes() == plain[u].tobytes() for u in plain)
    # Workers filled the store: a serial rerun computes nothing.
    st2 = FeatureStore(tmp_path)
    cached = extract_corpus(corpus, cfg, st2, workers=1, progress=True)
    assert st2.stats.computed == 0 and st2.stats.hits == 12
    assert all(cached[u].tobytes() == plain[u].tobytes() for u in plain)


class Unpicklable(ToyCorpus):
    def __reduce__(self):
        raise TypeError("holds an open handle")


def test_extract_corpus_errors(tmp_path):
    cfg = FeatureConfig()
    with pytest.raises(ConfigError, match="workers"):
        extract_corpus(Unpicklable(3), cfg, None, workers=2, progress=False)
    with pytest.raises(ConfigError, match="workers"):
        extract_corpus(ToyCorpus(3), cfg, None, workers=0, progress=False)
    with pytest.raises(ConfigError, match="dither"):
        extract_corpus(ToyCorpus(3), FeatureConfig(fbank=FbankConfig(dither=1.0)), None, 1, False)


def test_checksum_guards_payload(tmp_path):
    # The on-disk format is self-checking: magic, sha256 of the payload, .npy payload.
    st = FeatureStore(tmp_path)
    key = "12" + "3" * 62
    st.put(key, np.arange(6, dtype=np.float32).reshape(2, 3))
    blob = Path(st.path(key)).read_bytes()
    assert blob.startswith(b"FVXFEAT1") and b"NUMPY" in blob[:60]
    # A file written by plain np.save (no checksum) is not trusted.
    np.save(st.path(key).with_suffix(".npy"), np.zeros(3))
    st.path(key).write_bytes(st.path(key).with_suffix(".npy").read_bytes())
    with pytest.warns(UserWarning, match="corrupt"):
        assert st.get(key) is None


def test_an_unchanged_audio_file_is_not_read_again_and_a_changed_one_is(tmp_path, monkeypatch):
    from tiny_corpus import write_kaldi_dir

    from fedvox.data.audio import write_audio
    from fedvox.data.corpus import Corpus, load_kaldi_dir

    root = write_kaldi_dir(tmp_path / "kaldi", {"a": 2, "b": 2})
    corpus = load_kaldi_dir(root)
    cfg = FeatureConfig(fbank=FbankConfig(num_mel_bins=30))
    first = extract_corpus(corpus, cfg, FeatureStore(tmp_path / "st"), workers=1, progress=False)
    reads: list[str] = []
    real_load = Corpus.load
    monkeypatch.setattr(Corpus, "load", lambda self, u: reads.append(u) or real_load(self, u))
    again = FeatureStore(tmp_path / "st")
    cached = extract_corpus(corpus, cfg, again, workers=1, progress=False)
    assert reads == [] and again.stats.hits == 4 and again.stats.computed == 0
    assert all(cached[u].tobytes() == first[u].tobytes() for u in first)
    # a rewritten file (other samples, so another size or mtime) is read and recomputed
    utt = corpus.utt_ids()[0]
    rng = np.random.default_rng(5)
    write_audio(corpus[utt].path, (0.1 * rng.standard_normal(8000)).astype(np.float32))
    changed = FeatureStore(tmp_path / "st")
    new = extract_corpus(corpus, cfg, changed, workers=1, progress=False)
    assert reads == [utt] and changed.stats.computed == 1
    assert new[utt].shape != first[utt].shape
    # a damaged index entry falls back to reading the audio (the content key decides)
    source = corpus.source_of(corpus.utt_ids()[1])
    FeatureStore(tmp_path / "st").source_path(source, cfg).write_text("not a key")
    reads.clear()
    extract_corpus(corpus, cfg, FeatureStore(tmp_path / "st"), workers=1, progress=False)
    assert reads == [corpus.utt_ids()[1]]
