"""The speaker-verification tasks for the federated engine: one home for every speaker mode.

Global head (`SpeakerTask`, with fixed codeword rows via `fix_head`), speakers as local
prototypes (`SpeakerReconTask`: Federated Reconstruction, prototypes enrolled on the device
against public negatives the server broadcasts, `make_speaker_recon_update`) and FedAwS
(`FedAwSTask` with the `Spreadout` wrapper around any fl Algorithm); server learning on the
server's public corpus (`ServerLearning`, another such wrapper); plus the metrics that score
enrolled prototypes. Why the public negatives prevent collapse: docs/federated.md.
"""

from fedvox.tasks.speakers.common import EXTRACTOR, embedding_dim, extractor_params
from fedvox.tasks.speakers.fedaws import (
    CLASS_VECTORS,
    FedAwSTask,
    Spreadout,
    spreadout,
    spreadout_loss,
)
from fedvox.tasks.speakers.global_head import SpeakerTask
from fedvox.tasks.speakers.metrics import score_prototypes, speaker_separation
from fedvox.tasks.speakers.prototypes import (
    NEGATIVE_MODES,
    PROTOTYPES,
    SpeakerReconTask,
    enrollment_prototypes,
    speaker_population,
)
from fedvox.tasks.speakers.public import (
    DOMAIN_CENTRE,
    NEGATIVES,
    PUBLIC_SEED_OFFSET,
    DomainClusters,
    PublicStore,
    domain_clusters,
    normalised_embeddings,
    public_prototypes,
    public_speaker_store,
    public_store_from_features,
    public_synthetic_config,
    with_negatives,
)
from fedvox.tasks.speakers.server_learning import ServerLearning
from fedvox.tasks.speakers.update import (
    make_speaker_recon_update,
    make_version_broadcast,
    received_broadcast_update,
)

__all__ = [
    "CLASS_VECTORS",
    "DOMAIN_CENTRE",
    "EXTRACTOR",
    "NEGATIVES",
    "NEGATIVE_MODES",
    "PROTOTYPES",
    "PUBLIC_SEED_OFFSET",
    "DomainClusters",
    "FedAwSTask",
    "PublicStore",
    "ServerLearning",
    "SpeakerReconTask",
    "SpeakerTask",
    "Spreadout",
    "domain_clusters",
    "embedding_dim",
    "enrollment_prototypes",
    "extractor_params",
    "make_speaker_recon_update",
    "make_version_broadcast",
    "normalised_embeddings",
    "public_prototypes",
    "public_speaker_store",
    "public_store_from_features",
    "public_synthetic_config",
    "received_broadcast_update",
    "score_prototypes",
    "speaker_population",
    "speaker_separation",
    "spreadout",
    "spreadout_loss",
    "with_negatives",
]
