"""Privacy for federated training: secure aggregation (secagg.py, shamir.py) and DP stages.

Stages plug into the aggregation pipeline of fl/aggregation.py (Summer, SumStage, NoiseStage).
"""
