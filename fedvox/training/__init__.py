"""Training loops: centralised training of an extractor and its speaker head.

Sits between prepared features (fedvox.data) and the models; the federated engine reuses
its chunk sampler and the models' one-step function.
"""
