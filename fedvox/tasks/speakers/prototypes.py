"""Speakers as local parameters: prototypes enrolled on the device, never sent.

Part of fedvox.tasks.speakers: the Federated Reconstruction task (extractor global, one
prototype per local speaker slot) and the population that gives each chunk its slot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from fedvox.errors import ConfigError
from fedvox.fl.population import Population
from fedvox.models.heads import aam_logits, check_margin
from fedvox.tasks.speakers.common import EXTRACTOR, embedding_dim, extractor_params
from fedvox.tasks.speakers.public import (
    DOMAIN_CENTRE,
    NEGATIVES,
    PublicStore,
    public_prototypes,
)
from fedvox.types import Batch, Params

PROTOTYPES = "prototypes"  # the local parameter: [max_local, emb_dim] per client
NEGATIVE_MODES = ("public", "local", "none")

# Logit of an absent slot: exp() underflows to 0 against logits of magnitude <= scale.
_ABSENT = -1.0e4


def speaker_population(
    store: Mapping[str, Tensor],
    client_rows: Sequence[Sequence[int] | np.ndarray],
    seed: int = 0,
    max_local: int = 1,
    groups: np.ndarray | None = None,
    take: np.ndarray | None = None,
) -> Population:
    """The Population with a "slot" field: each chunk's local speaker index on its client
    (the client's speakers in label order). Refuses a client with more than `max_local`
    speakers, which one prototype per slot could not hold. `groups`/`take`: random crops
    (Population)."""
    if "y" not in store:
        raise ConfigError("population.store", "no speaker labels 'y'", "pass {'x': X, 'y': Y}")
    y = np.asarray(store["y"])
    slot = np.full(len(y), -1, dtype=np.int64)
    for c, rows in enumerate(client_rows):
        rows = np.asarray(rows, dtype=np.int64)
        labels, local = np.unique(y[rows], return_inverse=True)
        if len(labels) > max_local:
            raise ConfigError(
                "reconstruction.max_local",
                f"client {c} holds {len(labels)} speakers, max_local is {max_local}",
                f"use max_local >= {len(labels)}, or a partition with fewer speakers per client",
            )
        clash = (slot[rows] >= 0) & (slot[rows] != local)
        if clash.any():
            raise ConfigError(
                "population.clients",
                f"store row {int(rows[clash][0])} is shared by clients with different speakers",
                "give every client its own rows",
            )
        slot[rows] = local
    return Population(
        {**store, "slot": torch.from_numpy(slot)}, client_rows, seed=seed, groups=groups, take=take
    )


def enrollment_prototypes(embeddings: Tensor, weights: Tensor) -> Tensor:
    """The closed-form reconstruction of speaker prototypes [S, D]: for each of S speakers the
    normalised weighted mean of its length-normalised embeddings [n, D] (weights [n, S], 0/1
    membership × mask). Used on devices during training and by `fedvox enroll`."""
    return F.normalize(weights.transpose(0, 1) @ F.normalize(embeddings, dim=-1), dim=-1)


class SpeakerReconTask(nn.Module):
    """fl.local.ReconTask: extractor global, speaker prototypes local (one per local slot).

    negatives: "public" (AAM-softmax over the client's own prototypes plus the public
    speakers broadcast under NEGATIVES; needs make_speaker_recon_update), "local" (over the
    client's own prototypes only: the cross-silo case, needs max_local >= 2), or "none"
    (positive-only 1 − cos(e, own prototype): the baseline that collapses).
    Batches carry "x" [B, L, F] and "slot" [B] (speaker_population). A slot without support
    chunks has a zero prototype: it is left out of the softmax, and its query chunks get
    loss 0. Reconstruction must be closed form (enrollment); SGD steps may refine it.
    """

    def __init__(
        self,
        extractor: nn.Module,
        scale: float = 30.0,
        margin: float = 0.2,
        max_local: int = 1,
        negatives: str = "public",
        emb_dim: int | None = None,
    ) -> None:
        nn.Module.__init__(self)
        if negatives not in NEGATIVE_MODES:
            raise ConfigError(
                "model.negatives",
                f"unknown negatives {negatives!r}",
                f"use one of {', '.join(NEGATIVE_MODES)}",
            )
        if max_local < 1:
            raise ConfigError("reconstruction.max_local", f"must be >= 1, got {max_local}")
        if negatives == "local" and max_local < 2:
            raise ConfigError(
                "model.negatives",
                "'local' negatives need several speakers per client (max_local >= 2)",
                "use negatives = 'public' for one speaker per device",
            )
        if not scale > 0:
            raise ConfigError("model.scale", f"must be > 0, got {scale}", "use 30-32")
        self.extractor = extractor
        self.emb_dim = embedding_dim(extractor, emb_dim)
        self.scale = float(scale)
        self.max_local = int(max_local)
        self.negatives = negatives
        self.set_margin(margin)

    def set_margin(self, m: float) -> None:
        """Set the angular margin, e.g. from heads.margin_schedule each round."""
        self.margin = check_margin(m)

    # global parameters
    def init_params(self) -> Params:
        return {EXTRACTOR + n: p.detach().clone() for n, p in self.extractor.named_parameters()}

    def load_params(self, params: Mapping[str, Tensor]) -> None:
        """Copy global params (e.g. sim.params) into the extractor, for extraction/eval."""
        with torch.no_grad():
            for n, p in self.extractor.named_parameters():
                p.copy_(params[EXTRACTOR + n])

    def embed(self, params: Mapping[str, Tensor], x: Tensor) -> Tensor:
        """Embeddings [B, emb_dim] (un-normalised) of chunks x under the global params."""
        return functional_call(self.extractor, extractor_params(params), (x,))

    def _unit(self, params: Mapping[str, Tensor], x: Tensor) -> Tensor:
        """Normalised embeddings; with DOMAIN_CENTRE broadcast, of the normalised embedding
        minus the device domain's mean (what a domain-wide direction cannot help)."""
        e = F.normalize(self.embed(params, x), dim=-1)
        if DOMAIN_CENTRE in params:
            e = F.normalize(e - params[DOMAIN_CENTRE].detach(), dim=-1)
        return e

    # local parameters
    def init_local(self, client_ids: Sequence[int], generator: torch.Generator) -> Params:
        # zeros: every prototype is set by closed_form_local before it is used
        return {PROTOTYPES: torch.zeros(len(client_ids), self.max_local, self.emb_dim)}

    def closed_form_local(self, global_params: Params, batch: Batch, mask: Tensor) -> Params:
        """Enrollment: prototype of slot j = normalised mean of the normalised embeddings of
        the support chunks in slot j (masked sums: vmappable; an empty slot stays 0)."""
        e = self._unit(global_params, batch["x"])
        onehot = (batch["slot"].unsqueeze(-1) == torch.arange(self.max_local)).to(e.dtype)
        return {PROTOTYPES: enrollment_prototypes(e, onehot * mask.to(e.dtype).unsqueeze(-1))}

    def public_prototypes(self, params: Mapping[str, Tensor], store: PublicStore) -> Tensor:
        return public_prototypes(self, params, store)

    def loss(self, params: Params, batch: Batch) -> Tensor:
        """Per-example loss [B] of one client (global ∪ local params; see class docstring)."""
        if "slot" not in batch:
            raise ConfigError(
                "population", "batches have no 'slot' field", "build it with speaker_population"
            )
        e = self._unit(params, batch["x"])
        protos = params[PROTOTYPES]
        present = protos.detach().abs().sum(-1) > 0  # [S]: slots enrolled on this trip
        own = e @ F.normalize(protos, dim=-1).transpose(0, 1)  # [B, S]
        is_target = batch["slot"].unsqueeze(-1) == torch.arange(self.max_local)
        has_target = (is_target & present).any(-1)
        if self.negatives == "none":
            per = 1.0 - (own * is_target).sum(-1)
            return torch.where(has_target, per, torch.zeros_like(per))
        cos, target = own, is_target
        valid = present.unsqueeze(0).expand_as(own)
        if self.negatives == "public":
            if NEGATIVES not in params:
                raise ConfigError(
                    "client_update",
                    f"no public negatives ({NEGATIVES!r}) next to the global params",
                    "train with make_speaker_recon_update(public_store, recon), or pass "
                    "with_negatives(task, params, public_store) to evaluation",
                )
            # a constant of the start version, computed by the server: never trained here
            neg = F.normalize(params[NEGATIVES].detach(), dim=-1)
            extra = e @ neg.transpose(0, 1)  # [B, P]
            cos = torch.cat([own, extra], -1)
            target = torch.cat([is_target, torch.zeros_like(extra, dtype=torch.bool)], -1)
            # an all-zero row is an absent negative (a device cluster below its minimum size)
            live = (params[NEGATIVES].detach().abs().sum(-1) > 0).unsqueeze(0).expand_as(extra)
            valid = torch.cat([valid, live], -1)
        logits = aam_logits(cos, target, self.scale, self.margin)
        logits = torch.where(valid, logits, torch.full_like(logits, _ABSENT))
        per = torch.logsumexp(logits, -1) - (logits * target).sum(-1)
        return torch.where(has_target, per, torch.zeros_like(per))
