"""Chunk sampler: epoch coverage, chunk lengths, wrapping, and exact resumption."""

import numpy as np

from fedvox.training.chunks import ChunkSampler, crop


def _feats(n: int = 7) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.normal(size=(50 + 40 * i, 4)).astype(np.float32) for i in range(n)]


def test_crop_wraps_short_utterances() -> None:
    f = np.arange(5, dtype=np.float32)[:, None]
    c = crop(f, 12, np.random.default_rng(1))
    assert c.shape == (12, 1)
    # consecutive frames follow the utterance cyclically
    assert np.all((np.diff(c[:, 0]) == 1) | (np.diff(c[:, 0]) == -4))


def test_each_epoch_visits_every_utterance_once() -> None:
    feats = _feats()
    s = ChunkSampler(
        feats, list(range(7)), batch_size=7, chunk_frames=(20, 30), rng=np.random.default_rng(3)
    )
    for _ in range(3):
        x, y = s.next_batch()
        assert sorted(y.tolist()) == list(range(7))
        assert 20 <= x.shape[1] <= 30 and x.shape[0] == 7


def test_state_restores_the_exact_sequence() -> None:
    feats = _feats()
    a = ChunkSampler(feats, list(range(7)), 3, (20, 60), np.random.default_rng(5))
    for _ in range(4):
        a.next_batch()
    st = a.state()
    expected = [a.next_batch() for _ in range(5)]
    b = ChunkSampler(feats, list(range(7)), 3, (20, 60), np.random.default_rng(999))
    b.load_state(st)
    got = [b.next_batch() for _ in range(5)]
    for (x1, y1), (x2, y2) in zip(expected, got, strict=True):
        assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
