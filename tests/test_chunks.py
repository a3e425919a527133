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


def test_sliding_chunks_are_every_window_at_the_hop_and_the_store_counts_fixed_chunks() -> None:
    from fedvox.training.chunks import chunk_store, sliding_chunks

    f = np.arange(23 * 2, dtype=np.float32).reshape(23, 2)
    w = sliding_chunks(f, 10, 4)  # starts 0, 4, 8, 12
    assert w.shape == (4, 10, 2)
    assert [int(c[0, 0]) // 2 for c in w] == [0, 4, 8, 12]
    assert sliding_chunks(f[:6], 10, 4).shape == (1, 10, 2)  # short: tiled, as fixed_chunks
    feats = {"a": f, "b": f[:15]}
    store, rows, take = chunk_store(feats, ["a", "b"], np.array([0, 1]), 10, hop=4)
    assert [len(r) for r in rows] == [4, 2] and list(take) == [2, 1]  # 23 // 10, 15 // 10
    assert store["group"].tolist() == [0, 0, 0, 0, 1, 1]
    fixed_store, fixed_rows, none = chunk_store(feats, ["a", "b"], np.array([0, 1]), 10)
    assert none is None and [len(r) for r in fixed_rows] == [2, 1]
    assert fixed_store["x"].shape == (3, 10, 2)
