"""Derived random streams: every stream is a pure function of (seed, purpose, ids).

The base layer under every package: randomness never depends on call order, so a client, a
noise draw or a subset of the data regenerates identically on its own, after a resume and on
any backend. One enumeration names every purpose, so two streams can never collide by accident.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import torch


class Purpose(IntEnum):
    """What a stream is for. Values are part of the bits of every run: never renumber."""

    # the federated engine
    BATCHES = 1
    DELAY = 2
    DROPOUT = 3
    SELECT = 4
    RECON_INIT = 5
    RECON_EVAL = 6
    RECON_EVAL_INIT = 7
    # matrix factorisation task
    MF_SYNTH = 0x3F1
    MF_USER_SPLIT = 0x3F2
    MF_SEEN_SPLIT = 0x3F3
    MF_ITEM_INIT = 0x3F4
    MF_CENTRAL = 0x3F5
    MF_CENTRAL_BATCHES = 0x3F6
    # centralised training and the speaker task
    INIT = 0x1417
    CHUNKS = 0xC4C5
    CODEWORDS = 0xC0DE
    PARTITION = 0x9A27
    SERVER_LEARNING = 0x5E71  # server-learning batches on the public corpus
    SERVER_HEAD = 0x5E72  # the server's AAM head over the public speakers
    # privacy
    DP_NOISE = 0xD9A0
    CLIP_COUNT = 0xD9A1
    TREE_NOISE = 0xD9A2
    SECAGG_SESSION = 0x5A60
    SECAGG_ROUNDING = 0x5A61
    SECAGG_DROPOUT = 0x5A62
    SECAGG_GRAPH = 0x5A63
    # attack simulation
    ATTACK_SUBSET = 0xA77A  # which devices are malicious
    ATTACK_NOISE = 0xA77B  # a gaussian attacker's noise, per (client, trip)
    BACKDOOR_PAIRS = 0xA77C  # which held-out speakers a backdoor's impostors and targets are
    # upload compression
    COMPRESS = 0xC0A1  # stochastic rounding of a client's quantised upload


def derived_rng(seed: int, purpose: int, *ids: int) -> np.random.Generator:
    """A NumPy generator that depends only on (seed, purpose, ids)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, purpose, *ids])))


def derived_seed(seed: int, purpose: int, *ids: int, bits: int = 64) -> int:
    """An integer seed (32 or 64 bits) for libraries seeded by a number (torch)."""
    if bits not in (32, 64):
        raise ValueError(f"bits must be 32 or 64, got {bits}")
    dtype = np.uint64 if bits == 64 else np.uint32
    return int(np.random.SeedSequence([seed, purpose, *ids]).generate_state(1, dtype)[0])


def torch_generator(seed: int, purpose: int, *ids: int) -> torch.Generator:
    """A torch generator that depends only on (seed, purpose, ids)."""
    return torch.Generator().manual_seed(derived_seed(seed, purpose, *ids))
