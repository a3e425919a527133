"""How well an extractor separates speakers: prototypes enrolled, queries cosine-scored.

Part of fedvox.tasks.speakers: used by the speaker tests and by RECONEVAL
(experiment/reconeval.py) on a run's held-out speakers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fedvox.errors import DataError
from fedvox.eval.metrics import evaluate_scores
from fedvox.tasks.speakers.prototypes import enrollment_prototypes


class _Embedder(Protocol):
    def embed(self, params: Mapping[str, Tensor], x: Tensor) -> Tensor: ...


def score_prototypes(
    prototypes: Tensor, query: Tensor, query_label: Tensor
) -> dict[str, float | int]:
    """Cosine-score every (query, prototype) pair: "eer", "min_dcf_01", "spread" (mean
    pairwise 1 − cos between prototypes: → 0 when speakers collapse; a common offset that
    only narrows the cone lowers it too), "min_distance" (the smallest), "accuracy" (a
    query's closest prototype is its own), "n_target", "n_nontarget"."""
    p = F.normalize(prototypes, dim=-1)
    scores = F.normalize(query, dim=-1) @ p.T  # [Q, S]
    is_tgt = query_label.unsqueeze(1) == torch.arange(len(p))
    m = evaluate_scores(scores.flatten().numpy(), is_tgt.flatten().numpy())
    dist = (1.0 - p @ p.T)[~torch.eye(len(p), dtype=torch.bool)]
    return {
        "eer": m.eer,
        "min_dcf_01": m.min_dcf_01,
        "spread": float(dist.mean()),
        "min_distance": float(dist.min()),
        "accuracy": float((scores.argmax(1) == query_label).float().mean()),
        "n_target": m.n_target,
        "n_nontarget": m.n_nontarget,
    }


def speaker_separation(
    task: _Embedder, params: Mapping[str, Tensor], x: Tensor, y: Tensor, batch: int = 256
) -> dict[str, float | int]:
    """score_prototypes for speakers the extractor in `params` never saw (x [N, L, F], y [N]):
    per speaker, the chunks at even positions (in order) enroll a prototype (closed form, as
    on a device) and the odd ones are the queries. Needs >= 2 speakers with >= 2 chunks each.
    """
    y_np = np.asarray(y)
    speakers = np.unique(y_np)
    rank = np.empty(len(y_np), dtype=np.int64)
    for s in speakers:
        idx = np.flatnonzero(y_np == s)
        if len(idx) < 2:
            raise DataError(None, f"speaker {int(s)} has {len(idx)} chunk(s)", "give >= 2 each")
        rank[idx] = np.arange(len(idx))
    if len(speakers) < 2:
        raise DataError(None, "one speaker only", "give at least 2 speakers")
    with torch.no_grad():
        raw = torch.cat([task.embed(params, x[i : i + batch]) for i in range(0, len(x), batch)])
    label = torch.from_numpy(np.searchsorted(speakers, y_np))
    enroll = torch.from_numpy(rank % 2 == 0)
    onehot = (label[enroll].unsqueeze(1) == torch.arange(len(speakers))).to(raw.dtype)
    protos = enrollment_prototypes(raw[enroll], onehot)
    return score_prototypes(protos, raw[~enroll], label[~enroll])
