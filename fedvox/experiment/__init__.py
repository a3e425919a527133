"""Experiments: typed configs, run folders, manifests, checkpoints and reports.

The top of the pipeline below the command line: it wires data, models and evaluation.
"""
