"""Fixed-length training chunks cut from in-memory feature matrices, and chunk stores.

x-vector training sees 2–4 s crops (200–400 frames); every batch shares one length so it
stacks into a tensor. All randomness comes from the generator passed in. `chunk_store` lays
the chunks of many utterances out as one store for a federated population.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor


def crop(feats: np.ndarray, length: int, rng: np.random.Generator) -> np.ndarray:
    """A random `length`-frame window; a shorter utterance is tiled (wrapped) to fill it."""
    n = feats.shape[0]
    if n >= length:
        start = int(rng.integers(0, n - length + 1))
        return feats[start : start + length]
    reps = -(-length // n)
    start = int(rng.integers(0, n))
    return np.concatenate([feats] * (reps + 1), axis=0)[start : start + length]


class ChunkSampler:
    """Epoch-shuffled batches of random-length chunks with speaker labels.

    Each epoch visits every utterance once in a random order; each batch draws one length in
    [min_frames, max_frames]. The state is the generator's, so a resumed run continues exactly.
    """

    def __init__(
        self,
        feats: Sequence[np.ndarray],
        labels: Sequence[int],
        batch_size: int,
        chunk_frames: tuple[int, int],
        rng: np.random.Generator,
    ):
        if len(feats) != len(labels) or len(feats) == 0:
            raise ValueError("feats and labels must be non-empty and of equal length")
        self.feats = list(feats)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.batch_size = batch_size
        self.lo, self.hi = chunk_frames
        self.rng = rng
        self._order = np.zeros(0, dtype=np.int64)
        self._pos = 0

    def state(self) -> dict:
        """Everything needed to continue the exact same sequence of batches."""
        return {
            "rng": self.rng.bit_generator.state,
            "order": self._order.copy(),
            "pos": self._pos,
        }

    def load_state(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self._order = np.asarray(state["order"], dtype=np.int64)
        self._pos = int(state["pos"])

    def _next_indices(self) -> np.ndarray:
        out = []
        need = self.batch_size
        while need > 0:
            if self._pos >= len(self._order):
                self._order = self.rng.permutation(len(self.feats))
                self._pos = 0
            take = self._order[self._pos : self._pos + need]
            self._pos += len(take)
            need -= len(take)
            out.append(take)
        return np.concatenate(out)

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """([batch, frames, dim] float32 chunks, [batch] int64 labels)."""
        idx = self._next_indices()
        length = int(self.rng.integers(self.lo, self.hi + 1))
        x = np.stack([crop(self.feats[i], length, self.rng) for i in idx]).astype(np.float32)
        return x, self.labels[idx]


def fixed_chunks(feats: np.ndarray, length: int) -> np.ndarray:
    """Non-overlapping `length`-frame chunks of one utterance [n, length, dim] (at least one;
    a short utterance is tiled)."""
    n = feats.shape[0]
    if n < length:
        reps = -(-length // n)
        return np.tile(feats, (reps, 1))[None, :length]
    k = n // length
    return feats[: k * length].reshape(k, length, feats.shape[1])


def sliding_chunks(feats: np.ndarray, length: int, hop: int) -> np.ndarray:
    """Every `length`-frame window of one utterance starting at a multiple of `hop`
    [n, length, dim] (at least one; a short utterance is tiled, as fixed_chunks)."""
    n = feats.shape[0]
    if n < length:
        return fixed_chunks(feats, length)
    starts = range(0, n - length + 1, hop)
    return np.stack([feats[s : s + length] for s in starts])


def chunk_store(
    feats: dict[str, np.ndarray],
    utts: list[str],
    labels: np.ndarray,
    length: int,
    hop: int | None = None,
) -> tuple[dict[str, Tensor], list[np.ndarray], np.ndarray | None]:
    """One shared store {"x": [N, L, D], "y": [N], "group": [N]} and the chunk rows of each
    utterance; with `hop`, also how many windows make one epoch of each utterance.

    hop None: non-overlapping fixed chunks (take is None). hop h: every window at a multiple
    of h, and take[u] = the number of fixed chunks utterance u would have, so a device that
    draws take[u] windows per recording per epoch (Population groups/take) trains on as much
    as with fixed chunks, at fresh positions: the random crops the centralised trainer uses.
    """
    xs, ys, rows, takes, start = [], [], [], [], 0
    for u, y in zip(utts, labels, strict=True):
        f = feats[u]
        c = fixed_chunks(f, length) if hop is None else sliding_chunks(f, length, hop)
        takes.append(max(1, len(f) // length))  # what fixed_chunks would give
        xs.append(c)
        ys.append(np.full(len(c), y, dtype=np.int64))
        rows.append(np.arange(start, start + len(c)))
        start += len(c)
    store = {
        "x": torch.from_numpy(np.concatenate(xs)),
        "y": torch.from_numpy(np.concatenate(ys)),
        # the recording each chunk comes from (Federated Reconstruction's "groups" split)
        "group": torch.from_numpy(
            np.concatenate([np.full(len(r), i, dtype=np.int64) for i, r in enumerate(rows)])
        ),
    }
    return store, rows, (None if hop is None else np.asarray(takes, dtype=np.int64))
