"""Scoring and metrics: embeddings of trial utterances → fitted back ends → EER/minDCF, DET.

Sits after the models in the data path; `fedvox.eval.backend` is its entry point for a run.
"""
