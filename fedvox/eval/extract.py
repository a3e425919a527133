"""Embedding extraction: full utterances through a trained extractor, in eval mode.

Between the feature store and scoring; also the data layer's non-learned baseline embedding.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from fedvox.progress import task_progress


@torch.no_grad()
def embed_utterances(
    extractor: nn.Module,
    feats: Sequence[np.ndarray],
    max_frames: int | None = None,
    progress=None,
) -> np.ndarray:
    """[n, emb_dim] embeddings of whole utterances, one forward pass each.

    Utterances go one at a time rather than padded together: padding would change the
    mean/std statistics pooling, and a batch must not change an utterance's embedding.
    `max_frames` caps very long utterances (memory), using their first frames. Runs where
    the extractor's parameters are (a GPU when it was moved there).
    """
    first = next(extractor.parameters(), None)
    device = torch.device("cpu") if first is None else first.device
    was_training = extractor.training
    extractor.eval()
    out = []
    try:
        for f in feats:
            if max_frames is not None:
                f = f[:max_frames]
            x = torch.from_numpy(np.ascontiguousarray(f, dtype=np.float32)).unsqueeze(0)
            out.append(extractor(x.to(device))[0].cpu().numpy())
            if progress is not None:
                progress(1)
    finally:
        extractor.train(was_training)
    return np.stack(out).astype(np.float32)


def embed_dict(
    extractor: nn.Module, feats: dict[str, np.ndarray], utts: list[str], label: str, progress: bool
) -> dict[str, np.ndarray]:
    """Embeddings of `utts` by id, with a progress bar named `label`."""
    with task_progress(label, len(utts), enabled=progress) as tick:
        emb = embed_utterances(extractor, [feats[u] for u in utts], progress=tick)
    return dict(zip(utts, emb, strict=True))


def stats_embedding(feats: np.ndarray) -> np.ndarray:
    """Non-learned baseline: per-utterance mean and standard deviation of each feature bin."""
    return np.concatenate([feats.mean(axis=0), feats.std(axis=0)]).astype(np.float32)


def stats_embeddings(feats: Sequence[np.ndarray]) -> np.ndarray:
    """Baseline embeddings of many utterances, [n, 2 * bins]."""
    return np.stack([stats_embedding(f) for f in feats])
