"""What local training is told and what it returns: ClientConfig, ReconConfig, ClientResults.

The settings of fedvox.fl.local (the local-training core); the simulator and RECONEVAL pass
them in, the aggregator consumes ClientResults.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from fedvox.errors import ConfigError
from fedvox.types import Params

SPLITS = ("even_odd", "all", "fraction", "groups")
GROUP_FIELD = "group"  # store field naming each example's group (e.g. its recording)


@dataclass(frozen=True)
class ClientConfig:
    """Local training: `epochs` of SGD at `lr` with batch `batch_size`.

    mu > 0 adds FedProx's (mu/2)·||w − w_start||². lr_normalise scales a short batch's step
    by n_batch/B (FedBuff paper) by dividing its loss sum by B instead of n_batch.
    chunk_size: clients per vectorised call (None: as many as fit CHUNK_BYTES of params;
    1, chosen for clients of SOLO_BYTES or more, trains them one at a time without vmap).
    lowrank: the exact low-rank path for tasks that declare it (fl.local.lowrank): None uses
    it where the model allows and it saves work, True requires it, False never uses it.
    pack: vectorised calls take clients of similar size (largest first) and a step computes
    only the clients that still have a batch, so little is padded; which clients share a call
    changes, and with it the float bits (so it is a choice, off by default).
    """

    epochs: int = 1
    batch_size: int = 10
    lr: float = 0.1
    mu: float = 0.0
    lr_normalise: bool = False
    vectorised: bool = True
    chunk_size: int | None = None
    lowrank: bool | None = None
    pack: bool = False
    # Set by a backend that spreads one server step over workers (fedvox.scale): train only
    # the units (vectorised chunks, or single clients) whose FIRST job index lies in
    # [start, stop), cut exactly as the whole step would be; ClientResults.index then names
    # the rows. None: every job.
    shard: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ConfigError("client.epochs", f"must be >= 1, got {self.epochs}", "use 1")
        if self.batch_size < 1:
            raise ConfigError("client.batch_size", f"must be >= 1, got {self.batch_size}")
        if not self.lr > 0:
            raise ConfigError("client.lr", f"must be > 0, got {self.lr}", "use e.g. 0.1")
        if self.mu < 0:
            raise ConfigError("client.mu", f"must be >= 0, got {self.mu}", "use 0 for FedAvg")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ConfigError("client.chunk_size", f"must be >= 1, got {self.chunk_size}")


@dataclass(frozen=True)
class ReconConfig:
    """Reconstruction on the client (and in RECONEVAL).

    steps: reconstruction EPOCHS over the support batches (one SGD step at `lr` per support
      batch of ClientConfig.batch_size; TFF's "reconstruction epochs"). 0 without closed_form
      is the paper's "no reconstruction": local parameters stay at their initialisation.
    closed_form: set the local parameters with task.closed_form_local on all support
      examples first (then `steps` epochs of SGD refine them; usually steps = 0).
    split: "even_odd" (support = even-indexed local batches, query = odd ones; the paper's
      default), "fraction" (the first `support_fraction` of a shuffled client is support),
      "groups" (a `support_fraction` of the client's groups — store field "group", e.g. its
      recordings — is support, the other groups query; one group: all data for both), or
      "all" (support = query = all data; with no local parameters and steps = 0 this is
      exactly FedAvg's client update). A client with fewer than `min_examples_to_split`
      examples, or (even_odd) a single batch, uses all its data for both.
    joint: train local parameters together with the global ones on query (still never sent).
    """

    steps: int = 1
    lr: float = 0.1
    split: str = "even_odd"
    support_fraction: float = 0.5
    min_examples_to_split: int = 2
    joint: bool = False
    closed_form: bool = False

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ConfigError(
                "reconstruction.steps", f"must be >= 0, got {self.steps}", "use e.g. 1"
            )
        if not self.lr > 0:
            raise ConfigError("reconstruction.lr", f"must be > 0, got {self.lr}", "use e.g. 0.1")
        if self.split not in SPLITS:
            raise ConfigError(
                "reconstruction.split",
                f"unknown split {self.split!r}",
                f"use one of {', '.join(SPLITS)}",
            )
        if not 0 < self.support_fraction < 1:
            raise ConfigError(
                "reconstruction.support_fraction",
                f"must be in (0, 1), got {self.support_fraction}",
                "use e.g. 0.5",
            )
        if self.min_examples_to_split < 2:
            raise ConfigError(
                "reconstruction.min_examples_to_split",
                f"must be >= 2, got {self.min_examples_to_split}",
                "use 2 (one example cannot be split)",
            )


@dataclass
class ClientResults:
    """Results of k clients, stacked along the leading axis; `malicious` (a bool per row)
    marks the rows an attack replaced (None: no attack is simulated); `index` the job index
    of each row when only a shard of the jobs was trained."""

    delta: Params
    num_examples: Tensor
    loss: Tensor
    malicious: Tensor | None = None
    index: Tensor | None = None  # a shard's job indices (ClientConfig.shard); None: all jobs
