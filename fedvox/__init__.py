"""fedvox: federated x-vector speaker verification, reproducible to the bit."""

__version__ = "0.1.0"
