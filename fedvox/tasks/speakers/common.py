"""What every speaker task shares: the extractor's parameter names and its embedding size.

The base of fedvox.tasks.speakers; its task modules import it, nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn

from fedvox.errors import ConfigError

EXTRACTOR = "extractor."  # prefix of the global (extractor) parameter names


def extractor_params(params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The extractor's own parameters (names without EXTRACTOR) out of a task's params."""
    n = len(EXTRACTOR)
    return {k[n:]: v for k, v in params.items() if k.startswith(EXTRACTOR)}


def embedding_dim(extractor: nn.Module, emb_dim: int | None) -> int:
    """`emb_dim`, or the extractor's `emb_dim` attribute; refuses an unknown size."""
    dim = emb_dim if emb_dim is not None else getattr(extractor, "emb_dim", None)
    if not isinstance(dim, int) or dim < 1:
        raise ConfigError(
            "model.emb_dim",
            f"cannot tell the embedding size of {type(extractor).__name__}",
            "pass emb_dim=... (or give the extractor an `emb_dim` attribute)",
        )
    return dim
