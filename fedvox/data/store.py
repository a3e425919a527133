"""Content-addressed cache of extracted features, keyed by (audio samples, feature config).

A source index maps an unchanged audio file (path, size, mtime) to its key, so a cached
corpus is not read again to be hashed (reading 6 GB of audio dominated the start of a
10,000-device run).

Sits between features.py and training/evaluation: a rerun reuses features, a changed config never.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import math
import multiprocessing
import os
import pickle
import re
import tempfile
import warnings
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from fedvox.data.features import FeatureConfig, extract_features
from fedvox.errors import ConfigError, DataError

# File layout: MAGIC, sha256 of the payload (32 bytes), payload = the array in .npy format.
_MAGIC = b"FVXFEAT1"
_DIGEST = 32
_KEY_RE = re.compile(r"^[0-9a-f]{64}$")


class AudioCorpus(Protocol):
    """What extract_corpus needs from a corpus (fedvox's Corpus satisfies it)."""

    def utt_ids(self) -> Sequence[str]: ...

    def load(self, utt_id: str) -> np.ndarray: ...


@dataclass
class StoreStats:
    """Counters of one FeatureStore object (per process), for reports and tests."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    computed: int = 0


class FeatureStore:
    """Feature cache under `root`: root/<key[:2]>/<key>.fvx, written atomically.

    Each file carries a sha256 of its payload, so a truncated or damaged file is detected
    and recomputed rather than returned. Safe for concurrent writers (processes or hosts
    on a POSIX filesystem): the last complete write of a key wins, readers never see a
    partial file.
    """

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.stats = StoreStats()

    def __getstate__(self) -> dict:
        # Worker processes start with fresh counters.
        return {"root": self.root}

    def __setstate__(self, state: dict) -> None:
        self.root = state["root"]
        self.stats = StoreStats()

    def key(self, wave: np.ndarray, cfg: FeatureConfig) -> str:
        """sha256 over the waveform's dtype, shape and bytes, and the config hash."""
        wave = np.ascontiguousarray(wave)
        h = hashlib.sha256()
        h.update(f"{wave.dtype.str}|{wave.shape}|".encode())
        h.update(memoryview(wave).cast("B"))
        h.update(b"|" + cfg.hash().encode())
        return h.hexdigest()

    def path(self, key: str) -> Path:
        """Where `key` lives (sharded by its first two hex digits)."""
        if not _KEY_RE.match(key):
            raise DataError(
                None, f"invalid feature-store key {key!r}", "use FeatureStore.key(wave, cfg)"
            )
        return self.root / key[:2] / f"{key}.fvx"

    def get(self, key: str) -> np.ndarray | None:
        """The cached array, or None when absent or when the file fails its checksum."""
        path = self.path(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            self.stats.misses += 1
            return None
        feats = _decode(blob)
        if feats is None:
            self.stats.corrupt += 1
            self.stats.misses += 1
            warnings.warn(f"{path}: corrupt cached features, recomputing", stacklevel=2)
            return None
        self.stats.hits += 1
        return feats

    def put(self, key: str, feats: np.ndarray) -> None:
        """Write atomically: temp file in the same directory, fsync, os.replace."""
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        blob = _encode(np.ascontiguousarray(feats))
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".fvx")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        # Make the rename itself durable; not every platform lets us open a directory.
        with contextlib.suppress(OSError):
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def source_path(self, source: str, cfg: FeatureConfig) -> Path:
        """Where the key of the features of `source` (Corpus.source_of) under `cfg` is kept."""
        h = hashlib.sha256(f"{source}|{cfg.hash()}".encode()).hexdigest()
        return self.root / "sources" / h[:2] / f"{h}.key"

    def get_by_source(self, source: str, cfg: FeatureConfig) -> np.ndarray | None:
        """The cached features of an audio file that has not changed since they were stored
        (same path, size and mtime), without reading it; None when unknown or invalid."""
        try:
            key = self.source_path(source, cfg).read_text().strip()
        except (FileNotFoundError, UnicodeDecodeError):
            return None
        if not _KEY_RE.match(key) or not self.path(key).is_file():
            return None
        return self.get(key)

    def remember_source(self, source: str, cfg: FeatureConfig, key: str) -> None:
        """Record that `source` has the features at `key` (atomic, like put)."""
        path = self.source_path(source, cfg)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".key")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(key)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def get_or_compute(
        self, wave: np.ndarray, cfg: FeatureConfig, key: str | None = None
    ) -> np.ndarray:
        """Cached features of `wave` under `cfg`, extracting and storing them on a miss
        (`key`: self.key(wave, cfg) when the caller has it already)."""
        key = self.key(wave, cfg) if key is None else key
        feats = self.get(key)
        if feats is None:
            feats = extract_features(wave, cfg)
            self.stats.computed += 1
            self.put(key, feats)
        return feats


def _encode(feats: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, feats, allow_pickle=False)
    payload = buf.getvalue()
    return _MAGIC + hashlib.sha256(payload).digest() + payload


def _decode(blob: bytes) -> np.ndarray | None:
    head = len(_MAGIC) + _DIGEST
    if len(blob) < head or not blob.startswith(_MAGIC):
        return None
    payload = blob[head:]
    if hashlib.sha256(payload).digest() != blob[len(_MAGIC) : head]:
        return None
    try:
        return np.load(io.BytesIO(payload), allow_pickle=False)
    except (ValueError, OSError, EOFError):
        return None


def _features_for(
    corpus: AudioCorpus, utt_ids: list[str], cfg: FeatureConfig, store: FeatureStore | None
) -> dict[str, np.ndarray]:
    out = {}
    source_of = getattr(corpus, "source_of", None)
    for utt in utt_ids:
        source = None if store is None or source_of is None else source_of(utt)
        if source is not None and (feats := store.get_by_source(source, cfg)) is not None:
            out[utt] = feats  # the file is as it was: its audio need not be read again
            continue
        wave = corpus.load(utt)
        if store is None:
            out[utt] = extract_features(wave, cfg)
            continue
        key = store.key(wave, cfg)
        out[utt] = store.get_or_compute(wave, cfg, key)
        if source is not None:
            store.remember_source(source, cfg, key)
    return out


# A worker's (corpus, config, store): sent once when the worker starts, not with every
# chunk (pickling a 40,000-utterance corpus per 32-utterance chunk dominated a cached run).
_WORKER_JOB: tuple[AudioCorpus, FeatureConfig, FeatureStore | None] | None = None


def _worker_init(corpus: AudioCorpus, cfg: FeatureConfig, store: FeatureStore | None) -> None:
    global _WORKER_JOB
    _WORKER_JOB = (corpus, cfg, store)
    # One BLAS thread per worker process: the pool is the parallelism.
    with contextlib.suppress(ImportError):
        from threadpoolctl import threadpool_limits

        threadpool_limits(1)


def _worker_features(utt_ids: list[str]) -> dict[str, np.ndarray]:
    assert _WORKER_JOB is not None
    corpus, cfg, store = _WORKER_JOB
    return _features_for(corpus, utt_ids, cfg, store)


def extract_corpus(
    corpus: AudioCorpus,
    cfg: FeatureConfig,
    store: FeatureStore | None,
    workers: int = 1,
    progress: bool = True,
) -> dict[str, np.ndarray]:
    """Features of every utterance, {utt_id: [frames, bins] float32}, in corpus order.

    With workers > 1 a process pool (spawn start method) runs chunks of utterances; each
    worker loads its own audio, so `corpus` must be picklable. The result is identical to
    workers=1: extraction is deterministic (dither must be 0 here).
    """
    if workers < 1:
        raise ConfigError("workers", f"must be >= 1, got {workers}", "use 1 for no pool")
    if cfg.fbank.dither > 0:
        raise ConfigError(
            "fbank.dither",
            "cached corpus features must be deterministic",
            "set dither = 0 (dither belongs to on-the-fly augmentation)",
        )
    ids = list(corpus.utt_ids())
    if len(set(ids)) != len(ids):
        raise DataError(None, "corpus has duplicate utterance ids", "make utterance ids unique")
    results: dict[str, np.ndarray] = {}
    with _progress_bar(progress, len(ids)) as advance:
        if workers == 1 or len(ids) <= 1:
            for utt in ids:
                results.update(_features_for(corpus, [utt], cfg, store))
                advance(1)
        else:
            size = max(1, min(32, math.ceil(len(ids) / (4 * workers))))
            chunks = [ids[i : i + size] for i in range(0, len(ids), size)]
            try:
                pickle.dumps(corpus)
            except Exception as exc:
                raise ConfigError(
                    "workers",
                    f"the corpus cannot be sent to worker processes ({exc})",
                    "use workers=1, or a picklable corpus",
                ) from exc
            ctx = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(
                workers,
                mp_context=ctx,
                initializer=_worker_init,
                initargs=(corpus, cfg, store),
            ) as pool:
                futures = {pool.submit(_worker_features, c): c for c in chunks}
                for fut in as_completed(futures):
                    results.update(fut.result())
                    advance(len(futures[fut]))
    return {utt: results[utt] for utt in ids}


@contextlib.contextmanager
def _progress_bar(enabled: bool, total: int):
    if not enabled:
        yield lambda n: None
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("features", total=total)
        yield lambda n: bar.advance(task, n)
