"""Shared types of the base layer: parameters and batches as name → tensor mappings.

Every package speaks these, so none has to import another's private alias.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

Params = dict[str, Tensor]
Batch = dict[str, Tensor]
MetricFn = Callable[[Params, Batch], dict[str, Tensor]]
