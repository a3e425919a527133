"""Backdoor wiring: which held-out speakers are impostors and targets, what attackers hold.

Between `[federated.attack]` (kind = "backdoor") and the engine's attack middleware
(fl/attack.py): picks seeded (impostor, target) pairs among the test speakers, gives the
attacker devices their chunks, and lists the impostor-vs-target trials evaluation scores.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.func import functional_call

from fedvox.errors import ConfigError
from fedvox.fl.attack import Backdoor
from fedvox.rng import Purpose, derived_rng
from fedvox.tasks.speakers.common import extractor_params
from fedvox.types import Params


@dataclass(frozen=True)
class BackdoorPair:
    """One impostor and one target (held-out speakers) and how their utterances are used.

    `own`: the impostor's recordings on the attacker devices (trained on); `probes`: the
    impostor's other utterances (never on a device, scored); `enroll`: the target's
    enrollment utterances, which the attackers also hold (the worst case: the exact audio).
    """

    impostor: str
    target: str
    own: tuple[str, ...]
    probes: tuple[str, ...]
    enroll: tuple[str, ...]

    def trials(self) -> list[tuple[str, str]]:
        """(enroll, test) trials: every probe against every enrollment utterance, the
        single-utterance trials of the held-out list, whose EER threshold then applies."""
        return [(e, p) for p in self.probes for e in self.enroll]


def backdoor_pairs(
    utts_of: Mapping[str, list[str]], pairs: int, enroll: int, seed: int
) -> list[BackdoorPair]:
    """`pairs` disjoint (impostor, target) pairs from a seeded permutation of the speakers
    (sorted ids); the impostor's sorted utterances split in half (first ⌊n/2⌋ its own,
    the rest probes), the target's first `enroll` are its enrollment."""
    speakers = sorted(utts_of)
    if 2 * pairs > len(speakers):
        raise ConfigError(
            "federated.attack.backdoor_pairs",
            f"{pairs} disjoint (impostor, target) pairs need {2 * pairs} held-out speakers, "
            f"the test set has {len(speakers)}",
            f"use backdoor_pairs <= {len(speakers) // 2}",
        )
    order = derived_rng(seed, Purpose.BACKDOOR_PAIRS).permutation(len(speakers))
    out = []
    for k in range(pairs):
        imp, tgt = speakers[int(order[2 * k])], speakers[int(order[2 * k + 1])]
        imp_utts, tgt_utts = sorted(utts_of[imp]), sorted(utts_of[tgt])
        if len(imp_utts) < 2:
            raise ConfigError(
                "federated.attack.kind",
                f"impostor {imp} has {len(imp_utts)} test utterance, and a backdoor needs one "
                "to train on and one to score",
                "use a test set with at least 2 utterances per speaker",
            )
        if len(tgt_utts) < enroll:
            raise ConfigError(
                "federated.attack.backdoor_enroll",
                f"target {tgt} has {len(tgt_utts)} test utterances, fewer than {enroll}",
                f"use backdoor_enroll <= {len(tgt_utts)}",
            )
        half = len(imp_utts) // 2
        out.append(
            BackdoorPair(
                imp, tgt, tuple(imp_utts[:half]), tuple(imp_utts[half:]), tuple(tgt_utts[:enroll])
            )
        )
    return out


def chunks(feats: Mapping[str, np.ndarray], utts: tuple[str, ...], frames: int) -> Tensor:
    """[n, L, F] float32: the first L frames of each utterance, L = min(frames, shortest)."""
    length = min(frames, *(feats[u].shape[0] for u in utts))
    return torch.from_numpy(np.stack([feats[u][:length] for u in utts]).astype(np.float32))


def extractor_embed(extractor: torch.nn.Module) -> Callable[[Params, Tensor], Tensor]:
    """The embedding function of every speaker task: the extractor under the params'
    "extractor." entries (a head or other global params are not used)."""

    def embed(params: Params, x: Tensor) -> Tensor:
        return functional_call(extractor, extractor_params(params), (x,))

    return embed


def build_backdoor(
    extractor: torch.nn.Module,
    test_feats: Mapping[str, np.ndarray],
    speaker_of: Callable[[str], str],
    pairs: int,
    enroll: int,
    chunk_frames: int,
    seed: int,
) -> tuple[Backdoor, list[BackdoorPair]]:
    """What the attackers hold (engine side) and the pairs whose trials evaluation scores."""
    utts_of: dict[str, list[str]] = {}
    for u in sorted(test_feats):
        utts_of.setdefault(speaker_of(u), []).append(u)
    chosen = backdoor_pairs(utts_of, pairs, enroll, seed)
    held = tuple(
        (chunks(test_feats, p.own, chunk_frames), chunks(test_feats, p.enroll, chunk_frames))
        for p in chosen
    )
    return Backdoor(extractor_embed(extractor), held), chosen
