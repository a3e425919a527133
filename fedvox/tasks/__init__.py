"""Tasks for the federated engine beyond speaker verification (reference reproductions).

Each module gives data loading, a (Recon)Task for fedvox.fl and its centralised baseline.
"""
