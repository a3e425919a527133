"""Test-wide settings: one torch thread (steady on a shared 2-core machine, and the
thread count is part of what makes float results bit-reproducible)."""

import torch

torch.set_num_threads(1)
