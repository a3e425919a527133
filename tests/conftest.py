"""Test-wide settings: one torch thread (steady on a shared 2-core machine, and the
thread count is part of what makes float results bit-reproducible), and one Ray token."""

import os
import secrets

import torch

torch.set_num_threads(1)

# Ray 2.60 authenticates its clusters with a token, read when Ray is imported: one fresh
# token for the session's clusters and the drivers they start (tests/test_ray_backend.py),
# set here, before any test module can import Ray.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))
